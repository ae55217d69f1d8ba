// links.cc (c10d): Links, a pipeline's point-to-point connections over Gloo with the flag that
// stops every wait, the collectives made of their messages, and C10dTransport over them.
#include "transport/c10d/c10d.h"

#include "gpipe/check.h"

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/torch.h>

#include <climits>

namespace gpipe::c10d {

namespace {

// The collectives' tags, above every tag of the transport's.
constexpr int kTransportTags = 1 << 30;
constexpr int kCombineTag = kTransportTags;
constexpr int kBroadcastTag = kTransportTags + 1;
constexpr int kGatherTag = kTransportTags + 2;

constexpr char kLeaving = '\x01';  // the first byte of a leaving process's message


std::string first_line(const std::string& text) { return text.substr(0, text.find('\n')); }

}  // namespace

Links::Links(const std::string& scope, int generation) {
  const World& w = world();
  rank_ = w.rank;
  const std::string base = scope + "/" + std::to_string(generation) + "/";
  store_ = connect_store("");  // the watcher's keys: the flag is flag_key_ in both
  flag_key_ = base + "flag";
  auto options = ::c10d::ProcessGroupGloo::Options::create(w.timeout);
  options->devices.push_back(w.device);
  options->threads = 1;  // its collectives are not used
  // Each process counts itself in, so that one left waiting can say how many came.
  const std::string arrived = base + "arrived";
  try {
    const WaitNotice notice([&w, &arrived](int seconds) {
      // The count from a connection of the notice's thread; a shared store (a process group's) is
      // busy with the rendezvous' wait until it ends.
      const std::string came =
          w.shared ? "" : std::to_string(connect_store("", std::chrono::seconds(5))->add(arrived, 0)) + " here, ";
      return "rank " + std::to_string(w.rank) + " has waited " + std::to_string(seconds) + " s for the job's other " +
             "ranks to connect (" + came + std::to_string(w.size) + " in all); " + most_wait(w) +
             ": check that every rank was started";
    });
    store_->add(arrived, 1);  // within the notice: a store that never answers is said too
    group_ = c10::make_intrusive<::c10d::ProcessGroupGloo>(c10::make_intrusive<::c10d::PrefixStore>(base + "gloo", store_),
                                                           rank_, w.size, options);
  } catch (const std::exception& e) {
    GPIPE_CHECK(false, "rank ", rank_, " could not connect to the job's other ranks within ", w.timeout.count() / 1000,
                " s (GPIPE_TIMEOUT): ", first_line(e.what()), "; check that every rank was started and reaches the "
                "same point (GLOO_SOCKET_IFNAME picks the network interface)");
  }
  watch(this);
}

Links::~Links() { unwatch(this); }

void Links::throw_heard() const { throw RemoteError(heard_rank_, heard_); }

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
  std::vector<at::Tensor> one{tensor};
  try {
    sends_.emplace_back(group_->send(one, peer, tag), peer);
  } catch (const std::exception& e) {
    throw_broken(peer, e.what());  // Gloo refuses a send on a closed connection at once
  }
}

c10::intrusive_ptr<::c10d::Work> Links::post_recv(int peer, int tag, torch::Tensor& into) {
  std::vector<at::Tensor> one{into};
  try {
    return group_->recv(one, peer, tag);
  } catch (const std::exception& e) {
    throw_broken(peer, e.what());
  }
}

void Links::throw_broken(int peer, const std::string& broken) {
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
  if (!left_.empty()) throw RemoteError(left_rank_, left_);
  throw RemoteError(peer, "the connection between rank " + std::to_string(rank_) + " and rank " +
                              std::to_string(peer) + " broke (" + first_line(broken) +
                              "): that rank ended, was killed, or did not answer within GPIPE_TIMEOUT");
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
  try {
    done = work->wait();
  } catch (const std::exception& e) {
    broken = e.what();
  }
  {
    const std::lock_guard<std::mutex> lock(mutex_);
    waiting_.erase(work.get());
    if (!heard_.empty()) throw_heard();
  }
  if (!broken.empty()) throw_broken(peer, broken);
  if (!done) throw Cancelled("gpipe: a wait of rank " + std::to_string(rank_) + " was stopped");
}

void Links::wait_sends() {
  // Waited in order; when a wait throws, the rest are let go with it (a failed step's).
  auto sends = std::move(sends_);
  sends_.clear();
  for (const auto& [work, peer] : sends) wait(work, peer);
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
      if (a.kind != ActionKind::kRecv || rank(a.peer) == self) continue;
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
