// engine.cc: the two engines behind gpipe::Engine: every stage a thread of this process, or a rank per device.
#include "gpipe/engine.h"

#include "gpipe/check.h"
#include "gpipe/partition.h"
#if defined(GPIPE_HAS_MPI) && GPIPE_HAS_MPI
#include "gpipe/mpi.h"
#endif

#include <torch/torch.h>

#include <algorithm>
#include <cmath>

namespace gpipe {
namespace {

// Σ x_k·(k mod 7 + 1) over the parameters, restarting k at each parameter's first element.
double local_checksum(const std::vector<torch::Tensor>& params) {
  double sum = 0;
  for (const auto& p : params) {
    const torch::Tensor flat = p.detach().to(torch::kDouble).flatten();
    sum += (flat * (torch::arange(flat.numel(), torch::kDouble).remainder(7) + 1)).sum().item<double>();
  }
  return sum;
}

class ThreadEngine : public Engine {
 public:
  ThreadEngine(torch::nn::Sequential model, const PipelineOptions& options) : pipe_(std::move(model), options) {}

  torch::Tensor train_step(const torch::Tensor& input, const torch::Tensor& target, const LossFn& loss) override {
    return pipe_.train_step(input, target, loss);
  }
  std::vector<torch::Tensor> parameters() const override { return pipe_.parameters(); }
  torch::nn::Sequential layers() const override { return pipe_.model(); }
  const std::vector<int>& balance() const override { return pipe_.balance(); }
  const Schedule& schedule() const override { return pipe_.schedule(); }
  double bubble() override { return pipe_.last_trace().bubble(); }
  StepTrace trace() override { return pipe_.last_trace(); }
  double sum(double value) override { return value; }
  double max(double value) override { return value; }
  std::vector<std::string> gather(const std::string& bytes) override { return {bytes}; }
  bool root() const override { return true; }
  int replica() const override { return 0; }
  int device() const override { return -1; }
  int rank() const override { return 0; }
  std::string describe() const override {
    const size_t K = pipe_.devices().size();
    return "one process, " + std::to_string(K) + (K == 1 ? " device thread" : " device threads");
  }

  OutputRows forward(const torch::Tensor& input) override { return {pipe_.forward(input), 0}; }

 private:
  Pipeline pipe_;
};

#if defined(GPIPE_HAS_MPI) && GPIPE_HAS_MPI
int world_size() {
  int size = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  return size;
}

int world_rank() {
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  return rank;
}

class MpiEngine : public Engine {
 public:
  MpiEngine(torch::nn::Sequential layers, const mpi::MpiPipelineOptions& options) : pipe_(std::move(layers), options) {}

  torch::Tensor train_step(const torch::Tensor& input, const torch::Tensor& target, const LossFn& loss) override {
    return pipe_.train_step(input, target, loss);
  }
  std::vector<torch::Tensor> parameters() const override { return pipe_.parameters(); }
  std::vector<torch::Tensor> counted_parameters() const override { return pipe_.counted_parameters(); }
  torch::nn::Sequential layers() const override { return pipe_.layers(); }
  const std::vector<int>& balance() const override { return pipe_.balance(); }
  const Schedule& schedule() const override { return pipe_.schedule(); }
  double bubble() override { return pipe_.bubble(); }
  StepTrace trace() override { return pipe_.gather_trace(); }
  double sum(double value) override { return pipe_.sum(value); }
  double max(double value) override { return pipe_.max(value); }
  std::vector<std::string> gather(const std::string& bytes) override { return pipe_.gather(bytes); }
  bool root() const override { return world_rank() == 0; }
  int replica() const override { return pipe_.placement().replica; }
  int device() const override { return pipe_.placement().stage; }
  int rank() const override { return world_rank(); }
  std::string describe() const override {
    const mpi::Placement& p = pipe_.placement();
    return "MPI: " + std::to_string(p.stages * p.replicas) + " ranks = " + std::to_string(p.stages) +
           " stages x " + std::to_string(p.replicas) + " replicas";
  }

  OutputRows forward(const torch::Tensor& input) override {
    return {pipe_.forward(input), pipe_.share(input.size(0)).first};
  }

