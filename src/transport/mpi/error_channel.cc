// error_channel.cc: the channel on which a failing rank tells every other, so that no rank waits
// forever for a message that will not come.
#include "transport/mpi/group.h"

#include <chrono>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace gpipe::mpi {

namespace {
constexpr int kErrorTag = 1;
constexpr char kLeaving = '\x01';  // the first byte of a leaving rank's message (mpi::leave)
}  // namespace

namespace {

// The channels retired and not yet drained (ErrorChannel::retire); never destroyed, as they may be
// left to MPI_Finalize.
std::mutex retired_mutex;
std::vector<std::unique_ptr<ErrorChannel>>& retired() {
  static auto* channels = new std::vector<std::unique_ptr<ErrorChannel>>;
  return *channels;
}

}  // namespace

ErrorChannel::ErrorChannel(MPI_Comm world) : rank_(detail::rank_of(world)), size_(detail::size_of(world)) {
  detail::check_mpi(MPI_Comm_dup(world, &comm_), "MPI_Comm_dup");  // its own, so no tag can meet another's
  post();
  retire(nullptr);  // the channels of pipelines deleted before: their notices have had time to come
}

ErrorChannel::~ErrorChannel() {
  if (pending_ != MPI_REQUEST_NULL) {  // before buffer_ goes: a short message, done or cancelled at once
    MPI_Cancel(&pending_);
    MPI_Wait(&pending_, MPI_STATUS_IGNORE);
  }
  if (!abandoned_) MPI_Comm_free(&comm_);  // see abandon()
}

void ErrorChannel::post() {
  detail::check_mpi(MPI_Irecv(buffer_.data(), static_cast<int>(buffer_.size()), MPI_CHAR, MPI_ANY_SOURCE, kErrorTag,
                              comm_, &pending_),
                    "posting the error receive");
}

void ErrorChannel::received(const MPI_Status& status) {
  int length = 0;
  MPI_Get_count(&status, MPI_CHAR, &length);
  if (length > 0 && buffer_[0] == kLeaving) {
    if (left_.empty()) {  // the first to leave is the one named
      left_.assign(buffer_.data() + 1, static_cast<size_t>(length - 1));
      left_rank_ = status.MPI_SOURCE;
    }
    leavers_.insert(status.MPI_SOURCE);
    post();
    return;
  }
  throw RemoteError(status.MPI_SOURCE, std::string(buffer_.data(), static_cast<size_t>(length)));
}

void ErrorChannel::wait(MPI_Request& request) {
  while (request != MPI_REQUEST_NULL) {
    if (!left_.empty()) {
      // A rank left: what it sent before leaving still arrives; what it did not, never will. Another
      // rank's failure still comes on the channel, and is that rank's.
      const auto give_up = std::chrono::steady_clock::now() + std::chrono::duration<double>(kLeaveGraceSeconds);
      for (;;) {
        int done = 0;
        detail::check_mpi(MPI_Test(&request, &done, MPI_STATUS_IGNORE), "waiting for a message");
        if (done) return;
        if (pending_ != MPI_REQUEST_NULL) {  // null once a failure was received: nothing more to watch
          MPI_Status status;
          detail::check_mpi(MPI_Test(&pending_, &done, &status), "waiting for a message");
          if (done) received(status);
        }
        if (std::chrono::steady_clock::now() > give_up) throw RemoteError(left_rank_, left_);
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
    }
    std::array<MPI_Request, 2> requests{request, pending_};
    int index = MPI_UNDEFINED;
    MPI_Status status;
    detail::check_mpi(MPI_Waitany(2, requests.data(), &index, &status), "waiting for a message");
    request = requests[0];
    pending_ = requests[1];
    if (index == 1) received(status);
  }
}

bool ErrorChannel::drained() {
  for (;;) {
    int done = 0;
    MPI_Status status;
    if (pending_ == MPI_REQUEST_NULL || MPI_Test(&pending_, &done, &status) != MPI_SUCCESS) return false;
    if (!done) return static_cast<int>(leavers_.size()) == size_ - 1;
    received(status);
  }
}

void ErrorChannel::retire(std::unique_ptr<ErrorChannel> channel) {
  int finalized = 0;
  MPI_Finalized(&finalized);
  const std::lock_guard<std::mutex> lock(retired_mutex);
  if (finalized) {
    if (channel) channel.release()->abandon();  // too late to free; MPI_Finalize has taken it
    return;
  }
  auto& channels = retired();
  if (channel) channels.push_back(std::move(channel));
  for (auto it = channels.begin(); it != channels.end();) {
    ErrorChannel& c = **it;
    bool done = c.pending_ == MPI_REQUEST_NULL;  // a failure came before it was retired
    try {
      done = done || c.drained();
    } catch (const RemoteError&) {  // a failure came after: more may follow it
      done = true;
    }
    if (done && static_cast<int>(c.leavers_.size()) != c.size_ - 1) c.abandon();
    it = done ? channels.erase(it) : it + 1;  // freed (MPI_Comm_free), or left to MPI as abandoned
  }
}

void ErrorChannel::raise(const std::string& message) {
  const std::string text = message.substr(0, buffer_.size());
  std::vector<MPI_Request> sends;
  for (int r = 0; r < size_; ++r) {
    if (r == rank_) continue;
    sends.emplace_back();
    MPI_Isend(text.data(), static_cast<int>(text.size()), MPI_CHAR, r, kErrorTag, comm_, &sends.back());
  }
  // Short messages leave eagerly; a rank that died is the launcher's to clean up.
  MPI_Waitall(static_cast<int>(sends.size()), sends.data(), MPI_STATUSES_IGNORE);
}

void ErrorChannel::leave(const std::string& message) { raise(std::string(1, kLeaving) + message); }

}  // namespace gpipe::mpi
