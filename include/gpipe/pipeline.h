// pipeline.h: a torch::nn::Sequential trained with GPipe: the one runtime, whose devices are threads
// of this process or ranks of a job of several processes (a backend, backend.h: MPI's is
// mpi::MpiPipeline's); make_pipeline chooses (Runtime).
//
//   Pipeline ── plan (plan.h) ──▶ an Executor per device held here ──▶ Transport
//      │          K, V, M, cut,       runs its device's program           in-process mailboxes,
//      │          placement,          over its stages (stage.h)           or MPI messages
//      └── Backend (backend.h): what differs between one process and a job of several (MPI):
//          which devices run here, which rows, sums over ranks and replicas, tied copies
//
// A training loop written against Pipeline runs unchanged in one process and
// under mpirun. Under MPI every call is collective: every rank calls it, in
// the same order, with the same arguments (the whole mini-batch on every
// rank; each rank reads what its stages need).
#pragma once

#include "gpipe/backend.h"
#include "gpipe/device.h"
#include "gpipe/executor.h"
#include "gpipe/layers.h"
#include "gpipe/plan.h"
#include "gpipe/schedule.h"
#include "gpipe/stage.h"
#include "gpipe/trace.h"

#include <torch/nn/modules/container/sequential.h>
#include <torch/types.h>

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace gpipe {
/// Mean loss and share of correct predictions over a data set.
struct Evaluation {
  double loss = 0;
  double accuracy = 0;  ///< argmax of the output against integer targets; 0 when not classifying
};

/// Thrown by a step that Pipeline::set_interrupt stopped; the parameters and
/// gradients are as they were before the step.
struct Interrupted : Cancelled {
  Interrupted() : Cancelled("gpipe: the step was interrupted") {}
};

/// Puts `layers` in eval mode while it lives, then back in the mode they had
/// (also when an exception leaves the scope).
class EvalScope {
 public:
  explicit EvalScope(torch::nn::Sequential layers) : layers_(std::move(layers)), training_(layers_->is_training()) {
    layers_->eval();
  }
  ~EvalScope() { layers_->train(training_); }
  EvalScope(const EvalScope&) = delete;
  EvalScope& operator=(const EvalScope&) = delete;

 private:
  torch::nn::Sequential layers_;
  bool training_;
};

/// A torch::nn::Sequential cut into consecutive stages over K devices, trained
/// over M micro-batches by a schedule (GPipe's fill-drain by default; 1F1B,
/// interleaved or zero-bubble).
///
/// In one process each device has its own worker thread, and the pipeline
/// shares the model's parameters: an optimizer built on `pipe.parameters()`
/// steps what the stages use. A parameter that layers on two stages use (tied
/// weights) stays one tensor: each stage's backward adds its share to the one
/// gradient, so it gets the sum of its uses, as on one device, and one update.
/// After train_step every parameter's grad() holds exactly the gradient of the
/// whole mini-batch's mean loss (added to what it held, like backward()).
///
/// Errors: a bad configuration throws std::invalid_argument from the
/// constructor or from train_step/forward before any work. An exception inside
/// a stage stops every stage of the step and is rethrown as StageError naming
/// the stage and micro-batch; the gradients are then as they were before the
/// step, and the next step works. In a job of several processes (MPI, c10d)
/// the other ranks throw RemoteError (transport.h) with that message.
///
/// Thread: call train_step and forward from one thread at a time.
///
///   auto model = torch::nn::Sequential(torch::nn::Linear(784, 256), torch::nn::ReLU(),
///                                      torch::nn::Linear(256, 10));
///   gpipe::Pipeline pipe(model, gpipe::PipelineOptions().devices(2).micro_batches(4));
///   torch::optim::SGD sgd(pipe.parameters(), 0.1);
///   sgd.zero_grad();
///   torch::Tensor loss = pipe.train_step(x, y, gpipe::cross_entropy_loss);
///   sgd.step();
class Pipeline {
 public:
  /// One process: `model` cut as `options` say, a thread per device.
  Pipeline(torch::nn::Sequential model, PipelineOptions options);
  /// One process: `model` cut as `plan` says, a plan make_plan made for `options` (without skip
  /// connections: the model's are found and routed, route_skips); K, V, M and the cut are not
  /// resolved again. Throws std::invalid_argument when the plan is of another model or other options.
  Pipeline(torch::nn::Sequential model, const PipelinePlan& plan, PipelineOptions options);
  virtual ~Pipeline();
  /// The runtime over `backend` (backend.h: one process, or a job of several) for this process's
  /// `layers` (its devices' layers, device_layers, where it runs only some). What make_pipeline and
  /// mpi::MpiPipeline build; a backend of one's own runs the same way.
  Pipeline(std::unique_ptr<Backend> backend, torch::nn::Sequential layers, PipelineOptions options);
  Pipeline(const Pipeline&) = delete;
  Pipeline& operator=(const Pipeline&) = delete;

  /// Runs forward and backward of all micro-batches of (input, target)
  /// through the schedule, adds the mini-batch gradient to every parameter's
  /// grad(), and returns the mini-batch loss (a detached float64 scalar, on
  /// every rank). `loss` must be reduced by the mean over the batch dimension.
  /// A batch of fewer rows than M (the last one of an epoch) runs in one
  /// micro-batch per row. Under MPI each replica runs its share of the rows,
  /// and the gradients are summed over the replicas.
  /// `input`: one tensor, or a tuple (Tensors::tuple_of) whose tensors the
  /// first layer takes as a std::vector<torch::Tensor>; each is split into
  /// micro-batches along dim 0, but those PipelineOptions::whole_inputs names.
  /// `loss_scale`: each micro-batch's loss is multiplied by it before its backward, and the step's
  /// gradients (an input's too) and the returned loss are divided by it, before they are added to
  /// what grad() held: a power of two changes no bit of a finite gradient, and a small one no longer
  /// underflows in float16 (LossScaler, loss_scale.h, keeps one scale for a run).
  torch::Tensor train_step(const Tensors& input, const torch::Tensor& target, const LossFn& loss,
                           double loss_scale = 1.0);

  /// Pipelined inference with the layers' current train/eval mode, keeping no
  /// activations (a training-mode BatchNorm normalizes each micro-batch by its own
  /// statistics and, deferred as in train_step, updates its running statistics once
  /// from every row): the output rows this process holds: all of them in one
  /// process; under MPI, on the rank of each replica's last stage, its
  /// replica's rows (output_rows), and an undefined tensor elsewhere.
  torch::Tensor forward(const Tensors& input);
  /// The rows [first, first + count) of a batch of `rows` that forward returns here.
  std::pair<int64_t, int64_t> output_rows(int64_t rows) const;

  /// Mean loss (and, with `classification`, accuracy) of the model on
  /// (input, target), by pipelined inference in batches of `batch` rows, with
  /// the layers in eval mode; they are put back in the mode they had after.
  Evaluation evaluate(const torch::Tensor& input, const torch::Tensor& target, const LossFn& loss,
                      bool classification, int64_t batch = 1000);

  /// The parameters this process holds, each tensor once, in the model's
  /// order (all of them in one process): build the optimizer on these.
  std::vector<torch::Tensor> parameters() const;
  /// The parameters this process counts in sums over the whole model (the
  /// gradient norm, the checksum): parameters(), but under MPI a tied weight's
  /// copies once in all.
  std::vector<torch::Tensor> counted_parameters() const;
  /// The layers this process holds, named as in the whole model (the whole model in one process).
  torch::nn::Sequential layers() const { return layers_; }
  /// Stage `stage`'s layers, sharing the model's modules; throws if this process does not run it.
  torch::nn::Sequential stage(int stage) const;

  /// The plan: K, V, M, the cut, the placement and the programs.
  const PipelinePlan& plan() const { return plan_; }
  /// S, the number of stages (K·V).
  int stages() const { return plan_.stages(); }
  /// K, the number of devices.
  int devices() const { return plan_.devices; }
  int micro_batches() const { return plan_.micro_batches; }
  const std::vector<int>& balance() const { return plan_.balance; }
  Checkpoint checkpoint() const { return plan_.checkpoint; }
  /// The lowered training program of a full batch (plan().training).
  const Schedule& schedule() const { return plan_.training; }

  /// Bytes the skip connections (skip.h) of this process's stages carried in
  /// the last train_step or forward: stashed tensors and their gradients.
  int64_t skip_bytes() const;
  /// Bytes of boundary tensors (and skip connections' tensors) this process's
  /// devices sent through the transport since the pipeline was built, or
  /// since the last failed step (whose transport is replaced).
  int64_t bytes_sent() const;
  /// This process's rows of the last train_step's or forward's timeline
  /// (devices[d] for each device d held here).
  const StepTrace& last_trace() const { return trace_; }
  /// The last step's timeline of every device, on the root process (an empty
  /// trace elsewhere). Collective.
  StepTrace trace();
  /// The measured bubble of the last step over every device (and every
  /// replica): 1 - Σ busy / Σ step time. Collective.
  double bubble();

  /// Memory of one device (of its stages), with track_memory on.
  struct DeviceMemory {
    int64_t parameter_bytes = 0;  ///< its parameters and their gradients (a tied weight once)
    int64_t peak_bytes = 0;       ///< peak, above what it held before the last step, of the
                                  ///< activations it allocated: those kept for backward (or
                                  ///< recomputed), boundary tensors it sent, backward's buffers.
                                  ///< (With tracking on, a step's gradients are allocated before
                                  ///< it by the calling thread, so they count with the parameters.)
    int64_t held_peak_bytes = 0;  ///< peak of what stays allocated between actions (CPU stages; see
                                  ///< MemoryCounter::held_peak_bytes): what the schedule governs,
                                  ///< without the buffers an action frees before it ends
  };
  /// Per device held here, for the last train_step or forward; empty without
  /// track_memory. A CPU device's peak comes from gpipe's tracking allocator
  /// (what its thread allocated); a CUDA device's from the CUDA caching
  /// allocator's statistics (shared by stages on the same GPU).
  std::vector<DeviceMemory> memory() const;

  /// The sum and the largest of `value` over every process (collective).
  double sum(double value);
  double max(double value);
  /// Whether every process holds the same `value`.
  bool same_everywhere(double value) { return max(value) == -max(-value); }
  /// Every process's `bytes`, in rank order, on the root process; an empty list elsewhere (collective).
  std::vector<std::string> gather(const std::string& bytes);

  /// The L2 norm of the whole model's gradient: over every stage and, under
  /// MPI, every rank (replicas, which hold the same gradients after a step,
  /// count once), as torch.nn.utils.clip_grad_norm_ computes it on one device.
  double gradient_norm();
  /// Scales every gradient by max_norm / (norm + 1e-6) when that is below 1,
  /// as torch.nn.utils.clip_grad_norm_ does; returns the norm before clipping.
  double clip_gradients(double max_norm);
  /// Whether every parameter (and, with `buffers`, every floating-point buffer)
  /// of the whole model is finite, on every process.
  bool all_finite(bool buffers = true);
  /// A fingerprint of the whole model's parameters, the same on every process:
  /// Σ over parameters of Σ_k x_k·(k mod 7 + 1). Equal parameters give equal sums.
  double checksum();

  /// Whether this process prints for the job (rank 0; the only process otherwise).
  bool root() const;
  /// Which pipeline replica this process belongs to (0 in one process).
  int replica() const;
  /// The device this process runs in a job of several (0..K-1); -1 in one process, which runs them all.
  int device() const;
  /// The stages this process runs, in increasing order: every stage in one process.
  std::vector<int> stages_here() const;
  /// This process's rank in its job (MPI, c10d; 0 in one process).
  int rank() const;
  /// "one process, 2 device threads", "MPI: 4 ranks = 2 devices x 2 replicas" or "c10d (Gloo; shared memory with 1 of 1 other rank): ...".
  std::string describe() const;

  /// `interrupted` is called about every 100 ms while a step waits for its
  /// device threads (in one process); when it returns true the step is
  /// cancelled and throws Interrupted, with every gradient as before the step.
  /// For a front end that must react to Ctrl-C during a step.
  void set_interrupt(std::function<bool()> interrupted) { interrupted_ = std::move(interrupted); }

  /// `work(stage)` runs on each stage's device thread (and stream) before the stage's first action
  /// of every train_step, its receives included; on a device whose program starts with a receive
  /// (it waits for its input while the pipeline fills), for all its stages at the start: in time
  /// the device would otherwise wait. A trainer applies the previous step's update of the stage's parameters there (Trainer).
  /// The trace counts it as busy. A step that fails or is interrupted may end before `work` ran for
  /// every stage; what it throws fails the step as a stage's error does. Empty: none.
  void set_before_stage(std::function<void(int stage)> work) { before_stage_ = std::move(work); }

  /// The backend this pipeline runs on.
  const Backend& backend() const { return *group_; }

 private:
  // Runs `work` as a collective call: after a failed call it starts over; if `work` throws, the
  // other processes hear of it (under MPI) and the next call starts over.
  template <typename Work>
  auto collective(Work&& work);
  bool holds(int device) const;
  const Schedule& training_program(int micro_batches);
  const Schedule& inference_program(int micro_batches);
  void run(const Schedule& program, StepData& step);
  void reset_memory_peaks();
  // Deferred BatchNorm: the statistics the stages here gathered in the call, summed over the replicas
  // (undefined when no stage has any), and the running statistics updated from them once.
  torch::Tensor batch_norm_statistics();
  void update_batch_norms(const torch::Tensor& statistics);

  std::unique_ptr<Backend> group_;
  torch::nn::Sequential layers_;
  PipelinePlan plan_;
  std::vector<int> local_;                            // the devices held here, in increasing order
  std::vector<std::unique_ptr<Executor>> executors_;  // one per device held here
  std::vector<std::unique_ptr<DeviceThread>> threads_;  // one per device held here; none under MPI
  std::map<int, Schedule> training_programs_;         // by micro-batch count, for batches of fewer rows than M
  std::map<int, Schedule> inference_programs_;
  std::vector<int> whole_inputs_;                     // PipelineOptions::whole_inputs
  bool stochastic_ = false;                           // whether any stage of the model draws random numbers
  bool deferred_batch_norm_ = true;                   // PipelineOptions::deferred_batch_norm
  StepTrace trace_;
  std::vector<int64_t> memory_at_start_;  // each local device's tracked bytes when the last step began
  std::function<bool()> interrupted_;
  std::function<void(int stage)> before_stage_;
};

/// A pipeline of the model that `build` makes (`layers` layers in all) with
/// `options`, run on the backend `runtime` names (backend.h): Runtime::kAuto,
/// the backend whose job of several processes this process is in (MPI under
/// mpirun), else threads; kThreads, kMpi, or another of backends(). Threads:
/// the whole model is built and cut. A backend of several processes: each
/// process builds only its device's layers (device_layers; the process count
/// a multiple of K, the rest are replicas) and runs on the backend's
/// BackendEntry::make. Throws std::invalid_argument, naming the fix, for a
/// backend this gpipe was built without or one not started.
std::unique_ptr<Pipeline> make_pipeline(const LayerBuilder& build, int layers, const PipelineOptions& options,
                                        Runtime runtime = Runtime::kAuto);
/// The same for a plan already made by make_plan(layers, options): the plan is used as it is (its
/// skip connections routed, route_skips), so K, V, M and the cut are resolved once per run, here or
/// under mpirun on every rank alike.
std::unique_ptr<Pipeline> make_pipeline(const LayerBuilder& build, const PipelinePlan& plan,
                                        const PipelineOptions& options, Runtime runtime = Runtime::kAuto);

/// Whether make_pipeline with Runtime::kAuto would run MPI ranks (running_backend() == Runtime::kMpi).
bool mpi_runtime();

}  // namespace gpipe
