// group.cc: the ranks of an MPI job as one pipeline: the communicators of the steps, starting over
// after a failed step, and the collectives RankGroup asks for (sums, gathers, broadcasts).
#include "transport/mpi/group.h"

#include "gpipe/check.h"

#include <torch/torch.h>

#include <climits>

namespace gpipe::mpi {
namespace detail {

using Live = gpipe::detail::LiveGroups<MpiGroup>;  // the groups mpi::leave tells the other ranks about

MpiGroup::MpiGroup(MPI_Comm comm) : RankGroup("MPI"), control_(Communicator::duplicate(comm)) { Live::add(this); }

MpiGroup::MpiGroup(MPI_Comm comm, const PipelinePlan& plan) : RankGroup("MPI", plan), control_(Communicator::duplicate(comm)) {
  Live::add(this);
}

MpiGroup::~MpiGroup() {
  Live::remove(this);
  transport_.reset();
  if (failed_ || left_) {
    abandon();  // a failed step may have left messages and operations no rank will finish
    return;
  }
  // A rank still using the pipeline (its loop longer than this one's) stops rather than waiting.
  // The others' notices may still come: the channel's communicator goes once they all have (retire),
  // so that no later communicator, given its context, receives them.
  if (tell_leaving(/*program_ended=*/false))
    ErrorChannel::retire(std::move(errors_));
}

bool MpiGroup::tell_leaving(bool program_ended) {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized || !errors_) return false;
  errors_->leave(leaving_message(program_ended));
  return true;
}

void MpiGroup::leave() {
  if (left_) return;
  left_ = true;
  transport_.reset();
  tell_leaving(/*program_ended=*/true);
  abandon();  // its messages may still arrive: nothing here is freed
}

void allreduce_sum(ErrorChannel& errors, MPI_Comm comm, std::shared_ptr<torch::Tensor> buffer, const char* what) {
  GPIPE_CHECK(buffer->numel() <= INT_MAX, what, " has ", buffer->numel(),
              " elements, more than one MPI allreduce carries; use more devices");
  MPI_Request request = MPI_REQUEST_NULL;
  check_mpi(MPI_Iallreduce(MPI_IN_PLACE, buffer->data_ptr(), static_cast<int>(buffer->numel()),
                           buffer->scalar_type() == torch::kFloat ? MPI_FLOAT : MPI_DOUBLE, MPI_SUM, comm, &request),
            "MPI_Iallreduce");
  wait_or_keep(errors, request, std::move(buffer));
}

void MpiGroup::sum_replicas(const std::shared_ptr<torch::Tensor>& values, const char* what) {
  allreduce_sum(*errors_, replicas_.get(), values, what);
}

void MpiGroup::broadcast_tie(size_t tie, torch::Tensor& value) {
  GPIPE_CHECK(value.numel() * value.element_size() <= INT_MAX, "a tied parameter has ",
              value.numel() * value.element_size(), " bytes, more than one MPI broadcast carries");
  check_mpi(MPI_Bcast(value.data_ptr(), static_cast<int>(value.numel() * value.element_size()), MPI_BYTE, 0,
                      tie_comms_[tie].get()),
            "MPI_Bcast");
}

void MpiGroup::sum_tie(size_t tie, const std::shared_ptr<torch::Tensor>& values) {
  allreduce_sum(*errors_, tie_comms_[tie].get(), values, "a tied parameter");
}

std::vector<std::string> MpiGroup::all_gather_setup(const std::string& mine) {
  return all_gather(control_.get(), mine);
}

// Fresh communicators for everything a step does (control_ is used for nothing else).
void MpiGroup::open() {
  world_ = Communicator::duplicate(control_.get());
  pipeline_ = Communicator::split(world_.get(), placement_.replica, placement_.device);
  replicas_ = Communicator::split(world_.get(), placement_.device, placement_.replica);
  tie_comms_.clear();
  for (const Tie& tie : ties_)
    tie_comms_.push_back(
        Communicator::split(pipeline_.get(), tie.copies.empty() ? MPI_UNDEFINED : 0, placement_.device));
  errors_ = std::make_unique<ErrorChannel>(world_.get());
  // In the replica's communicator, rank d is device d.
  transport_ = std::make_unique<MpiTransport>(pipeline_.get(), errors_.get(), plan_.placement, plan_.micro_batches,
                                              static_cast<int>(plan_.skip_routes.size()));
}

void MpiGroup::abandon() {
  transport_.reset();
  if (errors_) errors_->abandon();
  errors_.reset();
  world_.abandon();
  pipeline_.abandon();
  replicas_.abandon();
  for (Communicator& comm : tie_comms_) comm.abandon();
}

void MpiGroup::tell_failure(const std::string& message) {
  if (errors_ && transport_ && !transport_->cancelled()) errors_->raise(message);
}

std::pair<int, std::string> MpiGroup::heard_leaving() const {
  if (!errors_) return {-1, ""};
  return {errors_->left_rank(), errors_->left()};
}

void MpiGroup::reduce(double* values, int count, bool largest) {
  auto buffer = std::make_shared<std::vector<double>>(values, values + count);
  MPI_Request request = MPI_REQUEST_NULL;
  check_mpi(MPI_Iallreduce(MPI_IN_PLACE, buffer->data(), count, MPI_DOUBLE, largest ? MPI_MAX : MPI_SUM, world_.get(),
                           &request),
            "MPI_Iallreduce");
  wait_or_keep(*errors_, request, buffer);
  std::copy(buffer->begin(), buffer->end(), values);
}

std::vector<std::string> MpiGroup::gather(const std::string& bytes) {
  const int size = size_of(world_.get()), rank = rank_of(world_.get());
  struct Buffers {  // kept alive by wait_or_keep if the gather is abandoned
    std::string mine;
    int64_t length = 0;
    std::vector<int64_t> sizes;
    Layout layout;
    std::string all;
  };
  auto b = std::make_shared<Buffers>();
  b->mine = bytes;
  b->length = static_cast<int64_t>(bytes.size());
  b->sizes.assign(static_cast<size_t>(size), 0);
  MPI_Request request = MPI_REQUEST_NULL;
  check_mpi(MPI_Iallgather(&b->length, 1, MPI_INT64_T, b->sizes.data(), 1, MPI_INT64_T, world_.get(), &request),
            "MPI_Iallgather");
  wait_or_keep(*errors_, request, b);
  b->layout = layout_of(b->sizes);  // every rank refuses a gather too large, or none
  b->all.assign(rank == 0 ? static_cast<size_t>(b->layout.total) : 0, '\0');
  check_mpi(MPI_Igatherv(b->mine.data(), static_cast<int>(b->length), MPI_CHAR, b->all.data(),
                         b->layout.lengths.data(), b->layout.offsets.data(), MPI_CHAR, 0, world_.get(), &request),
            "MPI_Igatherv");
  wait_or_keep(*errors_, request, b);
  std::vector<std::string> out;
  if (rank == 0)
    for (int r = 0; r < size; ++r)
      out.push_back(b->all.substr(static_cast<size_t>(b->layout.offsets[static_cast<size_t>(r)]),
                                  static_cast<size_t>(b->layout.lengths[static_cast<size_t>(r)])));
  return out;
}

}  // namespace detail

void leave() {
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (!initialized || finalized) return;
  // Then the deleted pipelines' channels whose notices have all come: freed.
  detail::Live::leave_all([] { ErrorChannel::retire(nullptr); });
}

}  // namespace gpipe::mpi
