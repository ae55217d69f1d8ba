// links.cc (c10d): Links, a pipeline's point-to-point connections over Gloo with the flag that
// stops every wait, the collectives made of their messages, and C10dTransport over them.
#include "transport/c10d/c10d.h"

#include "gpipe/check.h"
#include "gpipe/environment.h"
#include "gpipe/io.h"
#include "transport/c10d/shm.h"

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/torch.h>

#include <unistd.h>

#include <atomic>
#include <climits>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <deque>
#include <random>
#include <sstream>

namespace gpipe::c10d {

namespace {

// The collectives' tags, above every tag of the transport's.
constexpr int kTransportTags = 1 << 30;
constexpr int kCombineTag = kTransportTags;
constexpr int kBroadcastTag = kTransportTags + 1;
constexpr int kGatherTag = kTransportTags + 2;

constexpr char kLeaving = '\x01';  // the first byte of a leaving process's message


// Each way between two processes of a machine: a ring of 8 MiB, halved while a process's rings to
// the others there pass 32 MiB, down to 1 MiB. A message larger than its ring crosses in parts, as the
// receiver reads.
size_t ring_bytes(size_t peers) {
  size_t bytes = size_t{8} << 20;
  while (bytes > (size_t{1} << 20) && bytes * peers > (size_t{32} << 20)) bytes /= 2;
  return bytes;
}

// A message in a ring: its tag and its size in bytes, then its bytes.
struct MessageHead {
  int64_t tag;
  int64_t bytes;
};

// A message through shared memory has the size of the receive that takes it, as Gloo checks.
void expect_size(const torch::Tensor& into, int64_t bytes, int64_t tag) {
  GPIPE_CHECK(static_cast<int64_t>(into.nbytes()) == bytes, "a message of ", bytes, " bytes came where ",
              into.nbytes(), " were expected (tag ", tag, ")");
}

// This process's PID namespace: another's pids name nothing here (a container's).
std::string pid_namespace() {
  char link[128] = {};
  const ssize_t n = readlink("/proc/self/ns/pid", link, sizeof(link) - 1);
  return n > 0 ? std::string(link, static_cast<size_t>(n)) : std::string();
}

// The prefix of a process's rings' names in /dev/shm (each ring adds the rank it goes to): random, so
// that no other process has made them, nor another container of the same host name.
std::string ring_prefix() {
  std::random_device random;
  const uint64_t bits = (uint64_t{random()} << 32) ^ random();
  char name[40];
  std::snprintf(name, sizeof(name), "/gpipe.%016llx", static_cast<unsigned long long>(bits));
  return name;
}

std::vector<std::string> fields(const std::string& text) {
  std::vector<std::string> out;
  std::istringstream in(text);
  for (std::string field; in >> field;) out.push_back(field);
  return out;
}

}  // namespace

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

Links::Links(const std::string& scope, int generation) {
  const World& w = world();
  rank_ = w.rank;
  known_as_ = w.known_as;
  const std::string base = scope + "/" + std::to_string(generation) + "/";
  store_ = connect_store("");  // the watcher's keys: the flag is flag_key_ in both
  flag_key_ = base + "flag";
  auto options = ::c10d::ProcessGroupGloo::Options::create(w.timeout);
  options->devices.push_back(w.device);
  options->threads = 1;  // its collectives are not used
  const bool shared_memory = shared_memory_wanted();
  // Each process counts itself in, so that one left waiting can say how many came.
  const std::string arrived = base + "arrived";
  try {
    const WaitNotice notice([&w, &arrived](int seconds) {
      // The count from a connection of the notice's thread; a shared store (a process group's) is
      // busy with the rendezvous' wait until it ends.
      const std::string came =
          w.shared ? "" : std::to_string(connect_store("", std::chrono::seconds(5))->add(arrived, 0)) + " here, ";
      return rank_name(w.known_as, w.rank) + " has waited " + std::to_string(seconds) + " s for the job's other " +
             "ranks to connect (" + came + std::to_string(w.size) + " in all); " + most_wait(w) +
             ": check that every rank was started";
    });
    store_->add(arrived, 1);  // within the notice: a store that never answers is said too
    group_ = c10::make_intrusive<::c10d::ProcessGroupGloo>(c10::make_intrusive<::c10d::PrefixStore>(base + "gloo", store_),
                                                           rank_, w.size, options);
    connect_shared_memory(shared_memory);
  } catch (const std::exception& e) {
    // A rank that ended while the others connected is said as the others hear of it; anything else is
    // a connection that did not come.
    const std::string what = without_program_name(first_line(e.what()));
    GPIPE_CHECK(what.rfind("stopped because rank", 0) != 0, what);
    GPIPE_CHECK(false, name(rank_), " could not connect to the job's other ranks within ", w.timeout.count() / 1000,
                " s (GPIPE_TIMEOUT): ", what, "; check that every rank was started and reaches the "
                "same point (GLOO_SOCKET_IFNAME picks the network interface)");
  }
  watch(this);
}

Links::~Links() {
  unwatch(this);
  release_shared_memory();
}

bool shared_memory_wanted() {
  return environment_choice("GPIPE_SHM", {"0", "1"},
                            "1, the default, sends between the ranks of one machine through shared memory; 0 "
                            "through Gloo") != "0";
}

void Links::connect_shared_memory(bool wanted) {
  const World& w = world();
  if (w.size < 2) return;
  // The processes of this machine: the same host name, where both want shared memory (a ring another
  // container's /dev/shm holds is not found under its name).
  char host[256] = {};
  gethostname(host, sizeof(host) - 1);
  const std::string pids = pid_namespace();
  // Each process's rings are named by a prefix it draws and says here, and the rank they go to: a
  // process that dies after making its ring to this one leaves a name this one knows, and removes.
  const std::string prefix = ring_prefix();
  const std::vector<std::string> who = all_gather((wanted ? std::string("+") + host : std::string("-")) + "\n" +
                                                  pids + "\n" + std::to_string(getpid()) + "\n" + prefix);
  std::map<int, std::unique_ptr<ShmPeer>> found;
  std::vector<std::string> names(static_cast<size_t>(w.size), "-");  // of the rings this process makes
  std::vector<std::string> incoming;                                   // of those the others make to it
  // The names made, and those made for this process, go from /dev/shm when this ends, also when a
  // gather below fails (a peer that died before its ring was opened, or before it said it made it).
  struct Unlinked {
    const std::vector<std::string>& names;
    const std::vector<std::string>& incoming;
    ~Unlinked() {
      for (const auto* list : {&names, &incoming})
        for (const std::string& name : *list)
          if (name != "-") ShmRing::unlink(name);
    }
  } unlinked{names, incoming};
  for (int r = 0; r < w.size; ++r) {
    std::istringstream in(who[static_cast<size_t>(r)]);
    std::string their_host, their_pids, their_pid, their_prefix;
    std::getline(in, their_host);
    std::getline(in, their_pids);
    std::getline(in, their_pid);
    std::getline(in, their_prefix);
    if (r == rank_ || !wanted || their_host != std::string("+") + host) continue;
    auto peer = std::make_unique<ShmPeer>();
    peer->rank = r;
    peer->pid = std::atoi(their_pid.c_str());
    peer->pid_here = !pids.empty() && their_pids == pids;
    found[r] = std::move(peer);
    incoming.push_back(their_prefix + "." + std::to_string(rank_));
  }
  // Each process makes its rings to the others ("-" where /dev/shm has no room), opens theirs to it,
  // and says which it opened; the names then go from /dev/shm. A pair keeps its rings only where both
  // ways opened: a message waiting for room in a ring moves as its reader reads, which a process
  // waiting on Gloo for the same peer would not.
  std::string not_made, why;  // the ranks this process could make no ring to, and the system's reason
  for (auto& [p, peer] : found) {
    const std::string name = prefix + "." + std::to_string(p);
    peer->out = ShmRing::create(name, ring_bytes(found.size()), &why);
    if (peer->out)
      names[static_cast<size_t>(p)] = name;
    else
      not_made += (not_made.empty() ? "" : ", ") + this->name(p);
  }
  // Said, not silent: Gloo over TCP is slower than a ring (0.70 of mpirun's speed, docs/distributed.md).
  if (!not_made.empty())
    print_error_line("gpipe: " + this->name(rank_) + " could not make its shared-memory ring to " + not_made + " in " +
                     "/dev/shm (" + why + "; each needs " + std::to_string(ring_bytes(found.size()) >> 20) + " MiB, " +
                     std::to_string((ring_bytes(found.size()) >> 20) * found.size() * 2) + " MiB for this process's " +
                     "rings both ways): those ranks exchange through Gloo over TCP instead, slower; give /dev/shm room "
                     "(a container's shm size of 1 GiB) or set GPIPE_SHM=0 to choose Gloo");
  std::string mine;
  for (const std::string& name : names) mine += name + " ";
  const std::vector<std::string> made = all_gather(mine);
  std::string opened(static_cast<size_t>(w.size), '0');
  for (auto& [p, peer] : found) {
    const std::vector<std::string> theirs = fields(made[static_cast<size_t>(p)]);
    const std::string& name = theirs.at(static_cast<size_t>(rank_));
    if (name != "-") peer->in = ShmRing::open(name);
    if (peer->in) {
      opened[static_cast<size_t>(p)] = '1';
      ShmRing::unlink(name);  // at once: a process that dies before the maker does leaves no file
    }
  }
  const std::vector<std::string> opens = all_gather(opened);
  for (auto it = found.begin(); it != found.end();) {
    const auto p = static_cast<size_t>(it->first);
    const bool out_opened = opens[p][static_cast<size_t>(rank_)] == '1';
    it = out_opened && it->second->in ? std::next(it) : found.erase(it);
  }
  shm_ = std::move(found);  // the gathers above went through Gloo
}

void Links::release_shared_memory() {
  {
    const std::lock_guard<std::mutex> lock(push_mutex_);
    push_stop_ = true;
  }
  push_wake_.notify_all();
  if (pusher_.joinable()) pusher_.join();
  shm_.clear();
}

bool Links::shared_memory_with(int peer) const { return shm_.count(peer) > 0; }

ShmPeer* Links::shared_memory_peer(int peer) {
  const auto it = shm_.find(peer);
  return it != shm_.end() ? it->second.get() : nullptr;
}

ShmPeer* Links::push_out() {
  ShmPeer* full = nullptr;
  for (auto& [r, peer] : shm_) {
    const std::lock_guard<std::mutex> lock(peer->out_mutex);
    while (!peer->sending.empty()) {
      ShmPeer::Outgoing& o = peer->sending.front();
      const size_t head = sizeof(MessageHead), bytes = static_cast<size_t>(o.head.bytes);
      if (o.written < head)
        o.written += peer->out->write_some(reinterpret_cast<const uint8_t*>(&o.head) + o.written, head - o.written);
      if (o.written >= head && o.written < head + bytes)
        o.written += peer->out->write_some(static_cast<const uint8_t*>(o.data.data_ptr()) + (o.written - head),
                                           head + bytes - o.written);
      if (o.written < head + bytes) {
        if (full == nullptr) full = peer.get();
        break;
      }
      peer->sending.pop_front();
    }
  }
  return full;
}

void Links::push_until_sent() {
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(push_mutex_);
      push_wake_.wait(lock, [this] { return push_stop_ || push_more_; });
      if (push_stop_) return;
      push_more_ = false;
    }
    while (ShmPeer* full = push_out()) {
      {
        const std::lock_guard<std::mutex> lock(push_mutex_);
        if (push_stop_) return;
      }
      full->out->wait_writable(std::chrono::milliseconds(20));
    }
  }
}

