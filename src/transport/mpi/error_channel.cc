// error_channel.cc: the channel on which a failing rank tells every other, so that no rank waits
// forever for a message that will not come.
#include "transport/mpi/group.h"

#include <chrono>
#include <thread>

namespace gpipe::mpi {

namespace {
constexpr int kErrorTag = 1;
constexpr char kLeaving = '\x01';  // the first byte of a leaving rank's message (mpi::leave)
}  // namespace

RemoteError::RemoteError(int rank, const std::string& message)
    : Cancelled("gpipe: stopped because rank " + std::to_string(rank) + " failed: " + message), rank_(rank) {}

ErrorChannel::ErrorChannel(MPI_Comm world) : rank_(detail::rank_of(world)), size_(detail::size_of(world)) {
  detail::check_mpi(MPI_Comm_dup(world, &comm_), "MPI_Comm_dup");  // its own, so no tag can meet another's
  post();
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

void ErrorChannel::wait(MPI_Request& request) {
  while (request != MPI_REQUEST_NULL) {
    if (!left_.empty()) {
      // A rank left: what it sent before leaving still arrives; what it did not, never will.
      const auto give_up = std::chrono::steady_clock::now() + std::chrono::duration<double>(kLeaveGraceSeconds);
      for (;;) {
        int done = 0;
        detail::check_mpi(MPI_Test(&request, &done, MPI_STATUS_IGNORE), "waiting for a message");
        if (done) return;
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
    if (index == 1) {
      int length = 0;
      MPI_Get_count(&status, MPI_CHAR, &length);
      if (length > 0 && buffer_[0] == kLeaving) {
        left_.assign(buffer_.data() + 1, static_cast<size_t>(length - 1));
        left_rank_ = status.MPI_SOURCE;
        continue;
      }
      throw RemoteError(status.MPI_SOURCE, std::string(buffer_.data(), static_cast<size_t>(length)));
    }
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
