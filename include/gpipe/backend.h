// backend.h: the boundary between gpipe's runtime and a backend, what carries one pipeline across
// processes. The runtime (Pipeline, pipeline.h) holds the step; a backend holds what differs
// between one process and a job of several: which devices run here, point-to-point of boundary
// tensors (Transport, transport.h), the collectives (replicas' gradients, tied weights' copies,
// BatchNorm statistics, the loss), agreement between the processes, the error channel, ending the
// job when one process fails, and who this process is.
//
//   Pipeline (the runtime) ──▶ Backend: plan, agree, connect          once
//                              Backend: begin_call, transport(),      every call
//                                       reduce_gradients, reduce, ... (collective over the job)
//
// Backends: one process (Runtime::kThreads, a thread per device: src/runtime/group.cc), MPI
// (Runtime::kMpi: src/transport/mpi/, mpi_backend.h) and c10d under torchrun (Runtime::kC10d:
// src/transport/c10d/, Gloo). A backend includes nothing of the runtime:
// what it needs of it, such as finding a model's skip connections, the runtime hands it.
//
// A new backend is a Backend and a Transport in src/transport/NAME/, a Runtime value and its entry
// in backends() (src/transport/backend.cc); make_pipeline, gpipe train and the Python package's
// runtime= take it from there (docs/architecture.md, "Where new things go").
#pragma once

#include "gpipe/layers.h"
#include "gpipe/plan.h"
#include "gpipe/skip_connections.h"
#include "gpipe/tensors.h"
#include "gpipe/trace.h"
#include "gpipe/transport.h"

#include <torch/nn/modules/container/sequential.h>
#include <torch/types.h>

#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace gpipe {

/// Where the devices of a pipeline run: make_pipeline's choice of a backend (backends() lists them).
enum class Runtime {
  kAuto,     ///< the backend whose job of more than one process this process is in (MPI under mpirun, c10d under torchrun), else threads
  kThreads,  ///< a thread per device in this process
  kMpi,      ///< a rank per device; MPI must be initialised (mpi::Environment)
  kC10d,     ///< a rank per device over torch.distributed's c10d (Gloo), in a job torchrun started
};

/// The processes that run one pipeline together, as the step driver (Pipeline) sees them. One
/// object per pipeline and process; the runtime calls it from one thread (the caller's), never
/// concurrently, except Transport::send/recv from the device threads (transport.h). Every method
/// marked collective is called by every process of the job, in the same order: a backend may block
/// in it until every process has called it, and must end that wait (throwing) when another process
/// reports a failure through fail().
///
/// The step itself is Pipeline's alone: a backend never runs a stage. The defaults are those of
/// one process, which holds every device.
class Backend {
 public:
  virtual ~Backend() = default;

  // ---- set-up, once, in this order (plan, agree, connect), each collective

  /// Where `layers` stash and pop (skip_uses in skip.h): with `named_by_index`, at the layer
  /// number each layer's name gives (a process holding only some of the layers, named by add_layer).
  using SkipUseFinder = std::function<std::vector<SkipUse>(const torch::nn::Sequential& layers, bool named_by_index)>;
  /// The plan for this process's `layers` (the whole model in one process; its devices' layers in a
  /// job of several) and `options`, the same on every process: each throws the same
  /// std::invalid_argument, or none does. `skip_uses` finds the layers' skip connections (each
  /// process sees only its own: a backend gathers them). A backend given a plan made by make_plan
  /// (make_pipeline does) checks it against `options` (check_plan_of) and routes the skips into it
  /// (route_skips) rather than resolving it again.
  virtual PipelinePlan plan(const torch::nn::Sequential& layers, const PipelineOptions& options,
                            const SkipUseFinder& skip_uses) = 0;
  /// The devices this process runs, in increasing order (every device in one process; one per rank).
  virtual std::vector<int> local_devices() const = 0;
  /// Whether the devices' programs run on the calling thread (a rank's one device, where only that
  /// thread may call the backend) instead of a thread per device.
  virtual bool on_caller_thread() const = 0;
  /// Throws on every process if any process's set-up failed (`failure`, null where it did not): its
  /// own exception there, std::invalid_argument naming it elsewhere. Rank agreement: no process goes
  /// on alone.
  virtual void agree(std::exception_ptr failure) = 0;
  /// Connects the processes once this process's stages are built from `layers`: the transport, and
  /// what the collectives need (tied weights' copies: options.tied_parameters()).
  virtual void connect(const PipelinePlan& plan, const torch::nn::Sequential& layers,
                       const PipelineOptions& options) = 0;

  // ---- every call (train_step, evaluate, predict, ...), each collective

