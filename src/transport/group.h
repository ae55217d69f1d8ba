// group.h (internal): the processes that run one pipeline together, as the step driver (Pipeline)
// sees them: this process alone (local_group, src/runtime/group.cc), or the ranks of an MPI job
// (src/transport/mpi/). Everything that differs between the two is here; the step itself is
// Pipeline's alone. The boundary between the runtime and a backend: a Group implementation
// includes nothing of the runtime (the runtime hands it what it needs, such as skip_uses).
#pragma once

#include "gpipe/plan.h"
#include "gpipe/skip_connections.h"
#include "gpipe/tensors.h"
#include "gpipe/trace.h"
#include "gpipe/transport.h"

#include <torch/nn/modules/container/sequential.h>
#include <torch/types.h>

#include <exception>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace gpipe::detail {

class Group {
 public:
  virtual ~Group() = default;

  // ---- set-up, once, in this order

  /// Where `layers` stash and pop (skip_uses in skip.h): with `named_by_index`, at the layer
  /// number each layer's name gives (an MPI rank's layers).
  using SkipUseFinder = std::function<std::vector<SkipUse>(const torch::nn::Sequential& layers, bool named_by_index)>;
  /// The plan for this process's `layers` (the whole model in one process; a
  /// rank's devices' layers under MPI) and `options`, the same on every process:
  /// each throws the same std::invalid_argument, or none does. `skip_uses` finds the layers' skip connections.
  virtual PipelinePlan plan(const torch::nn::Sequential& layers, const PipelineOptions& options,
                            const SkipUseFinder& skip_uses) = 0;
  /// The devices this process runs, in increasing order.
  virtual std::vector<int> local_devices() const = 0;
  /// Whether the devices' programs run on the calling thread (an MPI rank's,
  /// the thread that may call MPI) instead of a thread per device.
  virtual bool on_caller_thread() const = 0;
  /// Throws on every process if any process's set-up failed (`failure`): its
  /// own exception there, std::invalid_argument naming it elsewhere.
  virtual void agree(std::exception_ptr failure) = 0;
  /// Connects the processes once this process's stages are built from `layers`.
  virtual void connect(const PipelinePlan& plan, const torch::nn::Sequential& layers,
                       const PipelineOptions& options) = 0;

  // ---- every call

  /// Before every call: after a failed one, starts over (MPI: on fresh communicators).
  virtual void begin_call() {}
  /// A call failed on this process (`why`; empty when another process's failure or an interrupt
  /// stopped it): the others hear of it, and the next call starts over.
  virtual void fail(const std::string& /*why*/) {}
  /// What the step's sends and receives go through.
  virtual Transport& transport() = 0;
  /// How this process names itself to the others in an error: "rank 1 (device 1, replica 0): ".
  virtual std::string who() const { return ""; }
  /// Throws std::invalid_argument on every process unless every process was given the same batch
  /// (compared by a fingerprint of `input`'s tensors and `target`, if defined), as every
  /// collective call requires.
  virtual void check_same_batch(const Tensors& /*input*/, const torch::Tensor& /*target*/) {}
  /// The rows [first, first + count) of a batch of `rows` that this process's replica runs.
  virtual std::pair<int64_t, int64_t> share(int64_t rows) const { return {0, rows}; }
  /// After the backward: each gradient summed over the replicas and over the copies of a tied weight.
  virtual void reduce_gradients(const std::vector<torch::Tensor>& /*params*/) {}
  /// `values` (float32 or float64, on the CPU) summed over the replicas, in place.
  virtual void sum_over_replicas(const std::shared_ptr<torch::Tensor>& /*values*/) {}
  /// `values` summed (or with `largest`, their maximum) over every process, in place.
  virtual void reduce(double* /*values*/, int /*count*/, bool /*largest*/) {}
  /// Every process's `bytes`, in rank order, on the root; an empty list elsewhere.
  virtual std::vector<std::string> gather(const std::string& bytes) { return {bytes}; }
  /// Every device's row of the last step's `trace` on the root (replica 0's); an empty trace elsewhere.
  virtual StepTrace gather_trace(const StepTrace& trace, const PipelinePlan& /*plan*/) { return trace; }
  /// Whether sums over the whole model count `parameter` here (a tied weight's copies count once).
  virtual bool counts(const torch::Tensor& /*parameter*/) const { return true; }

  // ---- who this process is

  virtual int rank() const { return 0; }
  virtual int replica() const { return 0; }
  virtual int device() const { return -1; }
  virtual std::string describe() const = 0;
};

}  // namespace gpipe::detail
