// c10d.h (internal): PyTorch's c10d as gpipe's backend (gpipe/backend.h): a job that torchrun
// started (or anything that sets torch.distributed's env:// variables: MASTER_ADDR, MASTER_PORT,
// RANK, WORLD_SIZE), one device per process, over Gloo.
//
//   the job's store (a TCPStore at MASTER_ADDR:MASTER_PORT; torchrun's agent hosts it, else rank 0):
//       Gloo's rendezvous, the error flags, the job's end
//   Links, one per pipeline and generation: a ProcessGroupGloo used for point-to-point only. Every
//       collective is made of point-to-point messages, each of which a failure elsewhere aborts
//       (Gloo's own collectives cannot be stopped, and would wait out their timeout).
//
// Files: world.cc (the job, its store, its end, the flags' watcher), links.cc (Links: connection,
// sends, receives and their waits), links_shm.cc (the Links' shared memory with the processes of one
// machine, over shm.cc's rings; shm_peer.h), collectives.cc (the Links' collectives), transport.cc
// (C10dTransport), group.cc (the pipeline's backend and c10d's entry in backends()).
#pragma once

#include "gpipe/backend.h"
#include "gpipe/job.h"
#include "gpipe/transport.h"
#include "transport/rank_group.h"

#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <exception>
#include <thread>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace gpipe::c10d {

class Links;
class ShmRing;
struct ShmPeer;
class ShmRecv;

/// A store value from text, and back.
inline std::vector<uint8_t> bytes_of(const std::string& text) { return std::vector<uint8_t>(text.begin(), text.end()); }
inline std::string text_of(const std::vector<uint8_t>& bytes) { return std::string(bytes.begin(), bytes.end()); }
/// The first line of `text` (an exception's message, say).
inline std::string first_line(const std::string& text) { return text.substr(0, text.find('\n')); }

/// GPIPE_SHM: whether the ranks of one machine meet through shared memory (1, the default) or Gloo (0);
/// std::invalid_argument for any other value.
bool shared_memory_wanted();

/// Whether an env:// launcher (torchrun) started this process as one of a job of several: RANK,
/// WORLD_SIZE (above 1), MASTER_ADDR and MASTER_PORT are set.
bool launched();

/// The job this process belongs to, once started (start()).
struct World {
  int rank = 0;
  int size = 1;
  std::string host;  // the store's
  int port = 0;
  bool agent_store = false;  // torchrun's agent hosts the store (TORCHELASTIC_USE_AGENT_STORE)
  std::string prefix;        // every key of this job: "gpipe/<restart>", then "/<scope>" if start_over has one
  std::chrono::milliseconds timeout{0};  // of every blocking call (GPIPE_TIMEOUT, in seconds)
  c10::intrusive_ptr<::c10d::Store> store;  // the first connection (on rank 0 without torchrun's agent, the store itself)
  /// start_over's store (a process group's), and its scope (the group's keys).
  c10::intrusive_ptr<::c10d::Store> given;
  std::string scope;
  /// Where start_over's store is not a TCPStore (gpipe connects to a TCPStore's server itself): every
  /// connection is that one, shared by the threads, one call at a time (a wait holds up the others).
  c10::intrusive_ptr<::c10d::Store> shared;
  std::shared_ptr<::gloo::transport::Device> device;  // Gloo's, shared by every Links
  /// What messages call each rank beside its own number: start_over's `known_as` (a subgroup's
  /// ranks in the default group); empty: nothing more.
  std::vector<int> known_as;
  /// start_over's `let_go`: the store is let go of when the last pipeline over it ends.
  bool let_go = false;
  std::atomic<int> pipelines_made{0};  // each pipeline's keys: the n-th made over this World
  std::unique_ptr<Links> job;          // the job's own connections (BackendEntry::all_gather)
};

/// How messages name rank `r` of a World whose known_as is `known_as`: "rank r", or "rank r (3 in the
/// default group)" for a subgroup.
std::string rank_name(const std::vector<int>& known_as, int r);