void Links::take_in(ShmPeer& peer, const ShmRecv* awaited) {
  const std::lock_guard<std::mutex> lock(peer.in_mutex);
  ShmPeer::Incoming& c = peer.current;
  for (;;) {
    // The receive waited for came: what follows stays in the ring, for the receive posted next.
    if (awaited != nullptr && awaited->done) return;
    if (c.head_read < sizeof(MessageHead)) {
      c.head_read += peer.in->read_some(reinterpret_cast<uint8_t*>(&c.head) + c.head_read, sizeof(MessageHead) - c.head_read);
      if (c.head_read < sizeof(MessageHead)) return;
      GPIPE_CHECK(c.head.bytes >= 0, "a message of ", c.head.bytes, " bytes came from ", name(peer.rank));
      c.receive = peer.take_posted(c.head.tag, c.head.bytes);
      if (c.receive) {
        c.into = static_cast<uint8_t*>(c.receive->into.data_ptr());
      } else {
        c.kept.resize(static_cast<size_t>(c.head.bytes));
        c.into = c.kept.data();
      }
      c.read = 0;
    }
    const auto bytes = static_cast<size_t>(c.head.bytes);
    if (c.read < bytes) c.read += peer.in->read_some(c.into + c.read, bytes - c.read);
    if (c.read < bytes) return;
    if (!c.receive) {  // a receive posted while the message came takes it now
      c.receive = peer.take_posted(c.head.tag, c.head.bytes);
      if (c.receive && bytes > 0) std::memcpy(c.receive->into.data_ptr(), c.kept.data(), bytes);
    }
    if (c.receive) {
      c.receive->done = true;
      // Another thread's receive, taken in by this one: wake it rather than leave it to its timeout.
      if (c.receive.get() != awaited) peer.in->wake_reader();
    } else
      peer.early[c.head.tag].push_back(std::move(c.kept));
    c = ShmPeer::Incoming{};
  }
}

