// links_shm.cc (c10d): the Links' shared memory: the rings to and from the other processes of this
// machine, made and opened together at connection, the messages written to them as their readers make
// room (by the sending thread, or a pusher thread for what did not fit), and read by the thread that
// waits for a receive.
#include "transport/c10d/shm_peer.h"

#include "gpipe/check.h"
#include "gpipe/environment.h"

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <sstream>
#include <string>

namespace gpipe::c10d {

namespace {

// Each way between two processes of a machine: a ring of 8 MiB, halved while a process's rings to
// the others there pass 32 MiB, down to 1 MiB. A message larger than its ring crosses in parts, as the
// receiver reads.
size_t ring_bytes(size_t peers) {
  size_t bytes = size_t{8} << 20;
  while (bytes > (size_t{1} << 20) && bytes * peers > (size_t{32} << 20)) bytes /= 2;
  return bytes;
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

// The words of `text`, as white space parts them.
std::vector<std::string> fields(const std::string& text) {
  std::vector<std::string> out;
  std::istringstream in(text);
  for (std::string field; in >> field;) out.push_back(field);
  return out;
}

}  // namespace

void expect_size(const torch::Tensor& into, int64_t bytes, int64_t tag) {
  GPIPE_CHECK(static_cast<int64_t>(into.nbytes()) == bytes, "a message of ", bytes, " bytes came where ",
              into.nbytes(), " were expected (tag ", tag, ")");
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

}  // namespace gpipe::c10d
