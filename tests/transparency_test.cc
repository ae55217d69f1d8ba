// transparency_test.cc: the pipeline's loss, gradients and parameters equal one device's, parameter by parameter.
#include "helpers.h"

#include <tuple>

using gpipe::Checkpoint;
using gpipe::testing::same_parameters;

namespace {

struct Model {
  std::string name;
  std::function<torch::nn::Sequential(uint64_t)> build;
  std::function<torch::Tensor(int64_t)> input;
  std::function<torch::Tensor(int64_t)> target;
  gpipe::LossFn loss;
};

Model mlp() {
  return {"mlp", [](uint64_t s) { return gpipe::testing::small_mlp(s); },
          [](int64_t n) { return torch::randn({n, 12}); },
          [](int64_t n) { return torch::randn({n, 4}); }, gpipe::mse_loss};
}

Model transformer() {
  using gpipe::testing::kVocab;
  return {"transformer", [](uint64_t s) { return gpipe::testing::small_transformer(s); },
          [](int64_t n) { return torch::randint(kVocab, {n, 6}, torch::kLong); },
          [](int64_t n) { return torch::randint(kVocab, {n, 6}, torch::kLong); },
          gpipe::cross_entropy_loss};
}

// (model, K, M, checkpoint, batch)
using Config = std::tuple<int, int, int, Checkpoint, int64_t>;

class TransparencyTest : public ::testing::TestWithParam<Config> {
 protected:
  Model model() const { return std::get<0>(GetParam()) == 0 ? mlp() : transformer(); }
};

TEST_P(TransparencyTest, LossAndGradientsEqualOneDevice) {
  const auto [which, K, M, mode, N] = GetParam();
  const Model m = model();
  torch::manual_seed(100);
  const torch::Tensor x = m.input(N), y = m.target(N);

  auto reference = m.build(1);
  const torch::Tensor expected = gpipe::testing::reference_step(reference, x, y, m.loss);

  auto piped = m.build(1);
  gpipe::Pipeline pipe(piped, gpipe::PipelineOptions().stages(K).chunks(M).checkpoint(mode));
  const torch::Tensor loss = pipe.train_step(x, y, m.loss);

  EXPECT_TRUE(gpipe::testing::close(loss.to(torch::kFloat), expected));
  EXPECT_TRUE(same_parameters(piped, reference, /*values=*/false));
}

std::string name(const ::testing::TestParamInfo<Config>& info) {
  const auto [which, K, M, mode, N] = info.param;
  return std::string(which == 0 ? "mlp" : "transformer") + "_K" + std::to_string(K) + "_M" +
         std::to_string(M) + "_" + gpipe::to_string(mode) + "_N" + std::to_string(N);
}

// 120 is divisible by every M below; 13 by none but 1.
INSTANTIATE_TEST_SUITE_P(
    Grid, TransparencyTest,
    ::testing::Combine(::testing::Values(0, 1), ::testing::Values(1, 2, 3, 4),
                       ::testing::Values(1, 2, 3, 5, 8),
                       ::testing::Values(Checkpoint::kAlways, Checkpoint::kExceptLast, Checkpoint::kNever),
                       ::testing::Values(int64_t{120}, int64_t{13})),
    name);

// Several optimizer steps: the parameters still match one device.
TEST(TransparencyTrainingTest, ParametersMatchAfterSeveralSgdSteps) {
  for (const Model& m : {mlp(), transformer()}) {
    auto reference = m.build(2);
    auto piped = m.build(2);
    gpipe::Pipeline pipe(piped, gpipe::PipelineOptions().stages(3).chunks(5)
                                    .checkpoint(Checkpoint::kExceptLast));
    torch::optim::SGD ref_opt(reference->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
    torch::optim::SGD pipe_opt(pipe.parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
    for (int step = 0; step < 4; ++step) {
      torch::manual_seed(200 + step);
      const torch::Tensor x = m.input(23), y = m.target(23);
      ref_opt.zero_grad();
      gpipe::testing::reference_step(reference, x, y, m.loss);
      ref_opt.step();
      pipe_opt.zero_grad();
      pipe.train_step(x, y, m.loss);
      pipe_opt.step();
    }
    EXPECT_TRUE(same_parameters(piped, reference, /*values=*/true)) << m.name;
  }
}

// Like backward(), a step adds to the gradients already there.
TEST(TransparencyTrainingTest, StepsAccumulateIntoExistingGradients) {
  const Model m = mlp();
  auto reference = m.build(3);
  auto piped = m.build(3);
  gpipe::Pipeline pipe(piped, gpipe::PipelineOptions().stages(2).chunks(3));
  for (int step = 0; step < 2; ++step) {
    torch::manual_seed(300 + step);
    const torch::Tensor x = m.input(9), y = m.target(9);
    gpipe::testing::reference_step(reference, x, y, m.loss);
    pipe.train_step(x, y, m.loss);
  }
  EXPECT_TRUE(same_parameters(piped, reference, /*values=*/false));
}

}  // namespace
