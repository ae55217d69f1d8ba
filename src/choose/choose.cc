// choose.cc: "auto"'s search over what a request leaves open, its choice in words, and the ranks'
// agreement on rank 0's choice.
#include "gpipe/choose.h"

#include "gpipe/backend.h"
#include "gpipe/check.h"
#include "gpipe/device.h"
#include "gpipe/microbatch.h"

#include <torch/torch.h>

#include <unistd.h>

#include <algorithm>
#include <exception>
#include <iomanip>
#include <map>
#include <memory>
#include <sstream>
#include <stdexcept>

namespace gpipe {

// ---------------------------------------------------------------- the schedule chosen by prediction
// ("auto"): of the configurations a run leaves open (the schedule and V; M and the cut unless given),
// the one search_plans predicts fastest among those that fit, at the run's K, batch and checkpoint mode.
namespace {

int64_t machine_memory() {
  return static_cast<int64_t>(sysconf(_SC_PHYS_PAGES)) * static_cast<int64_t>(sysconf(_SC_PAGESIZE));
}

std::string milliseconds(double seconds) {
  std::ostringstream out;
  out << std::fixed << std::setprecision(seconds < 0.01 ? 2 : 1) << 1000 * seconds << " ms";
  return out.str();
}

std::string percent(double share) {
  std::ostringstream out;
  out << std::fixed << std::setprecision(1) << 100 * share << "%";
  return out.str();
}

}  // namespace

std::string format_cut(const std::vector<int>& balance) {
  std::string out = "[";
  for (size_t j = 0; j < balance.size(); ++j) out += (j ? ", " : "") + std::to_string(balance[j]);
  return out + "]";
}

namespace {

// The K a request weighs: given; with a given balance and no K, its length over V (V given, or 1 and 2:
// the schedules' own).
std::vector<int> device_counts(const PipelineRequest& r) {
  if (r.devices.value_or(0) > 0) return {*r.devices};
  const int S = static_cast<int>(r.balance.size()), given_V = r.virtual_stages.value_or(0);
  GPIPE_CHECK(S > 0, "`devices` must be at least 1, or given by `balance`");
  if (given_V > 0) {
    GPIPE_CHECK(S % given_V == 0, "`balance` has ", S, " stages, not a multiple of `virtual_stages` ", given_V);
    return {S / given_V};
  }
  return S % 2 == 0 ? std::vector<int>{S, S / 2} : std::vector<int>{S};
}

// The M a request weighs at K: given, or default_micro_batch_counts (1 where none fits the rows:
// search_plans says why).
std::vector<int> micro_batch_counts(const PipelineRequest& r, int K, int64_t batch, int64_t least_micro_batch_rows) {
  if (r.micro_batches) return {*r.micro_batches};
  std::vector<int> Ms = default_micro_batch_counts(K, batch, least_micro_batch_rows);
  return Ms.empty() ? std::vector<int>{1} : Ms;
}

// Each layer's times the lesser of `a`'s and `b`'s (profiles of one model at one size).
CostModel lesser_times(CostModel a, const CostModel& b) {
  for (size_t l = 0; l < a.layers.size() && l < b.layers.size(); ++l) {
    LayerCost& x = a.layers[l];
    const LayerCost& y = b.layers[l];
    x.forward_s = std::min(x.forward_s, y.forward_s);
    x.backward_s = std::min(x.backward_s, y.backward_s);
    x.input_grad_s = std::min(x.input_grad_s, y.input_grad_s);
    x.weight_grad_s = std::min(x.weight_grad_s, y.weight_grad_s);
  }
  return a;
}

}  // namespace

std::vector<int64_t> profiled_rows(const PipelineRequest& request, int64_t batch, int64_t least_micro_batch_rows) {
  std::vector<int64_t> rows;
  for (int K : device_counts(request))
    for (int M : micro_batch_counts(request, K, batch, least_micro_batch_rows))
      rows.push_back(first_micro_batch_rows(batch, M));
  std::sort(rows.begin(), rows.end());
  rows.erase(std::unique(rows.begin(), rows.end()), rows.end());
  return rows;
}

CostsAtRows profiled_together(const CostsAtRows& profile, const std::vector<int64_t>& together, int rounds) {
  GPIPE_CHECK(rounds >= 1, "`rounds` must be at least 1 (got ", rounds, ")");
  auto profiled = std::make_shared<std::map<int64_t, CostModel>>();
  auto done = std::make_shared<bool>(together.empty());
  return [=](int64_t rows) {
    if (!*done) {  // every size, round by round, in turn: ascending, then descending
      std::vector<int64_t> order = together;
      for (int round = 0; round < rounds; ++round, std::reverse(order.begin(), order.end()))
        for (int64_t size : order) {
          CostModel costs = profile(size);
          const auto it = profiled->find(size);
          (*profiled)[size] = it == profiled->end() ? std::move(costs) : lesser_times(it->second, costs);
        }
      *done = true;
    }
    if (const auto it = profiled->find(rows); it != profiled->end()) return it->second;
    return (*profiled)[rows] = profile(rows);
  };
}

std::vector<PlanCandidate> schedule_candidates(const CostsAtRows& costs_at, const PipelineRequest& r, int64_t batch,
                                               int64_t memory_per_device, int64_t least_micro_batch_rows, int cores) {
  const int given_K = r.devices.value_or(0), given_V = r.virtual_stages.value_or(0);  // 0: left open
  const std::vector<int> Ks = device_counts(r);
  std::map<int64_t, CostModel> profiles;  // by rows per micro-batch: each size profiled once
  const int shared = cores > 0 ? cores : machine_cores();
  // The costs of K devices at M: at M's rows, each device's compute slowed by K / cores where the
  // devices outnumber the cores.
  auto costs_of = [&](int K, int M) {
    const int64_t rows = first_micro_batch_rows(batch, M);
    auto it = profiles.find(rows);
    if (it == profiles.end()) it = profiles.emplace(rows, costs_at(rows)).first;
    return K > shared ? with_compute_scaled(it->second, static_cast<double>(K) / shared) : it->second;
  };
  std::vector<PlanCandidate> found;
  std::string first_error;
  for (int K : Ks) {
    PlanSearch search;
    search.devices = K;
    search.stages = {K};
    search.memory_per_device = memory_per_device > 0 ? memory_per_device : std::max<int64_t>(1, machine_memory() / K);
    search.batch = batch;
    search.checkpoints = {Checkpoint::kNever, Checkpoint::kExceptLast, Checkpoint::kAlways};
    if (r.checkpoint) search.checkpoints = {*r.checkpoint};
    search.virtual_stages = given_V;
    if (given_K == 0 && given_V == 0) search.virtual_stages = static_cast<int>(r.balance.size()) / K;
    search.least_micro_batch_rows = least_micro_batch_rows;
    if (!r.balance.empty()) {
      search.given_cut = true;
      search.cut = CutRequest::given(r.balance);
    } else if (!r.layer_costs.empty() && r.balance_by != "time") {
      // By time the search's own cut: the min-max of the same times, refined by the simulation.
      search.given_cut = true;
      search.cut = CutRequest::by_cost(r.layer_costs);
    } else if (r.balance_by == "even") {
      search.given_cut = true;
      search.cut = CutRequest::even();
    }
    // Each M predicted from the costs at its own micro-batches' rows.
    for (int M : micro_batch_counts(r, K, batch, least_micro_batch_rows)) {
      search.micro_batches = {M};
      try {
        for (PlanCandidate& c : search_plans(costs_of(K, M), search)) found.push_back(std::move(c));
      } catch (const std::invalid_argument& e) {
        if (first_error.empty()) first_error = e.what();
      }
    }
  }
  if (found.empty()) throw std::invalid_argument(first_error);
  std::stable_sort(found.begin(), found.end(), ranks_before);
  return found;
}

CostsAtRows profiles_at_rows(const torch::nn::Sequential& whole, const torch::Tensor& input,
                             const torch::Tensor& target, int64_t batch, const PlanProfileOptions& options,
                             bool update_on_devices, const std::vector<int64_t>& together) {
  const CostsAtRows profile = [=](int64_t rows) {
    const int64_t n = std::min(rows, input.size(0));
    PlanProfileOptions o = options;
    o.layers().in_flight(static_cast<int>(std::max<int64_t>(1, batch / n)));
    if (target.defined()) o.layers().target(target.narrow(0, 0, n));
    CostModel costs = profile_model(whole, input.narrow(0, 0, n), o);
    costs.update_on_devices = update_on_devices;
    return costs;
  };
  return profiled_together(profile, together, kProfileRounds);
}

std::vector<PlanCandidate> schedule_candidates(const CostModel& costs, const PipelineRequest& request, int64_t batch,
                                               int64_t memory_per_device, int64_t least_micro_batch_rows, int cores) {
  return schedule_candidates([&costs](int64_t) { return costs; }, request, batch, memory_per_device,
                             least_micro_batch_rows, cores);
}

ScheduleChoice choose_schedule(const CostModel& costs, const PipelineRequest& request, int64_t batch,
                               int64_t memory_per_device, int64_t least_micro_batch_rows, int cores) {
  return choose_schedule([&costs](int64_t) { return costs; }, request, batch, memory_per_device,
                         least_micro_batch_rows, cores);
}

ScheduleChoice choose_schedule(const CostsAtRows& costs_at, const PipelineRequest& request, int64_t batch,
                               int64_t memory_per_device, int64_t least_micro_batch_rows, int cores) {
  const std::vector<PlanCandidate> found =
      schedule_candidates(costs_at, request, batch, memory_per_device, least_micro_batch_rows, cores);
  const PlanCandidate& best = found.front();
  ScheduleChoice c;
  c.config = best.config;
  c.config.precision = request.precision.value_or(Precision::kFloat32);
  c.predicted = best.predicted;
  c.fits = best.fits;
  c.considered = static_cast<int>(found.size());
  c.chose_micro_batches = !request.micro_batches;
  return c;
}

PipelineRequest with_choice(PipelineRequest r, const ScheduleChoice& c) {
  r.schedule = to_string(c.config.schedule);
  r.devices = c.config.devices;
  r.micro_batches = c.config.micro_batches;
  r.checkpoint = c.config.checkpoint;
  r.precision = c.config.precision;
  r.virtual_stages = c.config.virtual_stages;
  r.balance = c.config.balance;
  r.balance_by.clear();
  r.layer_costs.clear();
  r.stage_times = c.config.stage_times;
  return r;
}

std::string format_choice(const ScheduleChoice& c) {
  std::ostringstream out;
  out << "schedule auto: " << describe(c.config) << ", cut " << format_cut(c.config.balance);
  // A V schedule ordered by its stages' profiled times: naming it runs the unit order instead.
  if (!c.config.stage_times.empty()) out << ", ordered by the stages' times";
  if (!c.taken_from.empty()) {
    out << ": as " << c.taken_from << " was trained (saved with it; not profiled again)";
    return out.str();
  }
  out << ": predicted step " << milliseconds(c.predicted.step_s) << ", bubble " << percent(c.predicted.bubble)
      << " (" << (c.fits ? "the fastest of " : "none fits this machine's memory: the least memory of ")
      << c.considered << (c.considered == 1 ? " configuration" : " configurations") << " predicted)";
  if (!c.not_as_saved.empty()) out << "; " << c.not_as_saved;
  return out.str();
}

std::string format_choice_measured(const ScheduleChoice& c, int64_t steps, double seconds, double median_step_s,
                                   double measured_bubble) {
  const double step_s = steps > 0 ? seconds / static_cast<double>(steps) : 0.0;
  const std::string step = steps > 0 ? milliseconds(step_s) : "none";
  const std::string bubble = steps > 0 ? percent(measured_bubble) : "none";
  if (!c.taken_from.empty())
    return "  auto's choice  " + describe(c.config) + ", as " + c.taken_from + " was trained: step " + step +
           " measured; bubble " + bubble + " measured\n";
  // The median beside the mean: on a busy machine a few stalled steps lengthen the mean alone.
  const std::string median =
      steps > 0 && median_step_s > 0 ? " (median " + milliseconds(median_step_s) + ")" : "";
  return "  auto's choice  " + describe(c.config) + ": step " + milliseconds(c.predicted.step_s) + " predicted, " + step +
         " measured" + median + "; bubble " + percent(c.predicted.bubble) + " predicted, " + bubble + " measured\n";
}

// ---------------------------------------------------------------- the ranks' agreement

std::optional<ScheduleChoice> chosen_on_first_rank(const std::function<std::optional<ScheduleChoice>()>& choose,
                                                   const std::string& what) {
  const Runtime running = running_backend();
  if (running == Runtime::kThreads) return choose();
  const bool first = backend(running).process().first == 0;
  // Rank 0's answer, to every rank: "+" and the choice's fields (its config's, its predicted step and
  // bubble, whether it fits and how many were weighed), every number exact; "0" for no choice; or "-"
  // and the first line of its error.
  std::string answer;
  std::exception_ptr failure;
  std::optional<ScheduleChoice> mine;
  if (first) {
    try {
      mine = choose();
      answer = "0";
      if (mine) {
        Fields fields = fields_of(mine->config);
        fields.insert(fields.end(), {{"step_s", mine->predicted.step_s},
                                     {"bubble", mine->predicted.bubble},
                                     {"fits", int64_t{mine->fits}},
                                     {"considered", int64_t{mine->considered}},
                                     {"chose_micro_batches", int64_t{mine->chose_micro_batches}}});
        answer = "+" + text_of(fields);
      }
    } catch (const std::exception& e) {
      failure = std::current_exception();
      const std::string text = without_program_name(e.what());
      answer = "-" + text.substr(0, text.find('\n'));
    } catch (...) {
      failure = std::current_exception();
      answer = "-an error that is not an exception";
    }
  }
  answer = all_gather_processes(answer).front();  // none waits for rank 0
  if (failure) std::rethrow_exception(failure);
  if (first) return mine;
  if (answer == "0") return std::nullopt;
  if (answer.rfind('-', 0) == 0)
    throw std::runtime_error("gpipe: " + what + ": rank 0 could not profile the model to choose the schedule: " +
                             answer.substr(1));
  const std::string theirs = "gpipe: " + what + ": rank 0's choice";
  const Fields fields = fields_of_text(answer.substr(1), theirs);
  ScheduleChoice c;
  c.config = config_of(fields, theirs);
  // A field of rank 0's choice of type T, or an error that names a build of gpipe unlike this one.
  const auto field = [&](const std::string& name, auto type) {
    const FieldValue* value = find_field(fields, name);
    using T = decltype(type);
    if (value == nullptr || !std::holds_alternative<T>(*value))
      throw std::runtime_error(theirs + " came without its " + name +
                               ": do the ranks run the same gpipe? install one build of it for every rank");
    return std::get<T>(*value);
  };
  c.predicted.step_s = field("step_s", double{});
  c.predicted.bubble = field("bubble", double{});
  c.fits = field("fits", int64_t{}) != 0;
  c.considered = static_cast<int>(field("considered", int64_t{}));
  c.chose_micro_batches = field("chose_micro_batches", int64_t{}) != 0;
  return c;
}

PipelineConfig first_rank_config(const PipelineConfig& config) {
  if (running_backend() == Runtime::kThreads) return config;
  const std::string first = all_gather_processes(text_of(fields_of(config))).front();
  return config_of(fields_of_text(first, "gpipe: rank 0's pipeline"), "gpipe: rank 0's pipeline");
}

}  // namespace gpipe
