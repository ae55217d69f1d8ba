// optimizer.cc: the optimizers a Trainer takes by name (SGD, Adam, AdamW), their options' checks,
// and the learning rate of each step (warm-up, then constant, cosine or step).
#include "gpipe/train.h"

#include "gpipe/check.h"

#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <string>
#include <vector>

namespace gpipe {

std::string optimizer_name(OptimizerKind kind) {
  switch (kind) {
    case OptimizerKind::kSgd: return "sgd";
    case OptimizerKind::kAdam: return "adam";
    case OptimizerKind::kAdamW: return "adamw";
  }
  return "?";
}

OptimizerKind parse_optimizer(const std::string& name) {
  for (OptimizerKind kind : {OptimizerKind::kSgd, OptimizerKind::kAdam, OptimizerKind::kAdamW})
    if (optimizer_name(kind) == name) return kind;
  GPIPE_CHECK(false, "unknown optimizer '", name, "'; use sgd, adam or adamw");
  return OptimizerKind::kAdam;
}

std::string lr_schedule_name(LrSchedule kind) {
  switch (kind) {
    case LrSchedule::kConstant: return "constant";
    case LrSchedule::kCosine: return "cosine";
    case LrSchedule::kStep: return "step";
  }
  return "?";
}

LrSchedule parse_lr_schedule(const std::string& name) {
  for (LrSchedule kind : {LrSchedule::kConstant, LrSchedule::kCosine, LrSchedule::kStep})
    if (lr_schedule_name(kind) == name) return kind;
  GPIPE_CHECK(false, "unknown learning-rate schedule '", name, "'; use constant, cosine or step");
  return LrSchedule::kConstant;
}

double OptimizerOptions::decay() const {
  return weight_decay().value_or(kind() == OptimizerKind::kAdamW ? 0.01 : 0.0);  // torch.optim's defaults
}

void OptimizerOptions::check() const {
  const bool sgd = kind() == OptimizerKind::kSgd;
  GPIPE_CHECK(std::isfinite(lr()) && lr() > 0, "the learning rate must be a finite number above 0 (got ", lr(), ")");
  GPIPE_CHECK(sgd || (momentum() == 0 && !nesterov()), "`momentum` and `nesterov` are SGD's (`optimizer` sgd); ",
              optimizer_name(kind()), " has `betas`");
  GPIPE_CHECK(!sgd || !betas(), "`betas` are Adam's and AdamW's; SGD has `momentum`");
  GPIPE_CHECK(!nesterov() || momentum() > 0, "`nesterov` needs `momentum` above 0 (as torch.optim.SGD)");
  // The parameters are float: a factor beyond float's range cannot be applied to them.
  const double largest = std::numeric_limits<float>::max();
  GPIPE_CHECK(std::isfinite(decay()) && decay() >= 0 && decay() <= largest, "`weight_decay` must be a number from 0 "
              "to 3.4e38, float's largest (got ", decay(), ")");
  GPIPE_CHECK(std::isfinite(momentum()) && momentum() >= 0 && momentum() <= largest, "`momentum` must be a number "
              "from 0 to 3.4e38, float's largest (got ", momentum(), ")");
}

double state_per_parameter_byte(const OptimizerOptions& options) {
  if (options.kind() == OptimizerKind::kSgd) return options.momentum() > 0 ? 2.0 : 1.0;
  return 3.0;  // Adam, AdamW: two moments
}

std::unique_ptr<torch::optim::Optimizer> make_optimizer(const OptimizerOptions& o,
                                                        const std::vector<torch::Tensor>& params) {
  o.check();
  namespace optim = torch::optim;
  if (o.kind() == OptimizerKind::kSgd)
    return std::make_unique<optim::SGD>(
        params, optim::SGDOptions(o.lr()).momentum(o.momentum()).nesterov(o.nesterov()).weight_decay(o.decay()));
  const auto betas = o.betas().value_or(std::make_tuple(0.9, 0.999));
  if (o.kind() == OptimizerKind::kAdamW)
    return std::make_unique<optim::AdamW>(params, optim::AdamWOptions(o.lr()).betas(betas).weight_decay(o.decay()));
  return std::make_unique<optim::Adam>(params, optim::AdamOptions(o.lr()).betas(betas).weight_decay(o.decay()));
}

void LrScheduleOptions::check() const {
  GPIPE_CHECK(warmup_steps() >= 0, "the warm-up must be 0 steps or more (got ", warmup_steps(), ")");
  GPIPE_CHECK(step_size() >= 0, "the LR step size must be 0 (one epoch) or more steps (got ", step_size(), ")");
  GPIPE_CHECK(std::isfinite(gamma()) && gamma() > 0, "the LR decay factor gamma must be a finite number above 0 (got ",
              gamma(), ")");
}

double learning_rate(double lr, const LrScheduleOptions& schedule, int64_t step, int64_t total) {
  GPIPE_CHECK(schedule.kind() != LrSchedule::kStep || schedule.step_size() > 0,
              "the step schedule needs a step size above 0 (got ", schedule.step_size(), ")");
  const int64_t W = schedule.warmup_steps();
  if (step < W) return lr * static_cast<double>(step + 1) / static_cast<double>(W);
  const double t = static_cast<double>(step - W);
  if (schedule.kind() == LrSchedule::kCosine) {
    const double span = static_cast<double>(std::max<int64_t>(1, total - W));
    return lr * 0.5 * (1.0 + std::cos(M_PI * std::min(1.0, t / span)));
  }
  if (schedule.kind() == LrSchedule::kStep)
    return lr * std::pow(schedule.gamma(), std::floor(t / static_cast<double>(schedule.step_size())));
  return lr;
}

}  // namespace gpipe
