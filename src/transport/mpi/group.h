// group.h (internal): the ranks of an MPI job as one pipeline's backend (gpipe/backend.h), and the MPI
// helpers its files share. The group's parts live in files of their own:
//   environment.cc    MPI's set-up and the collectives over the job (all_gather, gathers), placement
//   error_channel.cc  the channel on which a failing rank stops every other
//   transport.cc      MpiTransport: boundary tensors between the ranks of a replica
//   group.cc          the group: agreement on the configuration, communicators, starting over
//   backend.cc        make_backend (MpiPipeline's, in mpi.h) and MPI's entry in backends()
//   replicas.cc       gradients and BatchNorm statistics summed over the pipeline replicas
//   tied.cc           a weight tied across ranks: its copies, their gradients summed
//   trace.cc          every rank's row of a step's timeline, gathered on rank 0
#pragma once

#include "gpipe/mpi_backend.h"

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

/// Sums `buffer` (float32 or float64, on the CPU) over the ranks of `comm`, in place, through `errors`.
void allreduce_sum(ErrorChannel& errors, MPI_Comm comm, std::shared_ptr<torch::Tensor> buffer, const char* what);

/// Every rank's `mine`, a line per entry, as the lines of each of the first `ranks` ranks of `comm`
/// (replica 0's, which hold the whole model between them). Collective.
std::vector<std::vector<std::string>> first_ranks_lines(MPI_Comm comm, const std::string& mine, int ranks);

/// The ranks of an MPI job running one pipeline and its replicas.
class MpiGroup : public gpipe::Backend {
 public:
  explicit MpiGroup(MPI_Comm comm);
  /// With a plan make_plan made for the pipeline's options on every rank alike: used as it is.
  MpiGroup(MPI_Comm comm, const PipelinePlan& plan);
  ~MpiGroup() override;

  PipelinePlan plan(const torch::nn::Sequential& layers, const PipelineOptions& options,
                    const SkipUseFinder& skip_uses) override;
  std::vector<int> local_devices() const override { return {placement_.device}; }
  bool on_caller_thread() const override { return true; }
  void agree(std::exception_ptr failure) override;
  void connect(const PipelinePlan& plan, const torch::nn::Sequential& layers, const PipelineOptions& options) override;

  void begin_call() override;
  void fail(const std::string& why) override;
  Transport& transport() override { return *transport_; }
  std::string who() const override;
  std::pair<int64_t, int64_t> share(int64_t rows) const override;
  void check_same_batch(const Tensors& input, const torch::Tensor& target) override;
  void reduce_gradients(const std::vector<torch::Tensor>& params) override;    // replicas.cc, tied.cc
  void sum_over_replicas(const std::shared_ptr<torch::Tensor>& values) override;  // replicas.cc
  void reduce(double* values, int count, bool largest) override;
  std::vector<std::string> gather(const std::string& bytes) override;
  StepTrace gather_trace(const StepTrace& trace, const PipelinePlan& plan) override;  // trace.cc
  bool counts(const torch::Tensor& parameter) const override;                         // tied.cc

  int rank() const override { return rank_of(control_.get()); }
  int replica() const override { return placement_.replica; }
  int device() const override { return placement_.device; }
  std::string describe() const override;

  const Placement& placement() const { return placement_; }
  /// Tells the other ranks that this one makes no more calls (mpi::leave); takes none after.
  void leave();

 private:
  // Throws on every rank if any rank's `local_error` is not empty.
  void agree_on(const std::string& local_error);
  // Every rank's settings, checked alike on every rank; sets placement_.
  void check_agreement(const torch::nn::Sequential& layers, const PipelineOptions& options, const PipelinePlan& plan);
  // Every Stash and Pop of the whole model, from replica 0's ranks.
  std::vector<SkipUse> all_skip_uses(const torch::nn::Sequential& layers, const SkipUseFinder& skip_uses);
  // Fresh communicators, error channel and transport for the steps.
  void open();
  // The step's communicators, left as they are after a failure (see begin_call).
  void abandon();
  // Tells the other ranks that this one makes no more calls, having done `what` (mpi::leave); false
  // if there is no channel to tell them on (or MPI has ended).
  bool tell_leaving(const std::string& what);

  // tied.cc: this rank's copies of each tied group, checked against every rank's; their first values
  // made the lowest device's; their gradients summed.
  void find_tied_copies(const torch::nn::Sequential& layers, const PipelineOptions& options);
  void share_tied_values();
  void sum_tied_gradients();

  Communicator control_;   // a duplicate of the caller's: setting up, and starting over after a failed step
  Communicator world_;     // every rank, for the steps' sums and gathers
  Communicator pipeline_;  // this replica's K ranks
  Communicator replicas_;  // the D ranks that run this device, one per replica
  Placement placement_;
  bool made_ = false;  // plan_ was made by make_plan before the pipeline (make_pipeline's)
  PipelinePlan plan_;
  struct Tie {
    std::vector<torch::Tensor> copies;  // this rank's, one per distinct tensor; maybe none
    Communicator comm;                  // the replica's ranks that hold a copy (null if this rank holds none)
  };
  std::vector<Tie> ties_;            // one per group of tied_parameters
  std::set<const void*> uncounted_;  // tied copies another rank counts
  std::unique_ptr<ErrorChannel> errors_;
  std::unique_ptr<MpiTransport> transport_;
  bool failed_ = false;
  bool left_ = false;  // this rank left (leave)
};

}  // namespace gpipe::mpi::detail
