// transport.cc: MpiTransport: each boundary message a header, then a data message per tensor, between the
// ranks of one replica, tagged by (from stage, to stage, channel, micro-batch).
#include "transport/mpi/group.h"

#include "gpipe/check.h"

#include <torch/torch.h>

#include <climits>

namespace gpipe::mpi {

MpiTransport::MpiTransport(MPI_Comm comm, ErrorChannel* errors, std::vector<int> rank_of_stage, int micro_batches,
                           int skips)
    : comm_(comm), errors_(errors), rank_of_stage_(std::move(rank_of_stage)), channels_(2 + 2 * skips) {
  void* value = nullptr;
  int found = 0;
  MPI_Comm_get_attr(comm_, MPI_TAG_UB, &value, &found);
  const int64_t tag_ub = found ? *static_cast<int*>(value) : 32767;
  const int S = static_cast<int>(rank_of_stage_.size());
  const int64_t per_micro_batch = int64_t{2} * channels_ * S * S;
  GPIPE_CHECK(per_micro_batch * micro_batches - 1 <= tag_ub, "M = ", micro_batches, " micro-batches over ", S,
              " stages", skips > 0 ? " with " + std::to_string(skips) + " skip connections between them" : "",
              " need more message tags than this MPI offers (", tag_ub, "); use at most ",
              std::max<int64_t>(1, (tag_ub + 1) / per_micro_batch), " micro-batches");
}

MpiTransport::~MpiTransport() {
  for (auto& [key, pending] : receives_) {
    MPI_Cancel(&pending.request);
    MPI_Wait(&pending.request, MPI_STATUS_IGNORE);
  }
  // Sends still pending after a failed step may finish later: their buffers
  // must outlive them, so they are handed to MPI and deliberately kept.
  for (auto& pending : sends_)
    for (MPI_Request& request : pending.requests)
      if (request != MPI_REQUEST_NULL) MPI_Request_free(&request);
  if (!sends_.empty()) new std::vector<PendingSend>(std::move(sends_));
}

// A message's tag names both stages, so messages between two ranks that hold several stages never mix.
int MpiTransport::tag(const Key& key, bool data) const {
  const auto [from, to, channel, micro_batch] = key;
  const int S = static_cast<int>(rank_of_stage_.size());
  return (((micro_batch * S + to) * S + from) * channels_ + channel) * 2 + (data ? 1 : 0);
}

int MpiTransport::rank(int stage) const {
  GPIPE_CHECK(stage >= 0 && stage < static_cast<int>(rank_of_stage_.size()), "stage ", stage,
              " does not exist; this pipeline has stages 0..", rank_of_stage_.size() - 1);
  return rank_of_stage_[static_cast<size_t>(stage)];
}

MpiTransport::PendingRecv MpiTransport::post_header(const Key& key) {
  PendingRecv pending;
  pending.header = std::make_unique<Header>();
  detail::check_mpi(MPI_Irecv(pending.header->data(), static_cast<int>(pending.header->size()), MPI_INT64_T,
                      rank(std::get<0>(key)), tag(key, false), comm_, &pending.request),
            "posting a receive");
  return pending;
}

void MpiTransport::send(int from, int to, Channel channel, int micro_batch, Tensors tensors) {
  check_cancelled();
  const Key key{from, to, static_cast<int>(channel), micro_batch};
  GPIPE_CHECK(tensors.size() <= static_cast<size_t>(kMaxTensors), "a stage boundary of ", tensors.size(),
              " tensors is more than one MPI message carries (", kMaxTensors,
              "); pass fewer tensors from layer to layer (stack those of one shape into one)");
  PendingSend pending;
  pending.header = std::make_unique<Header>();
  Header& h = *pending.header;
  h.fill(0);
  h[0] = static_cast<int64_t>(tensors.size());
  h[1] = tensors.tuple ? 1 : 0;
  for (size_t n = 0; n < tensors.size(); ++n) {
    int64_t* part = h.data() + 2 + n * kPart;
    const torch::Tensor& t = tensors.items[n];
    if (!t.defined()) {  // a gradient's entry for a tensor that takes none
      part[0] = -1;
      continue;
    }
    torch::Tensor data = t.detach().to(torch::kCPU).contiguous();
    GPIPE_CHECK(data.dim() <= kMaxDims, "a boundary tensor has ", data.dim(),
                " dimensions; MPI messages carry at most ", kMaxDims);
    GPIPE_CHECK(data.nbytes() <= static_cast<size_t>(INT_MAX), "a boundary tensor of ", data.nbytes(),
                " bytes is larger than one MPI message (2 GiB); use more micro-batches");
    part[0] = static_cast<int64_t>(data.scalar_type());
    part[1] = data.dim();
    for (int64_t d = 0; d < data.dim(); ++d) part[2 + d] = data.size(d);
    pending.data.push_back(std::move(data));
  }
  pending.requests.assign(1 + pending.data.size(), MPI_REQUEST_NULL);
  // Kept before anything is posted: if a later post fails, what MPI already sends stays alive.
  sends_.push_back(std::move(pending));
  PendingSend& sent = sends_.back();
  const int to_rank = rank(to);
  detail::check_mpi(MPI_Isend(sent.header->data(), static_cast<int>(2 + tensors.size() * kPart), MPI_INT64_T,
                              to_rank, tag(key, false), comm_, &sent.requests[0]),
                    "sending a header");
  // One data message per tensor, in order, under one tag: MPI keeps their order between two ranks.
  for (size_t n = 0; n < sent.data.size(); ++n) {
    const torch::Tensor& data = sent.data[n];
    detail::check_mpi(MPI_Isend(data.data_ptr(), static_cast<int>(data.nbytes()), MPI_BYTE, to_rank, tag(key, true),
                                comm_, &sent.requests[1 + n]),
                      "sending a tensor");
    bytes_sent_ += static_cast<int64_t>(data.nbytes());
  }
  messages_sent_ += 1;
  reap_sends();
}

void MpiTransport::reap_sends() {
  size_t kept = 0;
  for (size_t n = 0; n < sends_.size(); ++n) {
    int done = 0;
    MPI_Testall(static_cast<int>(sends_[n].requests.size()), sends_[n].requests.data(), &done, MPI_STATUSES_IGNORE);
    if (done) continue;
    if (kept != n) sends_[kept] = std::move(sends_[n]);  // a vector moved onto itself would empty
    ++kept;
  }
  sends_.resize(kept);
}

void MpiTransport::finish() {
  for (PendingSend& pending : sends_)
    for (MPI_Request& request : pending.requests) errors_->wait(request);
  sends_.clear();
}

void MpiTransport::cancel(const std::string& why) {
  if (!cancelled_.empty()) return;
  cancelled_ = Cancelled(why).what();
  errors_->raise(cancelled_);
}

void MpiTransport::check_cancelled() const {
  if (!cancelled_.empty()) throw Cancelled(cancelled_);
}

Tensors MpiTransport::recv(int from, int to, Channel channel, int micro_batch) {
  check_cancelled();
  const Key key{from, to, static_cast<int>(channel), micro_batch};
  auto it = receives_.find(key);
  if (it == receives_.end()) it = receives_.emplace(key, post_header(key)).first;
  errors_->wait(it->second.request);
  const Header h = *it->second.header;
  receives_.erase(it);

  GPIPE_CHECK(h[0] >= 0 && h[0] <= kMaxTensors, "stage ", from, " sent a message of ", h[0], " tensors");
  Tensors out;
  out.tuple = h[1] != 0;
  for (int64_t n = 0; n < h[0]; ++n) {
    const int64_t* part = h.data() + 2 + n * kPart;
    GPIPE_CHECK(part[1] >= 0 && part[1] <= kMaxDims, "stage ", from, " sent a tensor of ", part[1], " dimensions");
    if (part[0] < 0) {
      out.items.emplace_back();
      continue;
    }
    std::vector<int64_t> sizes(part + 2, part + 2 + part[1]);
    auto tensor = std::make_shared<torch::Tensor>(
        torch::empty(sizes, torch::TensorOptions().dtype(static_cast<c10::ScalarType>(part[0]))));
    MPI_Request request = MPI_REQUEST_NULL;
    detail::check_mpi(MPI_Irecv(tensor->data_ptr(), static_cast<int>(tensor->nbytes()), MPI_BYTE, rank(from),
                                tag(key, true), comm_, &request),
                      "receiving a tensor");
    detail::wait_or_keep(*errors_, request, tensor);
    out.items.push_back(*tensor);
  }
  return out;
}

void MpiTransport::begin(const std::vector<const std::vector<Action>*>& programs) {
  if (!cancelled_.empty())  // the runtime's mistake, not the caller's
    throw std::logic_error("gpipe: the MPI transport was cancelled; a failed step is followed by a transport of "
                           "its own");
  if (!receives_.empty())
    throw std::logic_error("gpipe: the MPI transport still expects " + std::to_string(receives_.size()) +
                           " messages from a failed step; a failed step is followed by a transport of its own");
  reap_sends();
  const int self = detail::rank_of(comm_);
  for (const std::vector<Action>* program : programs)
    for (const Action& a : *program) {
      // A receive from a stage of this rank is the executor's own hand-over: no message to post.
      if (a.kind != ActionKind::kRecv || rank(a.peer) == self) continue;
      const Key key{a.peer, a.stage, static_cast<int>(a.channel), a.micro_batch};
      if (receives_.count(key) == 0) receives_.emplace(key, post_header(key));
    }
}

}  // namespace gpipe::mpi
