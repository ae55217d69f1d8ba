// BatchNorm the GPipe way: each micro-batch normalized by its own statistics, the running
// statistics updated once per mini-batch from all its rows, against a one-device reference
// computed exactly so.
#include "helpers.h"

#include <gpipe/microbatch.h>

#include <map>
#include <tuple>

namespace {

using gpipe::Checkpoint;
using gpipe::PipelineOptions;
using gpipe::ScheduleKind;

// 10 layers: a convolution with BatchNorm2d, then BatchNorm1d layers, one with a cumulative
// average (momentum None). Input [N, 2, 4, 4], 3 outputs. A layer before a BatchNorm has no bias:
// BatchNorm takes the mean out, so its gradient would be rounding noise.
torch::nn::Sequential normed_model() {
  namespace nn = torch::nn;
  torch::manual_seed(11);
  nn::Sequential m(nn::Conv2d(nn::Conv2dOptions(2, 4, 3).padding(1).bias(false)), nn::BatchNorm2d(4), nn::ReLU(),
                   nn::Flatten(), nn::Linear(nn::LinearOptions(64, 16).bias(false)),
                   nn::BatchNorm1d(nn::BatchNormOptions(16).momentum(0.3)), nn::Tanh(),
                   nn::Linear(nn::LinearOptions(16, 16).bias(false)),
                   nn::BatchNorm1d(nn::BatchNormOptions(16).momentum(c10::nullopt)), nn::Linear(16, 3));
  return m;
}

bool is_norm(torch::nn::Module& layer) { return gpipe::running_statistics(layer).has_value(); }

// One step on one device as the paper defines it: micro-batch i normalized by its own statistics
// (the running ones untouched), its loss weighted by its share of rows, gradients summed; then each
// BatchNorm's running statistics updated once from the mean and unbiased variance of every row it saw.
void reference_step(torch::nn::Sequential model, const torch::Tensor& x, const torch::Tensor& y, int M) {
  const std::vector<torch::Tensor> xs = gpipe::scatter(x, M), ys = gpipe::scatter(y, M);
  std::map<size_t, std::vector<torch::Tensor>> seen;  // by layer: the inputs of a BatchNorm
  for (size_t i = 0; i < xs.size(); ++i) {
    // The running statistics as they were: training-mode normalization does not read them.
    std::vector<torch::Tensor> saved;
    for (const auto& b : model->buffers()) saved.push_back(b.clone());
    torch::Tensor a = xs[i];
    size_t n = 0;
    for (auto layer = model->begin(); layer != model->end(); ++layer, ++n) {
      if (is_norm(*layer->ptr())) seen[n].push_back(a.detach());
      a = layer->forward(a);
    }
    const double weight = static_cast<double>(xs[i].size(0)) / static_cast<double>(x.size(0));
    (gpipe::mse_loss(a, ys[i]) * weight).backward();
    torch::NoGradGuard no_grad;
    for (size_t k = 0; k < saved.size(); ++k) model->buffers()[k].copy_(saved[k]);
  }
  torch::NoGradGuard no_grad;
  for (const auto& [n, inputs] : seen) {
    const torch::Tensor all = torch::cat(inputs).to(torch::kDouble);
    std::vector<int64_t> dims{0};
    for (int64_t d = 2; d < all.dim(); ++d) dims.push_back(d);
    const torch::Tensor mean = all.mean(dims), var = all.var(dims, /*unbiased=*/true);
    auto running = *gpipe::running_statistics(**(model->children().begin() + static_cast<std::ptrdiff_t>(n)));
    running.batches += 1;
    const double f = running.momentum ? *running.momentum : 1.0 / running.batches.item<double>();
    running.mean.copy_(running.mean * (1 - f) + mean.to(torch::kFloat) * f);
    running.var.copy_(running.var * (1 - f) + var.to(torch::kFloat) * f);
  }
}

::testing::AssertionResult same_buffers(const torch::nn::Sequential& a, const torch::nn::Sequential& b) {
  const auto ba = a->named_buffers(), bb = b->named_buffers();
  if (ba.size() != bb.size()) return ::testing::AssertionFailure() << "buffer counts differ";
  for (size_t n = 0; n < ba.size(); ++n) {
    auto r = gpipe::testing::close(ba[n].value(), bb[n].value(), 1e-5);
    if (!r) return ::testing::AssertionFailure() << "buffer " << ba[n].key() << ": " << r.message();
  }
  return ::testing::AssertionSuccess();
}

struct Config {
  int K;
  int M;
  Checkpoint mode;
  ScheduleKind schedule;
  int V = 1;
};

std::string name_of(const Config& c) {
  return "K=" + std::to_string(c.K) + " V=" + std::to_string(c.V) + " M=" + std::to_string(c.M) + " " +
         gpipe::to_string(c.schedule) + " " + gpipe::to_string(c.mode);
}

// Two SGD steps of 10 rows (uneven micro-batches for M = 3 and 4) through the pipeline and on one device.
void expect_as_reference(const Config& c) {
  SCOPED_TRACE(name_of(c));
  torch::nn::Sequential piped = normed_model(), reference = normed_model();
  gpipe::Pipeline pipe(piped, PipelineOptions().devices(c.K).virtual_stages(c.V).micro_batches(c.M).checkpoint(c.mode)
                                  .schedule(c.schedule));
  torch::optim::SGD sgd_piped(pipe.parameters(), 0.1), sgd_reference(reference->parameters(), 0.1);
  torch::manual_seed(5);
  for (int step = 0; step < 2; ++step) {
    const torch::Tensor x = torch::randn({10, 2, 4, 4}) * 2 + 1, y = torch::randn({10, 3});
    sgd_piped.zero_grad();
    sgd_reference.zero_grad();
    pipe.train_step(x, y, gpipe::mse_loss);
    reference_step(reference, x, y, c.M);
    ASSERT_TRUE(gpipe::testing::same_parameters(piped, reference, /*values=*/false, 1e-4)) << "step " << step;
    sgd_piped.step();
    sgd_reference.step();
    ASSERT_TRUE(same_buffers(piped, reference)) << "step " << step;
  }
  EXPECT_TRUE(gpipe::testing::same_parameters(piped, reference, /*values=*/true, 1e-4));
  const auto buffers = piped->named_buffers();
  EXPECT_EQ(buffers["1.num_batches_tracked"].item<int64_t>(), 2) << "one update per mini-batch";
}

TEST(DeferredBatchNormTest, EveryStageCountModeAndScheduleMatchesTheOneDeviceReference) {
  for (int K : {1, 2, 3})
    for (int M : {1, 3, 4})
      for (Checkpoint mode : {Checkpoint::kAlways, Checkpoint::kExceptLast, Checkpoint::kNever})
        for (ScheduleKind schedule : {ScheduleKind::kGPipe, ScheduleKind::k1F1B, ScheduleKind::kZB1P})
          expect_as_reference({K, M, mode, schedule});
}

TEST(DeferredBatchNormTest, InterleavedStagesMatchTheOneDeviceReference) {
  for (Checkpoint mode : {Checkpoint::kAlways, Checkpoint::kExceptLast, Checkpoint::kNever})
    expect_as_reference({2, 4, mode, ScheduleKind::kInterleaved, 2});
}

// Pipelined inference in training mode (forward, as pipe(x) in Python): each micro-batch normalized by
// its own statistics, the running ones updated once from every row, as train_step does; in eval mode untouched.
TEST(DeferredBatchNormTest, ForwardInTrainingModeUpdatesOncePerMiniBatchAsTrainStep) {
  torch::nn::Sequential piped = normed_model(), reference = normed_model();
  gpipe::Pipeline pipe(piped, PipelineOptions().devices(2).micro_batches(4));
  torch::manual_seed(5);
  const torch::Tensor x = torch::randn({10, 2, 4, 4}) * 2 + 1, y = torch::randn({10, 3});
  const torch::Tensor out = pipe.forward(x);
  EXPECT_EQ(out.size(0), 10);
  reference_step(reference, x, y, 4);
  EXPECT_TRUE(same_buffers(piped, reference));
  EXPECT_EQ(piped->named_buffers()["1.num_batches_tracked"].item<int64_t>(), 1) << "one update per mini-batch";
  piped->eval();
  std::vector<torch::Tensor> before;
  for (const auto& b : piped->buffers()) before.push_back(b.clone());
  pipe.forward(x);
  const auto after = piped->buffers();
  for (size_t n = 0; n < before.size(); ++n) EXPECT_TRUE(torch::equal(after[n], before[n])) << "buffer " << n;
}

TEST(DeferredBatchNormTest, PerMicroBatchUpdatesOncePerMicroBatchAsBefore) {
  torch::nn::Sequential model = normed_model();
  gpipe::Pipeline pipe(model, PipelineOptions().devices(2).micro_batches(4).deferred_batch_norm(false));
  torch::manual_seed(5);
  pipe.train_step(torch::randn({10, 2, 4, 4}), torch::randn({10, 3}), gpipe::mse_loss);
  EXPECT_EQ(model->named_buffers()["1.num_batches_tracked"].item<int64_t>(), 4);
}

TEST(DeferredBatchNormTest, AFailedStepLeavesTheRunningStatisticsAsTheyWere) {
  torch::nn::Sequential model = normed_model();
  gpipe::Pipeline pipe(model, PipelineOptions().devices(3).micro_batches(4));
  std::vector<torch::Tensor> before;
  for (const auto& b : model->buffers()) before.push_back(b.clone());
  int calls = 0;
  auto failing = [&calls](const torch::Tensor& out, const torch::Tensor& target) {
    if (++calls == 3) throw std::runtime_error("the loss failed");
    return gpipe::mse_loss(out, target);
  };
  torch::manual_seed(5);
  EXPECT_THROW(pipe.train_step(torch::randn({10, 2, 4, 4}), torch::randn({10, 3}), failing), gpipe::StageError);
  const auto after = model->buffers();
  for (size_t n = 0; n < before.size(); ++n) EXPECT_TRUE(torch::equal(after[n], before[n])) << "buffer " << n;
}

TEST(DeferredBatchNormTest, ABatchNormInEvalModeIsLeftAlone) {
  torch::nn::Sequential model = normed_model();
  (*(model->children().begin() + 1))->eval();  // a frozen BatchNorm2d normalizes by its running statistics
  gpipe::Pipeline pipe(model, PipelineOptions().devices(2).micro_batches(3));
  const torch::Tensor mean = model->named_buffers()["1.running_mean"].clone();
  torch::manual_seed(5);
  pipe.train_step(torch::randn({10, 2, 4, 4}), torch::randn({10, 3}), gpipe::mse_loss);
  EXPECT_TRUE(torch::equal(model->named_buffers()["1.running_mean"], mean));
  EXPECT_EQ(model->named_buffers()["1.num_batches_tracked"].item<int64_t>(), 0);
  EXPECT_EQ(model->named_buffers()["5.num_batches_tracked"].item<int64_t>(), 1);
}

struct Block : torch::nn::Module {
  Block() : linear(register_module("linear", torch::nn::Linear(8, 8))), norm(register_module("norm", torch::nn::BatchNorm1d(8))) {}
  torch::Tensor forward(const torch::Tensor& x) { return norm(linear(x)); }
  torch::nn::Linear linear;
  torch::nn::BatchNorm1d norm;
};

TEST(DeferredBatchNormTest, ABatchNormInsideALayerIsRefusedWithTheFix) {
  torch::nn::Sequential model(torch::nn::Linear(4, 8), std::make_shared<Block>(), torch::nn::Linear(8, 2));
  try {
    gpipe::Pipeline pipe(model, PipelineOptions().devices(2).micro_batches(2));
    FAIL() << "a nested BatchNorm was accepted";
  } catch (const std::invalid_argument& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("1.norm"), std::string::npos) << what;
    EXPECT_NE(what.find("`deferred_batch_norm=false`"), std::string::npos) << what;
  }
  gpipe::Pipeline per_micro_batch(model, PipelineOptions().devices(2).micro_batches(2).deferred_batch_norm(false));
  EXPECT_EQ(per_micro_batch.stages(), 2);
}

