// transparency_test.cc: the pipeline's loss, gradients and parameters equal one device's, parameter by parameter.
#include "helpers.h"

#include <algorithm>
#include <random>
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

// (model, schedule, K, M, checkpoint, batch)
using Config = std::tuple<int, gpipe::ScheduleKind, int, int, Checkpoint, int64_t>;

class TransparencyTest : public ::testing::TestWithParam<Config> {
 protected:
  Model model() const { return std::get<0>(GetParam()) == 0 ? mlp() : transformer(); }
};

// The interleaved schedule, zbv and v-half run 2 stages per device; the others one.
int virtual_stages(gpipe::ScheduleKind kind) { return gpipe::default_virtual_stages(kind); }

TEST_P(TransparencyTest, LossAndGradientsEqualOneDevice) {
  const auto [which, schedule, K, M, mode, N] = GetParam();
  if (schedule == gpipe::ScheduleKind::kInterleaved && M % K != 0) GTEST_SKIP() << "interleaved needs K | M";
  const Model m = model();
  torch::manual_seed(100);
  const torch::Tensor x = m.input(N), y = m.target(N);

  auto reference = m.build(1);
  const torch::Tensor expected = gpipe::testing::reference_step(reference, x, y, m.loss);

  auto piped = m.build(1);
  gpipe::Pipeline pipe(piped, gpipe::PipelineOptions().devices(K).micro_batches(M).checkpoint(mode).schedule(schedule)
                                  .virtual_stages(virtual_stages(schedule)));
  const torch::Tensor loss = pipe.train_step(x, y, m.loss);

  EXPECT_TRUE(gpipe::testing::close(loss.to(torch::kFloat), expected));
  EXPECT_TRUE(same_parameters(piped, reference, /*values=*/false));
}

std::string name(const ::testing::TestParamInfo<Config>& info) {
  const auto [which, schedule, K, M, mode, N] = info.param;
  std::string schedule_name = gpipe::to_string(schedule);  // a test name takes no '-' (v-half)
  std::replace(schedule_name.begin(), schedule_name.end(), '-', '_');
  return std::string(which == 0 ? "mlp" : "transformer") + "_" + schedule_name + "_K" +
         std::to_string(K) + "_M" + std::to_string(M) + "_" + gpipe::to_string(mode) + "_N" + std::to_string(N);
}

// 120 is divisible by every M below; 13 by none but 1.
INSTANTIATE_TEST_SUITE_P(
    Grid, TransparencyTest,
    ::testing::Combine(::testing::Values(0, 1),
                       ::testing::Values(gpipe::ScheduleKind::kGPipe, gpipe::ScheduleKind::k1F1B,
                                         gpipe::ScheduleKind::kZB1P),
                       ::testing::Values(1, 2, 3, 4), ::testing::Values(1, 2, 3, 5, 8),
                       ::testing::Values(Checkpoint::kAlways, Checkpoint::kExceptLast, Checkpoint::kNever),
                       ::testing::Values(int64_t{120}, int64_t{13})),
    name);

// ZB-V: 2K stages placed as a V, the last beside the first on device 0; K <= 3 as for interleaved.
INSTANTIATE_TEST_SUITE_P(
    ZBV, TransparencyTest,
    ::testing::Combine(::testing::Values(0, 1), ::testing::Values(gpipe::ScheduleKind::kZBV),
                       ::testing::Values(1, 2, 3), ::testing::Values(1, 2, 3, 5, 8),
                       ::testing::Values(Checkpoint::kAlways, Checkpoint::kExceptLast, Checkpoint::kNever),
                       ::testing::Values(int64_t{120}, int64_t{13})),
    name);

// V-Half: zbv's V and programs under a tighter bound, so fewer shapes (M 2 and 5: a device that
// waits for room, and micro-batches of unequal rows).
INSTANTIATE_TEST_SUITE_P(
    VHalf, TransparencyTest,
    ::testing::Combine(::testing::Values(0, 1), ::testing::Values(gpipe::ScheduleKind::kVHalf),
                       ::testing::Values(1, 2, 3), ::testing::Values(2, 5),
                       ::testing::Values(Checkpoint::kAlways, Checkpoint::kExceptLast, Checkpoint::kNever),
                       ::testing::Values(int64_t{13})),
    name);

// Interleaved: K·V stages must fit the 6-7 layers of the test models, so K <= 3.
INSTANTIATE_TEST_SUITE_P(
    Interleaved, TransparencyTest,
    ::testing::Combine(::testing::Values(0, 1), ::testing::Values(gpipe::ScheduleKind::kInterleaved),
                       ::testing::Values(1, 2, 3), ::testing::Values(1, 2, 3, 6, 8),
                       ::testing::Values(Checkpoint::kAlways, Checkpoint::kExceptLast, Checkpoint::kNever),
                       ::testing::Values(int64_t{120}, int64_t{13})),
    name);

