// The residual network and the U-Net of models.h: their shapes, and one pipelined step of each,
// BatchNorm and skip connections crossing stages, against the same model on one device.
#include "helpers.h"

#include <gpipe/microbatch.h>

namespace {

using gpipe::PipelineOptions;

TEST(ModelsTest, ShapesAndLayerCounts) {
  torch::NoGradGuard no_grad;
  const torch::Tensor x = torch::randn({3, 1, 28, 28});
  torch::nn::Sequential resnet = gpipe::fashion_resnet(), unet = gpipe::fashion_unet();
  EXPECT_EQ(static_cast<int>(resnet->size()), gpipe::kFashionResnetLayers);
  EXPECT_EQ(static_cast<int>(unet->size()), gpipe::kFashionUnetLayers);
  EXPECT_EQ(resnet->forward(x).sizes(), (std::vector<int64_t>{3, 10}));
  EXPECT_EQ(unet->forward(x).sizes(), x.sizes());
  EXPECT_EQ(gpipe::skip_connections(resnet).size(), 3u);
  EXPECT_EQ(gpipe::skip_connections(unet).size(), 2u);
}

// The cost model profiles layer by layer; a Pop finds what its Stash put, on every pass.
TEST(ModelsTest, TheCostModelProfilesModelsWithSkips) {
  for (const auto& m : {gpipe::fashion_resnet(), gpipe::fashion_unet()}) {
    const torch::Tensor x = torch::randn({2, 1, 28, 28});
    const gpipe::CostModel costs = gpipe::profile_layers(m, x, 1, 1, 0, 1);
    EXPECT_EQ(costs.layers.size(), m->size());
  }
}

// The gradient of one step on one device, each micro-batch normalized by its own statistics.
void micro_batch_reference(torch::nn::Sequential model, const torch::Tensor& x, const torch::Tensor& y, int M,
                           const gpipe::LossFn& loss) {
  std::vector<torch::Tensor> saved;
  for (const auto& b : model->buffers()) saved.push_back(b.clone());
  const auto xs = gpipe::scatter(x, M), ys = gpipe::scatter(y, M);
  for (size_t i = 0; i < xs.size(); ++i)
    (loss(model->forward(xs[i]), ys[i]) * (static_cast<double>(xs[i].size(0)) / static_cast<double>(x.size(0))))
        .backward();
  torch::NoGradGuard no_grad;
  for (size_t n = 0; n < saved.size(); ++n) model->buffers()[n].copy_(saved[n]);
}

TEST(ModelsTest, ResNetOnThreeStagesHasOneDevicesGradients) {
  for (gpipe::ScheduleKind schedule : {gpipe::ScheduleKind::kGPipe, gpipe::ScheduleKind::kZB1P}) {
    SCOPED_TRACE(gpipe::to_string(schedule));
    torch::manual_seed(1);
    torch::nn::Sequential piped = gpipe::fashion_resnet();
    torch::manual_seed(1);
    torch::nn::Sequential reference = gpipe::fashion_resnet();
    // Cuts inside blocks: a residual connection crosses from stage 0 to 1 and from 1 to 2.
    gpipe::Pipeline pipe(piped, PipelineOptions().balance({5, 12, 13}).micro_batches(3).schedule(schedule)
                                    .checkpoint(gpipe::Checkpoint::kExceptLast));
    EXPECT_GE(pipe.schedule().skips.size(), 2u);
    const torch::Tensor x = torch::randn({9, 1, 28, 28}), y = torch::randint(10, {9}, torch::kLong);
    pipe.train_step(x, y, gpipe::cross_entropy_loss);
    micro_batch_reference(reference, x, y, 3, gpipe::cross_entropy_loss);
    EXPECT_TRUE(gpipe::testing::same_parameters(piped, reference, /*values=*/false, 1e-4));
    EXPECT_GT(pipe.skip_bytes(), 0);
  }
}

TEST(ModelsTest, UNetOnThreeStagesHasOneDevicesGradients) {
  torch::manual_seed(2);
  torch::nn::Sequential piped = gpipe::fashion_unet();
  torch::manual_seed(2);
  torch::nn::Sequential reference = gpipe::fashion_unet();
  // Cut so that both long skips cross: "28" from stage 0 to 2, "14" from stage 1 to 2.
  gpipe::Pipeline pipe(piped, PipelineOptions().balance({5, 10, 14}).micro_batches(2).checkpoint(gpipe::Checkpoint::kAlways));
  const torch::Tensor x = torch::randn({4, 1, 28, 28}), y = torch::randn({4, 1, 28, 28});
  const double loss = pipe.train_step(x, y, gpipe::mse_loss).item<double>();
  const double expected = gpipe::testing::reference_step(reference, x, y, gpipe::mse_loss).item<double>();
  EXPECT_NEAR(loss, expected, 1e-5 * expected);
  EXPECT_TRUE(gpipe::testing::same_parameters(piped, reference, /*values=*/false, 1e-4));
  // Both long skips cross stages: [4, 16, 28, 28] and [4, 32, 14, 14] floats out, as many gradient floats back.
  EXPECT_EQ(pipe.skip_bytes(), 2 * 4 * (4 * 16 * 28 * 28 + 4 * 32 * 14 * 14));
}

}  // namespace