// In evaluation a nested BatchNorm only reads its running statistics: the model is taken, and its
// inference and eval-mode steps run; put in training mode later, its next step is refused before
// any work, its parameters and statistics as they were.
TEST(DeferredBatchNormTest, ANestedBatchNormInEvaluationIsTakenAndRefusedOnceTrained) {
  torch::nn::Sequential model(torch::nn::Linear(4, 8), std::make_shared<Block>(), torch::nn::Linear(8, 2));
  model->eval();
  gpipe::Pipeline pipe(model, PipelineOptions().devices(2).micro_batches(2));
  torch::manual_seed(3);
  const torch::Tensor x = torch::randn({6, 4}), y = torch::randn({6, 2});
  EXPECT_EQ(pipe.forward(x).sizes(), (std::vector<int64_t>{6, 2}));
  pipe.train_step(x, y, gpipe::mse_loss);  // frozen statistics, as fine-tuning runs
  const torch::Tensor mean = model->named_buffers()["1.norm.running_mean"].clone();
  model->train();
  gpipe::testing::expect_invalid([&] { pipe.train_step(x, y, gpipe::mse_loss); }, "1.norm");
  EXPECT_TRUE(torch::equal(model->named_buffers()["1.norm.running_mean"], mean));
}

// One BatchNorm module at two places of the model, on two stages: two threads would update one
// set of running statistics at once, so the pipeline refuses it; on one stage it trains.
TEST(DeferredBatchNormTest, ABatchNormSharedByTwoStagesIsRefused) {
  torch::nn::BatchNorm1d norm(8);
  torch::nn::Sequential model(torch::nn::Linear(4, 8), norm, torch::nn::Linear(8, 8), norm, torch::nn::Linear(8, 2));
  try {
    gpipe::Pipeline pipe(model, PipelineOptions().balance({2, 3}).micro_batches(2));
    FAIL() << "a BatchNorm shared by two stages was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("is used by stages 0 and 1"), std::string::npos) << e.what();
  }
  gpipe::Pipeline one_stage(model, PipelineOptions().balance({5}).micro_batches(2));
  one_stage.train_step(torch::randn({6, 4}), torch::randn({6, 2}), gpipe::mse_loss);
  EXPECT_EQ(norm->num_batches_tracked.item<int64_t>(), 2) << "used twice in the step, updated twice";
  EXPECT_EQ(gpipe::shared_tensors(model, /*buffers=*/true).size(), 3u);
}

// A micro-batch of one row cannot be normalized by its own statistics: the error says what to change.
TEST(DeferredBatchNormTest, AOneRowMicroBatchNamesTheFix) {
  torch::nn::Sequential model = normed_model();
  gpipe::Pipeline pipe(model, PipelineOptions().devices(2).micro_batches(4));
  try {
    pipe.train_step(torch::randn({4, 2, 4, 4}), torch::randn({4, 3}), gpipe::mse_loss);
    FAIL() << "one row per micro-batch was accepted";
  } catch (const gpipe::StageError& e) {
    EXPECT_NE(std::string(e.what()).find("use fewer micro-batches or larger batches"), std::string::npos) << e.what();
  }
}

}  // namespace
