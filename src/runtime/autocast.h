// autocast.h: a stage's forward in its precision (PipelineOptions::precision), as torch.autocast
// runs a model's forward: matrix products and convolutions in bfloat16, the ops autocast keeps in
// float32 in float32. Autocast is per thread, so each device thread sets it around its own forward.
#pragma once

#include "gpipe/pipeline_config.h"

#include <ATen/autocast_mode.h>
#include <torch/version.h>

namespace gpipe {

/// Autocast to bfloat16 (Precision::kBFloat16) or float16 (kFloat16) on `kind` (CPU or CUDA) for its
/// scope, nothing under kFloat32; what was set before is set again when it ends.
class AutocastScope {
 public:
  AutocastScope(Precision precision, c10::DeviceType kind) : on_(precision != Precision::kFloat32), kind_(kind) {
    if (!on_) return;
    was_enabled_ = enabled(kind_);
    was_type_ = type(kind_);
    set(kind_, true, precision == Precision::kFloat16 ? at::kHalf : at::kBFloat16);
    at::autocast::increment_nesting();
  }
  ~AutocastScope() {
    if (!on_) return;
    // The weights' casts it cached: made again by the next forward (a micro-batch's, or its recompute).
    if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
    set(kind_, was_enabled_, was_type_);
  }
  AutocastScope(const AutocastScope&) = delete;
  AutocastScope& operator=(const AutocastScope&) = delete;

 private:
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)
  static bool enabled(c10::DeviceType kind) { return at::autocast::is_autocast_enabled(kind); }
  static at::ScalarType type(c10::DeviceType kind) { return at::autocast::get_autocast_dtype(kind); }
  static void set(c10::DeviceType kind, bool on, at::ScalarType t) {
    at::autocast::set_autocast_enabled(kind, on);
    at::autocast::set_autocast_dtype(kind, t);
  }
#else
  static bool enabled(c10::DeviceType kind) {
    return kind == c10::DeviceType::CUDA ? at::autocast::is_enabled() : at::autocast::is_cpu_enabled();
  }
  static at::ScalarType type(c10::DeviceType kind) {
    return kind == c10::DeviceType::CUDA ? at::autocast::get_autocast_gpu_dtype() : at::autocast::get_autocast_cpu_dtype();
  }
  static void set(c10::DeviceType kind, bool on, at::ScalarType t) {
    if (kind == c10::DeviceType::CUDA) {
      at::autocast::set_enabled(on);
      at::autocast::set_autocast_gpu_dtype(t);
    } else {
      at::autocast::set_cpu_enabled(on);
      at::autocast::set_autocast_cpu_dtype(t);
    }
  }
#endif

  bool on_;
  c10::DeviceType kind_;
  bool was_enabled_ = false;
  at::ScalarType was_type_ = at::kFloat;
};

}  // namespace gpipe
