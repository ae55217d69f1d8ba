// pipeline.h: the facade: a torch::nn::Sequential trained with GPipe over K pipelined stages.
#pragma once

#include "gpipe/device.h"
#include "gpipe/executor.h"
#include "gpipe/memory.h"
#include "gpipe/schedule.h"
#include "gpipe/stage.h"
#include "gpipe/trace.h"
#include "gpipe/transport.h"

#include <torch/arg.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/types.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

namespace gpipe {

/// Options of a Pipeline, set with chainable setters:
///
///   gpipe::Pipeline pipe(model, gpipe::PipelineOptions().stages(2).chunks(8));
///   gpipe::Pipeline pipe(model, gpipe::PipelineOptions().balance({3, 5}).chunks(4)
///                                   .checkpoint(gpipe::Checkpoint::kAlways));
///   gpipe::Pipeline pipe(model, gpipe::PipelineOptions().stages(2).chunks(8)
///                                   .schedule(gpipe::ScheduleKind::kInterleaved).virtual_stages(2));
struct PipelineOptions {
  /// K, the number of devices, cutting the layers evenly into K·V stages. 0: take it from balance.
  TORCH_ARG(int, stages) = 0;
  /// Layers per stage, e.g. {3, 5}: K·V entries. Empty: cut evenly.
  TORCH_ARG(std::vector<int>, balance) = {};
  /// The order in which the devices run forwards and backwards (schedule.h).
  TORCH_ARG(ScheduleKind, schedule) = ScheduleKind::kGPipe;
  /// V, stages per device (the interleaved schedule; 1 otherwise). Stage s runs on device s mod K.
  TORCH_ARG(int, virtual_stages) = 1;
  /// M, the number of micro-batches each mini-batch is split into.
  TORCH_ARG(int, chunks) = 1;
  /// Which micro-batches re-materialize in backward.
  TORCH_ARG(Checkpoint, checkpoint) = Checkpoint::kExceptLast;
  /// K devices. Empty: a CPU core group of `threads_per_stage` per device.
  TORCH_ARG(std::vector<Device>, devices) = {};
  /// Intra-op threads of each CPU stage when `devices` is empty.
  TORCH_ARG(int, threads_per_stage) = 1;
  /// BatchNorm as in the paper: each micro-batch is normalized by its own
  /// statistics, and the running statistics are updated once per mini-batch,
  /// from the mean and unbiased variance of all its rows, with the layer's
  /// momentum (num_batches_tracked grows by one per step). For BatchNorm layers
  /// of the Sequential itself (one inside a layer is refused). false: each
  /// micro-batch's forward updates them, as M small batches would.
  TORCH_ARG(bool, deferred_batch_norm) = true;
  /// Parameters tied across stages, by name in the model, e.g. {{"0.weight", "9.weight"}} for an
  /// input embedding and an output projection that share their weight. In one process tied
  /// layers hold one tensor, which is what ties them (found without being declared); a
  /// declared group that is not one tensor is refused. (Under MPI each owning rank holds a copy,
  /// and the declaration is what ties them: mpi::MpiPipelineOptions::tied_parameters.)
  TORCH_ARG(std::vector<std::vector<std::string>>, tied_parameters) = {};
  /// Account CPU memory per stage (installs gpipe's tracking allocator for the
  /// process; see memory.h). On by itself when a device has a memory cap.
  TORCH_ARG(bool, track_memory) = false;
};

/// A torch::nn::Sequential cut into consecutive stages over K devices, each
/// device with its own worker thread, trained over M micro-batches by a
/// schedule (GPipe's fill-drain by default; 1F1B, interleaved or zero-bubble).
///
/// The pipeline shares the model's parameters: an optimizer built on
/// `pipe.parameters()` steps what the stages use. A parameter that layers on
/// two stages use (tied weights) stays one tensor: each stage's backward adds
/// its share to the one gradient, so it gets the sum of its uses, as on one
/// device, and one update.
/// After train_step every parameter's grad() holds exactly the gradient of the
/// whole mini-batch's mean loss (added to what it held, like backward()).
///
/// Errors: a bad configuration throws std::invalid_argument from the
/// constructor or from train_step/forward before any work. An exception inside
/// a stage stops every stage of the step and is rethrown as StageError naming
/// the stage and micro-batch; the gradients are then as they were before the
/// step, and the next step works.
///
/// Thread: call train_step and forward from one thread at a time.
///
///   auto model = torch::nn::Sequential(torch::nn::Linear(784, 256), torch::nn::ReLU(),
///                                      torch::nn::Linear(256, 10));
///   gpipe::Pipeline pipe(model, gpipe::PipelineOptions().stages(2).chunks(4));
///   torch::optim::SGD sgd(pipe.parameters(), 0.1);
///   sgd.zero_grad();
///   torch::Tensor loss = pipe.train_step(x, y, [](const torch::Tensor& out, const torch::Tensor& t) {
///     return torch::nn::functional::cross_entropy(out, t);
///   });
///   sgd.step();
class Pipeline {
 public:
  Pipeline(torch::nn::Sequential model, PipelineOptions options);
  ~Pipeline();
  Pipeline(const Pipeline&) = delete;
  Pipeline& operator=(const Pipeline&) = delete;

