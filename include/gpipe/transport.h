// transport.h: how boundary tensors travel between stages: activations forward, gradients backward.
//
// One message per micro-batch per boundary per direction (the paper's
// communication pattern), and one per skip connection that crosses stages and
// per direction. A message is addressed by (from, to, channel, micro-batch),
// so messages never mix and may arrive in any order.
#pragma once

#include "gpipe/schedule.h"

#include <torch/types.h>

#include <condition_variable>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

namespace gpipe {

/// Thrown out of a blocked Transport::recv when the step is cancelled (another
/// stage failed). Executors pass it on as it is, not as their own failure.
struct Cancelled : std::runtime_error {
  explicit Cancelled(const std::string& why = "gpipe: step cancelled") : std::runtime_error(why) {}
};

/// The interface between stage executors: in one process, mailboxes; across
/// processes, MPI. Each stage calls send/recv only from its own thread.
class Transport {
 public:
  virtual ~Transport() = default;

  /// Delivers `tensor` to stage `to`. Does not block on the receiver.
  virtual void send(int from, int to, Channel channel, int micro_batch, torch::Tensor tensor) = 0;

  /// Blocks until the message (from, to, channel, micro_batch) arrives and
  /// returns it. Throws Cancelled once cancel() has been called.
  virtual torch::Tensor recv(int from, int to, Channel channel, int micro_batch) = 0;

  /// Wakes every blocked recv with Cancelled, now and until reset().
  virtual void cancel() = 0;

  /// Drops undelivered messages and clears cancellation, ready for a new step.
  virtual void reset() = 0;
};

/// Transport between stages of one process: a mailbox per receiving stage
/// (`stages` of them: every stage of the model, S = K·V).
/// Tensors are handed over, not copied.
class InProcessTransport : public Transport {
 public:
  explicit InProcessTransport(int stages);

  void send(int from, int to, Channel channel, int micro_batch, torch::Tensor tensor) override;
  torch::Tensor recv(int from, int to, Channel channel, int micro_batch) override;
  void cancel() override;
  void reset() override;

 private:
  using Key = std::tuple<int, int, int>;  // (from, channel, micro_batch)
  struct Mailbox {
    std::mutex mutex;
    std::condition_variable arrived;
    std::map<Key, torch::Tensor> messages;
    bool cancelled = false;
  };
  Mailbox& mailbox(int stage);

  std::vector<std::unique_ptr<Mailbox>> mailboxes_;
};

}  // namespace gpipe
