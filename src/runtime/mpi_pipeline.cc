// mpi_pipeline.cc: the runtime over the ranks of an MPI job: a Pipeline whose group is the MPI
// backend's (src/transport/mpi/).
#include "gpipe/mpi.h"

#include "transport/mpi/group.h"

namespace gpipe::mpi {

MpiPipeline::MpiPipeline(torch::nn::Sequential layers, PipelineOptions options, MPI_Comm comm)
    : Pipeline(std::make_unique<detail::MpiGroup>(comm), std::move(layers), std::move(options)) {}

MpiPipeline::MpiPipeline(torch::nn::Sequential layers, const PipelinePlan& plan, PipelineOptions options,
                         MPI_Comm comm)
    : Pipeline(std::make_unique<detail::MpiGroup>(comm, plan), std::move(layers), std::move(options)) {}

const Placement& MpiPipeline::placement() const {
  return static_cast<const detail::MpiGroup&>(group()).placement();
}

}  // namespace gpipe::mpi