bool Links::wait_shm(ShmRecv& work, int peer) {
  ShmPeer& from = *shm_.at(peer);
  using Clock = std::chrono::steady_clock;
  const Clock::time_point begin = Clock::now(), deadline = begin + world().timeout;
  Clock::time_point look = begin;
  // A peer alive but not calling (busy elsewhere, or waiting on this rank for something else): said
  // after 10 s, then every minute, as the start-up's waits are.
  std::chrono::seconds notice(10);
  for (;;) {
    // Taken before looking: bytes written, or this receive completed by another thread, after it
    // end the sleep below at once.
    const uint32_t ticket = from.in->wait_ticket();
    take_in(from, &work);
    if (work.done) return true;
    if (work.aborted) return false;
    // The waiting thread has nothing else to do: a short spin spares the wake-up's latency.
    const auto idle = [&] { return from.in->readable() == 0 && !work.aborted && !work.done; };
    const Clock::time_point spin = Clock::now() + std::chrono::microseconds(50);
    while (idle() && Clock::now() < spin) {
    }
    if (idle()) from.in->wait_readable(ticket, std::chrono::milliseconds(20));
    const Clock::time_point now = Clock::now();
    if (now >= look) {
      look = now + std::chrono::milliseconds(100);
      if (from.ended()) throw_broken(peer, name(peer) + "'s process ended");
    }
    if (now >= begin + notice) {
      print_error_line("gpipe: " + name(rank_) + " has waited " + std::to_string(notice.count()) + " s for " +
                       name(peer) + " in a pipeline call; " + most_wait(world()) + ": if this goes on, check that " +
                       name(peer) + " makes the same pipeline calls in turn and is not busy elsewhere");
      notice += std::chrono::seconds(60);
    }
    if (now >= deadline) throw_timed_out(peer);
  }
}

