// mpi.h: GPipe across processes: one device per MPI rank (one stage, or V with the interleaved
// schedule), on one machine or many, times D data-parallel pipeline replicas. The stage executor
// and the program are the ones of a one-process Pipeline; only the transport differs.
//
//   world rank r = replica · K + stage        (K stages, D replicas, np = K·D)
//
//        replica 0:  rank 0 ──▶ rank 1 ──▶ … ──▶ rank K-1     pipeline communicator
//        replica 1:  rank K ──▶ rank K+1 ─▶ … ──▶ rank 2K-1
//                      │          │                 │
//                      └── stage communicators: gradients allreduced across replicas
//
// Available when gpipe is built with GPIPE_WITH_MPI (the CMake option, on when
// MPI is found); the macro GPIPE_HAS_MPI is then 1.
#pragma once

#include "gpipe/executor.h"
#include "gpipe/layers.h"
#include "gpipe/pipeline.h"
#include "gpipe/schedule.h"
#include "gpipe/skip.h"
#include "gpipe/stage.h"
#include "gpipe/trace.h"
#include "gpipe/transport.h"

#include <mpi.h>

#include <torch/arg.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/types.h>

#include <array>
#include <map>
#include <memory>
#include <set>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

namespace gpipe::mpi {

/// Whether this process was started by an MPI launcher (mpirun, srun, ...),
/// judged from the environment it sets, before MPI is initialised.
bool launched();

/// Initialises MPI for the lifetime of the object (one per process; MPI
/// cannot be initialised twice). Only the thread that creates it may call MPI,
/// which is how gpipe uses it: each rank runs its stage on that thread.
class Environment {
 public:
  Environment(int* argc, char*** argv);
  ~Environment();
  Environment(const Environment&) = delete;
  Environment& operator=(const Environment&) = delete;
  int rank() const { return rank_; }
  int size() const { return size_; }

 private:
  int rank_ = 0;
  int size_ = 1;
};

/// Ends the whole job at once with a non-zero status: for a rank that cannot
/// go on.
[[noreturn]] void abort(int status = 1);

/// An MPI communicator, freed when this handle goes, unless abandoned.
class Communicator {
 public:
  Communicator() = default;
  ~Communicator();
  Communicator(Communicator&& other) noexcept : comm_(other.comm_) { other.comm_ = MPI_COMM_NULL; }
  Communicator& operator=(Communicator&& other) noexcept;
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  /// A duplicate of `comm` (collective over it).
  static Communicator duplicate(MPI_Comm comm);
  /// MPI_Comm_split of `comm` (collective over it).
  static Communicator split(MPI_Comm comm, int color, int key);

  MPI_Comm get() const { return comm_; }
  /// Lets the communicator go without freeing it: for one that may hold
  /// operations no rank will finish (a failed step's), which MPI_Comm_free
  /// would wait for.
  void abandon() { comm_ = MPI_COMM_NULL; }

 private:
  MPI_Comm comm_ = MPI_COMM_NULL;
};

/// Every rank's `mine`, in rank order, on every rank of `comm` (collective).
std::vector<std::string> all_gather(MPI_Comm comm, const std::string& mine);

/// Where a rank sits in a job of `world_size` ranks cut into `stages` stages.
struct Placement {
  int stage = 0;     ///< which device of the pipeline this rank is (0..stages-1); with V stages per
                     ///< device it runs stages stage, stage + K, ..., else stage `stage`
  int replica = 0;   ///< which pipeline replica it belongs to (0..replicas-1)
  int stages = 1;    ///< K
  int replicas = 1;  ///< D = world size / K
  bool first() const { return stage == 0; }
  bool last() const { return stage == stages - 1; }
};

/// Rank r of `world_size` runs stage r mod K of replica r div K. Throws
/// std::invalid_argument if the world size is not a multiple of K.
Placement place(int world_rank, int world_size, int stages);

/// The layers [first, last) of a model with balance `balance` that stage
/// `stage` runs. With V stages per device, a rank runs the stages d, d+K, ...:
/// build its layers in that order, one stage_layers range after another.
std::pair<int, int> stage_layers(const std::vector<int>& balance, int stage);

/// The layers device `device` of `devices` runs for `balance` (K·V entries):
/// those of its stages device, device + K, ..., in that order, each stage built
/// by `build` on its own, named as in the whole model. Throws
/// std::invalid_argument if the builder does not make the range it is asked for.
torch::nn::Sequential device_layers(const LayerBuilder& build, const std::vector<int>& balance, int devices,
                                    int device);

/// Thrown on every other rank when one rank's stage fails: the job cannot go
/// on. what() carries the failing rank's own message. (A Cancelled, so the
/// stage executor passes it on rather than blaming its own stage.)
class RemoteError : public Cancelled {
 public:
  RemoteError(int rank, const std::string& message);
  int rank() const { return rank_; }