  /// Runs forward and backward of all micro-batches of (input, target) through
  /// the schedule, accumulates the mini-batch gradient into every parameter's
  /// grad(), and returns the mini-batch loss (a detached scalar). `loss` must be
  /// reduced by the mean over the batch dimension. A batch of fewer rows than
  /// chunks() (the last one of an epoch) runs in one micro-batch per row, by
  /// the same schedule or, where it cannot take that many, fill-drain.
  torch::Tensor train_step(const torch::Tensor& input, const torch::Tensor& target,
                           const LossFn& loss);

  /// Pipelined inference: the model's output for `input`, keeping no
  /// activations for backward. Uses the modules' current train/eval mode.
  torch::Tensor forward(const torch::Tensor& input);

  /// All parameters of the model, in the model's order, each tensor once (unique_parameters).
  std::vector<torch::Tensor> parameters() const;
  torch::nn::Sequential model() const { return model_; }
  /// Stage j's layers (sharing the model's modules).
  torch::nn::Sequential stage(int j) const;

  /// S, the number of stages (K·V).
  int stages() const { return static_cast<int>(balance_.size()); }
  int chunks() const { return options_.chunks(); }
  const std::vector<int>& balance() const { return balance_; }
  /// The K devices.
  const std::vector<Device>& devices() const { return devices_; }
  Checkpoint checkpoint() const { return options_.checkpoint(); }
  /// The lowered training program the devices run (schedule.h).
  const Schedule& schedule() const { return train_program_; }

  /// Bytes the skip connections (skip.h) carried between stages in the last
  /// train_step or forward: stashed tensors and their gradients.
  int64_t skip_bytes() const;

  /// The timeline of the last train_step or forward.
  const StepTrace& last_trace() const { return trace_; }

  /// Memory of one device (of its stages), with track_memory on.
  struct StageMemory {
    int64_t parameter_bytes = 0;  ///< its parameters and their gradients
    int64_t peak_bytes = 0;       ///< peak, above what it held before the last step, of the
                                  ///< activations it allocated: those kept for backward (or
                                  ///< recomputed), boundary tensors it sent, backward's buffers.
                                  ///< (With tracking on, a step's gradients are allocated before
                                  ///< it by the calling thread, so they count with the parameters.)
    int64_t held_peak_bytes = 0;  ///< peak of what stays allocated between actions (CPU stages; see
                                  ///< MemoryCounter::held_peak_bytes): what the schedule governs,
                                  ///< without the buffers an action frees before it ends
  };
  /// Per device, for the last train_step or forward; empty without track_memory.
  /// A CPU stage's peak comes from gpipe's tracking allocator (what its thread
  /// allocated); a CUDA stage's from the CUDA caching allocator's statistics of
  /// its device (shared by stages on the same GPU).
  std::vector<StageMemory> memory() const;

 private:
  std::vector<torch::Tensor> split(const torch::Tensor& tensor, int micro_batches, const char* what) const;
  const Schedule& training_program(int micro_batches);
  void run(const Schedule& program, StepData& step);

  torch::nn::Sequential model_;
  PipelineOptions options_;
  std::vector<int> balance_;
  std::vector<Device> devices_;
  Schedule train_program_;
  Schedule forward_program_;
  std::map<int, Schedule> short_programs_;  // by micro-batch count, for batches of fewer rows than M
  std::vector<SkipRoute> skip_routes_;      // skip connections between stages (skip.h)
  std::unique_ptr<InProcessTransport> transport_;
  std::vector<std::unique_ptr<Executor>> executors_;  // one per device
  std::vector<std::unique_ptr<DeviceThread>> threads_;
  StepTrace trace_;
  std::vector<int64_t> memory_at_start_;  // each device's tracked bytes when the last step began
};

}  // namespace gpipe
