// train_step.cc: the checks of a stage's layers, and the scope that keeps a training step atomic.
#include "runtime/train_step.h"

#include "gpipe/check.h"

#include <torch/torch.h>

#include <algorithm>
#include <limits>

namespace gpipe::detail {

void check_batch_norm(const torch::nn::Sequential& layers, bool deferred) {
  if (!deferred) return;
  const std::string name = nested_batch_norm(layers);
  GPIPE_CHECK(name.empty(), "the BatchNorm ", name, " sits inside a layer of the model, where its stage cannot see "
              "its input, so it cannot update its running statistics once per mini-batch from every row; make each "
              "BatchNorm a layer of the Sequential itself, or update them from each micro-batch instead "
              "(`deferred_batch_norm=false`)");
}

void weigh_by_counted_targets(StepData& step, const torch::Tensor& target, int64_t first,
                              const std::vector<int64_t>& sizes) {
  using Loss = torch::Tensor (*)(const torch::Tensor&, const torch::Tensor&);
  const Loss* fn = step.loss.target<Loss>();
  if (fn == nullptr || *fn != &cross_entropy_loss || sizes.empty() || target.is_floating_point() ||
      target.scalar_type() == torch::kBool)
    return;
  constexpr int64_t kIgnored = -100;  // torch's ignore_index
  const torch::Tensor counted = target.ne(kIgnored);
  const int64_t total = counted.sum().item<int64_t>();
  // None ignored: every row counts alike (bᵢ/N). All ignored: the mean is 0/0, as torch's.
  if (total == counted.numel() || total == 0) return;
  int64_t at = first;
  for (size_t i = 0; i < sizes.size(); ++i) {
    step.weights[i] = static_cast<double>(counted.narrow(0, at, sizes[i]).sum().item<int64_t>()) /
                      static_cast<double>(total);
    at += sizes[i];
  }
}

bool wants_input_gradient(const Tensors& input, const std::vector<int>& whole) {
  for (size_t n = 0; n < input.size(); ++n) {
    const torch::Tensor& t = input.items[n];
    if (std::find(whole.begin(), whole.end(), static_cast<int>(n)) != whole.end()) continue;
    if (t.defined() && t.is_floating_point() && t.requires_grad()) return true;
  }
  return false;
}

void add_input_gradients(const Tensors& input, const StepData& step, int64_t first,
                         const std::vector<int>& whole) {
  std::vector<torch::Tensor> roots, grads;
  for (size_t n = 0; n < input.size(); ++n) {
    const torch::Tensor& x = input.items[n];
    if (std::find(whole.begin(), whole.end(), static_cast<int>(n)) != whole.end()) continue;
    if (!x.defined() || !x.is_floating_point() || !x.requires_grad()) continue;
    std::vector<torch::Tensor> parts;
    bool any = false;
    for (const Tensors& g : step.input_gradients) {
      const bool defined = n < g.size() && g.items[n].defined();
      any = any || defined;
      parts.push_back(defined ? g.items[n] : torch::Tensor());
    }
    if (!any) continue;  // no layer took a gradient from it
    // Rows this replica did not run stay zero (under MPI its own replica's rows are filled).
    torch::Tensor grad = torch::zeros_like(x);
    {
      torch::NoGradGuard no_grad;
      int64_t at = first;
      for (size_t i = 0; i < parts.size(); ++i) {
        const int64_t b = step.inputs[i].items[n].size(0);
        if (parts[i].defined()) grad.narrow(0, at, b).copy_(parts[i]);
        at += b;
      }
    }
    roots.push_back(x);
    grads.push_back(grad);
  }
  if (!roots.empty()) torch::autograd::backward(roots, grads);
}

TrainStepScope::TrainStepScope(StepData& step, const std::vector<int64_t>& sizes, int64_t total_rows,
                               bool stochastic, std::vector<torch::Tensor> params,
                               bool zero_grads)
    : params_(std::move(params)) {
  const int M = static_cast<int>(sizes.size());
  step.training = true;
  for (int64_t b : sizes) step.weights.push_back(static_cast<double>(b) / static_cast<double>(total_rows));
  step.losses.assign(static_cast<size_t>(M), 0.0);

  // Stochastic stages draw from streams seeded by this step's seed.
  if (stochastic) {
    at::Generator generator = at::globalContext().defaultGenerator(torch::kCPU);
    random_state_before_ = generator.get_state();  // a failed step goes back here: its retry draws the same seed
    step.seed = static_cast<uint64_t>(
        torch::randint(std::numeric_limits<int64_t>::max(), {1}, torch::kLong).item<int64_t>());
    random_state_ = generator.get_state();
  }
  before_.resize(params_.size());
  for (size_t n = 0; n < params_.size(); ++n) {
    before_[n] = params_[n].grad();
    params_[n].mutable_grad() = zero_grads ? torch::zeros_like(params_[n]) : torch::Tensor();
    if (zero_grads) versions_.push_back(params_[n].grad()._version());
  }
}

void TrainStepScope::restore_random_state(const torch::Tensor& state) {
  if (!state.defined()) return;
  at::Generator generator = at::globalContext().defaultGenerator(torch::kCPU);
  generator.set_state(state);
}

void TrainStepScope::commit(double inverse_scale) {
  restore_random_state(random_state_);
  torch::NoGradGuard no_grad;
  for (size_t n = 0; n < params_.size(); ++n) {
    // A zero gradient that backward never added to: the parameter had no part in the step.
    if (!versions_.empty() && params_[n].grad()._version() == versions_[n]) params_[n].mutable_grad() = torch::Tensor();
    if (inverse_scale != 1.0 && params_[n].grad().defined()) params_[n].mutable_grad().mul_(inverse_scale);
    if (!before_[n].defined()) continue;
    if (params_[n].grad().defined()) before_[n].add_(params_[n].grad());
    params_[n].mutable_grad() = before_[n];
  }
  committed_ = true;
}

TrainStepScope::~TrainStepScope() {
  if (committed_) return;
  for (size_t n = 0; n < params_.size(); ++n) params_[n].mutable_grad() = before_[n];
  restore_random_state(random_state_before_);
}

}  // namespace gpipe::detail