 private:
  int rank_;
};

/// A channel on which a failing rank tells every other rank, so that no rank
/// waits forever for a message that will not come. Every wait of the MPI
/// pipeline watches it.
class ErrorChannel {
 public:
  /// Collective over `world`, whose ranks it connects (on a duplicate).
  explicit ErrorChannel(MPI_Comm world);
  ~ErrorChannel();
  ErrorChannel(const ErrorChannel&) = delete;
  ErrorChannel& operator=(const ErrorChannel&) = delete;

  /// Waits for `request` to complete. Throws RemoteError if another rank
  /// reports a failure first.
  void wait(MPI_Request& request);
  /// Sends `message` to every other rank (their waits throw RemoteError).
  void raise(const std::string& message);
  /// Makes the destructor leave the channel's communicator (and its pending
  /// receive) as they are: after a failure, other failing ranks' messages may
  /// still be on their way to it, and a freed communicator's context is given
  /// to the next one MPI creates.
  void abandon() { abandoned_ = true; }

 private:
  void post();
  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0;
  int size_ = 1;
  MPI_Request pending_ = MPI_REQUEST_NULL;
  bool abandoned_ = false;
  std::array<char, 2048> buffer_{};
};

/// Transport between the ranks of one pipeline replica: each boundary tensor
/// is a header message (dtype and shape) and a data message, both
/// non-blocking, tagged by (from stage, to stage, micro-batch, direction), so
/// they never mix, even between ranks that hold several stages. Any dtype and
/// shape; CUDA tensors travel through host memory.
class MpiTransport : public Transport {
 public:
  /// `comm`: the replica's communicator; `rank_of_stage[s]`: the rank in it that runs stage s;
  /// `skips`: the skip connections between stages, each with a channel of its own.
  MpiTransport(MPI_Comm comm, ErrorChannel* errors, std::vector<int> rank_of_stage, int micro_batches,
               int skips = 0);
  ~MpiTransport() override;

  /// Posts ahead the header receives of the receive actions in `program`
  /// (this rank's row of a lowered schedule).
  void post_receives(const std::vector<Action>& program);
  /// Waits until every send has left this rank's buffers.
  void finish_sends();

  void send(int from, int to, Channel channel, int micro_batch, torch::Tensor tensor) override;
  torch::Tensor recv(int from, int to, Channel channel, int micro_batch) override;
  void cancel() override {}
  void reset() override;

  /// Messages sent and bytes of tensor data sent since construction.
  int64_t messages_sent() const { return messages_sent_; }
  int64_t bytes_sent() const { return bytes_sent_; }

 private:
  static constexpr int kMaxDims = 12;
  using Header = std::array<int64_t, 2 + kMaxDims>;  // dtype, dims, sizes...
  using Key = std::tuple<int, int, int, int>;         // (from stage, to stage, channel, micro-batch)
  struct PendingSend {
    std::unique_ptr<Header> header;
    torch::Tensor data;
    std::array<MPI_Request, 2> requests{MPI_REQUEST_NULL, MPI_REQUEST_NULL};
  };
  struct PendingRecv {
    std::unique_ptr<Header> header;
    MPI_Request request = MPI_REQUEST_NULL;
  };
  int tag(const Key& key, bool data) const;
  int rank(int stage) const;
  PendingRecv post_header(const Key& key);
  void reap_sends();