void Links::throw_heard() const { throw RemoteError(heard_rank_, heard_, name(heard_rank_)); }

void Links::flagged(const std::string& value) {
  const size_t end = value.find('\n');
  int from = -1;
  try {
    from = std::stoi(value.substr(0, end));
  } catch (const std::exception&) {
  }
  if (from == rank_ || end == std::string::npos) return;  // its own
  const bool leaving = end + 1 < value.size() && value[end + 1] == kLeaving;
  const std::string message = value.substr(end + (leaving ? 2 : 1));
  const std::lock_guard<std::mutex> lock(mutex_);
  if (leaving) {
    // What the leaving process sent before it left still comes: waits go on for kLeaveGrace (a wait
    // on the leaver itself ends sooner, when its connections close), then end with its message.
    if (left_.empty()) left_ = message, left_rank_ = from, left_at_ = std::chrono::steady_clock::now();
    if (!heard_.empty() || std::chrono::steady_clock::now() - left_at_ < kLeaveGrace) return;
  } else if (!heard_.empty()) {
    return;
  }
  heard_ = message;
  heard_rank_ = from;
  for (::c10d::Work* work : waiting_) work->abort();
}

std::pair<int, std::string> Links::left() const {
  const std::lock_guard<std::mutex> lock(mutex_);
  return {left_rank_, left_};
}

void Links::raise(const std::string& message) {
  if (raised_) return;
  raised_ = true;
  try {
    // The first process to raise is the one heard: a later notice (one that failed because of the
    // first, or left after it) does not replace it.
    store_->compareSet(flag_key_, {}, bytes_of(std::to_string(rank_) + "\n" + message));
  } catch (const std::exception&) {
    // The store is gone: the launcher is ending the job.
  }
}

void Links::leave(const std::string& message) { raise(std::string(1, kLeaving) + message); }

