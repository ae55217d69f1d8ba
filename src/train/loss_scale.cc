// loss_scale.cc: one loss scale for the whole pipeline (loss_scale.h), by GradScaler's rule.
#include "gpipe/loss_scale.h"

#include "gpipe/check.h"
#include "gpipe/pipeline.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <unordered_map>
#include <vector>

namespace gpipe {

namespace {

bool positive(double value) { return std::isfinite(value) && value > 0; }

}  // namespace

bool scales_loss(const std::optional<LossScaleOptions>& options, Precision precision) {
  return options ? options->enabled() : precision == Precision::kFloat16;
}

LossScaler::LossScaler(const LossScaleOptions& options) : options_(options) {
  GPIPE_CHECK(options.init_scale() >= std::numeric_limits<float>::min() &&
                  options.init_scale() <= std::numeric_limits<float>::max(),
              "the first loss scale must be a number that a float holds, from 1.2e-38 to 3.4e+38 (got ",
              options.init_scale(), ")");
  GPIPE_CHECK(std::isfinite(options.growth_factor()) && options.growth_factor() > 1,
              "the loss scale's growth factor must be a finite number above 1 (got ", options.growth_factor(), ")");
  GPIPE_CHECK(positive(options.backoff_factor()) && options.backoff_factor() < 1,
              "the loss scale's back-off factor must be a number above 0 and below 1 (got ", options.backoff_factor(),
              ")");
  GPIPE_CHECK(options.growth_interval() >= 1, "the loss scale's growth interval must be 1 step or more (got ",
              options.growth_interval(), ")");
  state_.scale = static_cast<float>(options.init_scale());  // kept in float, as GradScaler keeps it
}

void LossScaler::set_state(const LossScaleState& state) {
  GPIPE_CHECK(state.scale >= std::numeric_limits<float>::min() && state.scale <= std::numeric_limits<float>::max(),
              "a loss scale must be a number that a float holds, from 1.2e-38 to 3.4e+38 (got ", state.scale, ")");
  GPIPE_CHECK(state.growth_tracker >= 0 && state.skipped >= 0,
              "a loss scale's counts of steps must be 0 or more (got ", state.growth_tracker, " and ", state.skipped, ")");
  state_ = state;
}

bool LossScaler::check_and_update(Pipeline& pipeline, bool loss_finite) {
  const std::vector<torch::Tensor> parameters = pipeline.parameters();
  bool finite = loss_finite;
  if (finite) {
    // One flag per device, read once each: no wait on the host per parameter.
    std::unordered_map<c10::Device, torch::Tensor> flags;
    for (const torch::Tensor& p : parameters) {
      if (!p.grad().defined()) continue;
      const torch::Tensor ok = torch::isfinite(p.grad()).all();
      auto [flag, fresh] = flags.emplace(p.device(), ok);
      if (!fresh) flag->second = flag->second.logical_and(ok);
    }
    for (const auto& [device, flag] : flags) finite = finite && flag.item<bool>();
  }
  // One answer for every stage and rank: a step skipped anywhere is skipped everywhere.
  const bool all_finite = pipeline.max(finite ? 0.0 : 1.0) == 0.0;
  if (!all_finite)
    for (torch::Tensor p : parameters) p.mutable_grad().reset();
  update(all_finite);
  return all_finite;
}

void LossScaler::update(bool finite) {
  const float scale = static_cast<float>(state_.scale);
  if (!finite) {
    state_.scale = std::max(scale * static_cast<float>(options_.backoff_factor()), std::numeric_limits<float>::min());
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