  MPI_Comm comm_;
  ErrorChannel* errors_;
  std::vector<int> rank_of_stage_;
  int channels_;  // kActivation, kGradient, and two per skip connection
  std::vector<PendingSend> sends_;
  std::map<Key, PendingRecv> receives_;
  int64_t messages_sent_ = 0;
  int64_t bytes_sent_ = 0;
};

/// Options of an MpiPipeline, set like PipelineOptions.
struct MpiPipelineOptions {
  /// Layers per stage for the whole model, e.g. {3, 8}: K·V entries.
  TORCH_ARG(std::vector<int>, balance) = {};
  /// The order in which the ranks run forwards and backwards (schedule.h).
  TORCH_ARG(ScheduleKind, schedule) = ScheduleKind::kGPipe;
  /// V, stages per rank (the interleaved schedule): K = balance.size() / V.
  TORCH_ARG(int, virtual_stages) = 1;
  /// M, micro-batches per replica per mini-batch.
  TORCH_ARG(int, chunks) = 1;
  TORCH_ARG(Checkpoint, checkpoint) = Checkpoint::kExceptLast;
  /// BatchNorm's running statistics updated once per mini-batch from all its
  /// rows, every replica's included (PipelineOptions::deferred_batch_norm).
  TORCH_ARG(bool, deferred_batch_norm) = true;
  /// Parameters tied across stages, by name in the whole model, e.g. {{"0.weight", "9.weight"}}
  /// for an input embedding and an output projection that share their weight. Each rank that
  /// holds one keeps a copy: the copies start as the lowest-numbered device's, their gradients
  /// are summed over the copies before the update, so one update keeps them identical to the bit.
  TORCH_ARG(std::vector<std::vector<std::string>>, tied_parameters) = {};
  /// This rank's device: a CPU core group or a CUDA device.
  TORCH_ARG(Device, device) = Device::cpu(1);
  /// The ranks of the job (np = K·D). gpipe duplicates it, so its messages
  /// never meet the caller's.
  TORCH_ARG(MPI_Comm, comm) = MPI_COMM_WORLD;
};

/// One stage of a GPipe pipeline in this rank, trained with the ranks that run
/// the other stages and the other replicas. Each rank builds only its stage's
/// layers (mpi::stage_layers tells which), with the same initial values as the
/// whole model in one process.
///
/// The constructor is collective: every rank checks that all ranks agree on
/// the layer count, K, M, the checkpoint mode, the balance and the dtype, and
/// each throws the same std::invalid_argument if not.
///
/// Every call below is collective too: call it on every rank, in the same
/// order, with the same whole mini-batch (a rank reads only what its stage
/// needs: stage 0 the input, the last stage the target; replica d its share d
/// of the rows).
///
/// Errors: bad input throws std::invalid_argument on every rank before any
/// work, whichever rank found it. A stage that throws makes its rank throw
/// StageError and every other rank RemoteError with that message; the
/// gradients are then as before the step. The pipeline can go on: the next
/// call (on every rank, as always) starts on fresh communicators, leaving the
/// failed step's messages behind, so the step can be retried.
class MpiPipeline {
 public:
  /// `layers`: this rank's stages' layers, in stage order (balance[stage] layers
  /// when V = 1).
  MpiPipeline(torch::nn::Sequential layers, MpiPipelineOptions options);
  ~MpiPipeline();
  MpiPipeline(const MpiPipeline&) = delete;
  MpiPipeline& operator=(const MpiPipeline&) = delete;

  /// Forward and backward of this replica's share of the mini-batch through
  /// the pipeline; then each stage's gradients are summed over the replicas, so
  /// every parameter's grad() gets (added) the gradient of the whole
  /// mini-batch's mean loss. Returns that loss on every rank.
  torch::Tensor train_step(const torch::Tensor& input, const torch::Tensor& target, const LossFn& loss);

  /// Pipelined inference of this replica's share of `input`: the output on the
  /// last stage's rank, an undefined tensor on the others (and on every rank
  /// of a replica whose share is empty).
  torch::Tensor forward(const torch::Tensor& input);

