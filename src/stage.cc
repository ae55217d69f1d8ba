// stage.cc: the stage executor: forward, re-materialized backward, and the random stream replay.
#include "gpipe/stage.h"

#include <torch/torch.h>

#include <c10/core/DeviceGuard.h>

#include <mutex>
#include <optional>

namespace gpipe {

StageError::StageError(const Action& action, const std::string& what)
    : std::runtime_error("gpipe: stage " + std::to_string(action.stage) + " failed in the " +
                         (action.phase == Phase::kForward ? "forward" : "backward") +
                         " of micro-batch " + std::to_string(action.micro_batch) + " (action " +
                         action.str() + "): " + what),
      action_(action) {}

namespace {

template <typename Impl>
bool drops(torch::nn::Module& module) {
  auto* dropout = module.as<Impl>();
  return dropout != nullptr && dropout->options.p() > 0;
}

}  // namespace

bool draws_random_numbers(const torch::nn::Sequential& layers) {
  for (const auto& module : layers->modules(/*include_self=*/false)) {
    if (drops<torch::nn::DropoutImpl>(*module) || drops<torch::nn::Dropout2dImpl>(*module) ||
        drops<torch::nn::Dropout3dImpl>(*module) || drops<torch::nn::AlphaDropoutImpl>(*module) ||
        drops<torch::nn::FeatureAlphaDropoutImpl>(*module))
      return true;
  }
  return false;
}

namespace {

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

StageExecutor::StageExecutor(int index, int stages, torch::nn::Sequential layers, Device device,
                             Transport* transport, std::shared_ptr<MemoryCounter> memory)
    : index_(index),
      stages_(stages),
      layers_(std::move(layers)),
      device_(std::move(device)),
      transport_(transport),
      stochastic_(draws_random_numbers(layers_)),
      memory_(std::move(memory)) {}

uint64_t StageExecutor::seed_of(int i, const StepData& step) const {
  return mix(step.seed ^ mix((static_cast<uint64_t>(index_) << 32) | static_cast<uint32_t>(i)));
}

void StageExecutor::run(const std::vector<Action>& actions, StepData& step,
                        std::vector<ActionSpan>* trace) {
  c10::DeviceGuard device_guard(device_.device);
  torch::AutoGradMode grad_mode(step.training);
  std::optional<MemoryScope> memory_scope;
  if (memory_) memory_scope.emplace(memory_);
  kept_.assign(step.recompute.size(), Kept{});
  if (trace != nullptr) trace->reserve(actions.size());
  try {
    for (const Action& action : actions) {
      compute_begin_ns_ = 0;
      try {
        if (action.phase == Phase::kForward)
          forward(action.micro_batch, step);
        else
          backward(action.micro_batch, step);
      } catch (const Cancelled&) {
        throw;
      } catch (const std::exception& e) {
        throw StageError(action, e.what());
      }
      // The span starts when the inputs had arrived: waiting is idle time, not work.
      if (trace != nullptr) trace->push_back({action, compute_begin_ns_, now_ns()});
    }
  } catch (...) {
    kept_.clear();
    throw;
  }
  kept_.clear();
}

torch::Tensor StageExecutor::weighted_loss(const torch::Tensor& output, int i,
                                           const StepData& step) const {
  torch::Tensor loss = step.loss(output, step.targets[static_cast<size_t>(i)].to(device_.device));
  TORCH_CHECK(loss.defined() && loss.numel() == 1,
              "the loss must return a scalar reduced by the mean over the batch; it returned ",
              loss.defined() ? loss.sizes() : c10::IntArrayRef{});
  return loss.reshape({}) * step.weights[static_cast<size_t>(i)];
}

void StageExecutor::forward(int i, StepData& step) {
  torch::Tensor x = first() ? step.inputs[static_cast<size_t>(i)]
                            : transport_->recv(index_ - 1, index_, Channel::kActivation, i);
  x = x.to(device_.device).detach();
  compute_begin_ns_ = now_ns();
  if (!step.training) {
    torch::Tensor y = layers_->forward(x);
    if (last())
      step.outputs[static_cast<size_t>(i)] = y;
    else
      transport_->send(index_, index_ + 1, Channel::kActivation, i, y);
    return;
  }

  if (!first() && x.is_floating_point()) x.requires_grad_(true);  // [1]
  Kept& kept = kept_[static_cast<size_t>(i)];
  kept.input = x;
  const bool recompute = step.recompute[static_cast<size_t>(i)];
  torch::Tensor y, loss;
  {
    RandomStream stream(stochastic_, device_.device, seed_of(i, step));
    torch::AutoGradMode keep_graph(!recompute);
    y = layers_->forward(x);
    if (last()) loss = weighted_loss(y, i, step);
  }
  if (!recompute) {
    kept.output = y;
    kept.loss = loss;
  }
  if (last())
    step.losses[static_cast<size_t>(i)] = loss.item<double>();
  else
    transport_->send(index_, index_ + 1, Channel::kActivation, i, y.detach());  // [2]
}

void StageExecutor::backward(int i, StepData& step) {
  Kept& kept = kept_[static_cast<size_t>(i)];
  torch::Tensor grad;
  if (!last())
    grad = transport_->recv(index_ + 1, index_, Channel::kGradient, i).to(device_.device);  // [3]
  compute_begin_ns_ = now_ns();

  torch::Tensor y = kept.output, loss = kept.loss;
  if (step.recompute[static_cast<size_t>(i)]) {
    RandomStream stream(stochastic_, device_.device, seed_of(i, step));
    y = layers_->forward(kept.input);
    if (last()) loss = weighted_loss(y, i, step);
  }
  if (last()) {
    if (loss.requires_grad()) loss.backward();
  } else if (y.requires_grad()) {
    y.backward(grad);
  }

  if (!first()) {  // [4]
    torch::Tensor input_grad = kept.input.grad();
    if (!input_grad.defined()) input_grad = torch::zeros_like(kept.input);
    transport_->send(index_, index_ - 1, Channel::kGradient, i, input_grad);
  }
  kept = Kept{};
}

}  // namespace gpipe
