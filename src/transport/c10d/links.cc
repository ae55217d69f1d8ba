// links.cc (c10d): Links, a pipeline's point-to-point connections over Gloo (or shared memory, with
// a process of this machine: links_shm.cc) with the flag that stops every wait: connected, sends,
// receives and their waits, and what another process said. The collectives made of their messages
// are in collectives.cc, C10dTransport over them in transport.cc.
#include "transport/c10d/shm_peer.h"

#include "gpipe/check.h"

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <cstring>

namespace gpipe::c10d {

namespace {

constexpr char kLeaving = '\x01';  // the first byte of a leaving process's message

}  // namespace

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

}  // namespace gpipe::c10d
