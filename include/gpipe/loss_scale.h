// loss_scale.h: one loss scale for the whole pipeline, as torch.cuda.amp.GradScaler keeps it for a
// model on one device. Under float16 a small gradient underflows to 0, so every micro-batch's loss is
// multiplied by the scale before its backward, and the step's gradients are divided by it
// (Pipeline::train_step's `loss_scale`). Every stage checks its gradients, every rank takes one answer
// (Pipeline::max): a step with a gradient that is not finite is skipped everywhere, its parameters as
// they were, and the scale backs off; after `growth_interval` finite steps in a row it grows. The
// scale is a power of two (by default), so scaling and unscaling change no bit of a finite gradient.
//
//   gpipe::LossScaler scaler;                  // 65536, x2 after 2000 finite steps, x0.5 on a skip
//   optimizer.zero_grad();
//   double loss = pipe.train_step(x, y, gpipe::cross_entropy_loss, scaler.scale()).item<double>();
//   if (scaler.check_and_update(pipe, std::isfinite(loss))) optimizer.step();
#pragma once

#include "gpipe/stage.h"

#include <torch/arg.h>

#include <cstdint>
#include <optional>

namespace gpipe {

class Pipeline;

/// GradScaler's settings, with its defaults.
struct LossScaleOptions {
  TORCH_ARG(double, init_scale) = 65536.0;  ///< 2^16
  TORCH_ARG(double, growth_factor) = 2.0;   ///< after growth_interval finite steps in a row
  TORCH_ARG(double, backoff_factor) = 0.5;  ///< after a step whose gradients are not all finite
  TORCH_ARG(int64_t, growth_interval) = 2000;
  /// false: no scaling, even under float16 (GradScaler(enabled=False)).
  TORCH_ARG(bool, enabled) = true;
};

/// Where the scale stands: what a checkpoint keeps, so that a resumed run continues bit for bit.
struct LossScaleState {
  double scale = 65536.0;
  int64_t growth_tracker = 0;  ///< finite steps in a row since the scale last changed
  int64_t skipped = 0;         ///< steps skipped since the scale was made (a resumed run's too)
  bool operator==(const LossScaleState& o) const {
    return scale == o.scale && growth_tracker == o.growth_tracker && skipped == o.skipped;
  }
};

/// Whether a run scales its loss: as `options` say (LossScaleOptions::enabled), else where it runs in
/// float16.
bool scales_loss(const std::optional<LossScaleOptions>& options, Precision precision);

/// The scale, its rule and the check of a step's gradients (above).
class LossScaler {
 public:
  /// Throws std::invalid_argument for a first scale that is not a float above 0, a growth factor not
  /// above 1, a back-off not between 0 and 1, or an interval below 1. (`enabled` is the front ends'.)
  explicit LossScaler(const LossScaleOptions& options = {});

  double scale() const { return state_.scale; }
  const LossScaleOptions& options() const { return options_; }
  const LossScaleState& state() const { return state_; }
  /// Takes a saved state (a checkpoint's); throws std::invalid_argument for a scale that is not a finite
  /// number above 0 or negative counts.
  void set_state(const LossScaleState& state);

  /// After a step of `pipeline` under scale() (Pipeline::train_step's `loss_scale`): checks on every
  /// stage and rank that each gradient is finite (and `loss_finite`: a loss that is not finite counts as
  /// such a gradient), takes one answer for all of them (collective), and updates the scale by it
  /// (update). Returns whether the step's update may be applied; where not, every gradient is left
  /// undefined, so that an optimizer that skips a parameter without one (every torch.optim one, and
  /// libtorch's) changes nothing.
  bool check_and_update(Pipeline& pipeline, bool loss_finite);

  /// GradScaler's rule alone, for one step, in float as GradScaler keeps its scale: not `finite`: the
  /// scale times the back-off (never below float's least normal number), the tracker to 0, one more
  /// skipped; finite: one more in the tracker, and at `growth_interval` the scale times the growth
  /// factor (where the product is a float) and the tracker to 0.
  void update(bool finite);

 private:
  LossScaleOptions options_;
  LossScaleState state_;
};

}  // namespace gpipe