void Links::send(int peer, int tag, const torch::Tensor& tensor) {
  if (ShmPeer* to = shared_memory_peer(peer)) {
    {
      const std::lock_guard<std::mutex> lock(to->out_mutex);
      to->sending.push_back({MessageHead{tag, static_cast<int64_t>(tensor.nbytes())}, tensor});
    }
    if (push_out() != nullptr) {  // the rest goes as the reader makes room, whatever this thread waits on
      {
        const std::lock_guard<std::mutex> lock(push_mutex_);
        push_more_ = true;
      }
      if (!pusher_.joinable()) pusher_ = std::thread(&Links::push_until_sent, this);
      push_wake_.notify_all();
    }
    return;
  }
  std::vector<at::Tensor> one{tensor};
  try {
    sends_.emplace_back(group_->send(one, peer, tag), peer);
  } catch (const std::exception& e) {
    throw_broken(peer, e.what());  // Gloo refuses a send on a closed connection at once
  }
}

c10::intrusive_ptr<::c10d::Work> Links::post_recv(int peer, int tag, torch::Tensor& into) {
  if (ShmPeer* from = shared_memory_peer(peer)) {
    auto work = c10::make_intrusive<ShmRecv>(into, from->in);
    const std::lock_guard<std::mutex> lock(from->in_mutex);
    const auto early = from->early.find(tag);
    if (early == from->early.end()) {
      from->posted[tag].push_back(work);
      return work;
    }
    const std::vector<uint8_t>& bytes = early->second.front();
    expect_size(into, static_cast<int64_t>(bytes.size()), tag);
    if (!bytes.empty()) std::memcpy(into.data_ptr(), bytes.data(), bytes.size());
    early->second.pop_front();
    if (early->second.empty()) from->early.erase(early);
    work->done = true;
    return work;
  }
  std::vector<at::Tensor> one{into};
  try {
    return group_->recv(one, peer, tag);
  } catch (const std::exception& e) {
    throw_broken(peer, e.what());
  }
}

void Links::throw_what_was_said() {
  // A process that failed or left may have said so just before its connections closed: the watcher
  // may not have looked yet.
  try {
    if (store_->check({flag_key_})) {
      const auto value = store_->get(flag_key_);
      flagged(std::string(value.begin(), value.end()));
    }
  } catch (const std::exception&) {
  }
  const std::lock_guard<std::mutex> lock(mutex_);
  if (!heard_.empty()) throw_heard();
  if (!left_.empty()) throw RemoteError(left_rank_, left_, name(left_rank_));
}

void Links::throw_timed_out(int peer) {
  throw_what_was_said();
  const auto seconds = std::chrono::duration_cast<std::chrono::seconds>(world().timeout).count();
  throw std::runtime_error("gpipe: " + name(rank_) + " waited " + std::to_string(seconds) + " s (GPIPE_TIMEOUT) for " +
                           name(peer) + ", whose process is alive but made no pipeline call in that time: check that "
                           "every rank makes the same pipeline calls in turn, or give GPIPE_TIMEOUT more seconds");
}

void Links::throw_broken(int peer, const std::string& broken) {
  throw_what_was_said();
  const std::lock_guard<std::mutex> lock(mutex_);
  throw RemoteError(peer,
                    "the connection between " + name(rank_) + " and " + name(peer) + " broke (" +
                        first_line(broken) + "): that rank ended, was killed, or did not answer within GPIPE_TIMEOUT",
                    name(peer));
}

void Links::wait(const c10::intrusive_ptr<::c10d::Work>& work, int peer) {
  {
    const std::lock_guard<std::mutex> lock(mutex_);
    if (!heard_.empty()) {
      work->abort();
      throw_heard();
    }
    waiting_.insert(work.get());
  }
  bool done = false;
  std::string broken;
  auto* shm = dynamic_cast<ShmRecv*>(work.get());
  try {
    done = shm != nullptr ? wait_shm(*shm, peer) : work->wait();
  } catch (const std::exception& e) {
    if (shm != nullptr) {  // its errors say what they are; Gloo's say that the connection broke
      const std::lock_guard<std::mutex> lock(mutex_);
      waiting_.erase(work.get());
      throw;
    }
    broken = e.what();
  }
  {
    const std::lock_guard<std::mutex> lock(mutex_);
    waiting_.erase(work.get());
    if (!heard_.empty()) throw_heard();
  }
  if (!broken.empty()) throw_broken(peer, broken);
  if (!done) throw Cancelled("gpipe: a wait of " + name(rank_) + " was stopped");
}