// The V schedules ordered by their stages' times (PipelineOptions::stage_times, what auto gives them):
// another order of the same actions, the same loss and gradients as one device.
TEST(TransparencyScheduleTest, VSchedulesOrderedByTimesEqualOneDevice) {
  std::mt19937 random(3);
  std::uniform_real_distribution<double> time(0.1, 4.0);
  int reordered = 0;
  for (const gpipe::ScheduleKind schedule : {gpipe::ScheduleKind::kZBV, gpipe::ScheduleKind::kVHalf})
    for (int K : {2, 3})
      for (int M : {5, 8})
        for (const Checkpoint mode : {Checkpoint::kNever, Checkpoint::kAlways}) {
          SCOPED_TRACE(gpipe::to_string(schedule) + " K=" + std::to_string(K) + " M=" + std::to_string(M) + " " +
                       gpipe::to_string(mode));
          std::vector<gpipe::ActionTimes> times;
          for (int s = 0; s < 2 * K; ++s) times.push_back({time(random), time(random), time(random)});
          const Model m = transformer();
          torch::manual_seed(100);
          const torch::Tensor x = m.input(13), y = m.target(13);
          auto reference = m.build(1);
          const torch::Tensor expected = gpipe::testing::reference_step(reference, x, y, m.loss);
          auto piped = m.build(1);
          const auto options = gpipe::PipelineOptions().devices(K).micro_batches(M).checkpoint(mode).schedule(schedule);
          gpipe::Pipeline pipe(piped, gpipe::PipelineOptions(options).stage_times(times));
          const gpipe::PipelinePlan unit = gpipe::make_plan(static_cast<int>(piped->size()), options);
          if (gpipe::format_grid(pipe.plan().training) != gpipe::format_grid(unit.training)) ++reordered;
          const torch::Tensor loss = pipe.train_step(x, y, m.loss);
          EXPECT_TRUE(gpipe::testing::close(loss.to(torch::kFloat), expected));
          EXPECT_TRUE(same_parameters(piped, reference, /*values=*/false));
        }
  EXPECT_GT(reordered, 8) << "the times changed few orders; the test would not show they are run alike";
}

// Dropout: every schedule draws the same masks (a stream per step, stage and
// micro-batch), so its gradients equal fill-drain's over the same stages,
// re-materialized or not (up to the order in which micro-batches add up).
TEST(TransparencyScheduleTest, DropoutGradientsEqualFillDrainsInEverySchedule) {
  torch::manual_seed(7);
  const torch::Tensor x = torch::randn({24, 12}), y = torch::randn({24, 4});
  auto grads = [&](gpipe::ScheduleKind schedule, int K, Checkpoint mode) {
    auto model = gpipe::testing::small_mlp(5, 0.3);  // 10 layers
    gpipe::Pipeline pipe(model, gpipe::PipelineOptions().devices(K).micro_batches(4).checkpoint(mode).schedule(schedule)
                                    .virtual_stages(virtual_stages(schedule)));
    torch::manual_seed(11);
    pipe.train_step(x, y, gpipe::mse_loss);
    std::vector<torch::Tensor> out;
    for (const auto& p : model->parameters()) out.push_back(p.grad());
    return out;
  };
  const auto two_stages = grads(gpipe::ScheduleKind::kGPipe, 2, Checkpoint::kNever);
  const auto four_stages = grads(gpipe::ScheduleKind::kGPipe, 4, Checkpoint::kNever);  // interleaved's cut
  for (auto schedule : {gpipe::ScheduleKind::kGPipe, gpipe::ScheduleKind::k1F1B, gpipe::ScheduleKind::kInterleaved,
                        gpipe::ScheduleKind::kZB1P, gpipe::ScheduleKind::kZBV, gpipe::ScheduleKind::kVHalf})
    for (auto mode : {Checkpoint::kAlways, Checkpoint::kExceptLast, Checkpoint::kNever}) {
      const auto got = grads(schedule, 2, mode);
      const auto& expected = virtual_stages(schedule) == 2 ? four_stages : two_stages;
      for (size_t n = 0; n < got.size(); ++n)
        EXPECT_TRUE(gpipe::testing::close(got[n], expected[n], 1e-6))
            << gpipe::to_string(schedule) << " " << gpipe::to_string(mode) << " parameter " << n;
    }
}

// Several optimizer steps: the parameters still match one device.
TEST(TransparencyTrainingTest, ParametersMatchAfterSeveralSgdSteps) {
  for (const Model& m : {mlp(), transformer()}) {
    auto reference = m.build(2);
    auto piped = m.build(2);
    gpipe::Pipeline pipe(piped, gpipe::PipelineOptions().devices(3).micro_batches(5)
                                    .checkpoint(Checkpoint::kExceptLast).schedule(gpipe::ScheduleKind::kZB1P));
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
  gpipe::Pipeline pipe(piped, gpipe::PipelineOptions().devices(2).micro_batches(3));
  for (int step = 0; step < 2; ++step) {
    torch::manual_seed(300 + step);
    const torch::Tensor x = m.input(9), y = m.target(9);
    gpipe::testing::reference_step(reference, x, y, m.loss);
    pipe.train_step(x, y, m.loss);
  }
  EXPECT_TRUE(same_parameters(piped, reference, /*values=*/false));
}

}  // namespace
