// nested_norm.h: deferred BatchNorm for a BatchNorm at any depth inside a layer. Python's
// gpipe.DeferredBatchNorm (python/gpipe/norm.py) calls the op gpipe::batch_norm, which, while a
// stage runs its layers on this thread, normalizes by the micro-batch's statistics and adds them
// to the stage's own (detail::DeferredNorm, stage.h) instead of changing the running ones.
#pragma once

#include "gpipe/stage.h"

#include <torch/torch.h>

#include <vector>

namespace gpipe::detail {

// A BatchNorm's entry with no statistics gathered yet: a layer of the stage, or kInside.
DeferredNorm deferred_norm(size_t layer, RunningStatistics running);

// Adds what `input` holds to a deferred BatchNorm's statistics: its rows and positions, and per
// channel (dim 1) the sum and the sum of squares.
void gather_statistics(DeferredNorm& norm, const torch::Tensor& input);

// For its lifetime, the gpipe::batch_norm ops run on this thread in training defer to `norms`,
// the stage's (which holds those inside its layers, BatchNormLayer::deferring_norms_inside; one it
// does not hold is an error), and add their inputs' statistics where `gather` (not in a
// re-materialization). Without one, the op updates the running statistics as torch.nn.BatchNorm
// does.
class NestedNormScope {
 public:
  NestedNormScope(std::vector<DeferredNorm>* norms, bool gather);
  ~NestedNormScope();
  NestedNormScope(const NestedNormScope&) = delete;
  NestedNormScope& operator=(const NestedNormScope&) = delete;

 private:
  std::vector<DeferredNorm>* previous_norms_;
  bool previous_gather_;
};

}  // namespace gpipe::detail