  /// Before every call: after a failed one, starts over (a fresh transport; under MPI, fresh
  /// communicators, which the failed step's messages cannot reach).
  virtual void begin_call() {}
  /// The error channel: a call failed on this process (`why`; empty when another process's
  /// failure or an interrupt stopped it). Every other process's waits end (Transport::recv and the
  /// collectives throw, naming this process and `why`), and the next call starts over.
  virtual void fail(const std::string& /*why*/) {}
  /// Point-to-point: what the step's sends and receives of boundary tensors go through.
  virtual Transport& transport() = 0;
  /// How this process names itself to the others in an error: "rank 1 (device 1, replica 0): ".
  virtual std::string who() const { return ""; }
  /// Throws std::invalid_argument on every process unless every process was given the same batch
  /// (compared by a fingerprint of `input`'s tensors and `target`, if defined), as every
  /// collective call requires.
  virtual void check_same_batch(const Tensors& /*input*/, const torch::Tensor& /*target*/) {}
  /// The rows [first, first + count) of a batch of `rows` that this process's replica runs.
  virtual std::pair<int64_t, int64_t> share(int64_t rows) const { return {0, rows}; }
  /// After the backward: each gradient summed over the replicas and over the copies of a tied weight
  /// (the replicas' sum in a fixed order, so every replica ends with the same bits).
  virtual void reduce_gradients(const std::vector<torch::Tensor>& /*params*/) {}
  /// BatchNorm statistics: `values` (float32 or float64, on the CPU) summed over the replicas, in place.
  virtual void sum_over_replicas(const std::shared_ptr<torch::Tensor>& /*values*/) {}
  /// The loss and other figures: `values` summed (or with `largest`, their maximum) over every
  /// process, in place.
  virtual void reduce(double* /*values*/, int /*count*/, bool /*largest*/) {}
  /// Every process's `bytes`, in rank order, on the root; an empty list elsewhere.
  virtual std::vector<std::string> gather(const std::string& bytes) { return {bytes}; }
  /// Every device's row of the last step's `trace` on the root (replica 0's); an empty trace elsewhere.
  virtual StepTrace gather_trace(const StepTrace& trace, const PipelinePlan& /*plan*/) { return trace; }
  /// Whether sums over the whole model count `parameter` here (a tied weight's copies count once).
  virtual bool counts(const torch::Tensor& /*parameter*/) const { return true; }

  // ---- who this process is

  /// This process's rank in the job (0 in one process).
  virtual int rank() const { return 0; }
  /// The pipeline replica this process belongs to (0 in one process).
  virtual int replica() const { return 0; }
  /// The one device this process runs; -1 where it runs them all.
  virtual int device() const { return -1; }
  /// "one process, 2 device threads" or "MPI: 4 ranks = 2 devices x 2 replicas".
  virtual std::string describe() const = 0;
};

/// Where a process sits in a job of several running a pipeline of K devices: the same rule for every
/// backend.
struct Placement {
  int device = 0;    ///< which device of its pipeline this process runs (0..K-1): the plan's stages_of(device)
  int replica = 0;   ///< which pipeline replica it belongs to (0..replicas-1)
  int devices = 1;   ///< K
  int replicas = 1;  ///< D = processes / K
};

/// Rank r of `world_size` runs device r mod K of replica r div K. Throws std::invalid_argument if the
/// world size is not a multiple of K.
Placement place(int world_rank, int world_size, int devices);

/// The layers device `device` of `plan` holds: those of its stages, in stage order
/// (plan.device_layers), each stage's built by `build` on its own, named as in the whole model.
/// Throws std::invalid_argument if the builder does not make the range it is asked for.
torch::nn::Sequential device_layers(const LayerBuilder& build, const PipelinePlan& plan, int device);

/// A backend of several processes as make_pipeline and the front ends reach it: one entry of
/// backends(). Each function is set where `built`; none is called otherwise.
struct BackendEntry {
  Runtime runtime = Runtime::kThreads;
  /// Its name where a front end takes one (Python's runtime="mpi").
  std::string name;
  /// Whether this gpipe was built with it; where not, `not_built` says how to build it in.
  bool built = false;
  std::string not_built;
  /// Whether this process is one of several of a job of this backend that is running now (what
  /// Runtime::kAuto chooses).
  std::function<bool()> running;
  /// Starts the backend for the rest of the process when a launcher of it started this process,
  /// or when `required`; returns whether it is started.
  std::function<bool(bool required)> start;
  /// Who this process is: {rank, processes}. Throws std::invalid_argument naming the fix when the
  /// backend is not started.
  std::function<std::pair<int, int>()> process;
  /// The backend of one pipeline over every process of the job, for a plan made by make_plan on
  /// every process alike (used as it is). Collective.
  std::function<std::unique_ptr<Backend>(const PipelinePlan& plan)> make;
  /// Every process's `mine`, in rank order, on every process. Collective.
  std::function<std::vector<std::string>(const std::string& mine)> all_gather;
  /// Ends the whole job at once with `status`.
  std::function<void(int status)> abort;
  /// Tells the other processes that this one makes no more calls (mpi::leave).
  std::function<void()> leave;
};

/// The backends of several processes that gpipe knows, built in or not (one process, threads, is
/// the runtime's own and is not listed).
const std::vector<BackendEntry>& backends();
/// The entry of `runtime` (neither kAuto nor kThreads). Throws std::invalid_argument naming the
/// fix, followed by `otherwise`, when this gpipe was built without it.
const BackendEntry& backend(Runtime runtime, const std::string& otherwise = "");
/// "auto", "threads", then each backend's name; throws std::invalid_argument naming them all otherwise.
Runtime parse_runtime(const std::string& name);

/// The backend whose job of several processes this process is in now (Runtime::kAuto's choice), or
/// Runtime::kThreads.
Runtime running_backend();
/// Starts, for the rest of the process, each backend built in whose launcher started this process,
/// and `required` (a backend's value, where the caller asked for it by name) even without one.
void start_backends(Runtime required = Runtime::kAuto);
/// Rank agreement: every process's `mine`, in rank order, on every process of the running
/// backend's job (collective); `mine` alone in one process.
std::vector<std::string> all_gather_processes(const std::string& mine);
/// Ends the running backend's whole job with `status` (never returning); nothing in one process.
void abort_processes(int status);
/// Tells the other processes of the running backend's job that this one makes no more calls;
/// nothing in one process.
void leave_processes();

}  // namespace gpipe
