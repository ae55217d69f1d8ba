// mpi_backend.h: MPI as gpipe's backend (backend.h) for one device per rank: the environment,
// communicators, the backend of one pipeline (make_backend), the error channel and the transport
// between the ranks of a replica. The pipeline over it, MpiPipeline, is in mpi.h (the runtime);
// this header includes none of it.
//
//   world rank r = replica · K + device        (K devices, D replicas, np = K·D)
//
// Available when gpipe is built with GPIPE_MPI (the CMake option, on when
// MPI is found); the macro GPIPE_HAS_MPI is then 1.
#pragma once

#include "gpipe/backend.h"
#include "gpipe/layers.h"
#include "gpipe/plan.h"
#include "gpipe/schedule.h"
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

/// MPI for the rest of the process: initialised on the first call (with
/// `argc` and `argv` when given), finalised when the process exits. For front
/// ends that start MPI when an MPI launcher started them (gpipe train, the
/// Python package).
Environment& process_environment(int* argc = nullptr, char*** argv = nullptr);

/// Ends the whole job at once with a non-zero status: for a rank that cannot
/// go on.
[[noreturn]] void abort(int status = 1);

/// Tells every other rank of each live MPI pipeline of this process that this rank makes no more
/// calls (its program is ending: the end of main or of a Python script, sys.exit), so that a rank
/// still in a call, or making one later, stops within kLeaveGraceSeconds with a RuntimeError naming
/// this rank instead of waiting forever for it. Those pipelines take no further call here. Called
/// by Environment's destructor and by the Python package at exit; a no-op without live pipelines.
void leave();

/// How long a rank told that another left still waits for the part of the current operation that
/// the leaving rank may have sent before it left.
inline constexpr double kLeaveGraceSeconds = 2.0;

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

/// Where a rank sits, and the layers it builds: the rule every backend shares (backend.h).
using Placement = gpipe::Placement;
using gpipe::device_layers;
using gpipe::place;

/// The backend of one pipeline over the ranks of `comm` (np = K·D; gpipe duplicates it, so its
/// messages never meet the caller's), with `plan` when make_plan made one for the pipeline's
/// options on every rank alike (used as it is). Collective over `comm`. What MpiPipeline runs on.
std::unique_ptr<Backend> make_backend(MPI_Comm comm, const PipelinePlan* plan = nullptr);
/// Where this rank sits in the pipeline of `backend`, one make_backend made.
const Placement& placement_of(const Backend& backend);

/// Thrown on every other rank when one rank fails (transport.h's, shared by every backend).
using gpipe::RemoteError;

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
  /// reports a failure first, or if another rank left (mpi::leave) and the
  /// request does not complete within kLeaveGraceSeconds.
  void wait(MPI_Request& request);
  /// Sends `message` to every other rank (their waits throw RemoteError).
  void raise(const std::string& message);
  /// Tells every other rank that this one makes no more calls (mpi::leave).
  void leave(const std::string& message);
  /// The message of a rank that left (empty if none has), and its rank.
  const std::string& left() const { return left_; }
  int left_rank() const { return left_rank_; }
  /// Makes the destructor leave the channel's communicator (and its pending
  /// receive) as they are: after a failure, other failing ranks' messages may
  /// still be on their way to it, and a freed communicator's context is given
  /// to the next one MPI creates.
  void abandon() { abandoned_ = true; }
  /// A channel this rank has left (leave) whose communicator goes once every
  /// other rank's leave notice has come, after which nothing more can come
  /// (MPI keeps each sender's messages in order). Never waits: the channel is
  /// kept until then, and looked at again whenever a channel is made or
  /// retired. A failure that comes instead keeps the communicator, as abandon().
  static void retire(std::unique_ptr<ErrorChannel> channel);

 private:
  void post();
  // A message taken by the posted receive: a leave notice is noted and the receive posted again
  // (another rank's failure may still come); a failure throws RemoteError.
  void received(const MPI_Status& status);
  // Takes what has come without waiting; whether every other rank has left.
  bool drained();
  std::set<int> leavers_;  // the ranks whose leave notices came
  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0;
  int size_ = 1;
  MPI_Request pending_ = MPI_REQUEST_NULL;
  bool abandoned_ = false;
  std::string left_;  // a leaving rank's message
  int left_rank_ = -1;
  std::array<char, 2048> buffer_{};
};

/// Transport between the ranks of one pipeline replica: each boundary message
/// (one tensor, or a tuple of up to 64) is a header message (the count, then
/// each tensor's dtype and shape) and a data message per defined tensor, all
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

  /// Checks that the last step left nothing behind and posts ahead the header
  /// receives of the programs' receive actions; after cancel(), or a step that
  /// left receives behind, throws std::logic_error (the Transport contract).
  void begin(const std::vector<const std::vector<Action>*>& programs) override;
  void send(int from, int to, Channel channel, int micro_batch, Tensors tensors) override;
  Tensors recv(int from, int to, Channel channel, int micro_batch) override;
  /// Waits until every send has left this rank's buffers.
  void finish() override;
  /// Tells every other rank through the error channel (their waits throw
  /// RemoteError with `why`); a later send or recv here throws Cancelled, and
  /// begin() std::logic_error. MPI is called only from the thread that runs
  /// this rank's program.
  void cancel(const std::string& why) override;
  bool cancelled() const override { return !cancelled_.empty(); }

  /// Boundary messages sent (a tuple is one) and bytes of tensor data sent since construction.
  int64_t messages_sent() const { return messages_sent_; }
  int64_t bytes_sent() const override { return bytes_sent_; }

 private:
  static constexpr int kMaxDims = 12;
  static constexpr int kMaxTensors = kMostBoundaryTensors;  // of a tuple in one message
  static constexpr int kPart = 2 + kMaxDims;
  // The tensor count, whether a tuple, then per tensor: dtype (-1: undefined), dims, sizes...
  using Header = std::array<int64_t, 2 + kMaxTensors * kPart>;
  using Key = std::tuple<int, int, int, int>;  // (from stage, to stage, channel, micro-batch)
  struct PendingSend {
    std::unique_ptr<Header> header;
    std::vector<torch::Tensor> data;       // the defined tensors, contiguous, on the CPU
    std::vector<MPI_Request> requests;     // the header's, then one per tensor of data
  };
  struct PendingRecv {
    std::unique_ptr<Header> header;
    MPI_Request request = MPI_REQUEST_NULL;
  };
  int tag(const Key& key, bool data) const;
  int rank(int stage) const;
  PendingRecv post_header(const Key& key);
  void reap_sends();
  void check_cancelled() const;

  MPI_Comm comm_;
  ErrorChannel* errors_;
  std::vector<int> rank_of_stage_;
  int channels_;  // kActivation, kGradient, and two per skip connection
  std::vector<PendingSend> sends_;
  std::map<Key, PendingRecv> receives_;
  int64_t messages_sent_ = 0;
  int64_t bytes_sent_ = 0;
  std::string cancelled_;  // why the step was cancelled; empty while it runs
};

}  // namespace gpipe::mpi
