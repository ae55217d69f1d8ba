// stage_updates.cc: each stage's share of a step's update, applied on its device.
#include "train/stage_updates.h"

#include "train/optimizer_state.h"

#include <exception>
#include <set>
#include <stdexcept>
#include <string>

namespace gpipe::detail {
namespace {

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

// The parameters' .grad set to `stand_in` while it lives, then put back as they were.
class StandInGradients {
 public:
  StandInGradients(std::vector<torch::Tensor>& parameters, const std::vector<torch::Tensor>& stand_in)
      : parameters_(parameters) {
    for (size_t n = 0; n < parameters_.size(); ++n) {
      kept_.push_back(parameters_[n].grad());
      parameters_[n].mutable_grad() = stand_in[n];
    }
  }
  ~StandInGradients() {
    for (size_t n = 0; n < parameters_.size(); ++n) parameters_[n].mutable_grad() = kept_[n];
  }

 private:
  std::vector<torch::Tensor>& parameters_;
  std::vector<torch::Tensor> kept_;
};

}  // namespace

bool StageUpdates::possible(const Pipeline& pipeline) {
  std::set<const void*> seen;
  for (int s : pipeline.stages_here())
    for (const torch::Tensor& p : unique_parameters(*pipeline.stage(s)))
      if (!seen.insert(p.unsafeGetTensorImpl()).second) return false;
  return true;
}

StageUpdates::StageUpdates(const Pipeline& pipeline, const OptimizerOptions& options) {
  for (int s : pipeline.stages_here()) {
    std::vector<torch::Tensor> parameters = unique_parameters(*pipeline.stage(s));
    if (parameters.empty()) continue;
    Share& share = shares_[s];
    share.optimizer = make_optimizer(options, parameters);
    share.parameters = std::move(parameters);
  }
}

void StageUpdates::hold(double lr, torch::optim::Optimizer& whole) {
  if (holding_) throw std::logic_error("gpipe: StageUpdates::hold with an update held");
  const bool move = !state_here_;
  state_here_ = true;  // give_back moves back whatever moved, should a move below fail
  for (auto& [stage, share] : shares_) {
    if (move) move_state(whole, *share.optimizer, share.parameters);
    share.gradients.clear();
    for (torch::Tensor& p : share.parameters) {
      share.gradients.push_back(p.grad());
      p.mutable_grad() = torch::Tensor();
    }
    for (auto& group : share.optimizer->param_groups()) group.options().set_lr(lr);
    share.due = true;
  }
  holding_ = true;
}

void StageUpdates::apply(int stage) {
  const auto it = shares_.find(stage);
  if (it == shares_.end() || !it->second.due) return;
  Share& share = it->second;
  share.due = false;  // once: a share that fails part way is not applied again
  try {
    // The optimizer reads .grad: the held gradients stand in for the ones this step is writing.
    // They stay held until apply_remaining (on a GPU the update may still be queued on the stream).
    const StandInGradients stand_in(share.parameters, share.gradients);
    share.optimizer->step();
  } catch (const std::exception& e) {
    throw std::runtime_error("gpipe: the optimizer's update of stage " + std::to_string(stage) +
                             " failed part way, leaving its parameters part updated: " + e.what());
  }
}

void StageUpdates::apply_remaining() {
  std::exception_ptr first;
  for (auto& [stage, share] : shares_) {
    try {
      apply(stage);
    } catch (...) {
      if (!first) first = std::current_exception();
    }
    share.gradients.clear();
  }
  holding_ = false;
  if (first) std::rethrow_exception(first);
}

void StageUpdates::give_back(torch::optim::Optimizer& whole) {
  std::exception_ptr failed;
  try {
    apply_remaining();
  } catch (...) {
    failed = std::current_exception();
  }
  if (state_here_)
    for (auto& [stage, share] : shares_) move_state(*share.optimizer, whole, share.parameters);
  state_here_ = false;
  if (failed) std::rethrow_exception(failed);
}

}  // namespace gpipe::detail
