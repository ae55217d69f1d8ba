// train_step.h (internal): what Pipeline and mpi::MpiPipeline share around a training step:
// the micro-batch plan, the step's random seed, and gradients kept aside until the step succeeds.
#pragma once

#include "gpipe/pipeline.h"
#include "gpipe/stage.h"

#include <torch/types.h>

#include <cstdint>
#include <vector>

namespace gpipe::detail {

/// Prepares `step` for micro-batches of `sizes` rows out of a mini-batch of
/// `total_rows`: weights bᵢ/total_rows and loss slots. With `stochastic`, draws the step's seed from the default generator.
///
/// Backward then accumulates into fresh gradients; commit() adds them to the
/// old ones and puts the default generator back as if only the seed had been
/// drawn. Without commit() (an exception), the destructor restores both, so a
/// failed step changes no gradient and no random state.
///
/// With `zero_grads` the fresh gradients are zeros allocated here, on the
/// caller's thread, so that memory accounting charges them to no stage: the
/// stages' peaks are then activations and backward's buffers alone, and the
/// gradients count with the parameters.
class TrainStepScope {
 public:
  TrainStepScope(StepData& step, const std::vector<int64_t>& sizes, int64_t total_rows, bool stochastic, std::vector<torch::Tensor> params, bool zero_grads = false);
  ~TrainStepScope();
  TrainStepScope(const TrainStepScope&) = delete;
  TrainStepScope& operator=(const TrainStepScope&) = delete;

  void commit();

 private:
  void restore_random_state();

  std::vector<torch::Tensor> params_;
  std::vector<torch::Tensor> before_;
  std::vector<int64_t> versions_;  // with zero_grads: each fresh gradient's version
  torch::Tensor random_state_;  // undefined unless stochastic
  bool committed_ = false;
};

}  // namespace gpipe::detail
