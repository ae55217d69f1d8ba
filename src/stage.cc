// stage.cc: one stage: forward, re-materialized backward, the I/W split, and the random stream replay.
#include "gpipe/stage.h"

#include "gpipe/check.h"
#include "backward_split.h"

#include <torch/torch.h>

#include <cctype>
#include <mutex>
#include <unordered_set>

namespace gpipe {
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

template <typename Impl>
bool drops(torch::nn::Module& module) {
  auto* dropout = module.as<Impl>();
  return dropout != nullptr && dropout->options.p() > 0;
}

// The default generators are shared by every thread of the process. A
// stochastic stage holds this lock while it draws, and seeds the generator
// with a value fixed by (step, stage, micro-batch), so the forward and its
// re-materialization draw the same numbers whatever the other stages do.
std::mutex& random_stream_mutex() {
  static std::mutex mutex;
  return mutex;
}

class RandomStream {
 public:
  RandomStream(bool active, const torch::Device& device, uint64_t seed) {
    if (!active) return;
    lock_ = std::unique_lock<std::mutex>(random_stream_mutex());
    at::Generator generator = at::globalContext().defaultGenerator(device);
    std::lock_guard<std::mutex> guard(generator.mutex());
    generator.set_current_seed(seed);
  }

 private:
  std::unique_lock<std::mutex> lock_;
};

uint64_t mix(uint64_t x) {  // splitmix64's finalizer
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

}  // namespace

StageError::StageError(const Action& action, const std::string& what, const std::string& operand,
                       std::string backtrace)
    : std::runtime_error("gpipe: stage " + std::to_string(action.stage) + " failed in the " + describe(action.kind) +
                         " of micro-batch " + std::to_string(action.micro_batch) + " (action " + action.str() +
                         (operand.empty() ? "" : ", " + operand) + "): " + what),
      action_(action),
      backtrace_(std::move(backtrace)) {}

std::string short_error(const std::exception& e, std::string* report) {
  const auto* error = dynamic_cast<const c10::Error*>(&e);
  std::string what = error ? error->what_without_backtrace() : e.what();
  if (report != nullptr) *report = error ? e.what() : "";
  // TorchScript's interpreter: the serialized and the Python code, then the message on the last line.
  if (what.find("Traceback of TorchScript") == std::string::npos) return what;
  if (report != nullptr && report->empty()) *report = what;
  while (!what.empty() && std::isspace(static_cast<unsigned char>(what.back()))) what.pop_back();
  std::string last = what.substr(what.find_last_of('\n') + 1);
  for (const std::string prefix : {"RuntimeError: ", "Exception: "})
    if (last.rfind(prefix, 0) == 0) last = last.substr(prefix.size());
  return last;
}

namespace {

// Keeps a stage's buffers (a BatchNorm's running statistics and batch count) as they are
// while a forward is recomputed for backward: the first forward updated them already.
class KeepBuffers {
 public:
  explicit KeepBuffers(const torch::nn::Sequential& layers) : buffers_(layers->buffers()) {
    for (const auto& b : buffers_) saved_.push_back(b.clone());
  }
  ~KeepBuffers() {
    // Without a version bump: the recomputed graph holds the running statistics, which the
    // backward of a training-mode BatchNorm does not read.
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    for (size_t n = 0; n < buffers_.size(); ++n) buffers_[n].copy_(saved_[n]);
  }
  KeepBuffers(const KeepBuffers&) = delete;
  KeepBuffers& operator=(const KeepBuffers&) = delete;

