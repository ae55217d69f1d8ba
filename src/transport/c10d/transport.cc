// transport.cc (c10d): C10dTransport, the pipeline's boundary messages over Links: a header and a
// message per tensor under a tag of (from stage, to stage, channel, micro-batch), and the thread that
// posts the step's receives in the order its program takes them.
#include "transport/c10d/c10d.h"

#include "gpipe/check.h"

#include <torch/torch.h>

#include <exception>
#include <memory>
#include <stdexcept>
#include <string>

namespace gpipe::c10d {

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
