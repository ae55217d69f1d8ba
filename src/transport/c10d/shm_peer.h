// shm_peer.h (internal): another process of this machine as the c10d Links reach it through shared
// memory: the rings both ways, what waits to be written to its ring and what is being read from its
// own, and a receive that is done once its bytes were read. links_shm.cc connects and drives the
// rings; links.cc sends and receives through them.
#pragma once

#include "transport/c10d/c10d.h"
#include "transport/c10d/shm.h"

#include "gpipe/io.h"

#include <torch/torch.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <vector>

namespace gpipe::c10d {

// A message in a ring: its tag and its size in bytes, then its bytes.
struct MessageHead {
  int64_t tag;
  int64_t bytes;
};

// A message through shared memory has the size of the receive that takes it, as Gloo checks.
void expect_size(const torch::Tensor& into, int64_t bytes, int64_t tag);

/// A receive through shared memory: done once its bytes were read from the ring into `into`.
class ShmRecv : public ::c10d::Work {
 public:
  ShmRecv(torch::Tensor into, std::shared_ptr<ShmRing> ring) : into(std::move(into)), ring(std::move(ring)) {}
  bool isCompleted() override { return done.load(); }
  void abort() override {
    aborted = true;
    ring->wake_reader();
  }
  // Links::wait waits for it, reading the ring meanwhile.
  bool wait(std::chrono::milliseconds /*timeout*/) override {
    throw std::logic_error("gpipe: a receive through shared memory is waited for by Links::wait");
  }

  torch::Tensor into;
  std::shared_ptr<ShmRing> ring;  // kept for abort() after a failed generation let go of its rings
  std::atomic<bool> done{false};
  std::atomic<bool> aborted{false};
};

/// A process of this machine and the rings to it and from it.
struct ShmPeer {
  int rank = 0;
  int pid = 0;
  bool pid_here = false;  // its pid is of this process's namespace
  std::shared_ptr<ShmRing> out, in;

  // Whether its process is known to have ended: gone, or a zombie its parent (torchrun) has not yet
  // reaped.
  bool ended() const { return pid_here && pid > 0 && !process_runs(pid); }

  // What waits to be written to `out`, in order (kept alive until it is).
  struct Outgoing {
    MessageHead head;
    torch::Tensor data;
    size_t written = 0;  // of the head, then of the data
  };
  std::mutex out_mutex;
  std::deque<Outgoing> sending;

  // The message being read from `in`: into a receive, or into a copy kept for one not posted yet.
  std::mutex in_mutex;
  struct Incoming {
    MessageHead head{};
    size_t head_read = 0;
    uint8_t* into = nullptr;
    size_t read = 0;
    c10::intrusive_ptr<ShmRecv> receive;
    std::vector<uint8_t> kept;
  } current;
  std::map<int64_t, std::deque<c10::intrusive_ptr<ShmRecv>>> posted;  // by tag, in the order posted
  std::map<int64_t, std::deque<std::vector<uint8_t>>> early;          // by tag, in the order sent

  // The oldest receive posted under `tag`, if any, which takes a message of `bytes`.
  c10::intrusive_ptr<ShmRecv> take_posted(int64_t tag, int64_t bytes) {
    const auto it = posted.find(tag);
    if (it == posted.end()) return {};
    c10::intrusive_ptr<ShmRecv> receive = it->second.front();
    it->second.pop_front();
    if (it->second.empty()) posted.erase(it);
    expect_size(receive->into, bytes, tag);
    return receive;
  }
};

}  // namespace gpipe::c10d