/// Starts the job for the rest of the process on the first call (connects to the store, and starts
/// the thread that watches the error flags); returns it. Throws std::invalid_argument naming the
/// variable that is missing or wrong.
World& start();
/// Whether start() has run.
bool started();
/// The started job; throws std::invalid_argument naming the fix when it is not.
World& world();
/// A connection of its own to the job's store (a store connection is used by one thread), its keys
/// under the job's prefix and `prefix`, if any.
/// A wait on it lasts at most `timeout` (0: the job's).
c10::intrusive_ptr<::c10d::Store> connect_store(const std::string& prefix,
                                                std::chrono::milliseconds timeout = std::chrono::milliseconds(0));

/// "it waits N s at most (GPIPE_TIMEOUT)": what WaitNotice's lines say of the job's timeout.
std::string most_wait(const World& w);

/// While alive, says on standard error that this process still waits, after 10 s and then every
/// minute: `line(seconds waited)`. For the waits of the set-up no output shows (the store's
/// connection, the other ranks' arrival), which last up to GPIPE_TIMEOUT.
class WaitNotice {
 public:
  explicit WaitNotice(std::function<std::string(int)> line);
  ~WaitNotice();
  WaitNotice(const WaitNotice&) = delete;
  WaitNotice& operator=(const WaitNotice&) = delete;

 private:
  std::mutex mutex_;
  std::condition_variable ended_;
  bool done_ = false;
  std::thread thread_;
};

/// The watcher looks at `links`' flag (Links::flag_key) until unwatch, and calls Links::flagged
/// with its value while it is set.
void watch(Links* links);
void unwatch(Links* links);

/// Ends the whole job with `status`, after `print`ing `message` as job.h's end_job says.
[[noreturn]] void end_job(int status, const std::string& message, const std::function<void(const std::string&)>& print);
/// Ends the whole job at once: every process exits with `status`.
[[noreturn]] void abort(int status);
/// Tells every other process of each live pipeline that this one makes no more calls (as mpi::leave).
void leave();
/// The pipelines of this process over the c10d backend that are alive.
size_t live_pipelines();
/// Called as a pipeline ends: a World start_over made with `let_go` is let go of once none is left.
void pipeline_ended();
/// Starts the job (start()) for a command-line program, bound to cores first (bind_to_cores); returns
/// this rank and the ranks.
std::pair<int, int> start_job();
/// With GPIPE_BIND_CORES=1, as mpirun binds its ranks: the calling thread, and the threads it starts
/// after (a program's main thread, before any other), on the LOCAL_RANK-th of LOCAL_WORLD_SIZE even
/// shares of the machine's cores. Not where a process has fewer cores than the machine (taskset,
/// numactl or Slurm bound it already), nor with fewer cores than processes. Not by default: a rank
/// whose threads per stage outnumber its share runs many times slower (docs/distributed.md).
void bind_to_cores();
/// job.h's time_link, on this rank of a job of two.
std::vector<LinkTiming> time_link(int warmup);

/// c10d's entry in backends().
BackendEntry backend_entry();

/// One generation of a pipeline's connections: a ProcessGroupGloo over every process of the job, on
/// keys of its own, and the flag on which a failing process stops every other. A failed call is
/// followed by a new generation (the old one's messages in flight cannot reach it). Between two
/// processes of one machine, messages go through shared memory instead (shm.h), each way where
/// /dev/shm has room for a ring (GPIPE_SHM=0: never).
class Links {
 public:
  /// Collective over the job. `scope` names the pipeline (its keys in the store).
  Links(const std::string& scope, int generation);
  ~Links();
  Links(const Links&) = delete;
  Links& operator=(const Links&) = delete;

  int rank() const { return rank_; }
  /// Whether messages to and from `peer` go through shared memory (taken by the thread that waits for them).
  bool shared_memory_with(int peer) const;
  /// How many other processes messages reach through shared memory.
  int shared_memory_peers() const { return static_cast<int>(shm_.size()); }
  /// Lets go of the rings to the processes of this machine (a failed generation's, kept for Gloo).
  void release_shared_memory();

  /// Sends `tensor` (contiguous, on the CPU) to `peer` without waiting: kept until wait_sends().
  void send(int peer, int tag, const torch::Tensor& tensor);
  /// Posts a receive of `into` (contiguous, on the CPU, of the size sent) from `peer`.
  c10::intrusive_ptr<::c10d::Work> post_recv(int peer, int tag, torch::Tensor& into);
  /// Waits for `work` (a receive from, or a send to, `peer`). Throws RemoteError when another
  /// process raised a failure or left, or when the connection to `peer` broke (it died, or the
  /// wait passed the job's timeout).
  void wait(const c10::intrusive_ptr<::c10d::Work>& work, int peer);
  /// Waits until every send has left.
  void wait_sends();