 private:
  std::vector<torch::Tensor> buffers_, saved_;
};

template <typename Impl>
bool in_place(torch::nn::Module& module) {
  auto* m = module.as<Impl>();
  return m != nullptr && m->options.inplace();
}

bool works_in_place(torch::nn::Module& m) {
  namespace nn = torch::nn;
  return in_place<nn::ReLUImpl>(m) || in_place<nn::ReLU6Impl>(m) || in_place<nn::LeakyReLUImpl>(m) ||
         in_place<nn::ELUImpl>(m) || in_place<nn::SELUImpl>(m) || in_place<nn::CELUImpl>(m) ||
         in_place<nn::HardtanhImpl>(m) || in_place<nn::ThresholdImpl>(m) || in_place<nn::RReLUImpl>(m) ||
         in_place<nn::DropoutImpl>(m) || in_place<nn::Dropout2dImpl>(m) || in_place<nn::Dropout3dImpl>(m) ||
         in_place<nn::AlphaDropoutImpl>(m) || in_place<nn::FeatureAlphaDropoutImpl>(m);
}

}  // namespace

std::string in_place_layer(const torch::nn::Sequential& layers) {
  for (const auto& layer : layers->named_children()) {
    if (works_in_place(*layer.value())) return layer.key();
    for (const auto& inner : layer.value()->modules(/*include_self=*/false))
      if (works_in_place(*inner)) return layer.key();
  }
  return "";
}

bool draws_random_numbers(const torch::nn::Sequential& layers) {
  for (const auto& module : layers->modules(/*include_self=*/false)) {
    if (drops<torch::nn::DropoutImpl>(*module) || drops<torch::nn::Dropout2dImpl>(*module) ||
        drops<torch::nn::Dropout3dImpl>(*module) || drops<torch::nn::AlphaDropoutImpl>(*module) ||
        drops<torch::nn::FeatureAlphaDropoutImpl>(*module))
      return true;
    const auto* random = dynamic_cast<const RandomLayer*>(module.get());
    if (random != nullptr && random->draws_random_numbers()) return true;
  }
  return false;
}

Stage::Stage(int index, int stages, torch::nn::Sequential layers, Device device)
    : index_(index),
      stages_(stages),
      layers_(std::move(layers)),
      device_(std::move(device)),
      stochastic_(draws_random_numbers(layers_)) {
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
  return loss.reshape({}) * step.weights[static_cast<size_t>(i)];
}

torch::Tensor Stage::run_layers(int i, const torch::Tensor& x, bool split, Kept& kept, StepData& step) {
  torch::Tensor y;
  if (!split) {
    y = layers_->forward(x);
    kept.output = y;
  } else {
    // Each layer on a detached copy of the previous output, so I and W can treat layers one by one.
    kept.layer_inputs.clear();
    kept.layer_outputs.clear();
    torch::Tensor a = x;
    for (auto& layer : *layers_) {
      if (!kept.layer_inputs.empty()) {
        const bool upstream = a.requires_grad();
        a = a.detach();
        if (upstream && a.is_floating_point()) a.requires_grad_(true);
      }
      kept.layer_inputs.push_back(a);
      a = layer.forward(a);
      kept.layer_outputs.push_back(a);
    }
    // The loss's own graph starts at a leaf, so I starts from d loss / d output.
    y = a;
    kept.output = a.detach();
    if (a.requires_grad() && kept.output.is_floating_point()) kept.output.requires_grad_(true);
  }
  if (last()) kept.loss = weighted_loss(kept.output, i, step);
  return y;
}

torch::Tensor Stage::forward(int i, torch::Tensor input, bool recompute, bool split, StepData& step) {
  torch::Tensor x = (first() ? step.inputs[static_cast<size_t>(i)] : input).to(device_.device).detach();
  if (!step.training) {
    torch::Tensor y = layers_->forward(x);
    if (!last()) return y;
    step.outputs[static_cast<size_t>(i)] = y;
    return {};
  }
  if (!first() && x.is_floating_point()) x.requires_grad_(true);  // [1]
  Kept& k = kept_[i] = Kept{};
  k.input = x;
  k.recompute = recompute;
  k.split = split;
  torch::Tensor y, loss;
  {
    RandomStream stream(stochastic_, device_.device, seed_of(i, step));
    torch::AutoGradMode keep_graph(!recompute);
    y = run_layers(i, x, split && !recompute, k, step);
    loss = k.loss;
  }
  if (recompute) {  // keep the input alone
    k.output = k.loss = torch::Tensor();
    k.layer_inputs.clear();
    k.layer_outputs.clear();
  }
  if (!last()) return y.detach();  // [2]
  step.losses[static_cast<size_t>(i)] = loss.item<double>();
  return {};
}

torch::Tensor Stage::backward(int i, const torch::Tensor& output_grad, StepData& step) {
  Kept& k = kept(i);
  if (k.recompute) {
    RandomStream stream(stochastic_, device_.device, seed_of(i, step));
    const KeepBuffers keep(layers_);
    run_layers(i, k.input, false, k, step);
  }
  if (last()) {
    if (k.loss.requires_grad()) k.loss.backward();
  } else if (k.output.requires_grad()) {
    k.output.backward(output_grad.to(device_.device));  // [3]
  }
  torch::Tensor input_grad;
  if (!first()) {  // [4]
    input_grad = k.input.grad();
    if (!input_grad.defined()) input_grad = torch::zeros_like(k.input);
  }
  kept_.erase(i);
  return input_grad;
}

torch::Tensor Stage::input_grad(int i, const torch::Tensor& output_grad, StepData& step) {
  Kept& k = kept(i);
  GPIPE_CHECK(k.split, "stage ", index_, " ran the forward of micro-batch ", i,
              " without recording its layers, so its backward cannot be split into I and W");
  if (k.recompute) {
    RandomStream stream(stochastic_, device_.device, seed_of(i, step));
    const KeepBuffers keep(layers_);
    run_layers(i, k.input, true, k, step);
  }
  const size_t L = k.layer_outputs.size();
  k.weight_backward.clear();
  torch::Tensor g;
  if (!last())
    g = output_grad.to(device_.device);
  else if (k.loss.requires_grad())
    g = torch::autograd::grad({k.loss}, {k.output})[0];
  for (size_t l = L; l-- > 0;) {
    const torch::Tensor y = std::move(k.layer_outputs[l]);
    const torch::Tensor& a = k.layer_inputs[l];
    if (!g.defined() || !y.requires_grad()) {  // nothing before this layer takes a gradient from it
      g = torch::Tensor();
      break;
    }
    // d/da, and W's share of this layer kept for later (backward_split.h).
    auto w = std::make_shared<detail::WeightBackward>();
    g = detail::WeightBackward::input_backward(y, a, g, *w);
    k.weight_backward.push_back(std::move(w));
    if (!g.defined() && a.requires_grad()) g = torch::zeros_like(a);
  }
  torch::Tensor input_grad;
  if (!first()) input_grad = g.defined() ? g : torch::zeros_like(k.input);
  k.layer_inputs.clear();
  k.layer_outputs.clear();
  k.output = k.loss = torch::Tensor();
  return input_grad;
}

void Stage::weight_grad(int i) {
  Kept& k = kept(i);
  for (const auto& w : k.weight_backward) w->run();
  kept_.erase(i);
}

}  // namespace gpipe