  /// The rows [begin, begin + count) of a batch of `batch_size` that this
  /// replica takes (none, with fewer rows than replicas, for the last ones).
  std::pair<int64_t, int64_t> share(int64_t batch_size) const;

  /// The sum of `value` over every rank of the job (collective).
  double sum(double value);
  /// Every rank's `bytes`, in rank order, on rank 0 of the job; an empty list
  /// on the others (collective).
  std::vector<std::string> gather(const std::string& bytes);
  /// The largest `value` over every rank of the job (collective).
  double max(double value);
  /// The last step's timeline of replica 0's K stages, returned on rank 0 of
  /// the job (an empty trace elsewhere). Each rank's times count from its own
  /// start of the step; ranks start a step within a message latency of each
  /// other, as the previous step ends with a collective (collective).
  StepTrace gather_trace();
  /// The measured bubble of the last step over all stages of all replicas:
  /// 1 - Σ busy / Σ step time (collective).
  double bubble();

  const Placement& placement() const { return placement_; }
  int stages() const { return placement_.stages; }
  int chunks() const { return options_.chunks(); }
  const std::vector<int>& balance() const { return options_.balance(); }
  /// This rank's layers (all its stages').
  torch::nn::Sequential layers() const { return layers_; }
  /// The lowered training program of the whole pipeline; this rank runs row placement().stage.
  const Schedule& schedule() const { return train_program_; }
  /// This rank's parameters, each tensor once: build the optimizer on these.
  std::vector<torch::Tensor> parameters() const { return unique_parameters(*layers_); }
  /// The parameters this rank counts in sums over the whole model (a gradient
  /// norm, a checksum): all but the copies of a tied weight that another rank
  /// (the lowest device holding one) counts.
  std::vector<torch::Tensor> counted_parameters() const;
  /// Bytes this rank's stages sent through skip connections in the last step (Pipeline::skip_bytes).
  int64_t skip_bytes() const;
  /// This stage's row of the last step's timeline.
  const StepTrace& last_trace() const { return trace_; }
  const MpiTransport& transport() const { return *transport_; }

 private:
  void check_agreement();
  void agree_on(const std::string& local_error);
  void connect();
  void ready();
  const Schedule& training_program(int micro_batches);
  void run(const Schedule& program, StepData& step);
  void allreduce_gradients();
  // Each tied group's gradient: the sum over its copies, on every rank that holds one.
  void sum_tied_gradients();
  // This rank's copies of each tied group, checked against every rank's.
  void find_tied_copies();
  // Every Stash and Pop of the whole model, from replica 0's ranks (collective).
  std::vector<SkipUse> all_skip_uses();
  // This rank's stages' BatchNorm statistics, summed over the replicas; undefined without any.
  torch::Tensor batch_norm_statistics();
  void reduce(double* values, int count, MPI_Op op);  // in place, over every rank

  torch::nn::Sequential layers_;
  MpiPipelineOptions options_;
  Placement placement_;
  Communicator control_;   // a duplicate of options.comm: setting up, and starting over after a failed step
  Communicator world_;     // every rank, for the steps' sums and gathers
  Communicator pipeline_;  // this replica's K ranks
  Communicator stage_;     // the D ranks that run this device's stages
  struct Tie {
    std::vector<torch::Tensor> copies;  // this rank's, one per distinct tensor; maybe none
    Communicator comm;                  // the replica's ranks that hold a copy (null if this rank holds none)
  };
  std::vector<Tie> ties_;  // one per group of tied_parameters
  std::set<const void*> uncounted_;  // tied copies another rank counts (counted_parameters)
  std::unique_ptr<ErrorChannel> errors_;
  std::unique_ptr<MpiTransport> transport_;
  std::unique_ptr<Executor> executor_;
  Schedule train_program_;
  Schedule forward_program_;
  std::map<int, Schedule> short_programs_;  // by micro-batch count, for batches of fewer rows than M
  bool stochastic_ = false;  // whether any stage of the model draws random numbers
  bool failed_ = false;
  StepTrace trace_;
};

}  // namespace gpipe::mpi