  /// Tells every other process that this one failed with `message`: their waits throw RemoteError.
  void raise(const std::string& message);
  /// Tells every other process that this one makes no more calls (`message` says why).
  void leave(const std::string& message);
  /// The rank and message of a process that left (an empty message if none has), read together.
  std::pair<int, std::string> left() const;

  // ---- collectives made of point-to-point messages, over `ranks` (ascending, this one among them)

  /// `values` combined in place: summed in rank order (every process ends with the same bits), or
  /// their elementwise maximum with `largest`.
  void combine(const std::vector<int>& ranks, torch::Tensor& values, bool largest = false);
  /// `value` made ranks[0]'s.
  void broadcast(const std::vector<int>& ranks, torch::Tensor& value);
  /// Every process's `bytes` on rank 0, in rank order; an empty list elsewhere (every process).
  std::vector<std::string> gather(const std::string& bytes);
  /// Every process's `bytes`, in rank order, on every process (every process).
  std::vector<std::string> all_gather(const std::string& bytes);

  /// Called by the watcher with the flag's value ("<rank>\n<message>") whenever it is set: a failure
  /// aborts every wait; a leave notice is kept (left()), and aborts them 2 s later.
  void flagged(const std::string& value);
  const std::string& flag_key() const { return flag_key_; }

 private:
  // The failure notice that came (empty while none has), and the leave notice.
  std::string heard_;
  int heard_rank_ = -1;
  std::string left_;
  int left_rank_ = -1;
  std::chrono::steady_clock::time_point left_at_;
  static constexpr std::chrono::seconds kLeaveGrace{2};
  mutable std::mutex mutex_;
  std::set<::c10d::Work*> waiting_;
  std::vector<std::pair<c10::intrusive_ptr<::c10d::Work>, int>> sends_;
  c10::intrusive_ptr<::c10d::Store> store_;  // the caller thread's connection
  c10::intrusive_ptr<::c10d::ProcessGroupGloo> group_;
  std::string flag_key_;
  int rank_ = 0;
  std::vector<int> known_as_;  // the World's, for messages made while mutex_ is held
  std::string name(int r) const { return rank_name(known_as_, r); }
  bool raised_ = false;
  std::map<int, std::unique_ptr<ShmPeer>> shm_;  // the processes of this machine, by rank
  // The thread that writes what did not fit in a ring as its reader makes room (started by the first
  // such message).
  std::thread pusher_;
  std::mutex push_mutex_;
  std::condition_variable push_wake_;
  bool push_more_ = false;
  bool push_stop_ = false;
  [[noreturn]] void throw_heard() const;
  // The rings to and from the other processes of this machine (collective, at construction).
  void connect_shared_memory(bool wanted);
  ShmPeer* shared_memory_peer(int peer);  // nullptr: Gloo
  // Writes what waits to be sent through shared memory as far as the rings have room; returns a
  // peer whose ring is full, if any.
  ShmPeer* push_out();
  void push_until_sent();  // the pusher's loop
  // Reads what came from `peer` into the receives posted, or keeps it until they are; stops once
  // `awaited` is done.
  void take_in(ShmPeer& peer, const ShmRecv* awaited = nullptr);
  // Waits for `work` from `peer`: false when it was aborted.
  bool wait_shm(ShmRecv& work, int peer);
  // Throws for the connection to `peer` that broke (`broken`: Gloo's words): the failure or leave
  // notice it came with, if any, else a RemoteError naming `peer`.
  [[noreturn]] void throw_broken(int peer, const std::string& broken);
  /// A wait for `peer`, whose process is alive, that passed GPIPE_TIMEOUT: this rank's own error
  /// (the peer made no call), unless a failure or a leave was said first.
  [[noreturn]] void throw_timed_out(int peer);
  /// Throws what another process said (a failure, or that it left), if it said anything.
  void throw_what_was_said();
};

/// The message tags: the transport's are below kTransportTags, the Links' collectives' from it up.
constexpr int kTransportTags = 1 << 30;

