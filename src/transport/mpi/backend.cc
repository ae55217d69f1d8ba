// backend.cc (MPI): the backend of one pipeline over MPI (make_backend, MpiPipeline's) and MPI's
// entry in backends(): whether this process is a rank of a running MPI job, starting MPI, who this
// rank is, the pipeline's backend over MPI_COMM_WORLD, gathering, ending the job, leaving.
#include "transport/mpi/backend.h"

#include "gpipe/check.h"
#include "gpipe/mpi_backend.h"
#include "transport/mpi/group.h"

#include <mpi.h>

#include <utility>

namespace gpipe::mpi {

std::unique_ptr<Backend> make_backend(MPI_Comm comm, const PipelinePlan* plan) {
  if (plan == nullptr) return std::make_unique<detail::MpiGroup>(comm);
  return std::make_unique<detail::MpiGroup>(comm, *plan);
}

const Placement& placement_of(const Backend& backend) {
  return static_cast<const detail::MpiGroup&>(backend).placement();
}

BackendEntry backend_entry() {
  BackendEntry entry;
  entry.runtime = Runtime::kMpi;
  entry.name = "mpi";
  entry.built = true;
  entry.running = [] {
    int initialized = 0, finalized = 0, size = 1;
    MPI_Initialized(&initialized);
    MPI_Finalized(&finalized);
    if (initialized && !finalized) MPI_Comm_size(MPI_COMM_WORLD, &size);
    return initialized && !finalized && size > 1;
  };
  entry.start = [](bool required) {
    if (required || launched()) process_environment();
    return required || launched();
  };
  entry.process = [] {
    int initialized = 0;
    MPI_Initialized(&initialized);
    GPIPE_CHECK(initialized, "the MPI runtime needs MPI initialised first: create a gpipe::mpi::Environment");
    int rank = 0, size = 1;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    return std::make_pair(rank, size);
  };
  entry.make = [](const PipelinePlan& plan) { return make_backend(MPI_COMM_WORLD, &plan); };
  entry.all_gather = [](const std::string& mine) { return mpi::all_gather(MPI_COMM_WORLD, mine); };
  entry.abort = [](int status) { mpi::abort(status); };
  entry.leave = [] { mpi::leave(); };
  return entry;
}

}  // namespace gpipe::mpi
