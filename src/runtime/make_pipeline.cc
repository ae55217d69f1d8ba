// make_pipeline.cc: the choice of a backend (backend.h): a Pipeline of the whole model here, a
// thread per device, or of this process's device's layers over a backend of several processes
// (MPI under mpirun). No backend is named here: each is an entry of backends().
#include "gpipe/pipeline.h"

#include "gpipe/backend.h"
#include "gpipe/check.h"

#include <torch/torch.h>

namespace gpipe {

bool mpi_runtime() { return running_backend() == Runtime::kMpi; }

std::unique_ptr<Pipeline> make_pipeline(const LayerBuilder& build, int layers, const PipelineOptions& options,
                                        Runtime runtime) {
  GPIPE_CHECK(static_cast<bool>(build), "make_pipeline needs a layer builder");
  return make_pipeline(build, make_plan(layers, options), options, runtime);
}

std::unique_ptr<Pipeline> make_pipeline(const LayerBuilder& build, const PipelinePlan& plan,
                                        const PipelineOptions& options, Runtime runtime) {
  GPIPE_CHECK(static_cast<bool>(build), "make_pipeline needs a layer builder");
  if (runtime == Runtime::kAuto) runtime = running_backend();
  if (runtime == Runtime::kThreads) {
    torch::nn::Sequential model = build(LayerRange{});
    GPIPE_CHECK(static_cast<int>(model->size()) == plan.layers, "the layer builder made ", model->size(),
                " layers, but the model was said to have ", plan.layers);
    return std::make_unique<Pipeline>(model, plan, options);
  }
  const BackendEntry& entry = backend(runtime, ", or use Runtime::kThreads");
  // The cut is the plan's, made before the layers: this process builds only its device's, each stage's
  // on its own, so every layer starts as in one process.
  const auto [rank, size] = entry.process();
  const Placement place = gpipe::place(rank, size, plan.devices);
  PipelineOptions resolved = options;
  resolved.balance(plan.balance).devices(0);
  torch::nn::Sequential mine = device_layers(build, plan, place.device);
  return std::make_unique<Pipeline>(entry.make(plan), std::move(mine), resolved);
}

}  // namespace gpipe
