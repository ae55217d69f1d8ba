// cuda_test.cc: the pipeline on one GPU, K = 2 and 3 devices (each stage its own stream), against one
// device on the same GPU; every schedule and re-materialization mode; models with skip connections,
// BatchNorm and tied weights. Skipped, not failed, where no CUDA device is visible (CPU-only CI).
//
// Under bf16 and fp16 (PipelineOptions::precision) the pipeline is compared with the same autocast on
// one device of the same GPU, fp16 with one loss scale for the pipeline (loss_scale.h).
//
// With GPIPE_CUDA_RESULT=FILE it writes the largest relative difference it saw as JSON there
// (bench/device.sh reads it for bench/results/device.json).
#include "helpers.h"
#include "runtime/autocast.h"  // the one device's autocast, as the pipeline's stages set it

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>

namespace {

using gpipe::Checkpoint;
using gpipe::Device;
using gpipe::PipelineOptions;
using gpipe::ScheduleKind;

// GPIPE_CUDA_TEST_ON_CPU=1 runs these tests' logic with CPU devices in place of the GPU (a check of
// the tests themselves where no GPU is; the streams are then not exercised).
bool on_cpu() {
  static const bool cpu = std::getenv("GPIPE_CUDA_TEST_ON_CPU") != nullptr &&
                          std::string(std::getenv("GPIPE_CUDA_TEST_ON_CPU")) == "1";
  return cpu;
}
bool have_gpu() { return torch::cuda::is_available() || on_cpu(); }
torch::Device gpu_device() { return on_cpu() ? torch::Device(torch::kCPU) : torch::Device(torch::kCUDA, 0); }
gpipe::Device gpu_stage() { return on_cpu() ? gpipe::Device::cpu(1) : gpipe::Device::cuda(0); }

#define GPIPE_NEED_CUDA()                                                                        \
  if (!have_gpu())                                                                               \
  GTEST_SKIP() << "no CUDA device visible (this libtorch has no CUDA, or no GPU): nothing to test " \
                  "on a GPU here"

double largest_gpu_difference = 0;  // max relative parameter difference over every GPU pipeline
double largest_cpu_difference = -1;  // the pipeline on the GPU against the same on CPU (reported only)
double largest_bf16_difference = -1;  // the bf16 pipeline's gradients against one device's under autocast
double largest_fp16_difference = -1;  // the same in fp16, with a loss scale on both sides
double fp16_scale = 0;                // the loss scale after the fp16 steps

// Writes the figures so far to GPIPE_CUDA_RESULT after every test that adds to them (a run stopped
// by a time limit keeps what it measured), and prints them once every test has run.
void save_report() {
  const char* path = std::getenv("GPIPE_CUDA_RESULT");
  if (path == nullptr) return;
  const std::string tmp = std::string(path) + ".tmp";
  {
    std::ofstream out(tmp);
    out << "{\"cuda_exact_max_rel_diff\": " << largest_gpu_difference
        << ", \"cpu_vs_cuda_max_rel_diff\": " << largest_cpu_difference
        << ", \"cuda_bf16_max_rel_diff\": " << largest_bf16_difference
        << ", \"cuda_fp16_loss_scale\": {\"max_rel_diff\": " << largest_fp16_difference << ", \"scale\": " << fp16_scale
        << "}}\n";
  }
  std::rename(tmp.c_str(), path);
}

class Report : public ::testing::Environment {
 public:
  void TearDown() override {
    if (!have_gpu()) return;
    std::printf("cuda_exact_max_rel_diff %.3g, cpu_vs_cuda_max_rel_diff %.3g\n", largest_gpu_difference,
                largest_cpu_difference);
  }
};
const auto* const report = ::testing::AddGlobalTestEnvironment(new Report);

struct Model {
  std::string name;
  std::function<torch::nn::Sequential()> build;
  std::function<torch::Tensor(int64_t)> input, target;
  gpipe::LossFn loss;
  bool batch_norm = false;  // one device's reference normalizes each micro-batch by itself
};

torch::nn::Sequential normed() {  // BatchNorm after a convolution and after linear layers: 9 layers
  namespace nn = torch::nn;
  return nn::Sequential(nn::Conv2d(nn::Conv2dOptions(2, 4, 3).padding(1).bias(false)), nn::BatchNorm2d(4), nn::ReLU(),
                        nn::Flatten(), nn::Linear(nn::LinearOptions(64, 16).bias(false)), nn::BatchNorm1d(16),
                        nn::Tanh(), nn::Linear(16, 16), nn::Linear(16, 3));
}

torch::nn::Sequential skipped() {  // two skip connections across any cut: 10 layers
  namespace nn = torch::nn;
  return nn::Sequential(nn::Linear(6, 16), gpipe::Stash("u"), nn::Tanh(), nn::Linear(16, 16), gpipe::Stash("r"),
                        nn::ReLU(), nn::Linear(16, 16), gpipe::Pop("r"), gpipe::Pop("u", gpipe::concat_skip),
                        nn::Linear(32, 3));
}

torch::nn::Sequential tied() {  // an embedding, 4 encoder blocks, a projection by the embedding's weight
  torch::nn::Embedding embedding(gpipe::testing::kVocab, 16);
  torch::nn::Sequential m;
  m->push_back(embedding);
  for (int b = 0; b < 4; ++b) m->push_back(gpipe::EncoderBlock(16, 2, 32, 0.0));
  m->push_back(gpipe::TiedProjection(embedding->weight));
  return m;
}

std::vector<Model> models() {
  using gpipe::testing::kVocab;
  auto tokens = [](int64_t n) { return torch::randint(kVocab, {n, 6}, torch::kLong); };
  return {
      {"mlp", [] { return gpipe::testing::small_mlp(1); }, [](int64_t n) { return torch::randn({n, 12}); },
       [](int64_t n) { return torch::randn({n, 4}); }, gpipe::mse_loss},
      {"transformer", [] { return gpipe::testing::small_transformer(1); }, tokens, tokens, gpipe::cross_entropy_loss},
      {"skips", skipped, [](int64_t n) { return torch::randn({n, 6}); }, [](int64_t n) { return torch::randn({n, 3}); },
       gpipe::mse_loss},
      {"batch_norm", normed, [](int64_t n) { return torch::randn({n, 2, 4, 4}); },
       [](int64_t n) { return torch::randn({n, 3}); }, gpipe::mse_loss, true},
      {"tied", tied, tokens, tokens, gpipe::cross_entropy_loss},
  };
}

// max over the tensors of max|a - b| / max|b|.
double relative_difference(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  EXPECT_EQ(a.size(), b.size());
  double worst = 0;
  for (size_t n = 0; n < std::min(a.size(), b.size()); ++n) {
    const torch::Tensor x = a[n].detach().to(torch::kCPU, torch::kDouble), y = b[n].detach().to(torch::kCPU, torch::kDouble);
    const double scale = std::max(y.abs().max().item<double>(), 1e-12);
    worst = std::max(worst, (x - y).abs().max().item<double>() / scale);
  }
  return worst;
}

std::vector<torch::Tensor> values(const torch::nn::Sequential& m) {
  std::vector<torch::Tensor> out;
  for (const auto& p : gpipe::unique_parameters(*m)) out.push_back(p.detach().clone());
  return out;
}

// One device: the model itself on `device`; with BatchNorm, each micro-batch through it by itself
// (the paper's rule), its loss weighted by its share of rows.
void reference_step(const Model& m, torch::nn::Sequential model, const torch::Tensor& x, const torch::Tensor& y,
                    int M, const torch::Device& device) {
  if (!m.batch_norm) {
    m.loss(model->forward(x.to(device)), y.to(device)).backward();
    return;
  }
  const std::vector<torch::Tensor> xs = gpipe::scatter(x, M), ys = gpipe::scatter(y, M);
  for (size_t i = 0; i < xs.size(); ++i) {
    const double weight = static_cast<double>(xs[i].size(0)) / static_cast<double>(x.size(0));
    (m.loss(model->forward(xs[i].to(device)), ys[i].to(device)) * weight).backward();
  }
}

// Two SGD steps (momentum): the parameters after them, and the gradients of the first step.
struct Result {
  std::vector<torch::Tensor> grads, params;
};

Result train(const Model& m, const std::function<void(torch::nn::Sequential, const torch::Tensor&, const torch::Tensor&)>& step,
          torch::nn::Sequential model, const std::vector<torch::Tensor>& parameters) {
  Result run;
  torch::optim::SGD sgd(parameters, torch::optim::SGDOptions(0.05).momentum(0.9));
  for (int s = 0; s < 2; ++s) {
    torch::manual_seed(500 + s);
    const torch::Tensor x = m.input(13), y = m.target(13);
    sgd.zero_grad();
    step(model, x, y);
    if (s == 0)
      for (const auto& p : parameters) run.grads.push_back(p.grad().defined() ? p.grad().clone() : torch::zeros_like(p));
    sgd.step();
  }
  run.params = values(model);
  return run;
}

torch::nn::Sequential build_on(const Model& m, const torch::Device& device) {
  torch::manual_seed(1);
  torch::nn::Sequential model = m.build();
  model->to(device);
  return model;
}

using Config = std::tuple<int, ScheduleKind, Checkpoint, int>;  // (model, schedule, mode, K)

class CudaTransparencyTest : public ::testing::TestWithParam<Config> {};

TEST_P(CudaTransparencyTest, ParametersEqualOneDeviceOnTheSameGpu) {
  GPIPE_NEED_CUDA();
  gpipe::allow_tf32(false);
  const auto [which, schedule, mode, K] = GetParam();
  const Model m = models()[static_cast<size_t>(which)];
  const torch::Device gpu = gpu_device();
  constexpr int M = 6;  // K | M for the interleaved schedule

  torch::nn::Sequential reference = build_on(m, gpu);
  const Result expected = train(m, [&](torch::nn::Sequential model, const torch::Tensor& x, const torch::Tensor& y) {
    reference_step(m, model, x, y, M, gpu);
  }, reference, gpipe::unique_parameters(*reference));

  // K devices, all the GPU: each its own thread, each stage its own stream (V of them per device).
  torch::nn::Sequential piped = build_on(m, gpu);
  gpipe::Pipeline pipe(piped, PipelineOptions()
                                  .devices(K)
                                  .device_list(std::vector<Device>(static_cast<size_t>(K), gpu_stage()))
                                  .micro_batches(M)
                                  .checkpoint(mode)
                                  .schedule(schedule)
                                  .virtual_stages(gpipe::default_virtual_stages(schedule)));
  const Result got = train(m, [&](torch::nn::Sequential, const torch::Tensor& x, const torch::Tensor& y) {
    pipe.train_step(x, y, m.loss);
  }, piped, pipe.parameters());

  const double difference = std::max(relative_difference(got.grads, expected.grads),
                                     relative_difference(got.params, expected.params));
  largest_gpu_difference = std::max(largest_gpu_difference, difference);
  save_report();
  EXPECT_LE(difference, 1e-5) << m.name << " " << gpipe::to_string(schedule) << " " << gpipe::to_string(mode)
                              << " K=" << K;
  for (const auto& p : piped->parameters()) EXPECT_EQ(p.device(), gpu);
}

std::string name(const ::testing::TestParamInfo<Config>& info) {
  const auto [which, schedule, mode, K] = info.param;
  std::string s = gpipe::to_string(schedule);
  std::replace(s.begin(), s.end(), '-', '_');
  return models()[static_cast<size_t>(which)].name + "_" + s + "_" + gpipe::to_string(mode) + "_K" + std::to_string(K);
}

INSTANTIATE_TEST_SUITE_P(
    OneGpu, CudaTransparencyTest,
    ::testing::Combine(::testing::Values(0, 1, 2, 3, 4),
                       ::testing::Values(ScheduleKind::kGPipe, ScheduleKind::k1F1B, ScheduleKind::kInterleaved,
                                         ScheduleKind::kZB1P, ScheduleKind::kZBV, ScheduleKind::kVHalf),
                       ::testing::Values(Checkpoint::kAlways, Checkpoint::kExceptLast, Checkpoint::kNever),
                       ::testing::Values(2, 3)),
    name);

// The same pipeline on the GPU and on CPU devices: reported (different kernels sum in other orders),
// and bounded loosely.
TEST(CudaTest, GpuPipelineAgainstCpuPipeline) {
  GPIPE_NEED_CUDA();
  gpipe::allow_tf32(false);
  for (const Model& m : models()) {
    auto run_on = [&](bool gpu) {
      torch::nn::Sequential model = build_on(m, gpu ? gpu_device() : torch::Device(torch::kCPU));
      PipelineOptions options = PipelineOptions().devices(2).micro_batches(4).checkpoint(Checkpoint::kAlways);
      if (gpu) options.device_list({gpu_stage(), gpu_stage()});
      gpipe::Pipeline pipe(model, options);
      return train(m, [&](torch::nn::Sequential, const torch::Tensor& x, const torch::Tensor& y) {
        pipe.train_step(x, y, m.loss);
      }, model, pipe.parameters());
    };
    const double difference = relative_difference(run_on(true).params, run_on(false).params);
    largest_cpu_difference = std::max(largest_cpu_difference, difference);
    save_report();
    EXPECT_LE(difference, 1e-4) << m.name;
  }
}

// A step's tensors cross streams without the host waiting in between, and the next step works:
// many micro-batches, several steps, the loss each time equal to one device's.
TEST(CudaTest, ManyMicroBatchesAcrossStreamsMatchOneDeviceStepAfterStep) {
  GPIPE_NEED_CUDA();
  gpipe::allow_tf32(false);
  const Model m = models()[1];
  const torch::Device gpu = gpu_device();
  torch::nn::Sequential piped = build_on(m, gpu), reference = build_on(m, gpu);
  gpipe::Pipeline pipe(piped, PipelineOptions().devices(3).device_list({gpu_stage(), gpu_stage(), gpu_stage()})
                                  .micro_batches(32).schedule(ScheduleKind::k1F1B));
  for (int s = 0; s < 3; ++s) {
    torch::manual_seed(700 + s);
    const torch::Tensor x = m.input(96), y = m.target(96);
    for (const auto& p : piped->parameters()) p.mutable_grad() = torch::Tensor();
    for (const auto& p : reference->parameters()) p.mutable_grad() = torch::Tensor();
    const double loss = pipe.train_step(x, y, m.loss).item<double>();
    torch::Tensor expected = m.loss(reference->forward(x.to(gpu)), y.to(gpu));
    expected.backward();
    EXPECT_NEAR(loss, expected.item<double>(), 1e-5 * std::max(1.0, std::abs(expected.item<double>())));
    EXPECT_LE(relative_difference(gpipe::unique_parameters(*piped), gpipe::unique_parameters(*reference)), 0.0);
    std::vector<torch::Tensor> a, b;
    for (const auto& p : gpipe::unique_parameters(*piped)) a.push_back(p.grad());
    for (const auto& p : gpipe::unique_parameters(*reference)) b.push_back(p.grad());
    EXPECT_LE(relative_difference(a, b), 1e-5) << "step " << s;
  }
}

// Under bf16 and fp16 each stage's forward runs under the GPU's autocast: the gradients of one step
// equal one device's under the same autocast to a few roundings (3% of each gradient's largest entry
// for bf16's 8 bits, as tests/precision_test.cc argues; 1/256 for fp16's 11). Under fp16 both sides
// scale the loss by the pipeline's one scale and divide the gradients by it, and a step's gradients
// are all finite. K = 2 and 3, fill-drain and 1F1B, with re-materialization.
TEST(CudaTest, MixedPrecisionMatchesOneDeviceUnderTheSameAutocast) {
  GPIPE_NEED_CUDA();
  if (on_cpu()) GTEST_SKIP() << "autocast on a GPU: nothing to compare on CPU devices";
  gpipe::allow_tf32(false);
  const Model m = models()[1];  // the Transformer
  const torch::Device gpu = gpu_device();
  for (const gpipe::Precision precision : {gpipe::Precision::kBFloat16, gpipe::Precision::kFloat16})
    for (const int K : {2, 3})
      for (const ScheduleKind kind : {ScheduleKind::kGPipe, ScheduleKind::k1F1B}) {
        SCOPED_TRACE(gpipe::to_string(precision) + " K=" + std::to_string(K) + " " + gpipe::to_string(kind));
        torch::nn::Sequential piped = build_on(m, gpu), reference = build_on(m, gpu);
        gpipe::Pipeline pipe(piped, PipelineOptions().devices(K).device_list(std::vector<Device>(static_cast<size_t>(K), gpu_stage()))
                                        .micro_batches(6).schedule(kind).checkpoint(Checkpoint::kAlways)
                                        .precision(precision));
        gpipe::LossScaler scaler;
        const bool fp16 = precision == gpipe::Precision::kFloat16;
        const double scale = fp16 ? scaler.scale() : 1.0;
        torch::manual_seed(800);
        const torch::Tensor x = m.input(24), y = m.target(24);
        const double piped_loss = pipe.train_step(x, y, m.loss, scale).item<double>();
        if (fp16) EXPECT_TRUE(scaler.check_and_update(pipe, std::isfinite(piped_loss)));
        torch::Tensor loss;
        {
          const gpipe::AutocastScope autocast(precision, c10::DeviceType::CUDA);
          loss = m.loss(reference->forward(x.to(gpu)), y.to(gpu));
        }
        (loss.to(torch::kFloat) * scale).backward();
        std::vector<torch::Tensor> a, b;
        for (const auto& p : gpipe::unique_parameters(*piped)) a.push_back(p.grad());
        for (const auto& p : gpipe::unique_parameters(*reference)) b.push_back(p.grad() / scale);
        const double difference = relative_difference(a, b);
        (fp16 ? largest_fp16_difference : largest_bf16_difference) =
            std::max(fp16 ? largest_fp16_difference : largest_bf16_difference, difference);
        if (fp16) fp16_scale = scale;
        save_report();
        EXPECT_LE(difference, fp16 ? 1.0 / 256 : 1.0 / 32);
      }
}

// Memory figures of a GPU device come from the CUDA caching allocator.
TEST(CudaTest, MemoryComesFromTheCachingAllocator) {
  GPIPE_NEED_CUDA();
  const Model m = models()[0];
  torch::nn::Sequential model = build_on(m, gpu_device());
  gpipe::Pipeline pipe(model, PipelineOptions().devices(1).device_list({gpu_stage()}).micro_batches(2).track_memory(true));
  torch::manual_seed(9);
  pipe.train_step(m.input(64), m.target(64), m.loss);
  const auto memory = pipe.memory();
  ASSERT_EQ(memory.size(), 1u);
  EXPECT_GT(memory[0].peak_bytes, 0) << "no peak from the caching allocator (built without GPIPE_CUDA_MEMORY_STATS?)";
  EXPECT_GT(memory[0].parameter_bytes, 0);
}

// Without a GPU the CUDA tests skip; a CUDA device asked for is refused by name.
TEST(CudaTest, WithoutAGpuACudaDeviceIsRefusedByName) {
  if (torch::cuda::is_available() || on_cpu()) GTEST_SKIP() << "a GPU is visible: nothing to refuse";
  gpipe::testing::expect_invalid([] { gpipe::check_device(Device::cuda(0)); }, "cuda:0");
  // The stream helpers do nothing on CPU.
  const gpipe::DeviceStream none{torch::Device(torch::kCPU)};
  EXPECT_FALSE(none.active());
  EXPECT_EQ(none.record(), nullptr);
  EXPECT_EQ(gpipe::record_current_stream(torch::Device(torch::kCPU)), nullptr);
  gpipe::allow_tf32(false);  // harmless without CUDA
}

}  // namespace