/// Transport between the processes of one pipeline replica over Links: each boundary message a
/// header (the count, then each tensor's dtype and shape) and a data message per tensor, under a tag
/// of (from stage, to stage, channel, micro-batch). CUDA tensors travel through host memory.
///
/// Gloo sends a message once its receive is posted, and a tensor's receive can be posted only once
/// its header has come: a thread of the transport takes the step's headers in the order the program
/// receives them and posts each one's data receives at once, so that the data crosses while the
/// receiving device computes. Messages through shared memory (a rank of this machine) cross as they
/// are sent; the device's own thread takes them.
class C10dTransport : public Transport {
 public:
  /// `rank_of_stage[s]`: the job's rank that runs stage s.
  C10dTransport(Links* links, std::vector<int> rank_of_stage, int micro_batches, int skips = 0);
  ~C10dTransport() override;

  void begin(const std::vector<const std::vector<Action>*>& programs) override;
  void send(int from, int to, Channel channel, int micro_batch, Tensors tensors) override;
  Tensors recv(int from, int to, Channel channel, int micro_batch) override;
  void finish() override;
  void cancel(const std::string& why) override;
  bool cancelled() const override { return !cancelled_.empty(); }
  int64_t bytes_sent() const override { return bytes_sent_; }
  /// Stops the receiving thread: the receives still posted are aborted (after a failed step).
  void stop_receiving();

 private:
  static constexpr int kMaxDims = 12;
  static constexpr int kPart = 2 + kMaxDims;
  static constexpr int kHeader = 2 + kMostBoundaryTensors * kPart;
  using Key = std::tuple<int, int, int, int>;  // (from stage, to stage, channel, micro-batch)
  // A message under way: its header's receive, then (the receiving thread's) its tensors' receives.
  struct PendingRecv {
    torch::Tensor header;
    c10::intrusive_ptr<::c10d::Work> work;
    bool posted = false;  // the header came and the tensors' receives are posted
    Tensors tensors;
    std::vector<c10::intrusive_ptr<::c10d::Work>> data;
  };
  int tag(const Key& key) const;
  int rank(int stage) const;
  void check_cancelled() const;
  // The receiving thread: each of `order`'s headers, in turn, then its tensors' receives posted.
  void receive_ahead(std::vector<Key> order);
  // Posts `pending`'s tensors' receives from its header (from stage `from`).
  void post_data(const Key& key, PendingRecv& pending);

  Links* links_;
  std::vector<int> rank_of_stage_;
  int channels_;
  std::mutex mutex_;  // receives_, failure_; the receiving thread and the device's
  std::condition_variable posted_;
  std::map<Key, std::shared_ptr<PendingRecv>> receives_;
  std::exception_ptr failure_;  // the receiving thread's
  std::thread receiver_;
  int64_t bytes_sent_ = 0;
  std::string cancelled_;
};

/// The processes of a c10d job running one pipeline and its replicas.
class C10dGroup : public detail::RankGroup {
 public:
  C10dGroup();
  explicit C10dGroup(const PipelinePlan& plan);
  ~C10dGroup() override;

  Transport& transport() override { return *transport_; }
  void reduce(double* values, int count, bool largest) override;
  std::vector<std::string> gather(const std::string& bytes) override;
  int rank() const override { return world().rank; }
  std::string rank_name(int r) const override { return c10d::rank_name(world().known_as, r); }

  /// Tells the other processes that this one makes no more calls; takes none after.
  void leave();

 protected:
  std::vector<std::string> all_gather_setup(const std::string& mine) override;
  // "c10d (Gloo)", with how many of the other ranks this one reaches through shared memory.
  std::string backend_name() const override;
  void sum_replicas(const std::shared_ptr<torch::Tensor>& values, const char* what) override;
  void broadcast_tie(size_t tie, torch::Tensor& value) override;
  void sum_tie(size_t tie, const std::shared_ptr<torch::Tensor>& values) override;
  // A new generation of connections; abandoned, the old one is kept (Gloo may still write into a
  // failed call's buffers, which its operations hold).
  void open() override;
  void abandon() override;
  void tell_failure(const std::string& message) override;
  std::pair<int, std::string> heard_leaving() const override;

 private:
  std::vector<int> tie_ranks(size_t tie) const;

  std::string scope_;  // this pipeline's keys in the store
  int generation_ = 0;
  std::unique_ptr<Links> links_;
  std::unique_ptr<C10dTransport> transport_;
};

}  // namespace gpipe::c10d
