// engine.h: one interface for training a pipeline, whether its stages are threads of this process
// (Pipeline) or ranks of an MPI job (mpi::MpiPipeline); make_engine chooses.
//
// A training loop written against Engine runs unchanged in one process and
// under mpirun. Under MPI every call is collective: every rank calls it, in
// the same order, with the same arguments (the whole mini-batch on every
// rank; each rank reads what its stages need).
#pragma once

#include "gpipe/layers.h"
#include "gpipe/pipeline.h"
#include "gpipe/schedule.h"
#include "gpipe/stage.h"
#include "gpipe/trace.h"
#include "gpipe/workloads.h"

#include <torch/nn/modules/container/sequential.h>
#include <torch/types.h>

#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace gpipe {

/// Where the stages of an engine run.
enum class Runtime {
  kAuto,     ///< MPI ranks when this process was started by an MPI launcher with more than one rank, else threads
  kThreads,  ///< a thread per device in this process (Pipeline)
  kMpi,      ///< a rank per device (mpi::MpiPipeline); MPI must be initialised (mpi::Environment)
};

/// Mean loss and share of correct predictions over a data set.
struct Evaluation {
  double loss = 0;
  double accuracy = 0;  ///< argmax of the output against integer targets; 0 when not classifying
};

/// What pipelined inference leaves in one process: some rows of the output.
struct OutputRows {
  torch::Tensor output;  ///< undefined on a process that holds no output (not a last stage)
  int64_t first = 0;     ///< the batch row of output's first row
};

/// A pipeline to train, in this process or across MPI ranks.
///
/// Errors: as Pipeline and mpi::MpiPipeline (std::invalid_argument before any
/// work; StageError for a failure inside a stage, with the gradients as they
/// were). Under MPI a failed step ends the job: report it and call mpi::abort.
class Engine {
 public:
  virtual ~Engine() = default;

  /// Forward and backward of the mini-batch; adds its gradient to every
  /// parameter's grad() and returns the mini-batch's mean loss (on every rank).
  virtual torch::Tensor train_step(const torch::Tensor& input, const torch::Tensor& target, const LossFn& loss) = 0;

  /// Pipelined inference with the layers' current train/eval mode: in one
  /// process the whole output; under MPI the last stage of each replica holds
  /// its replica's share of the rows.
  virtual OutputRows forward(const torch::Tensor& input) = 0;

  /// Mean loss (and, with `classification`, accuracy) of the model on
  /// (input, target), by pipelined inference in batches of `batch` rows, with
  /// the layers in eval mode; they are put back in train mode after.
  Evaluation evaluate(const torch::Tensor& input, const torch::Tensor& target, const LossFn& loss,
                      bool classification, int64_t batch = 1000);

  /// The parameters this process holds (all of them in one process): build
  /// the optimizer on these.
  virtual std::vector<torch::Tensor> parameters() const = 0;
  /// The parameters this process counts in sums over the whole model (the
  /// gradient norm, the checksum): parameters(), but under MPI a tied weight's
  /// copies once in all.
  virtual std::vector<torch::Tensor> counted_parameters() const { return parameters(); }
  /// The layers this process holds, named by their index in the whole model.
  virtual torch::nn::Sequential layers() const = 0;
  /// Layers per stage, K·V entries.
  virtual const std::vector<int>& balance() const = 0;
  /// The lowered training program.
  virtual const Schedule& schedule() const = 0;

  /// The measured bubble of the last step (over every rank under MPI).
  virtual double bubble() = 0;
  /// The last step's timeline of every stage, on the root process (an empty
  /// trace elsewhere).
  virtual StepTrace trace() = 0;

  /// The sum and the largest of `value` over every process.
  virtual double sum(double value) = 0;
  virtual double max(double value) = 0;
  /// Whether every process holds the same `value`.
  bool same_everywhere(double value) { return max(value) == -max(-value); }
  /// Every process's `bytes`, in rank order, on the root process; an empty list elsewhere.
  virtual std::vector<std::string> gather(const std::string& bytes) = 0;

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

  /// Whether this process prints for the job (rank 0; the only process otherwise).
  virtual bool root() const = 0;
  /// Which pipeline replica this process belongs to (0 in one process).
  virtual int replica() const = 0;
  /// Which device of its pipeline this process runs under MPI (0..K-1); -1 in
  /// one process, which runs them all.
  virtual int device() const = 0;
  /// This process's rank in the MPI job (0 in one process).
  virtual int rank() const = 0;
  /// "one process, 2 threads" or "MPI: 4 ranks = 2 stages x 2 replicas".
  virtual std::string describe() const = 0;

  /// A fingerprint of the whole model's parameters, the same on every process:
  /// Σ over parameters of Σ_k x_k·(k mod 7 + 1). Equal parameters give equal sums.
  double checksum();
};

/// A pipeline of the model that `build` makes (`layers` layers in all) with
/// `options`, run as `runtime` says. Threads: the whole model is built and
/// cut as Pipeline does. MPI: each rank builds only its stages' layers (K =
/// options.stages() or the balance's length divided by V; the rank count a
/// multiple of K, the rest are replicas), on a CPU of
/// options.threads_per_stage() threads or devices()[stage].
std::unique_ptr<Engine> make_engine(const LayerBuilder& build, int layers, const PipelineOptions& options,
                                    Runtime runtime = Runtime::kAuto);

/// Whether make_engine with Runtime::kAuto would run MPI ranks.
bool mpi_runtime();

}  // namespace gpipe
