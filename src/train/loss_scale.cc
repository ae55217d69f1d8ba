// loss_scale.cc: one loss scale for the whole pipeline (loss_scale.h), by GradScaler's rule.
#include "gpipe/loss_scale.h"

#include "gpipe/check.h"
#include "gpipe/pipeline.h"

#include <cmath>
#include <utility>

namespace gpipe {

namespace {

bool positive(double value) { return std::isfinite(value) && value > 0; }

}  // namespace

bool scales_loss(const std::optional<LossScaleOptions>& options, Precision precision) {
  return options ? options->enabled() : precision == Precision::kFloat16;
}

LossScaler::LossScaler(const LossScaleOptions& options) : options_(options) {
  GPIPE_CHECK(positive(options.init_scale()), "the first loss scale must be a finite number above 0 (got ",
              options.init_scale(), ")");
  GPIPE_CHECK(std::isfinite(options.growth_factor()) && options.growth_factor() > 1,
              "the loss scale's growth factor must be a finite number above 1 (got ", options.growth_factor(), ")");
  GPIPE_CHECK(positive(options.backoff_factor()) && options.backoff_factor() < 1,
              "the loss scale's back-off factor must be a number above 0 and below 1 (got ", options.backoff_factor(),
              ")");
  GPIPE_CHECK(options.growth_interval() >= 1, "the loss scale's growth interval must be 1 step or more (got ",
              options.growth_interval(), ")");
  state_.scale = options.init_scale();
}

void LossScaler::set_state(const LossScaleState& state) {
  GPIPE_CHECK(positive(state.scale), "a loss scale must be a finite number above 0 (got ", state.scale, ")");
  GPIPE_CHECK(state.growth_tracker >= 0 && state.skipped >= 0,
              "a loss scale's counts of steps must be 0 or more (got ", state.growth_tracker, " and ", state.skipped, ")");
  state_ = state;
}

LossFn LossScaler::scaled(LossFn loss) const {
  return [loss = std::move(loss), scale = state_.scale](const torch::Tensor& output, const torch::Tensor& target) {
    return loss(output, target) * scale;
  };
}

bool LossScaler::unscale_and_update(Pipeline& pipeline, bool loss_finite) {
  const std::vector<torch::Tensor> parameters = pipeline.parameters();
  bool finite = loss_finite;
  {
    torch::NoGradGuard no_grad;
    // The reciprocal in float, as GradScaler takes it: exact for a power of two.
    const double inverse = static_cast<double>(1.0f / static_cast<float>(state_.scale));
    for (const torch::Tensor& p : parameters) {
      if (!finite) break;
      if (!p.grad().defined()) continue;
      torch::Tensor grad = p.mutable_grad();
      grad.mul_(inverse);
      finite = torch::isfinite(grad).all().item<bool>();
    }
  }
  // One answer for every stage and rank: a step skipped anywhere is skipped everywhere.
  const bool all_finite = pipeline.max(finite ? 0.0 : 1.0) == 0.0;
  if (!all_finite)
    for (torch::Tensor p : parameters) p.mutable_grad().reset();
  update(all_finite);
  return all_finite;
}

// In float, as GradScaler keeps its scale: a growth past float's range leaves it as it is.
void LossScaler::update(bool finite) {
  const float scale = static_cast<float>(state_.scale);
  if (!finite) {
    state_.scale = scale * static_cast<float>(options_.backoff_factor());
    state_.growth_tracker = 0;
    ++state_.skipped;
    return;
  }
  if (++state_.growth_tracker < options_.growth_interval()) return;
  const float grown = scale * static_cast<float>(options_.growth_factor());
  if (std::isfinite(grown)) state_.scale = grown;
  state_.growth_tracker = 0;
}

}  // namespace gpipe
