// precision_test.cc: PipelineOptions::precision. Under bf16 each stage's forward (and its recompute
// and the loss) runs under autocast to bfloat16, as torch.autocast runs a model on one device; the
// pipeline is compared with the same model under the same autocast on one device, parameter by
// parameter, for K = 2 and 3, every schedule family, with re-materialization.
//
// The tolerance: bfloat16 keeps 8 significant bits (unit roundoff 2^-9 = 0.2%). A micro-batch's
// rows go through the same products as the whole batch's, but a weight's gradient is a product over
// the rows: one bfloat16 product over the batch on one device, M products over each micro-batch's
// rows, each rounded to bfloat16, summed in float32 by the pipeline. Each such gradient entry differs
// by a few roundings of its partial sums, so by up to about 2^-7 of the gradient's scale; the test
// allows 2^-5 (3%) of each gradient's largest entry. That the comparison can fail: the same
// pipeline in fp32 differs from the bf16 one on one device by more than 1e-4 of the scale.
#include "helpers.h"
#include "runtime/autocast.h"  // the one device's autocast, as the pipeline's stages set it

#include <gpipe/gpipe.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

namespace {

using gpipe::PipelineOptions;
using gpipe::Precision;
using gpipe::testing::small_mlp;

const gpipe::LossFn mse = [](const torch::Tensor& out, const torch::Tensor& y) { return torch::mse_loss(out, y); };

constexpr double kBf16Tolerance = 1.0 / 32;

// One step of `model` on one device under CPU autocast to bfloat16, as torch.autocast("cpu") runs it:
// the forward and the loss inside, the backward outside.
// (Python's test compares with torch.autocast itself: tests/python/test_training.py.)
torch::Tensor reference_bf16_step(torch::nn::Sequential model, const torch::Tensor& x, const torch::Tensor& y) {
  torch::Tensor loss;
  {
    const gpipe::AutocastScope autocast(Precision::kBFloat16, c10::DeviceType::CPU);
    loss = mse(model->forward(x), y);
  }
  loss.backward();
  return loss.detach();
}

struct Family {
  gpipe::ScheduleKind kind;
  gpipe::Checkpoint checkpoint;
};

TEST(PrecisionTest, Bf16PipelineMatchesOneDeviceUnderTheSameAutocast) {
  const std::vector<Family> families = {
      {gpipe::ScheduleKind::kGPipe, gpipe::Checkpoint::kAlways},
      {gpipe::ScheduleKind::k1F1B, gpipe::Checkpoint::kExceptLast},
      {gpipe::ScheduleKind::kInterleaved, gpipe::Checkpoint::kAlways},
      {gpipe::ScheduleKind::kZB1P, gpipe::Checkpoint::kNever},
      {gpipe::ScheduleKind::kZBV, gpipe::Checkpoint::kAlways},
  };
  for (const int K : {2, 3}) {
    for (const Family& f : families) {
      SCOPED_TRACE("K=" + std::to_string(K) + " " + gpipe::to_string(f.kind) + " " + gpipe::to_string(f.checkpoint));
      const int V = gpipe::default_virtual_stages(f.kind);
      if (K * V > 7) continue;  // small_mlp has 7 layers
      auto model = small_mlp(1), reference = small_mlp(1);
      gpipe::Pipeline pipe(model, PipelineOptions()
                                      .devices(K)
                                      .virtual_stages(V)
                                      .schedule(f.kind)
                                      .checkpoint(f.checkpoint)
                                      .micro_batches(6)  // a multiple of every K
                                      .precision(Precision::kBFloat16));
      EXPECT_EQ(pipe.plan().precision, Precision::kBFloat16);
      torch::manual_seed(2);
      const torch::Tensor x = torch::randn({18, 12}), y = torch::randn({18, 4});
      const torch::Tensor loss = pipe.train_step(x, y, mse);
      const torch::Tensor expected = reference_bf16_step(reference, x, y);
      EXPECT_TRUE(gpipe::testing::close(loss.to(torch::kFloat), expected.to(torch::kFloat), kBf16Tolerance));
      EXPECT_TRUE(gpipe::testing::same_parameters(model, reference, /*values=*/false, kBf16Tolerance));
      for (const auto& p : model->parameters()) {  // the parameters and their gradients stay float32
        EXPECT_EQ(p.scalar_type(), torch::kFloat);
        EXPECT_EQ(p.grad().scalar_type(), torch::kFloat);
      }
    }
  }
}

// The comparison above can fail: a float32 pipeline is not the bf16 model, and the bf16 pipeline is
// not the float32 one (autocast did run), both by more than float32's rounding.
TEST(PrecisionTest, Bf16DiffersFromFloat32) {
  auto fp32 = small_mlp(1), bf16 = small_mlp(1), reference = small_mlp(1);
  torch::manual_seed(2);
  const torch::Tensor x = torch::randn({16, 12}), y = torch::randn({16, 4});
  gpipe::Pipeline(fp32, PipelineOptions().devices(2).micro_batches(4)).train_step(x, y, mse);
  gpipe::Pipeline(bf16, PipelineOptions().devices(2).micro_batches(4).precision(Precision::kBFloat16))
      .train_step(x, y, mse);
  reference_bf16_step(reference, x, y);
  EXPECT_FALSE(gpipe::testing::same_parameters(fp32, reference, /*values=*/false, 1e-4));
  EXPECT_FALSE(gpipe::testing::same_parameters(bf16, fp32, /*values=*/false, 1e-4));
}

// Re-materialization recomputes under the same autocast: a bf16 step that recomputes every
// micro-batch's forward equals, to the bit, one that keeps every activation.
TEST(PrecisionTest, RecomputeRunsUnderTheSameAutocast) {
  auto kept = small_mlp(1), recomputed = small_mlp(1);
  torch::manual_seed(2);
  const torch::Tensor x = torch::randn({16, 12}), y = torch::randn({16, 4});
  const auto options = [](gpipe::Checkpoint mode) {
    return PipelineOptions().devices(2).micro_batches(4).checkpoint(mode).precision(Precision::kBFloat16);
  };
  gpipe::Pipeline(kept, options(gpipe::Checkpoint::kNever)).train_step(x, y, mse);
  gpipe::Pipeline(recomputed, options(gpipe::Checkpoint::kAlways)).train_step(x, y, mse);
  EXPECT_TRUE(gpipe::testing::same_parameters(recomputed, kept, /*values=*/false, /*tol=*/0.0));
}

// What crosses between stages crosses in the type it has: a bfloat16 activation, and its gradient.
TEST(PrecisionTest, ActivationsCrossInBfloat16AndAutocastEndsWithTheStep) {
  auto model = small_mlp(1);
  gpipe::Pipeline pipe(model, PipelineOptions().devices(2).balance({1, 6}).micro_batches(2).precision(Precision::kBFloat16));
  torch::manual_seed(2);
  const torch::Tensor x = torch::randn({4, 12}), y = torch::randn({4, 4});
  const torch::Tensor out = pipe.forward(x);
  EXPECT_EQ(out.scalar_type(), torch::kBFloat16);  // the last Linear ran in bfloat16
  pipe.train_step(x, y, mse);
  EXPECT_EQ(torch::matmul(x, x.t()).scalar_type(), torch::kFloat);  // the caller's thread is left as it was
}

// The precision is part of the pipeline's value: written and read back by the one serializer, and an
// older record without it reads as fp32.
TEST(PrecisionTest, ConfigCarriesThePrecision) {
  gpipe::PipelineConfig c;
  c.devices = 2;
  c.balance = {3, 4};
  c.precision = Precision::kBFloat16;
  const gpipe::Fields fields = gpipe::fields_of(c);
  EXPECT_EQ(gpipe::config_of(gpipe::fields_of_text(gpipe::text_of(fields), "t"), "t").precision, Precision::kBFloat16);
  gpipe::Fields old;
  for (const auto& field : fields)
    if (field.first != "precision") old.push_back(field);
  EXPECT_EQ(gpipe::config_of(old, "t").precision, Precision::kFloat32);
  gpipe::Fields wrong = fields;
  for (auto& field : wrong)
    if (field.first == "precision") field.second = std::string("fp8");
  EXPECT_THROW(gpipe::config_of(wrong, "t"), std::runtime_error);
  EXPECT_EQ(gpipe::parse_precision("bf16"), Precision::kBFloat16);
  EXPECT_THROW(gpipe::parse_precision("half"), std::invalid_argument);
}

}  // namespace