 private:
  mpi::MpiPipeline pipe_;
};
#endif

}  // namespace

Evaluation Engine::evaluate(const torch::Tensor& input, const torch::Tensor& target, const LossFn& loss,
                            bool classification, int64_t batch) {
  GPIPE_CHECK(batch >= 1, "evaluate needs a batch of at least 1 row (got ", batch, ")");
  GPIPE_CHECK(input.defined() && target.defined() && input.dim() >= 1 && target.dim() >= 1 &&
                  input.size(0) == target.size(0) && input.size(0) >= 1,
              "evaluate needs input and target with the same number of rows, at least one");
  torch::nn::Sequential model = layers();
  model->eval();
  double loss_sum = 0, correct = 0;
  const int64_t N = input.size(0);
  try {
    for (int64_t at = 0; at < N; at += batch) {
      const int64_t n = std::min(batch, N - at);
      // Each process scores the rows whose output it holds (under MPI: the last stage of each replica).
      const auto [out, first] = forward(input.narrow(0, at, n));
      if (!out.defined()) continue;
      const torch::Tensor rows = target.narrow(0, at + first, out.size(0));
      loss_sum += loss(out, rows).item<double>() * static_cast<double>(out.size(0));
      if (classification) correct += static_cast<double>(out.argmax(-1).eq(rows).sum().item<int64_t>());
    }
  } catch (...) {
    model->train();
    throw;
  }
  model->train();
  const double rows = static_cast<double>(N);
  return {sum(loss_sum) / rows, classification ? sum(correct) / rows : 0.0};
}

double Engine::checksum() { return sum(replica() == 0 ? local_checksum(counted_parameters()) : 0.0); }

double Engine::gradient_norm() {
  double squares = 0;
  if (replica() == 0)
    for (const auto& p : counted_parameters())
      if (p.grad().defined()) {
        const double norm = p.grad().detach().norm().item<double>();
        squares += norm * norm;
      }
  return std::sqrt(sum(squares));
}

double Engine::clip_gradients(double max_norm) {
  GPIPE_CHECK(max_norm > 0 && std::isfinite(max_norm), "the largest gradient norm must be a positive number (got ",
              max_norm, ")");
  const double norm = gradient_norm();
  const double scale = max_norm / (norm + 1e-6);
  if (scale < 1) {
    torch::NoGradGuard no_grad;
    for (auto p : parameters())
      if (p.grad().defined()) p.mutable_grad().mul_(scale);
  }
  return norm;
}

bool Engine::all_finite(bool buffers) {
  bool finite = true;
  for (const auto& p : parameters()) finite = finite && torch::isfinite(p.detach()).all().item<bool>();
  if (buffers)
    for (const auto& b : layers()->buffers())
      if (b.is_floating_point()) finite = finite && torch::isfinite(b).all().item<bool>();
  return max(finite ? 0.0 : 1.0) == 0.0;
}

bool mpi_runtime() {
#if defined(GPIPE_HAS_MPI) && GPIPE_HAS_MPI
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  return initialized && !finalized && world_size() > 1;
#else
  return false;
#endif
}

std::unique_ptr<Engine> make_engine(const LayerBuilder& build, int layers, const PipelineOptions& options,
                                    Runtime runtime) {
  GPIPE_CHECK(static_cast<bool>(build), "make_engine needs a layer builder");
  GPIPE_CHECK(layers >= 1, "the model needs at least 1 layer (got ", layers, ")");
  if (runtime == Runtime::kAuto) runtime = mpi_runtime() ? Runtime::kMpi : Runtime::kThreads;
  if (runtime == Runtime::kThreads) {
    torch::nn::Sequential model = build(LayerRange{});
    GPIPE_CHECK(static_cast<int>(model->size()) == layers, "the layer builder made ", model->size(),
                " layers, but the model was said to have ", layers);
    return std::make_unique<ThreadEngine>(model, options);
  }
#if defined(GPIPE_HAS_MPI) && GPIPE_HAS_MPI
  int initialized = 0;
  MPI_Initialized(&initialized);
  GPIPE_CHECK(initialized, "the MPI runtime needs MPI initialised first: create a gpipe::mpi::Environment");
  const int V = options.virtual_stages();
  GPIPE_CHECK(V >= 1, "virtual_stages must be at least 1 (got ", V, ")");
  std::vector<int> balance = options.balance();
  if (balance.empty()) {
    GPIPE_CHECK(options.stages() >= 1, "the number of stages must be at least 1 (got ", options.stages(),
                "); set stages(K) or give a balance");
    GPIPE_CHECK(options.stages() * V <= layers, "stages (", options.stages(), V > 1 ? " x " + std::to_string(V) : "",
                ") outnumber the model's ", layers, " layers; use at most ", layers / V, " stages");
    balance = even_balance(layers, options.stages() * V);
  }
  check_balance(balance, layers);
  const int K = static_cast<int>(balance.size()) / V;
  GPIPE_CHECK(options.stages() == 0 || options.stages() == K, "stages (", options.stages(), ") and the balance (",
              balance.size(), " stages) disagree; set only one of them");
  const mpi::Placement place = mpi::place(world_rank(), world_size(), K);
  Device device = Device::cpu(options.threads_per_stage());
  if (!options.devices().empty()) {
    GPIPE_CHECK(static_cast<int>(options.devices().size()) == K, "got ", options.devices().size(), " devices for ",
                K, " stages; give one device per stage");
    device = options.devices()[static_cast<size_t>(place.stage)];
  }
  // This rank's stages, each built on its own so every layer starts as in one process.
  const torch::nn::Sequential mine = mpi::device_layers(build, balance, K, place.stage);
  return std::make_unique<MpiEngine>(mine, mpi::MpiPipelineOptions()
                                               .balance(balance)
                                               .chunks(options.chunks())
                                               .checkpoint(options.checkpoint())
                                               .schedule(options.schedule())
                                               .virtual_stages(V)
                                               .deferred_batch_norm(options.deferred_batch_norm())
                                               .tied_parameters(options.tied_parameters())
                                               .device(device));
#else
  GPIPE_CHECK(false, "this gpipe was built without MPI; install libopenmpi-dev and rebuild with -DGPIPE_WITH_MPI=ON, "
                     "or use Runtime::kThreads");
  return nullptr;
#endif
}

}  // namespace gpipe
