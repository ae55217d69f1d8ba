// rank_group.cc: what every backend of several processes shares (rank_group.h): agreement on the
// configuration before any work, the skip connections and tied weights of the whole model, the
// batch compared, the replicas' rows and sums, the step's timeline gathered on the first process.
#include "transport/rank_group.h"

#include "gpipe/check.h"
#include "gpipe/digest.h"
#include "gpipe/pipeline_config.h"
#include "gpipe/partition.h"

#include <torch/torch.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <numeric>
#include <sstream>

namespace gpipe::detail {

namespace {

// `values` as bytes, and back.
template <typename T>
std::string bytes_of(const std::vector<T>& values) {
  return std::string(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(T));
}
template <typename T>
std::vector<T> values_of(const std::string& bytes) {
  std::vector<T> out(bytes.size() / sizeof(T));
  if (!out.empty()) std::memcpy(out.data(), bytes.data(), out.size() * sizeof(T));
  return out;
}

}  // namespace

void print_by_message(const std::vector<std::string>& messages, const std::function<void(const std::string&)>& print) {
  std::vector<bool> told(messages.size(), false);
  for (size_t r = 0; r < messages.size(); ++r) {
    if (told[r]) continue;
    std::vector<size_t> ranks;
    for (size_t q = r; q < messages.size(); ++q)
      if (!told[q] && messages[q] == messages[r]) ranks.push_back(q), told[q] = true;
    std::string who;
    for (size_t n = 0; n < ranks.size(); ++n) who += (n ? ", " : "") + std::to_string(ranks[n]);
    print(ranks.size() == messages.size() ? messages[r]
                                          : (ranks.size() == 1 ? "[rank " : "[ranks ") + who + "] " + messages[r]);
  }
}

std::vector<LinkTiming> time_transport(Transport& transport, int rank, int warmup) {
  const int peer = 1 - rank;
  std::vector<LinkTiming> rows;
  for (int64_t bytes = 8; bytes <= (int64_t{64} << 20); bytes *= 8) {
    const torch::Tensor message = torch::ones({bytes / 4});
    const int repeats = static_cast<int>(std::clamp<int64_t>((int64_t{256} << 20) / bytes, 10, 2000));
    std::vector<double> one_way_s;
    for (int r = 0; r < warmup + repeats; ++r) {
      const int64_t begin = now_ns();
      if (rank == 0) {
        transport.send(0, peer, Channel::kActivation, 0, message);
        transport.recv(peer, 0, Channel::kGradient, 0);
      } else {
        transport.recv(peer, 1, Channel::kActivation, 0);
        transport.send(1, peer, Channel::kGradient, 0, message);
      }
      transport.finish();
      if (r >= warmup) one_way_s.push_back(static_cast<double>(now_ns() - begin) * 0.5e-9);
    }
    std::sort(one_way_s.begin(), one_way_s.end());
    rows.push_back({bytes, repeats, one_way_s[one_way_s.size() / 2], one_way_s.front(), one_way_s.back()});
  }
  return rows;
}

void RankGroup::agree_on(const std::string& local_error) {
  const std::vector<std::string> errors = all_gather_setup(local_error);
  if (!local_error.empty()) throw std::invalid_argument(local_error);
  for (size_t r = 0; r < errors.size(); ++r)
    if (!errors[r].empty()) {
      const std::string prefix = "gpipe: ";
      const std::string& what = errors[r];
      throw std::invalid_argument("gpipe: " + rank_name(static_cast<int>(r)) + " refused the configuration: " +
                                  (what.rfind(prefix, 0) == 0 ? what.substr(prefix.size()) : what));
    }
}

void RankGroup::agree(std::exception_ptr failure) {
  std::string error;
  if (failure) {
    try {
      std::rethrow_exception(failure);
    } catch (const std::exception& e) {
      error = e.what();
    } catch (...) {
      error = "gpipe: an unknown exception while building the stages";
    }
    try {  // the others hear of it; this process throws what it caught
      agree_on(error);
    } catch (const std::invalid_argument&) {
    }
    std::rethrow_exception(failure);
  }
  agree_on(error);
}

PipelinePlan RankGroup::plan(const torch::nn::Sequential& layers, const PipelineOptions& options,
                             const SkipUseFinder& skip_uses) {
  // What a process can judge alone is agreed on, so every process throws or none does.
  std::string error;
  PipelinePlan cut;  // the plan without skip connections: K, V and the balance
  try {
    GPIPE_CHECK(!options.balance().empty(), "a pipeline over several processes needs the balance of the whole model "
                "(layers per stage, e.g. {3, 8}); make_pipeline finds it for you");
    const int layer_count = std::accumulate(options.balance().begin(), options.balance().end(), 0);
    if (made_) check_plan_of(plan_, layer_count, options);  // the plan made once: not resolved again
    cut = made_ ? plan_ : make_plan(layer_count, options);
  } catch (const std::exception& e) {
    error = e.what();
  }
  agree_on(error);
  check_agreement(layers, options, cut);  // sets placement_
  const std::vector<SkipUse> uses = all_skip_uses(layers, skip_uses);
  try {
    plan_ = cut;
    route_skips(plan_, connect_skips(uses));
  } catch (const std::exception& e) {
    error = e.what();
  }
  agree_on(error);
  return plan_;
}

namespace {

// What every rank of a pipeline must share, in the order it is checked, and its words: the plan's
// PipelineConfig as its one serializer writes it (pipeline_config.h), so that a field added there is
// compared here too (as "the pipeline's <field>" until it has words), and what the config does not
// hold: the layer counts, the parameters' dtype, deferred BatchNorm, a program given.
const std::vector<std::pair<std::string, std::string>>& shared_fields() {
  static const std::vector<std::pair<std::string, std::string>> fields = {
      {"stages", "the number of stages K·V"}, {"virtual_stages", "the number of stages per device V"},
      {"layers", "the model's layer count"}, {"micro_batches", "the number of micro-batches M"},
      {"checkpoint", "the checkpoint mode"}, {"dtype", "the parameters' dtype"}, {"schedule", "the schedule"},
      {"batch_norm", "deferred BatchNorm statistics (deferred_batch_norm)"},
      {"program", "the program given (PipelineOptions::program)"}, {"precision", "the precision"},
      {"devices", "the number of devices K"}, {"balance", "the balance"},
      {"stage_times", "the stage times the V schedule is ordered by"}};
  return fields;
}

// A field's value as an error shows it: as the serializer writes it, a list of whole numbers as {3, 5}.
std::string shown(const FieldValue& value) {
  if (const auto* whole = std::get_if<std::vector<int64_t>>(&value))
    return format_balance(std::vector<int>(whole->begin(), whole->end()));
  return text_of(value);
}

}  // namespace

// Every process gathers every process's settings and runs the same checks, so all of them throw the
// same error or none does.
void RankGroup::check_agreement(const torch::nn::Sequential& layers, const PipelineOptions& options,
                                const PipelinePlan& plan) {
  Fields mine = fields_of(plan.config());
  std::string dtype = "none";  // a device without parameters
  for (const auto& p : layers->parameters())
    if (p.is_floating_point()) {
      dtype = c10::toString(p.scalar_type());
      break;
    }
  mine.insert(mine.end(), {{"stages", int64_t{plan.stages()}},
                           {"layers", int64_t{plan.layers}},
                           {"dtype", dtype},
                           {"batch_norm", std::string(options.deferred_batch_norm() ? "deferred" : "per-micro-batch")},
                           {"program", plan.program.empty() ? std::string("none")
                                                            : "digest-" + std::to_string(text_digest(plan.program))},
                           {"given", static_cast<int64_t>(layers->size())}});
  std::vector<Fields> all;
  for (const std::string& text : all_gather_setup(text_of(mine))) all.push_back(fields_of_text(text, "a rank's settings"));
  const int size = static_cast<int>(all.size());
  auto value = [&](int rank, const std::string& name) -> const FieldValue* {
    return find_field(all[static_cast<size_t>(rank)], name);
  };
  auto check = [&](const std::string& name, const std::string& words) {
    int reference = -1;
    for (int r = 0; r < size; ++r) {
      const FieldValue* v = value(r, name);
      if (name == "dtype" && v != nullptr && shown(*v) == "none") continue;
      if (reference < 0) {
        reference = r;
        continue;
      }
      const FieldValue* first = value(reference, name);
      const std::string a = first ? shown(*first) : "none", b = v ? shown(*v) : "none";
      GPIPE_CHECK(a == b, "the ranks disagree on ", words, ": ", rank_name(reference), " has ", a, ", ", rank_name(r),
                  " has ", b, name == "balance" ? "; start every rank with the same cut"
                                                : "; start every rank with the same model and settings");
    }
  };
  for (const auto& [name, words] : shared_fields()) check(name, words);
  for (const auto& [name, v] : mine)  // a field of the config that has no words yet
    if (name != "given" && std::none_of(shared_fields().begin(), shared_fields().end(),
                                        [&name = name](const auto& f) { return f.first == name; }))
      check(name, "the pipeline's " + name);
  // K agrees now, so every process reaches the same verdict on the world size.
  placement_ = place(rank(), size, plan.devices);
  const std::vector<int>& balance = plan.balance;
  for (int r = 0; r < size; ++r) {
    const int device = place(r, size, plan.devices).device;
    int expected = 0;
    std::string which;
    for (int s : plan.stages_of(device)) {
      expected += balance[static_cast<size_t>(s)];
      which += (which.empty() ? "" : ", ") + std::to_string(s);
    }
    const int64_t given = std::get<int64_t>(*value(r, "given"));
    GPIPE_CHECK(given == expected, rank_name(r), " runs stage", plan.virtual_stages > 1 ? "s " : " ", which,
                ", which the balance ", format_balance(balance), " gives ", expected, " layers, but it was given ",
                given, "; build each rank's layers with gpipe::device_layers");
  }
}

std::vector<std::vector<std::string>> RankGroup::first_lines(const std::string& mine, int count) {
  const std::vector<std::string> all = all_gather_setup(mine);
  std::vector<std::vector<std::string>> lines(static_cast<size_t>(count));
  for (int r = 0; r < count; ++r) {
    std::istringstream text(all[static_cast<size_t>(r)]);
    for (std::string line; std::getline(text, line);) lines[static_cast<size_t>(r)].push_back(line);
  }
  return lines;
}

std::vector<SkipUse> RankGroup::all_skip_uses(const torch::nn::Sequential& layers, const SkipUseFinder& skip_uses) {
  // A line "pop|stash <layer> <name>" per use; the layers are named by their index in the whole model.
  std::string mine, error;
  try {
    for (const SkipUse& u : skip_uses(layers, /*named_by_index=*/true))
      mine += std::string(u.pop ? "pop " : "stash ") + std::to_string(u.layer) + " " + u.name + "\n";
  } catch (const std::exception& e) {
    error = e.what();
  }
  agree_on(error);
  std::vector<SkipUse> uses;
  for (const auto& lines : first_lines(mine, placement_.devices))
    for (const std::string& line : lines) {
      std::istringstream fields(line);
      std::string kind;
      SkipUse use;
      fields >> kind >> use.layer;
      fields.get();  // the space before the name
      std::getline(fields, use.name);
      use.pop = kind == "pop";
      uses.push_back(use);
    }
  return uses;
}

void RankGroup::connect(const PipelinePlan& plan, const torch::nn::Sequential& layers, const PipelineOptions& options) {
  plan_ = plan;
  find_tied_copies(layers, options);
  open();
  share_tied_values();
}

// After a failed call every process has thrown (StageError where it failed, RemoteError elsewhere),
// but messages of that call may still be in flight, a process may have heard of more than one
// failure, and a collective may have been started by some processes only. Starting over on fresh
// connections (open) leaves all of that behind; the old ones are abandoned, not freed, so that the
// failed call's stray messages reach nothing new.
void RankGroup::begin_call() {
  GPIPE_CHECK(!left_, "this rank left the job (at its exit): its pipelines take no more calls");
  auto [rank, left] = heard_leaving();
  if (!left.empty()) {
    failed_ = true;  // the next call cannot start over: fresh connections need every process
    throw RemoteError(rank, left, rank_name(rank));
  }
  if (!failed_) return;
  abandon();
  open();
  failed_ = false;
}

void RankGroup::fail(const std::string& why) {
  // A failure outside the transport's steps (a sum, the gradients' reduction, a loss in evaluation)
  // is told here; one the transport cancelled was told already.
  if (!failed_ && !why.empty()) tell_failure(who() + why);
  failed_ = true;
}

std::string RankGroup::leaving_message(bool program_ended) const {
  const char* what = program_ended
                         ? "ended its program (the end of main or of the script, exit, sys.exit)"
                         : "let go of its pipeline (its Pipeline or Python GPipe was deleted, or its program ended)";
  return who() + what + " while this rank still called into gpipe; every rank makes the same calls (the same number of "
         "train_step, forward, save, sum...), so end every rank's loop together";
}

std::string RankGroup::who() const {
  return rank_name(rank()) + " (device " + std::to_string(placement_.device) + ", replica " +
         std::to_string(placement_.replica) + "): ";
}

std::string RankGroup::describe() const {
  return backend_name() + ": " + std::to_string(placement_.devices * placement_.replicas) + " ranks = " +
         std::to_string(placement_.devices) + " devices x " + std::to_string(placement_.replicas) +
         (placement_.replicas == 1 ? " replica" : " replicas");
}

void RankGroup::check_same_batch(const Tensors& input, const torch::Tensor& target) {
  auto name = [&](size_t n) {
    return n == input.size() ? std::string("target") : input.tuple ? "input's tensor " + std::to_string(n) : std::string("input");
  };
  const std::string fix = "; every rank calls with the same whole mini-batch: draw the data in the same order on every "
                          "rank (seed the generator that shuffles it, e.g. torch.manual_seed before building a "
                          "DataLoader)";
  // The count first: the sums below are one reduction of that many values on every process.
  const double count = static_cast<double>(input.size());
  double counts[2] = {count, -count};
  reduce(counts, 2, /*largest=*/true);
  if (counts[0] != -counts[1]) failed_ = true;
  GPIPE_CHECK(counts[0] == -counts[1], "the ranks were given inputs of different numbers of tensors", fix);
  std::vector<torch::Tensor> tensors = input.items;
  if (target.defined()) tensors.push_back(target);
  // Per tensor its size and the sum of its values, each with its negation: one maximum gives both
  // the largest and the smallest over the processes.
  std::vector<double> values;
  for (const torch::Tensor& t : tensors) {
    const double size = static_cast<double>(t.numel());
    double sum = t.numel() > 0 ? t.detach().sum(torch::kDouble).item<double>() : 0.0;
    if (std::isnan(sum)) sum = std::numeric_limits<double>::max();  // NaN compares with nothing
    if (std::isinf(sum)) sum = sum > 0 ? std::numeric_limits<double>::max() : std::numeric_limits<double>::lowest();
    values.insert(values.end(), {size, -size, sum, -sum});
  }
  reduce(values.data(), static_cast<int>(values.size()), /*largest=*/true);
  for (size_t n = 0; n < values.size(); n += 2) {
    // Every process reaches the same verdict from the same sums, so nothing is told: one told first
    // would stop the others with its message before they reach their own.
    if (values[n] != -values[n + 1]) failed_ = true;
    GPIPE_CHECK(values[n] == -values[n + 1], "the ranks were given different batches (", n % 4 == 0 ? "sizes" : "values",
                " of the ", name(n / 4), " differ)", fix);
  }
}

std::pair<int64_t, int64_t> RankGroup::share(int64_t rows) const {
  // As micro_batch_sizes: the first rows % D replicas take one row more; with fewer rows than
  // replicas, the last replicas take none.
  const int64_t D = placement_.replicas, r = placement_.replica;
  const int64_t base = rows / D, extra = rows % D;
  return {r * base + std::min(r, extra), base + (r < extra ? 1 : 0)};
}

// ---- the replicas: each device's gradients and BatchNorm statistics summed over the replicas that run it

void RankGroup::reduce_gradients(const std::vector<torch::Tensor>& params) {
  if (placement_.replicas > 1 && !params.empty()) {
    torch::NoGradGuard no_grad;
    bool all_float = true;
    std::vector<torch::Tensor> flat;
    for (const auto& p : params) {
      all_float = all_float && p.scalar_type() == torch::kFloat;
      flat.push_back((p.grad().defined() ? p.grad() : torch::zeros_like(p)).reshape({-1}).to(torch::kCPU));
    }
    auto kept =
        std::make_shared<torch::Tensor>(torch::cat(flat).to(all_float ? torch::kFloat : torch::kDouble).contiguous());
    const torch::Tensor buffer = *kept;
    sum_replicas(kept, "a device's gradients");
    int64_t at = 0;
    for (torch::Tensor p : params) {
      p.mutable_grad() = buffer.narrow(0, at, p.numel()).view(p.sizes()).to(p.options(), false, /*copy=*/true);
      at += p.numel();
    }
  }
  sum_tied_gradients();
}

void RankGroup::sum_over_replicas(const std::shared_ptr<torch::Tensor>& values) {
  if (placement_.replicas > 1) sum_replicas(values, "a device's BatchNorm statistics");
}

// ---- a weight tied across processes (an input embedding and an output projection, say): each process
// that holds one keeps a copy; the copies start equal and their gradients are summed before the update.

void RankGroup::find_tied_copies(const torch::nn::Sequential& layers, const PipelineOptions& options) {
  const auto named = layers->named_parameters();
  // What each process holds of each group, a line "group name numel dtype" per copy; every process
  // judges the same lines alike, so all throw the same error or none does.
  std::string mine;
  const auto& groups = options.tied_parameters();
  for (size_t g = 0; g < groups.size(); ++g)
    for (const std::string& name : groups[g])
      if (named.contains(name)) {
        std::ostringstream line;
        line << g << " " << name << " " << named[name].sizes() << " " << c10::toString(named[name].scalar_type());
        mine += line.str() + "\n";
      }
  const auto held = first_lines(mine, placement_.devices);
  ties_.clear();
  uncounted_.clear();
  for (size_t g = 0; g < groups.size(); ++g) {
    std::string shape;  // "[sizes] dtype" of the group's first copy
    for (const std::string& name : groups[g]) {
      const std::string key = std::to_string(g) + " " + name + " ";
      std::string found;
      for (const auto& lines : held)
        for (const std::string& line : lines)
          if (found.empty() && line.rfind(key, 0) == 0) found = line.substr(key.size());
      GPIPE_CHECK(!found.empty(), "tied_parameters: no rank holds a parameter ", name, "; name parameters as in the "
                  "whole model (the layer's index in it, then the parameter's name, e.g. 0.weight)");
      if (shape.empty()) shape = found;
      GPIPE_CHECK(found == shape, "tied parameters ", groups[g].front(), " and ", name, " differ: ", shape, " against ",
                  found, "; tie parameters of one shape and dtype");
      GPIPE_CHECK(found.find(" Float") != std::string::npos || found.find(" Double") != std::string::npos,
                  "tied parameter ", name, " is ", found, "; tied parameters are float32 or float64");
    }
    Tie tie;
    for (const std::string& name : groups[g]) {
      if (!named.contains(name)) continue;
      const torch::Tensor& p = named[name];
      bool seen = false;
      for (const auto& c : tie.copies) seen = seen || c.is_same(p);
      if (!seen) tie.copies.push_back(p);
    }
    for (int d = 0; d < placement_.devices; ++d)
      for (const std::string& line : held[static_cast<size_t>(d)])
        if (line.rfind(std::to_string(g) + " ", 0) == 0 &&
            (tie.devices.empty() || tie.devices.back() != d))
          tie.devices.push_back(d);
    // Sums over the whole model count the group once: the first copy of the lowest device holding one.
    const int owner = tie.devices.empty() ? -1 : tie.devices.front();
    for (size_t c = 0; c < tie.copies.size(); ++c)
      if (placement_.device != owner || c > 0) uncounted_.insert(tie.copies[c].unsafeGetTensorImpl());
    ties_.push_back(std::move(tie));
  }
}

void RankGroup::share_tied_values() {
  // Every copy of a tied weight starts as the lowest device's.
  for (size_t t = 0; t < ties_.size(); ++t) {
    Tie& tie = ties_[t];
    if (tie.copies.empty()) continue;
    torch::NoGradGuard no_grad;
    torch::Tensor first = tie.copies.front().detach().to(torch::kCPU, /*non_blocking=*/false, /*copy=*/true).contiguous();
    broadcast_tie(t, first);
    for (torch::Tensor& copy : tie.copies) copy.copy_(first);
  }
}

void RankGroup::sum_tied_gradients() {
  torch::NoGradGuard no_grad;
  for (size_t t = 0; t < ties_.size(); ++t) {
    Tie& tie = ties_[t];
    if (tie.copies.empty()) continue;
    torch::Tensor sum;
    for (const torch::Tensor& p : tie.copies) {
      const torch::Tensor g = p.grad().defined() ? p.grad() : torch::zeros_like(p);
      sum = sum.defined() ? sum + g : g.clone();
    }
    auto kept = std::make_shared<torch::Tensor>(sum.to(torch::kCPU).contiguous());
    const torch::Tensor total = *kept;
    sum_tie(t, kept);
    for (torch::Tensor p : tie.copies) p.mutable_grad() = total.to(p.device(), /*non_blocking=*/false, /*copy=*/true);
  }
}

bool RankGroup::counts(const torch::Tensor& parameter) const {
  return uncounted_.count(parameter.unsafeGetTensorImpl()) == 0;
}

// ---- the step's timeline: replica 0's processes' rows gathered on the first

StepTrace RankGroup::gather_trace(const StepTrace& trace, const PipelinePlan& plan) {
  // Per action: stage, kind, micro-batch, recompute flag, begin and end in ns from this process's
  // step start; work outside the program (a stage's update) as kind kOtherWork. Processes start a step
  // within a message latency of each other, as the previous one ends with a collective.
  constexpr size_t kFields = 6;
  constexpr int64_t kOtherWork = -1;
  std::vector<int64_t> mine;
  const auto d = static_cast<size_t>(placement_.device);
  if (placement_.replica == 0 && static_cast<int>(trace.devices.size()) > placement_.device) {
    for (const ActionSpan& span : trace.devices[d])
      mine.insert(mine.end(), {span.action.stage, static_cast<int64_t>(span.action.kind), span.action.micro_batch,
                               span.action.recompute ? 1 : 0, span.begin_ns - trace.begin_ns,
                               span.end_ns - trace.begin_ns});
    if (d < trace.other.size())
      for (const WorkSpan& span : trace.other[d])
        mine.insert(mine.end(), {span.stage, kOtherWork, 0, 0, span.begin_ns - trace.begin_ns, span.end_ns - trace.begin_ns});
  }
  const std::vector<std::string> parts = gather(bytes_of(mine));
  StepTrace out;
  if (parts.empty()) return out;  // not the first process
  out.devices.assign(static_cast<size_t>(plan.devices), {});
  out.other.assign(static_cast<size_t>(plan.devices), {});
  for (const std::string& part : parts) {
    const std::vector<int64_t> all = values_of<int64_t>(part);
    for (size_t n = 0; n + kFields <= all.size(); n += kFields) {
      const auto device = static_cast<size_t>(plan.placement[static_cast<size_t>(all[n])]);
      out.end_ns = std::max(out.end_ns, all[n + 5]);
      if (all[n + 1] == kOtherWork) {
        out.other[device].push_back({static_cast<int>(all[n]), all[n + 4], all[n + 5]});
        continue;
      }
      ActionSpan span;
      span.action.stage = static_cast<int>(all[n]);
      span.action.kind = static_cast<ActionKind>(all[n + 1]);
      span.action.micro_batch = static_cast<int>(all[n + 2]);
      span.action.recompute = all[n + 3] != 0;
      span.begin_ns = all[n + 4];
      span.end_ns = all[n + 5];
      out.devices[device].push_back(span);
    }
  }
  return out;
}

}  // namespace gpipe::detail