void Links::wait_sends() {
  // Waited in order; when a wait throws, the rest are let go with it (a failed step's).
  auto sends = std::move(sends_);
  sends_.clear();
  for (const auto& [work, peer] : sends) wait(work, peer);
  // Through shared memory: until every message is in its ring, reading meanwhile what comes (a peer
  // may be waiting for room in its ring to this process too).
  using Clock = std::chrono::steady_clock;
  const Clock::time_point deadline = Clock::now() + world().timeout;
  while (ShmPeer* full = push_out()) {
    {
      const std::lock_guard<std::mutex> lock(mutex_);
      if (!heard_.empty()) throw_heard();
    }
    for (auto& [r, peer] : shm_) take_in(*peer);
    full->out->wait_writable(std::chrono::milliseconds(1));
    if (full->ended()) throw_broken(full->rank, name(full->rank) + "'s process ended");
    if (Clock::now() >= deadline)
      throw_timed_out(full->rank);
  }
}

void Links::combine(const std::vector<int>& ranks, torch::Tensor& values, bool largest) {
  const int root = ranks.front();
  if (rank_ != root) {
    send(root, kCombineTag, values.clone());
    auto work = post_recv(root, kCombineTag, values);
    wait(work, root);
    wait_sends();
    return;
  }
  for (size_t n = 1; n < ranks.size(); ++n) {
    torch::Tensor part = torch::empty_like(values);
    auto work = post_recv(ranks[n], kCombineTag, part);
    wait(work, ranks[n]);
    if (largest)
      values.copy_(torch::maximum(values, part));
    else
      values.add_(part);
  }
  for (size_t n = 1; n < ranks.size(); ++n) send(ranks[n], kCombineTag, values);
  wait_sends();
}

void Links::broadcast(const std::vector<int>& ranks, torch::Tensor& value) {
  const int root = ranks.front();
  if (rank_ == root) {
    for (size_t n = 1; n < ranks.size(); ++n) send(ranks[n], kBroadcastTag, value);
    wait_sends();
    return;
  }
  auto work = post_recv(root, kBroadcastTag, value);
  wait(work, root);
}

std::vector<std::string> Links::gather(const std::string& bytes) {
  const int size = world().size;
  if (rank_ != 0) {
    send(0, kGatherTag, torch::tensor({static_cast<int64_t>(bytes.size())}, torch::kLong));
    if (!bytes.empty()) {
      torch::Tensor data = torch::empty({static_cast<int64_t>(bytes.size())}, torch::kUInt8);
      std::memcpy(data.data_ptr(), bytes.data(), bytes.size());
      send(0, kGatherTag, data);
    }
    wait_sends();
    return {};
  }
  std::vector<std::string> out{bytes};
  for (int r = 1; r < size; ++r) {
    torch::Tensor length = torch::empty({1}, torch::kLong);
    wait(post_recv(r, kGatherTag, length), r);
    const int64_t n = length.item<int64_t>();
    std::string part(static_cast<size_t>(n), '\0');
    if (n > 0) {
      torch::Tensor data = torch::empty({n}, torch::kUInt8);
      wait(post_recv(r, kGatherTag, data), r);
      std::memcpy(part.data(), data.data_ptr(), static_cast<size_t>(n));
    }
    out.push_back(std::move(part));
  }
  return out;
}

std::vector<std::string> Links::all_gather(const std::string& bytes) {
  std::vector<std::string> all = gather(bytes);
  // Rank 0 sends every part to every other rank: their lengths, then their bytes.
  const int size = world().size;
  torch::Tensor lengths = torch::empty({size}, torch::kLong);
  if (rank_ == 0) {
    std::string joined;
    for (int r = 0; r < size; ++r) {
      lengths[r] = static_cast<int64_t>(all[static_cast<size_t>(r)].size());
      joined += all[static_cast<size_t>(r)];
    }
    torch::Tensor data = torch::empty({static_cast<int64_t>(joined.size())}, torch::kUInt8);
    if (!joined.empty()) std::memcpy(data.data_ptr(), joined.data(), joined.size());
    for (int r = 1; r < size; ++r) {
      send(r, kGatherTag, lengths);
      if (!joined.empty()) send(r, kGatherTag, data);
    }
    wait_sends();
    return all;
  }
  wait(post_recv(0, kGatherTag, lengths), 0);
  const int64_t total = lengths.sum().item<int64_t>();
  std::string joined(static_cast<size_t>(total), '\0');
  if (total > 0) {
    torch::Tensor data = torch::empty({total}, torch::kUInt8);
    wait(post_recv(0, kGatherTag, data), 0);
    std::memcpy(joined.data(), data.data_ptr(), static_cast<size_t>(total));
  }
  all.clear();
  size_t at = 0;
  for (int r = 0; r < size; ++r) {
    const auto n = static_cast<size_t>(lengths[r].item<int64_t>());
    all.push_back(joined.substr(at, n));
    at += n;
  }
  return all;
}

