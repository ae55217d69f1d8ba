// train_step.cc: the step scope shared by the one-process and the MPI pipeline.
#include "runtime/train_step.h"

#include "gpipe/check.h"
#include "gpipe/partition.h"

#include <torch/torch.h>

#include <algorithm>
#include <limits>

namespace gpipe::detail {

void check_splittable(const Schedule& program, const torch::nn::Sequential& layers) {
  bool split = false;
  for (const auto& row : program.actions)
    for (const Action& a : row) split = split || a.kind == ActionKind::kInputGrad;
  if (!split) return;
  const std::string name = in_place_layer(layers);
  GPIPE_CHECK(name.empty(), "layer ", name, " works in place (a module built with inplace(true)), but the ",
              program.name, " schedule splits each backward into I and W, which keeps every layer's input; build "
              "it with inplace(false), or use a schedule without I and W (gpipe, 1f1b, interleaved)");
}

void check_batch_norm(const torch::nn::Sequential& layers, bool deferred) {
  if (!deferred) return;
  const std::string name = nested_batch_norm(layers);
  GPIPE_CHECK(name.empty(), "the BatchNorm ", name, " sits inside a layer of the model, where its stage cannot see "
              "its input, so it cannot update its running statistics once per mini-batch from every row; make each "
              "BatchNorm a layer of the Sequential itself, or set deferred_batch_norm(false) (gpipe train: --batch-norm per-micro-batch) to update them "
              "from each micro-batch");
}

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

SkipPlan plan_skips(const std::vector<SkipConnection>& connections, const std::vector<int>& balance) {
  const std::vector<int> offsets = stage_offsets(balance);
  auto stage_of = [&](int layer) {
    return static_cast<int>(std::upper_bound(offsets.begin(), offsets.end(), layer) - offsets.begin()) - 1;
  };
  SkipPlan plan;
  for (const SkipConnection& c : connections) {
    const int from = stage_of(c.stash_layer), to = stage_of(c.pop_layer);
    if (from == to) continue;  // the stage's own layers meet in its tray
    plan.routes.push_back({from, to});
    plan.names.push_back(c.name);
  }
  return plan;
}

void SkipPlan::connect(Stage& stage) const {
  std::vector<std::pair<int, std::string>> stashed, popped;
  for (size_t k = 0; k < routes.size(); ++k) {
    if (routes[k].from == stage.index()) stashed.emplace_back(static_cast<int>(k), names[k]);
    if (routes[k].to == stage.index()) popped.emplace_back(static_cast<int>(k), names[k]);
  }
  stage.set_skips(std::move(stashed), std::move(popped));
}

Schedule short_batch_program(ScheduleKind kind, int devices, int micro_batches, int virtual_stages, Checkpoint mode,
                             const std::vector<SkipRoute>& skips) {
  Schedule compute;
  try {
    compute = make_schedule(kind, devices, micro_batches, virtual_stages);
  } catch (const std::invalid_argument&) {
    compute = fill_drain(devices, micro_batches, virtual_stages);
  }
  Schedule program = lower(compute, mode, skips);
  validate(program);
  return program;
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

void TrainStepScope::commit() {
  restore_random_state(random_state_);
  torch::NoGradGuard no_grad;
  for (size_t n = 0; n < params_.size(); ++n) {
    // A zero gradient that backward never added to: the parameter had no part in the step.
    if (!versions_.empty() && params_[n].grad()._version() == versions_[n]) params_[n].mutable_grad() = torch::Tensor();
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
