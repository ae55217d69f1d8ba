// transport.h: how boundary tensors travel between stages: activations forward, gradients backward.
//
// One message per micro-batch per boundary per direction (the paper's
// communication pattern), and one per skip connection that crosses stages and
// per direction. A message is addressed by (from, to, channel, micro-batch),
// so messages never mix and may arrive in any order.
#pragma once

#include "gpipe/schedule.h"
#include "gpipe/tensors.h"

#include <torch/types.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

namespace gpipe {

/// The most tensors a stage boundary may pass in one message where a transport has a limit: the
/// MPI transport sends a tuple of at most this many (one process's mailboxes take any number).
/// The planner proposes no cut whose boundary passes more, and check_stage_inputs refuses one.
constexpr int kMostBoundaryTensors = 64;

/// Thrown out of a blocked Transport::recv when the step is cancelled (another
/// stage failed). Executors pass it on as it is, not as their own failure.
struct Cancelled : std::runtime_error {
  explicit Cancelled(const std::string& why = "") : std::runtime_error(why.empty() ? "gpipe: step cancelled" : why) {}
};

/// Thrown on every other process of a job of several (MPI, c10d) when one process fails or leaves:
/// the job cannot go on. what() carries the failing process's own message. (A Cancelled, so the
/// executor passes it on rather than blaming its own stage.)
class RemoteError : public Cancelled {
 public:
  /// `named`: how the message names the rank (empty: "rank N").
  RemoteError(int rank, const std::string& message, const std::string& named = "")
      : Cancelled("gpipe: stopped because " + (named.empty() ? "rank " + std::to_string(rank) : named) +
                  " failed: " + message),
        rank_(rank) {}
  /// The rank of the process that failed, in the job or process group the pipeline runs over.
  int rank() const { return rank_; }

 private:
  int rank_;
};

/// The interface between the devices' executors: in one process, mailboxes;
/// across processes, the backend's (MPI, c10d). Each device calls send/recv only
/// from its own thread.
///
/// A step: begin() with the programs this process runs, the executors' send
/// and recv, then finish() once they have all run; or, when an action fails,
/// cancel(), which stops the step on every stage.
class Transport {
 public:
  virtual ~Transport() = default;

  /// Ready for a new step whose devices held here run `programs` (their rows
  /// of a lowered schedule), and posts the programs' receives ahead where that
  /// helps. A cancelled transport takes no further step: begin() after
  /// cancel() throws std::logic_error, and the next step needs a new transport
  /// (the runtime makes one; under MPI on fresh communicators, which a failed
  /// step's messages still in flight cannot reach).
  virtual void begin(const std::vector<const std::vector<Action>*>& programs) = 0;

  /// Delivers `tensors` (one tensor, or a tuple: one message of them all, an
  /// undefined entry of a gradient included) to stage `to`. Does not block on the receiver.
  virtual void send(int from, int to, Channel channel, int micro_batch, Tensors tensors) = 0;

  /// Blocks until the message (from, to, channel, micro_batch) arrives and
  /// returns it. Throws Cancelled once the step is cancelled.
  virtual Tensors recv(int from, int to, Channel channel, int micro_batch) = 0;

  /// After this process's programs have run: waits until every message it
  /// sent has left its buffers.
  virtual void finish() = 0;

  /// Stops the step, and with it the transport: every blocked or later recv
  /// (and, in one process, send), on every device of the pipeline, throws
  /// Cancelled carrying `why`, and begin() throws std::logic_error. More than
  /// once is as once. In one process any thread may call it; under MPI the
  /// thread that runs the rank's program.
  virtual void cancel(const std::string& why) = 0;
  /// Whether this process's side of the step was cancelled (a cancellation by
  /// another process shows only at a recv).
  virtual bool cancelled() const = 0;

  /// Bytes of tensor data this process has sent through the transport since it was made.
  virtual int64_t bytes_sent() const = 0;
};

/// Transport between stages of one process: a mailbox per receiving stage
/// (`stages` of them: every stage of the model, S = K·V).
/// Tensors are handed over, not copied.
class InProcessTransport : public Transport {
 public:
  explicit InProcessTransport(int stages);

  void begin(const std::vector<const std::vector<Action>*>& programs) override;
  void send(int from, int to, Channel channel, int micro_batch, Tensors tensors) override;
  Tensors recv(int from, int to, Channel channel, int micro_batch) override;
  void finish() override {}  // a send hands the tensors over: nothing is left to wait for
  void cancel(const std::string& why) override;
  bool cancelled() const override { return cancelled_; }
  int64_t bytes_sent() const override { return bytes_sent_; }

 private:
  using Key = std::tuple<int, int, int>;  // (from, channel, micro_batch)
  struct Mailbox {
    std::mutex mutex;
    std::condition_variable arrived;
    std::map<Key, Tensors> messages;
    bool cancelled = false;
    std::string why;
  };
  Mailbox& mailbox(int stage);

  std::vector<std::unique_ptr<Mailbox>> mailboxes_;
  std::atomic<int64_t> bytes_sent_{0};
  std::atomic<bool> cancelled_{false};
};

}  // namespace gpipe