// ---- the transport

C10dTransport::C10dTransport(Links* links, std::vector<int> rank_of_stage, int micro_batches, int skips)
    : links_(links), rank_of_stage_(std::move(rank_of_stage)), channels_(2 + 2 * skips) {
  const int S = static_cast<int>(rank_of_stage_.size());
  const int64_t per_micro_batch = int64_t{channels_} * S * S;
  GPIPE_CHECK(per_micro_batch * micro_batches <= kTransportTags, "M = ", micro_batches, " micro-batches over ", S,
              " stages need more message tags than gpipe's c10d transport has (", kTransportTags, "); use at most ",
              std::max<int64_t>(1, kTransportTags / per_micro_batch), " micro-batches");
}

C10dTransport::~C10dTransport() { stop_receiving(); }

void C10dTransport::stop_receiving() {
  if (!receiver_.joinable()) return;
  {
    // The receives still posted are stopped: the thread's wait ends. Their buffers go with the
    // Links, which the group keeps after a failed step.
    const std::lock_guard<std::mutex> lock(mutex_);
    for (auto& [key, pending] : receives_) {
      pending->work->abort();
      for (auto& work : pending->data) work->abort();
    }
  }
  receiver_.join();
}

void C10dTransport::post_data(const Key& key, PendingRecv& pending) {
  const int from = std::get<0>(key);
  const int64_t* h = pending.header.data_ptr<int64_t>();
  GPIPE_CHECK(h[0] >= 0 && h[0] <= kMostBoundaryTensors, "stage ", from, " sent a message of ", h[0], " tensors");
  pending.tensors.tuple = h[1] != 0;
  for (int64_t n = 0; n < h[0]; ++n) {
    const int64_t* part = h + 2 + n * kPart;
    GPIPE_CHECK(part[1] >= 0 && part[1] <= kMaxDims, "stage ", from, " sent a tensor of ", part[1], " dimensions");
    if (part[0] < 0) {
      pending.tensors.items.emplace_back();
      continue;
    }
    const std::vector<int64_t> sizes(part + 2, part + 2 + part[1]);
    torch::Tensor tensor = torch::empty(sizes, torch::TensorOptions().dtype(static_cast<c10::ScalarType>(part[0])));
    if (tensor.numel() > 0) pending.data.push_back(links_->post_recv(rank(from), tag(key), tensor));
    pending.tensors.items.push_back(tensor);
  }
}

void C10dTransport::receive_ahead(std::vector<Key> order) {
  for (const Key& key : order) {
    std::shared_ptr<PendingRecv> pending;
    {
      const std::lock_guard<std::mutex> lock(mutex_);
      const auto it = receives_.find(key);
      if (it == receives_.end() || it->second->posted) continue;
      pending = it->second;
    }
    try {
      links_->wait(pending->work, rank(std::get<0>(key)));
      post_data(key, *pending);
    } catch (...) {
      const std::lock_guard<std::mutex> lock(mutex_);
      failure_ = std::current_exception();
      posted_.notify_all();
      return;
    }
    const std::lock_guard<std::mutex> lock(mutex_);
    pending->posted = true;
    posted_.notify_all();
  }
}

int C10dTransport::tag(const Key& key) const {
  const auto [from, to, channel, micro_batch] = key;
  const int S = static_cast<int>(rank_of_stage_.size());
  return ((micro_batch * S + to) * S + from) * channels_ + channel;
}

int C10dTransport::rank(int stage) const {
  GPIPE_CHECK(stage >= 0 && stage < static_cast<int>(rank_of_stage_.size()), "stage ", stage,
              " does not exist; this pipeline has stages 0..", rank_of_stage_.size() - 1);
  return rank_of_stage_[static_cast<size_t>(stage)];
}

void C10dTransport::check_cancelled() const {
  if (!cancelled_.empty()) throw Cancelled(cancelled_);
}

