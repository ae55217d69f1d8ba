// train_step.h (internal): the checks a stage's layers pass before a pipeline runs them, and the
// scope of a training step: the micro-batch weights, the step's random seed, and gradients kept aside
// until the step succeeds.
#pragma once

#include "gpipe/stage.h"

#include <torch/types.h>

#include <cstdint>
#include <vector>

namespace gpipe::detail {

/// With `deferred`, throws std::invalid_argument if a BatchNorm in training mode sits inside
/// one of `layers` (one stage's) rather than being one of them.
void check_batch_norm(const torch::nn::Sequential& layers, bool deferred);

/// With cross_entropy_loss and class-index targets of which some are ignored (-100), weighs each
/// micro-batch by its targets not ignored over those of the whole mini-batch `target` (PyTorch's
/// mean), in place of bᵢ/N; `first`: this replica's first row, `sizes`: its micro-batches' rows.
void weigh_by_counted_targets(StepData& step, const torch::Tensor& target, int64_t first,
                              const std::vector<int64_t>& sizes);

/// Whether the caller's `input` wants its gradient (a floating-point tensor that requires grad,
/// split into micro-batches, not one of `whole`).
bool wants_input_gradient(const Tensors& input, const std::vector<int>& whole);

/// Adds the first stage's input gradients in `step` (its micro-batches, from row `first` of the
/// mini-batch) to the caller's `input`, as loss.backward() would: to .grad of a leaf, on through
/// the graph of a tensor that is not one.
void add_input_gradients(const Tensors& input, const StepData& step, int64_t first, const std::vector<int>& whole);

/// Prepares `step` for micro-batches of `sizes` rows out of a mini-batch of
/// `total_rows`: weights bᵢ/total_rows and loss slots. With `stochastic`, draws the step's seed from the default generator.
///
/// Backward then accumulates into fresh gradients; commit() adds them to the
/// old ones and puts the default generator back as if only the seed had been
/// drawn. Without commit() (an exception), the destructor puts back the
/// gradients and the generator as they were before the step, seed draw
/// included, so a failed step changes nothing and its retry draws the same
/// seed (the same Dropout masks).
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

  /// The step's gradients (times `inverse_scale`, which undoes a loss scale) added to those before it.
  void commit(double inverse_scale = 1.0);

 private:
  static void restore_random_state(const torch::Tensor& state);

  std::vector<torch::Tensor> params_;
  std::vector<torch::Tensor> before_;
  std::vector<int64_t> versions_;  // with zero_grads: each fresh gradient's version
  torch::Tensor random_state_before_;  // before the seed was drawn; undefined unless stochastic
  torch::Tensor random_state_;         // after
  bool committed_ = false;
};

}  // namespace gpipe::detail
