// backend.cc: the backends of several processes gpipe knows (backend.h), the placement rule they
// share, and the front ends' backend-neutral calls. A new backend is one entry here.
#include "gpipe/backend.h"

#include "gpipe/check.h"

#if defined(GPIPE_HAS_MPI) && GPIPE_HAS_MPI
#include "transport/mpi/backend.h"
#endif
#if defined(GPIPE_HAS_C10D) && GPIPE_HAS_C10D
#include "transport/c10d/c10d.h"
#endif

#include <torch/torch.h>

namespace gpipe {

Placement place(int world_rank, int world_size, int devices) {
  GPIPE_CHECK(devices >= 1, "the number of devices must be at least 1 (got ", devices, ")");
  GPIPE_CHECK(world_size % devices == 0, "the job has ", world_size, " ranks, not a multiple of the ", devices,
              " devices; start K·D processes for K devices and D replicas (", devices, ", ", 2 * devices,
              ", ... under mpirun or torchrun)");
  Placement p;
  p.devices = devices;
  p.replicas = world_size / devices;
  p.device = world_rank % devices;
  p.replica = world_rank / devices;
  return p;
}

torch::nn::Sequential device_layers(const LayerBuilder& build, const PipelinePlan& plan, int device) {
  torch::nn::Sequential mine;
  for (const LayerRange range : plan.device_layers(device)) {
    const torch::nn::Sequential part = build(range);
    GPIPE_CHECK(static_cast<int>(part->size()) == range.last - range.first, "the layer builder made ", part->size(),
                " layers for layers ", range.first, "..", range.last - 1,
                "; build the whole model and keep the range (add_layer)");
    const auto names = part->named_children().keys();
    size_t n = 0;
    for (auto it = part->begin(); it != part->end(); ++it, ++n) mine->push_back(names[n], *it);
  }
  return mine;
}

namespace {

// The entry of a backend this gpipe was built without: `fix` says how to build it in.
[[maybe_unused]] BackendEntry not_built(Runtime runtime, const std::string& name, const std::string& fix) {
  BackendEntry entry;
  entry.runtime = runtime;
  entry.name = name;
  entry.not_built = fix;
  return entry;
}

}  // namespace

const std::vector<BackendEntry>& backends() {
  static const std::vector<BackendEntry> all = [] {
    std::vector<BackendEntry> list;
#if defined(GPIPE_HAS_MPI) && GPIPE_HAS_MPI
    list.push_back(mpi::backend_entry());
#else
    list.push_back(not_built(Runtime::kMpi, "mpi",
                             "this gpipe was built without MPI (GPIPE_MPI=OFF, or no MPI found); install "
                             "libopenmpi-dev and rebuild with -DGPIPE_MPI=ON"));
#endif
#if defined(GPIPE_HAS_C10D) && GPIPE_HAS_C10D
    list.push_back(c10d::backend_entry());
#else
    list.push_back(not_built(Runtime::kC10d, "c10d",
                             "this gpipe was built without the c10d backend (GPIPE_C10D=OFF, or Gloo's headers not "
                             "found); install libgloo-dev and rebuild with -DGPIPE_C10D=ON"));
#endif
    return list;
  }();
  return all;
}

const BackendEntry& backend(Runtime runtime, const std::string& otherwise) {
  for (const BackendEntry& entry : backends()) {
    if (entry.runtime != runtime) continue;
    GPIPE_CHECK(entry.built, entry.not_built, otherwise);
    return entry;
  }
  GPIPE_CHECK(false, "no backend of several processes is Runtime value ", static_cast<int>(runtime),
              "; name one of backends() (Runtime::kAuto and kThreads are the runtime's own)");
  return backends().front();
}

Runtime parse_runtime(const std::string& name) {
  std::vector<std::string> names = {"auto", "threads"};
  for (const BackendEntry& entry : backends()) {
    if (entry.name == name) return entry.runtime;
    names.push_back(entry.name);
  }
  if (name == "auto") return Runtime::kAuto;
  if (name == "threads") return Runtime::kThreads;
  std::string choices;
  for (size_t n = 0; n < names.size(); ++n)
    choices += (n == 0 ? "" : n + 1 == names.size() ? " or " : ", ") + ("\"" + names[n] + "\"");
  GPIPE_CHECK(false, "runtime must be ", choices, " (got \"", name, "\")");
  return Runtime::kAuto;
}

Runtime running_backend() {
  for (const BackendEntry& entry : backends())
    if (entry.built && entry.running()) return entry.runtime;
  return Runtime::kThreads;
}

void start_backends(Runtime required) {
  if (required != Runtime::kAuto && required != Runtime::kThreads) backend(required);
  for (const BackendEntry& entry : backends())
    if (entry.built) entry.start(entry.runtime == required);
}

std::vector<std::string> all_gather_processes(const std::string& mine) {
  const Runtime running = running_backend();
  if (running == Runtime::kThreads) return {mine};
  return backend(running).all_gather(mine);
}

void abort_processes(int status) {
  const Runtime running = running_backend();
  if (running != Runtime::kThreads) backend(running).abort(status);
}

void leave_processes() {
  const Runtime running = running_backend();
  if (running != Runtime::kThreads) backend(running).leave();
}

}  // namespace gpipe
