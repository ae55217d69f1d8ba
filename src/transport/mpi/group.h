// group.h (internal): the ranks of an MPI job as one pipeline's backend (gpipe/backend.h), and the MPI
// helpers its files share. The group's parts live in files of their own:
//   environment.cc    MPI's set-up and the collectives over the job (all_gather, gathers)
//   error_channel.cc  the channel on which a failing rank stops every other
//   transport.cc      MpiTransport: boundary tensors between the ranks of a replica
//   group.cc          the group: communicators, starting over, the collectives RankGroup asks for
//   backend.cc        make_backend (MpiPipeline's, in mpi.h) and MPI's entry in backends()
// What every backend of several processes shares (agreement, tied weights, replicas, the trace) is
// RankGroup's (transport/rank_group.h).
#pragma once

#include "gpipe/mpi_backend.h"
#include "transport/rank_group.h"

#include <mpi.h>

#include <cstdint>
#include <memory>
#include <set>
#include <string>
#include <vector>

namespace gpipe::mpi::detail {

/// Throws std::runtime_error naming `what` and MPI's message unless `code` is MPI_SUCCESS.
void check_mpi(int code, const char* what);
int rank_of(MPI_Comm comm);
int size_of(MPI_Comm comm);

/// Where each rank's part of a gather lies in the whole; throws std::length_error if the parts add
/// up to more than one MPI gather carries (every rank knows every size, so all of them refuse together).
struct Layout {
  std::vector<int> lengths, offsets;
  int64_t total = 0;
};
Layout layout_of(const std::vector<int64_t>& sizes);

/// Waits for `request` through `errors`. If another rank fails first, the
/// operation may still write into its buffers later (a collective cannot be
/// cancelled; a matched receive completes), so `buffers` are kept for good:
/// deliberately leaked, as a failed step's pending sends are.
template <typename Buffers>
void wait_or_keep(ErrorChannel& errors, MPI_Request& request, std::shared_ptr<Buffers> buffers) {
  try {
    errors.wait(request);
  } catch (...) {
    new std::shared_ptr<Buffers>(std::move(buffers));
    throw;
  }
}

class MpiGroup : public gpipe::detail::RankGroup {
 public:
  explicit MpiGroup(MPI_Comm comm);
  /// With a plan make_plan made for the pipeline's options on every rank alike: used as it is.
  MpiGroup(MPI_Comm comm, const PipelinePlan& plan);
  ~MpiGroup() override;

  Transport& transport() override { return *transport_; }
  void reduce(double* values, int count, bool largest) override;
  std::vector<std::string> gather(const std::string& bytes) override;
  int rank() const override { return rank_of(control_.get()); }

  /// Tells the other ranks that this one makes no more calls (mpi::leave); takes none after.
  void leave();

 protected:
  std::vector<std::string> all_gather_setup(const std::string& mine) override;
  void sum_replicas(const std::shared_ptr<torch::Tensor>& values, const char* what) override;
  void broadcast_tie(size_t tie, torch::Tensor& value) override;
  void sum_tie(size_t tie, const std::shared_ptr<torch::Tensor>& values) override;
  // Fresh communicators, error channel and transport for the steps; abandoned, they are kept, not
  // freed: MPI would give a freed communicator's context to a new one, where the failed step's stray
  // messages would then arrive.
  void open() override;
  void abandon() override;
  void tell_failure(const std::string& message) override;
  std::pair<int, std::string> heard_leaving() const override;

 private:
  // Tells the other ranks that this one makes no more calls (leaving_message; mpi::leave); false
  // if there is no channel to tell them on (or MPI has ended).
  bool tell_leaving(bool program_ended);

  Communicator control_;   // a duplicate of the caller's: setting up, and starting over after a failed step
  Communicator world_;     // every rank, for the steps' sums and gathers
  Communicator pipeline_;  // this replica's K ranks
  Communicator replicas_;  // the D ranks that run this device, one per replica
  std::vector<Communicator> tie_comms_;  // per tied group, the replica's ranks that hold a copy (null elsewhere)
  std::unique_ptr<ErrorChannel> errors_;
  std::unique_ptr<MpiTransport> transport_;
};

}  // namespace gpipe::mpi::detail
