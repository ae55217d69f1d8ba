// rematerialization_test.cc: re-materialization replays the random stream: Dropout gives the same gradients in every mode.
#include "helpers.h"

using gpipe::Checkpoint;
using gpipe::PipelineOptions;

namespace {

struct StepResult {
  std::vector<torch::Tensor> grads;
  double loss;
};

// One training step of an MLP with Dropout(0.5), from a fixed seed.
StepResult dropout_step(Checkpoint mode, int K, int M, uint64_t seed = 42,
                        gpipe::ScheduleKind schedule = gpipe::ScheduleKind::kGPipe) {
  auto model = gpipe::testing::small_mlp(7, /*dropout=*/0.5);
  gpipe::Pipeline pipe(model, PipelineOptions().devices(K).micro_batches(M).checkpoint(mode).schedule(schedule));
  torch::manual_seed(11);
  const torch::Tensor x = torch::randn({16, 12}), y = torch::randn({16, 4});
  torch::manual_seed(seed);
  StepResult run;
  run.loss = pipe.train_step(x, y, gpipe::mse_loss).item<double>();
  for (const auto& p : model->parameters()) run.grads.push_back(p.grad().clone());
  return run;
}

}  // namespace

TEST(RematerializationTest, DropoutGradientsAreIdenticalInEveryMode) {
  for (int K : {1, 2, 4}) {
    const StepResult never = dropout_step(Checkpoint::kNever, K, 4);
    for (Checkpoint mode : {Checkpoint::kAlways, Checkpoint::kExceptLast}) {
      const StepResult other = dropout_step(mode, K, 4);
      EXPECT_EQ(other.loss, never.loss) << gpipe::to_string(mode) << " K=" << K;
      for (size_t n = 0; n < never.grads.size(); ++n)
        EXPECT_TRUE(torch::equal(other.grads[n], never.grads[n]))
            << gpipe::to_string(mode) << " K=" << K << " parameter " << n;
    }
  }
}

// ZB-V and V-Half (I/W split, V placement): re-materialized or not, the same masks and the same
// gradients, bit for bit.
TEST(RematerializationTest, DropoutGradientsAreIdenticalInEveryModeWithTheVSchedules) {
  for (int K : {1, 2, 3})
    for (auto schedule : {gpipe::ScheduleKind::kZBV, gpipe::ScheduleKind::kVHalf}) {
      const StepResult never = dropout_step(Checkpoint::kNever, K, 4, 42, schedule);
      for (Checkpoint mode : {Checkpoint::kAlways, Checkpoint::kExceptLast}) {
        const StepResult other = dropout_step(mode, K, 4, 42, schedule);
        EXPECT_EQ(other.loss, never.loss) << gpipe::to_string(mode) << " K=" << K;
        for (size_t n = 0; n < never.grads.size(); ++n)
          EXPECT_TRUE(torch::equal(other.grads[n], never.grads[n]))
              << gpipe::to_string(mode) << " K=" << K << " parameter " << n;
      }
    }
}

TEST(RematerializationTest, DropoutReallyDrops) {
  // Guards the test above: with p = 0.5 the masks matter, so another seed changes every gradient.
  const StepResult a = dropout_step(Checkpoint::kAlways, 2, 4);
  const StepResult b = dropout_step(Checkpoint::kAlways, 2, 4, /*seed=*/43);
  ASSERT_EQ(a.grads.size(), b.grads.size());
  for (size_t n = 0; n < a.grads.size(); ++n)
    EXPECT_FALSE(torch::allclose(a.grads[n], b.grads[n])) << "parameter " << n;
}

TEST(RematerializationTest, SameSeedSameStepDifferentSeedDifferentStep) {
  const StepResult a = dropout_step(Checkpoint::kAlways, 2, 4);
  const StepResult b = dropout_step(Checkpoint::kAlways, 2, 4);
  EXPECT_EQ(a.loss, b.loss);
  auto model = gpipe::testing::small_mlp(7, 0.5);
  gpipe::Pipeline pipe(model, PipelineOptions().devices(2).micro_batches(4));
  torch::manual_seed(11);
  const torch::Tensor x = torch::randn({16, 12}), y = torch::randn({16, 4});
  torch::manual_seed(43);
  EXPECT_NE(pipe.train_step(x, y, gpipe::mse_loss).item<double>(), a.loss);
}

TEST(RematerializationTest, TheCallersRandomStreamAdvancesByOneDraw) {
  auto model = gpipe::testing::small_mlp(7, 0.5);
  gpipe::Pipeline pipe(model, PipelineOptions().devices(2).micro_batches(4));
  const torch::Tensor x = torch::randn({16, 12}), y = torch::randn({16, 4});
  torch::manual_seed(5);
  pipe.train_step(x, y, gpipe::mse_loss);
  const torch::Tensor after_step = torch::rand({4});
  torch::manual_seed(5);
  torch::randint(std::numeric_limits<int64_t>::max(), {1}, torch::kLong);  // the step's one draw
  EXPECT_TRUE(torch::equal(torch::rand({4}), after_step));
}

TEST(RematerializationTest, StochasticStagesAreDetected) {
  gpipe::Pipeline pipe(gpipe::testing::small_mlp(7, 0.5), PipelineOptions().balance({2, 8}));
  // small_mlp with dropout: layers 0,1 (Linear, ReLU) then Dropout at 2.
  gpipe::Stage first(0, 2, pipe.stage(0), gpipe::Device::cpu());
  gpipe::Stage second(1, 2, pipe.stage(1), gpipe::Device::cpu());
  EXPECT_FALSE(first.stochastic());
  EXPECT_TRUE(second.stochastic());
}

TEST(RematerializationTest, RecomputingLeavesBatchNormStatisticsAsTheForwardLeftThem) {
  // A recomputed forward must not update running statistics a second time: every mode ends
  // with the buffers of `never`, which runs each micro-batch's forward once.
  auto buffers_after_step = [](Checkpoint mode) {
    torch::manual_seed(3);
    torch::nn::Sequential model(torch::nn::Linear(12, 16), torch::nn::BatchNorm1d(16), torch::nn::ReLU(),
                                torch::nn::Linear(16, 16), torch::nn::BatchNorm1d(16), torch::nn::Linear(16, 4));
    gpipe::Pipeline pipe(model, PipelineOptions().balance({2, 4}).micro_batches(4).checkpoint(mode).deferred_batch_norm(false));
    const torch::Tensor x = torch::randn({16, 12}), y = torch::randn({16, 4});
    pipe.train_step(x, y, gpipe::mse_loss);
    std::vector<torch::Tensor> out;
    for (const auto& b : model->buffers()) out.push_back(b.clone());
    return out;
  };
  const auto never = buffers_after_step(Checkpoint::kNever);
  ASSERT_EQ(never.size(), 6u);
  EXPECT_EQ(never[2].item<int64_t>(), 4) << "one update per micro-batch's forward";
  for (Checkpoint mode : {Checkpoint::kAlways, Checkpoint::kExceptLast}) {
    const auto other = buffers_after_step(mode);
    for (size_t n = 0; n < never.size(); ++n)
      EXPECT_TRUE(torch::equal(other[n], never[n])) << gpipe::to_string(mode) << " buffer " << n;
  }
}