void C10dTransport::send(int from, int to, Channel channel, int micro_batch, Tensors tensors) {
  check_cancelled();
  const Key key{from, to, static_cast<int>(channel), micro_batch};
  GPIPE_CHECK(tensors.size() <= static_cast<size_t>(kMostBoundaryTensors), "a stage boundary of ", tensors.size(),
              " tensors is more than one message carries (", kMostBoundaryTensors,
              "); pass fewer tensors from layer to layer (stack those of one shape into one)");
  torch::Tensor header = torch::zeros({kHeader}, torch::kLong);
  int64_t* h = header.data_ptr<int64_t>();
  h[0] = static_cast<int64_t>(tensors.size());
  h[1] = tensors.tuple ? 1 : 0;
  std::vector<torch::Tensor> data;
  for (size_t n = 0; n < tensors.size(); ++n) {
    int64_t* part = h + 2 + n * kPart;
    const torch::Tensor& t = tensors.items[n];
    if (!t.defined()) {  // a gradient's entry for a tensor that takes none
      part[0] = -1;
      continue;
    }
    torch::Tensor cpu = t.detach().to(torch::kCPU).contiguous();
    GPIPE_CHECK(cpu.dim() <= kMaxDims, "a boundary tensor has ", cpu.dim(), " dimensions; messages carry at most ",
                kMaxDims);
    part[0] = static_cast<int64_t>(cpu.scalar_type());
    part[1] = cpu.dim();
    for (int64_t d = 0; d < cpu.dim(); ++d) part[2 + d] = cpu.size(d);
    data.push_back(std::move(cpu));
  }
  // The header, then one data message per tensor, in order, under one tag: Gloo keeps their order
  // between two processes.
  const int to_rank = rank(to);
  links_->send(to_rank, tag(key), header);
  for (const torch::Tensor& t : data) {
    if (t.numel() > 0) links_->send(to_rank, tag(key), t);
    bytes_sent_ += static_cast<int64_t>(t.nbytes());
  }
}

Tensors C10dTransport::recv(int from, int to, Channel channel, int micro_batch) {
  check_cancelled();
  const Key key{from, to, static_cast<int>(channel), micro_batch};
  std::shared_ptr<PendingRecv> pending;
  {
    std::unique_lock<std::mutex> lock(mutex_);
    auto it = receives_.find(key);
    if (it == receives_.end()) {  // a receive no program announced (time_link's): taken here
      lock.unlock();
      PendingRecv alone;
      alone.header = torch::empty({kHeader}, torch::kLong);
      links_->wait(links_->post_recv(rank(from), tag(key), alone.header), rank(from));
      post_data(key, alone);
      for (const auto& work : alone.data) links_->wait(work, rank(from));
      return alone.tensors;
    }
    pending = it->second;
    // Bounded: the thread's own wait on the header ends, or throws, as any wait of the Links does.
    posted_.wait(lock, [&] { return pending->posted || failure_ != nullptr; });
    if (!pending->posted) std::rethrow_exception(failure_);
    receives_.erase(it);
  }
  for (const auto& work : pending->data) links_->wait(work, rank(from));
  return pending->tensors;
}

void C10dTransport::finish() {
  links_->wait_sends();
  stop_receiving();  // every receive of the step was taken: the thread has ended
}

void C10dTransport::cancel(const std::string& why) {
  if (!cancelled_.empty()) return;
  cancelled_ = Cancelled(why).what();
  links_->raise(cancelled_);
}

void C10dTransport::begin(const std::vector<const std::vector<Action>*>& programs) {
  if (!cancelled_.empty())  // the runtime's mistake, not the caller's
    throw std::logic_error("gpipe: the c10d transport was cancelled; a failed step is followed by a transport of "
                           "its own");
  stop_receiving();
  if (!receives_.empty())
    throw std::logic_error("gpipe: the c10d transport still expects " + std::to_string(receives_.size()) +
                           " messages from a failed step; a failed step is followed by a transport of its own");
  failure_ = nullptr;
  const int self = links_->rank();
  std::vector<Key> order;  // the receives in the order the programs take them
  for (const std::vector<Action>* program : programs)
    for (const Action& a : *program) {
      // A receive from a stage of this process is the executor's own hand-over: no message to post.
      // One through shared memory is read by the thread that waits for it.
      if (a.kind != ActionKind::kRecv || rank(a.peer) == self || links_->shared_memory_with(rank(a.peer))) continue;
      const Key key{a.peer, a.stage, static_cast<int>(a.channel), a.micro_batch};
      if (receives_.count(key) > 0) continue;
      auto pending = std::make_shared<PendingRecv>();
      pending->header = torch::empty({kHeader}, torch::kLong);
      pending->work = links_->post_recv(rank(a.peer), tag(key), pending->header);
      receives_.emplace(key, pending);
      order.push_back(key);
    }
  if (!order.empty()) receiver_ = std::thread(&C10dTransport::receive_ahead, this, std::move(order));
}

}  // namespace gpipe::c10d
