// stage_updates.cc: each stage's share of a step's update, applied on its device.
#include "train/stage_updates.h"

#include "train/optimizer_state.h"

#include <set>

namespace gpipe::detail {
namespace {

// The stages this process holds: every stage in one process, else those of its device.
std::vector<int> stages_here(const Pipeline& pipeline) {
  std::vector<int> out;
  const PipelinePlan& plan = pipeline.plan();
  for (int s = 0; s < plan.stages(); ++s)
    if (pipeline.device() < 0 || plan.placement[static_cast<size_t>(s)] == pipeline.device()) out.push_back(s);
  return out;
}

// Moves the state of `parameters` from `from` to `to` (a parameter without state has none to move).
void move_state(torch::optim::Optimizer& from, torch::optim::Optimizer& to, const std::vector<torch::Tensor>& parameters) {
  auto& source = from.state();
  auto& target = to.state();
  for (const torch::Tensor& p : parameters) {
    const auto it = source.find(state_key(source, p));
    if (it == source.end()) continue;
    target[state_key(target, p)] = std::move(it->second);
    source.erase(it);
  }
}

}  // namespace

bool StageUpdates::possible(const Pipeline& pipeline) {
  std::set<const void*> seen;
  for (int s : stages_here(pipeline))
    for (const torch::Tensor& p : unique_parameters(*pipeline.stage(s)))
      if (!seen.insert(p.unsafeGetTensorImpl()).second) return false;
  return true;
}

StageUpdates::StageUpdates(const Pipeline& pipeline, const OptimizerOptions& options) {
  for (int s : stages_here(pipeline)) {
    std::vector<torch::Tensor> parameters = unique_parameters(*pipeline.stage(s));
    if (parameters.empty()) continue;
    Share& share = shares_[s];
    share.optimizer = make_optimizer(options, parameters);
    share.parameters = std::move(parameters);
  }
}

void StageUpdates::hold(double lr, torch::optim::Optimizer& whole) {
  if (holding_) throw std::logic_error("gpipe: StageUpdates::hold with an update held");
  for (auto& [stage, share] : shares_) {
    if (!state_here_) move_state(whole, *share.optimizer, share.parameters);
    share.gradients.clear();
    for (torch::Tensor& p : share.parameters) {
      share.gradients.push_back(p.grad());
      p.mutable_grad() = torch::Tensor();
    }
    for (auto& group : share.optimizer->param_groups()) group.options().set_lr(lr);
    share.due = true;
  }
  state_here_ = true;
  holding_ = true;
}

void StageUpdates::apply(int stage) {
  const auto it = shares_.find(stage);
  if (it == shares_.end() || !it->second.due) return;
  Share& share = it->second;
  share.due = false;  // once, even if the update fails part way
  // The optimizer reads .grad: the held gradients stand in for the ones this step is writing.
  std::vector<torch::Tensor> current;
  for (size_t n = 0; n < share.parameters.size(); ++n) {
    current.push_back(share.parameters[n].grad());
    share.parameters[n].mutable_grad() = share.gradients[n];
  }
  try {
    share.optimizer->step();
  } catch (...) {
    for (size_t n = 0; n < share.parameters.size(); ++n) share.parameters[n].mutable_grad() = current[n];
    throw;
  }
  for (size_t n = 0; n < share.parameters.size(); ++n) share.parameters[n].mutable_grad() = current[n];
  share.gradients.clear();
}

void StageUpdates::finish(torch::optim::Optimizer& whole) {
  for (auto& [stage, share] : shares_) apply(stage);
  if (state_here_)
    for (auto& [stage, share] : shares_) move_state(*share.optimizer, whole, share.parameters);
  state_here_ = false;
  holding_ = false;
}

}  // namespace gpipe::detail
