// stage.cc: one stage: its forward (through its layers, with the skip tray and a deferred BatchNorm's
// statistics), the random stream it replays, the weighted loss, and its errors. Its backward (B, and
// I then W) is in stage_backward.cc; what it asks of a model's layers in layers.cc.
#include "runtime/nested_norm.h"
#include "runtime/stage_parts.h"

#include "runtime/autocast.h"

#include "gpipe/check.h"
#include "gpipe/skip.h"

#include <algorithm>
#include <map>
#include <string>

namespace gpipe {
namespace detail {

KeepBuffers::KeepBuffers(std::vector<torch::Tensor> buffers) {
  for (auto& b : buffers)
    if (b.defined()) {
      saved_.push_back(b.clone());
      buffers_.push_back(std::move(b));
    }
}

KeepBuffers::~KeepBuffers() {
  // Without a version bump: a training-mode BatchNorm's graph holds its running statistics, which
  // its backward does not read.
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  for (size_t n = 0; n < buffers_.size(); ++n) buffers_[n].copy_(saved_[n]);
}

namespace {

std::mutex& random_stream_mutex() {
  static std::mutex mutex;
  return mutex;
}

}  // namespace

RandomStream::RandomStream(bool active, const torch::Device& device, uint64_t seed) {
  if (!active) return;
  lock_ = std::unique_lock<std::mutex>(random_stream_mutex());
  at::Generator generator = at::globalContext().defaultGenerator(device);
  std::lock_guard<std::mutex> guard(generator.mutex());
  generator.set_current_seed(seed);
}

}  // namespace detail

namespace {

const char* describe(ActionKind kind) {
  switch (kind) {
    case ActionKind::kForward: return "forward";
    case ActionKind::kBackward: return "backward";
    case ActionKind::kInputGrad: return "input-gradient backward (I)";
    case ActionKind::kWeightGrad: return "weight-gradient backward (W)";
    case ActionKind::kSend: return "send";
    case ActionKind::kRecv: return "receive";
  }
  return "?";
}

// The model's output, which the loss (or the caller of forward) takes: one tensor.
torch::Tensor model_output(const Tensors& y) {
  return y.only("the model's output", "end the model with a layer that returns one tensor, for the loss");
}

uint64_t mix(uint64_t x) {  // splitmix64's finalizer
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

std::string stage_error_message(const Action& action, const std::string& what, const std::string& operand) {
  return "gpipe: stage " + std::to_string(action.stage) + " failed in the " + describe(action.kind) +
         " of micro-batch " + std::to_string(action.micro_batch) + " (action " + action.str() +
         (operand.empty() ? "" : ", " + operand) + "): " + what;
}

}  // namespace

StageError::StageError(const Action& action, const std::string& what, const std::string& operand,
                       std::string backtrace, const std::string& program)
    : std::runtime_error(stage_error_message(action, what, operand) + (program.empty() ? "" : "\n" + program)),
      action_(action),
      message_(stage_error_message(action, what, operand)),
      backtrace_(std::move(backtrace)) {}

Stage::Stage(int index, int stages, torch::nn::Sequential layers, Device device, bool deferred_batch_norm)
    : index_(index),
      stages_(stages),
      layers_(std::move(layers)),
      device_(std::move(device)),
      stochastic_(draws_random_numbers(layers_)),
      skips_inside_(!skip_uses(layers_).empty()),
      stream_(device_.device) {
  names_ = layer_names(layers_);
  deferred_batch_norm_ = deferred_batch_norm;
  if (!deferred_batch_norm) return;
  size_t n = 0;
  for (const auto& layer : layers_->children()) {
    if (auto running = running_statistics(*layer)) {
      norms_.push_back(detail::deferred_norm(n, *running));
    }
    ++n;
  }
  // Those inside layers, in module order: every replica of the stage sums the same ones from its first step.
  for (const auto& layer : layers_->children())
    if (const auto* holder = dynamic_cast<const BatchNormLayer*>(layer.get()))
      for (RunningStatistics& running : holder->deferring_norms_inside())
        norms_.push_back(detail::deferred_norm(detail::DeferredNorm::kInside, std::move(running)));
}

torch::Tensor Stage::batch_norm_statistics() const {
  if (norms_.empty()) return {};
  std::vector<torch::Tensor> parts;
  for (const detail::DeferredNorm& norm : norms_) parts.insert(parts.end(), {norm.count, norm.sum, norm.squares});
  return torch::cat(parts).to(torch::kCPU);
}

void Stage::update_batch_norm(const torch::Tensor& statistics) {
  if (norms_.empty()) return;
  torch::NoGradGuard no_grad;
  const torch::Tensor all = statistics.to(torch::kCPU, torch::kDouble);
  int64_t at = 0;
  for (detail::DeferredNorm& norm : norms_) {
    const int64_t C = norm.sum.numel();
    GPIPE_CHECK(at + 1 + 2 * C <= all.numel(), "stage ", index_, " got BatchNorm statistics of ", all.numel(),
                " values, fewer than its layers hold");
    const double n = all[at].item<double>();
    const torch::Tensor sum = all.narrow(0, at + 1, C), squares = all.narrow(0, at + 1 + C, C);
    at += 1 + 2 * C;
    if (n <= 0) continue;  // not run in training mode this step
    // The mean and the unbiased variance of every row: Σ(x - μ)² = Σx² - μ·Σx.
    const torch::Tensor mean = sum / n;
    const torch::Tensor var = ((squares - mean * sum) / std::max(n - 1, 1.0)).clamp_min(0);
    RunningStatistics& r = norm.running;
    r.batches += 1;
    const double factor = r.momentum ? *r.momentum : 1.0 / r.batches.item<double>();
    r.mean.mul_(1 - factor).add_(mean.to(r.mean.options()), factor);
    r.var.mul_(1 - factor).add_(var.to(r.var.options()), factor);
  }
  reset_batch_statistics();
}

void Stage::begin_step() {
  reset_batch_statistics();
  skip_bytes_ = 0;
}

void Stage::reset_batch_statistics() {
  for (detail::DeferredNorm& norm : norms_) {
    norm.count.zero_();
    norm.sum.zero_();
    norm.squares.zero_();
  }
}

uint64_t Stage::seed_of(int i, const StepData& step) const {
  return mix(step.seed ^ mix((static_cast<uint64_t>(index_) << 32) | static_cast<uint32_t>(i)));
}

Stage::Kept& Stage::kept(int i) {
  auto it = kept_.find(i);
  GPIPE_CHECK(it != kept_.end(), "stage ", index_, " has no forward of micro-batch ", i,
              " to run backward from; the schedule must run F before B, I or W");
  return it->second;
}

torch::Tensor Stage::weighted_loss(const torch::Tensor& output, int i, const StepData& step) const {
  torch::Tensor loss = step.loss(output, step.targets[static_cast<size_t>(i)].to(device_.device));
  TORCH_CHECK(loss.defined() && loss.numel() == 1,
              "the loss must return a scalar reduced by the mean over the batch; it returned ",
              loss.defined() ? loss.sizes() : c10::IntArrayRef{});
  TORCH_CHECK(!output.requires_grad() || loss.requires_grad(),
              "the loss has no gradient with respect to the model's output (it detaches the output or does not "
              "use it); compute the loss from the output, as loss.backward() on one device would need");
  const double weight = step.weights[static_cast<size_t>(i)];
  // A micro-batch whose targets are all ignored counts for nothing (its own mean is 0/0).
  if (weight == 0) return torch::nan_to_num(loss.reshape({}), 0.0) * 0.0;
  return loss.reshape({}) * weight;
}

Tensors Stage::run_chain(int i, const Tensors& x, bool split, bool gather, Kept& kept, StepData& step) {
  // With `split`, each layer runs on a detached copy of the previous output, so I and W can treat
  // layers one by one.
  kept.layer_inputs.clear();
  kept.layer_outputs.clear();
  const auto found = in_place_.find(layer_modes());  // by forward (none: its search failed)
  Tensors a = x;
  // The BatchNorms inside the layers (gpipe::batch_norm) gather into norms_ through this scope.
  const detail::NestedNormScope nested(deferred_batch_norm_ ? &norms_ : nullptr, gather);
  size_t norm = 0;
  size_t n = 0;
  for (auto layer = layers_->begin(); layer != layers_->end(); ++layer, ++n) {
    if (split) {
      if (n > 0) a = leaves_of(a, LeafGrad::kKept);
      kept.layer_inputs.push_back(a);
    }
    // A layer that changes its input in place, where that input is kept: on a copy (the graph runs
    // through it, so the gradient reaches the input itself).
    if (found != in_place_.end() && found->second[n] && (split || shares_storage(a, x))) a = copy_of(a);
    if (norm < norms_.size() && norms_[norm].layer == n && layer->ptr()->is_training()) {
      // Deferred BatchNorm: this micro-batch's statistics normalize it; the running ones wait for the step's end.
      const torch::Tensor input = a.only(names_[n] + "'s input", "a BatchNorm layer takes one tensor");
      {
        const RunningStatistics& running = norms_[norm].running;
        const detail::KeepBuffers keep({running.mean, running.var, running.batches});
        a = run_layer(*layer, a, names_[n]);
      }
      if (gather) detail::gather_statistics(norms_[norm], input);
    } else {
      a = run_layer(*layer, a, names_[n]);
    }
    if (norm < norms_.size() && norms_[norm].layer == n) ++norm;
    if (split) kept.layer_outputs.push_back(a);
  }
  // With `split`, the loss's own graph starts at a leaf, so I starts from d loss / d output.
  kept.output = split ? leaves_of(a, LeafGrad::kKept) : a;
  if (last() && step.training) kept.loss = weighted_loss(model_output(kept.output), i, step);
  return a;
}

void Stage::finish_step(StepData& step) {
  for (const auto& [i, loss] : device_losses_)
    if (static_cast<size_t>(i) < step.losses.size()) step.losses[static_cast<size_t>(i)] = loss.item<double>();
  device_losses_.clear();
}

void Stage::clear() {
  device_losses_.clear();
  kept_.clear();
  skip_inbox_.clear();
  skip_outbox_.clear();
}

void Stage::set_skips(std::vector<std::pair<int, std::string>> stashed, std::vector<std::pair<int, std::string>> popped) {
  stashed_ = std::move(stashed);
  popped_ = std::move(popped);
}

void Stage::receive_skip(int i, Channel channel, torch::Tensor tensor) { skip_inbox_[{i, static_cast<int>(channel)}] = std::move(tensor); }

torch::Tensor Stage::take_skip(int i, Channel channel) {
  auto it = skip_outbox_.find({i, static_cast<int>(channel)});
  GPIPE_CHECK(it != skip_outbox_.end(), "stage ", index_, " has nothing to send for skip connection ", skip_of(channel),
              " of micro-batch ", i);
  torch::Tensor t = std::move(it->second);
  skip_outbox_.erase(it);
  skip_bytes_ += t.numel() * static_cast<int64_t>(t.element_size());
  return t;
}

Tensors Stage::run_layers(int i, const Tensors& x, bool split, bool gather, Kept& kept, StepData& step) {
  const AutocastScope autocast(precision_, device_.device.type());  // the backward runs outside it, as in torch
  if (stashed_.empty() && popped_.empty() && !skips_inside_) return run_chain(i, x, split, gather, kept, step);
  // The tray the layers' Stash and Pop meet in: what other stages stashed, and what these layers stash.
  std::map<std::string, torch::Tensor> tray;
  for (const auto& [k, name] : popped_) tray[name] = kept.skip_inputs.at(k);
  Tensors y;
  {
    const detail::SkipTrayScope scope(tray);
    y = run_chain(i, x, split, gather, kept, step);
  }
  kept.stashed.clear();
  for (const auto& [k, name] : stashed_) {
    auto it = tray.find(name);
    GPIPE_CHECK(it != tray.end(), "stage ", index_, " ran its layers without stashing \"", name,
                "\", which a later stage pops");
    kept.stashed[k] = std::move(it->second);
  }
  return y;
}

std::vector<bool> Stage::layer_modes() const {
  std::vector<bool> modes;
  for (const auto& layer : layers_->children()) modes.push_back(layer->is_training());
  return modes;
}

void Stage::find_in_place_layers(int i, const Tensors& x, const Kept& kept, const StepData& step) {
  const std::vector<bool> modes = layer_modes();
  if (in_place_.count(modes) > 0) return;
  // As the forward runs them, and leaving nothing changed: in training the random stream the forward
  // draws from next starts again from its seed (in evaluation the process's generator is left alone),
  // the buffers are put back, what a layer stashes lands on a tray of its own.
  const AutocastScope autocast(precision_, device_.device.type());
  const detail::RandomStream stream(stochastic_ && step.training, device_.device, seed_of(i, step));
  const detail::KeepBuffers keep(layers_->buffers());
  std::map<std::string, torch::Tensor> tray;
  for (const auto& [k, name] : popped_) tray[name] = kept.skip_inputs.at(k).detach().clone();
  const detail::SkipTrayScope scope(tray);
  // Where a layer failed, its forward fails too; the next forward searches again.
  if (const std::optional<std::vector<bool>> found = layers_changing_their_input(layers_, x, names_))
    in_place_[modes] = *found;
}

Tensors Stage::forward(int i, const Tensors& input, bool recompute, bool split, StepData& step) {
  const Tensors& given = first() ? step.inputs[static_cast<size_t>(i)] : input;
  const LeafGrad grad =
      (!first() || step.keep_input_gradients) && step.training ? LeafGrad::kFloating : LeafGrad::kNone;
  const Tensors x = leaves_of(given.to(device_.device), grad);  // [1]
  Kept& k = kept_[i] = Kept{};
  k.input = x;
  k.recompute = recompute;
  k.split = split;
  for (const auto& [skip, name] : popped_) {  // what other stages stashed: leaves, as the input is
    auto it = skip_inbox_.find({i, static_cast<int>(skip_channel(skip, false))});
    GPIPE_CHECK(it != skip_inbox_.end(), "stage ", index_, " got no tensor for \"", name, "\" in micro-batch ", i);
    torch::Tensor t = it->second.to(device_.device).detach();
    if (step.training && t.is_floating_point()) t.requires_grad_(true);
    k.skip_inputs[skip] = t;
    skip_inbox_.erase(it);
  }
  find_in_place_layers(i, x, k, step);
  Tensors y;
  torch::Tensor loss;
  // The input must stay as it was: the first stage's is the caller's data, of which the micro-batches
  // are views, and a re-materialized forward runs again from the input it keeps.
  const bool recomputed = step.training && recompute;
  const std::vector<int64_t> versions = first() || recomputed ? versions_of(x) : std::vector<int64_t>{};
  if (!step.training) {
    y = run_layers(i, x, false, /*gather=*/true, k, step);
  } else {
    detail::RandomStream stream(stochastic_, device_.device, seed_of(i, step));
    torch::AutoGradMode keep_graph(!recompute);
    // A stage with skip connections inside splits its backward in one piece: its whole graph is kept.
    y = run_layers(i, x, split && !recompute && !skips_inside_, /*gather=*/true, k, step);
    loss = k.loss;
  }
  if (const std::string changed = changed_in_place(x, versions); !changed.empty())
    throw std::invalid_argument(
        first() ? "the stage's layers change " + changed + ", the caller's data, in place (the micro-batches are "
                  "views of its batch): make the layer return a new tensor (e.g. ReLU(inplace=False))"
                : "the stage's layers change " + changed +
                      " in place, and the stage keeps its input for its backward pass (and re-materialization runs "
                      "the forward again from it): make the layer return a new tensor (e.g. ReLU(inplace=False)), "
                      "or cut the model so that another layer begins the stage");
  for (const auto& [skip, name] : stashed_)  // [2], for each skip connection
    skip_outbox_[{i, static_cast<int>(skip_channel(skip, false))}] = k.stashed.at(skip).detach();
  if (!step.training) {
    kept_.erase(i);
    if (!last()) return y;
    step.outputs[static_cast<size_t>(i)] = model_output(y);
    return {};
  }
  if (recompute) {  // keep the inputs alone
    k.output = Tensors();
    k.loss = torch::Tensor();
    k.layer_inputs.clear();
    k.layer_outputs.clear();
    k.stashed.clear();
  }
  if (!last()) return leaves_of(y, LeafGrad::kNone);  // [2]
  if (stream_.active())
    device_losses_[i] = loss.detach();  // read at the step's end: no host wait here
  else
    step.losses[static_cast<size_t>(i)] = loss.item<double>();
  return {};
}

torch::Tensor mse_loss(const torch::Tensor& output, const torch::Tensor& target) {
  return torch::mse_loss(output, target);
}

torch::Tensor cross_entropy_loss(const torch::Tensor& output, const torch::Tensor& target) {
  const int64_t classes = output.size(-1);
  if (target.is_floating_point() && target.sizes() == output.sizes())  // class probabilities
    return torch::nn::functional::cross_entropy(output.reshape({-1, classes}), target.reshape({-1, classes}));
  return torch::nn::functional::cross_entropy(output.reshape({-1, classes}), target.reshape({-1}));
}

std::string precision_refusal(Precision precision, c10::DeviceType kind) {
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)
  (void)precision;
  (void)kind;
  return "";
#else
  if (precision != Precision::kFloat16 || kind != c10::DeviceType::CPU) return "";
  return "`precision` fp16 runs on CUDA devices with this torch (" + std::string(TORCH_VERSION) +
         "): its autocast takes bfloat16 only on a CPU (torch 2.4 and later take float16 there); use `precision` "
         "bf16 on a CPU";
#endif
}

void check_precision_runs(Precision precision, c10::DeviceType kind) {
  if (const std::string refused = precision_refusal(precision, kind); !refused.empty()) throw std::invalid_argument("gpipe: " + refused);
}

}  // namespace gpipe
