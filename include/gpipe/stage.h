// stage.h: StageExecutor: one stage's layers on one device, running its list of actions.
//
// A stage keeps its own autograd graph. Its input is a detached tensor that
// requires grad; its backward runs on the stage's own thread and sends
// input.grad() upstream. No graph ever spans two stages, so the backward of
// stage j never waits on another stage's thread:
//
//      stage j-1                 stage j                          stage j+1
//   ... -> y_{j-1} ==send==> [1] x = recv().detach().requires_grad_()
//                                 y = layers(x)          ==send==> [2]
//                            [4] x.grad()  <==recv== y.backward(g) [3] <== g
//   ... <==send== x.grad()
//
//   [1] the boundary: the only tensor a stage keeps when it re-materializes
//   [2] y.detach() goes on, so the next stage's graph starts fresh
//   [3] the gradient of y arrives from downstream (the last stage uses the loss)
//   [4] the gradient of x goes upstream
#pragma once

#include "gpipe/device.h"
#include "gpipe/memory.h"
#include "gpipe/schedule.h"
#include "gpipe/trace.h"
#include "gpipe/transport.h"

#include <torch/nn/modules/container/sequential.h>
#include <torch/types.h>

#include <cstdint>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

namespace gpipe {

/// A loss: output and target of a micro-batch → a scalar, reduced by the mean
/// over the batch dimension (so micro-batch i is weighted by bᵢ/N).
using LossFn = std::function<torch::Tensor(const torch::Tensor& output, const torch::Tensor& target)>;

/// An error raised inside a stage, naming the stage, the action and micro-batch.
class StageError : public std::runtime_error {
 public:
  StageError(const Action& action, const std::string& what);
  const Action& action() const { return action_; }

 private:
  Action action_;
};

/// Everything one step asks of the stages. The driver fills it before the step
/// and reads it after; during the step each stage touches only its own parts.
struct StepData {
  bool training = true;
  std::vector<torch::Tensor> inputs;   ///< micro-batch inputs, read by stage 0
  std::vector<torch::Tensor> targets;  ///< micro-batch targets, read by the last stage
  std::vector<double> weights;         ///< bᵢ/N per micro-batch
  std::vector<bool> recompute;         ///< per micro-batch: re-materialize in backward
  LossFn loss;
  uint64_t seed = 0;                   ///< this step's seed for stochastic layers
  std::vector<torch::Tensor> outputs;  ///< written by the last stage (forward only)
  std::vector<double> losses;          ///< written by the last stage: weighted loss per micro-batch
};

/// Whether `layers` draw random numbers in training (Dropout with p > 0).
bool draws_random_numbers(const torch::nn::Sequential& layers);

/// One stage: a run of consecutive layers on one device.
///
/// Thread: run() is called from one thread at a time (the stage's DeviceThread,
/// or an MPI rank's main thread). Between a micro-batch's forward and its
/// backward the executor keeps either the stage input alone (re-materialized) or
/// the input and the autograd graph.
class StageExecutor {
 public:
  /// With `memory` set, the stage's CPU allocations are charged to it (see memory.h).
  StageExecutor(int index, int stages, torch::nn::Sequential layers, Device device,
                Transport* transport, std::shared_ptr<MemoryCounter> memory = nullptr);

  /// Runs `actions` in order for `step`, appending each action's timespan to
  /// `trace` when given (from the arrival of its inputs to its end). Throws
  /// StageError for a failure in an action, and Cancelled when another stage
  /// failed; either way the executor drops what it kept for this step.
  void run(const std::vector<Action>& actions, StepData& step, std::vector<ActionSpan>* trace);

  int index() const { return index_; }
  const Device& device() const { return device_; }
  torch::nn::Sequential layers() const { return layers_; }
  /// Whether the layers draw random numbers in training (Dropout with p > 0).
  /// Such stages replay the same random stream when they re-materialize.
  bool stochastic() const { return stochastic_; }
  /// The stage's memory counter, or null when memory is not tracked.
  const std::shared_ptr<MemoryCounter>& memory() const { return memory_; }

 private:
  // What a micro-batch leaves behind between its forward and its backward.
  struct Kept {
    torch::Tensor input;   // [1] in the diagram
    torch::Tensor output;  // with its graph, unless re-materialized
    torch::Tensor loss;    // last stage only, with its graph, unless re-materialized
  };

  void forward(int i, StepData& step);
  void backward(int i, StepData& step);
  torch::Tensor weighted_loss(const torch::Tensor& output, int i, const StepData& step) const;
  uint64_t seed_of(int i, const StepData& step) const;
  bool first() const { return index_ == 0; }
  bool last() const { return index_ == stages_ - 1; }

  int index_;
  int stages_;
  torch::nn::Sequential layers_;
  Device device_;
  Transport* transport_;
  bool stochastic_;
  std::vector<Kept> kept_;
  std::shared_ptr<MemoryCounter> memory_;
  int64_t compute_begin_ns_ = 0;  // when the running action's inputs had arrived
};

}  // namespace gpipe
