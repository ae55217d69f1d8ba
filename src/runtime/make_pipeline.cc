// make_pipeline.cc: the one-process/MPI choice: a Pipeline of the whole model here, or of this rank's
// device's layers under mpirun.
#include "gpipe/pipeline.h"

#include "gpipe/check.h"
#if defined(GPIPE_HAS_MPI) && GPIPE_HAS_MPI
#include "gpipe/mpi.h"
#endif

#include <torch/torch.h>

namespace gpipe {

bool mpi_runtime() {
#if defined(GPIPE_HAS_MPI) && GPIPE_HAS_MPI
  int initialized = 0, finalized = 0, size = 1;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (initialized && !finalized) MPI_Comm_size(MPI_COMM_WORLD, &size);
  return initialized && !finalized && size > 1;
#else
  return false;
#endif
}

std::unique_ptr<Pipeline> make_pipeline(const LayerBuilder& build, int layers, const PipelineOptions& options,
                                        Runtime runtime) {
  GPIPE_CHECK(static_cast<bool>(build), "make_pipeline needs a layer builder");
  return make_pipeline(build, make_plan(layers, options), options, runtime);
}

std::unique_ptr<Pipeline> make_pipeline(const LayerBuilder& build, const PipelinePlan& plan,
                                        const PipelineOptions& options, Runtime runtime) {
  GPIPE_CHECK(static_cast<bool>(build), "make_pipeline needs a layer builder");
  if (runtime == Runtime::kAuto) runtime = mpi_runtime() ? Runtime::kMpi : Runtime::kThreads;
  if (runtime == Runtime::kThreads) {
    torch::nn::Sequential model = build(LayerRange{});
    GPIPE_CHECK(static_cast<int>(model->size()) == plan.layers, "the layer builder made ", model->size(),
                " layers, but the model was said to have ", plan.layers);
    return std::make_unique<Pipeline>(model, plan, options);
  }
#if defined(GPIPE_HAS_MPI) && GPIPE_HAS_MPI
  int initialized = 0;
  MPI_Initialized(&initialized);
  GPIPE_CHECK(initialized, "the MPI runtime needs MPI initialised first: create a gpipe::mpi::Environment");
  // The cut is the plan's, made before the layers: this rank builds only its device's, each stage's on
  // its own, so every layer starts as in one process.
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  const mpi::Placement place = mpi::place(rank, size, plan.devices);
  PipelineOptions resolved = options;
  resolved.balance(plan.balance).devices(0);
  return std::make_unique<mpi::MpiPipeline>(mpi::device_layers(build, plan, place.device), plan, resolved);
#else
  GPIPE_CHECK(false, "this gpipe was built without MPI (GPIPE_MPI=OFF, or no MPI found); install libopenmpi-dev and "
                     "rebuild with -DGPIPE_MPI=ON, or use Runtime::kThreads");
  return nullptr;
#endif
}

}  // namespace gpipe
