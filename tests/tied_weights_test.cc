// Tied weights across stages: a parameter that layers on two stages use gets one gradient, the sum
// of its uses, and one update, as on one device.
#include "helpers.h"

namespace {

using gpipe::Checkpoint;
using gpipe::PipelineOptions;
using gpipe::ScheduleKind;

// Embedding, 4 encoder blocks, and an output projection that reads the embedding's weight: 6 layers.
torch::nn::Sequential tied_transformer(uint64_t seed) {
  torch::manual_seed(seed);
  torch::nn::Embedding embedding(gpipe::testing::kVocab, 16);
  torch::nn::Sequential m;
  m->push_back(embedding);
  for (int b = 0; b < 4; ++b) m->push_back(gpipe::EncoderBlock(16, 2, 32, 0.0));
  m->push_back(gpipe::TiedProjection(embedding->weight));
  return m;
}

TEST(TiedWeightsTest, TheProjectionSharesTheEmbeddingsTensor) {
  const torch::nn::Sequential m = tied_transformer(1);
  const auto params = m->named_parameters();
  EXPECT_TRUE(params["0.weight"].is_same(params["5.weight"]));
  gpipe::Pipeline pipe(m, PipelineOptions().devices(2).micro_batches(2));
  const auto unique = pipe.parameters();
  EXPECT_EQ(unique.size() + 1, m->parameters().size()) << "the pipeline's parameters list the tied tensor once";
  int seen = 0;
  for (const auto& p : unique) seen += p.is_same(params["0.weight"]) ? 1 : 0;
  EXPECT_EQ(seen, 1);
}

// Three SGD steps with the first and last stage sharing the embedding, against one device.
TEST(TiedWeightsTest, EveryStageCountModeAndScheduleMatchesOneDevice) {
  struct Config {
    int K, M;
    Checkpoint mode;
    ScheduleKind schedule;
    int V = 1;
  };
  std::vector<Config> configs;
  for (int K : {2, 3})
    for (Checkpoint mode : {Checkpoint::kAlways, Checkpoint::kExceptLast, Checkpoint::kNever})
      for (ScheduleKind schedule : {ScheduleKind::kGPipe, ScheduleKind::k1F1B, ScheduleKind::kZB1P})
        configs.push_back({K, 3, mode, schedule});
  configs.push_back({2, 4, Checkpoint::kExceptLast, ScheduleKind::kInterleaved, 2});
  // ZB-V and V-Half put the last stage (the output projection) on device 0 beside the embedding.
  for (Checkpoint mode : {Checkpoint::kAlways, Checkpoint::kExceptLast, Checkpoint::kNever})
    for (ScheduleKind v : {ScheduleKind::kZBV, ScheduleKind::kVHalf}) configs.push_back({2, 3, mode, v, 2});
  configs.push_back({1, 4, Checkpoint::kAlways, ScheduleKind::kGPipe});
  for (const Config& c : configs) {
    SCOPED_TRACE("K=" + std::to_string(c.K) + " V=" + std::to_string(c.V) + " " + gpipe::to_string(c.schedule) +
                 " " + gpipe::to_string(c.mode));
    torch::nn::Sequential piped = tied_transformer(3), reference = tied_transformer(3);
    gpipe::Pipeline pipe(piped, PipelineOptions().devices(c.K).virtual_stages(c.V).micro_batches(c.M).checkpoint(c.mode)
                                    .schedule(c.schedule));
    // SGD: Adam would turn the key bias's gradient, zero up to rounding (softmax ignores a shift), into whole steps.
    torch::optim::SGD sgd_piped(pipe.parameters(), 0.05), sgd_reference(gpipe::unique_parameters(*reference), 0.05);
    for (int step = 0; step < 3; ++step) {
      torch::manual_seed(20 + step);
      const torch::Tensor x = torch::randint(gpipe::testing::kVocab, {7, 5}, torch::kLong);
      const torch::Tensor y = torch::randint(gpipe::testing::kVocab, {7, 5}, torch::kLong);
      sgd_piped.zero_grad();
      sgd_reference.zero_grad();
      const double loss = pipe.train_step(x, y, gpipe::cross_entropy_loss).item<double>();
      const double expected = gpipe::testing::reference_step(reference, x, y, gpipe::cross_entropy_loss).item<double>();
      EXPECT_NEAR(loss, expected, 1e-5 * std::abs(expected));
      ASSERT_TRUE(gpipe::testing::same_parameters(piped, reference, /*values=*/false, 1e-4)) << "step " << step;
      sgd_piped.step();
      sgd_reference.step();
    }
    EXPECT_TRUE(gpipe::testing::same_parameters(piped, reference, /*values=*/true, 1e-4));
    EXPECT_TRUE(piped->named_parameters()["0.weight"].is_same(piped->named_parameters()["5.weight"]));
  }
}

// The benchmark's transformer with --tie-embeddings: one step on 2 stages, its gradients as one device's.
TEST(TiedWeightsTest, TheTiedBenchmarkTransformerMatchesOneDevice) {
  gpipe::Workload piped = gpipe::make_workload("transformer", 0, {}, /*tie_embeddings=*/true);
  gpipe::Workload reference = gpipe::make_workload("transformer", 0, {}, /*tie_embeddings=*/true);
  ASSERT_EQ(piped.tied.size(), 1u);
  const auto named = piped.model->named_parameters();
  EXPECT_TRUE(named[piped.tied[0][0]].is_same(named[piped.tied[0][1]]));
  gpipe::Pipeline pipe(piped.model, PipelineOptions().balance(piped.balance(2)).micro_batches(4).tied_parameters(piped.tied));
  const torch::Tensor x = piped.input.narrow(0, 0, 8), y = piped.target.narrow(0, 0, 8);
  const double loss = pipe.train_step(x, y, piped.loss).item<double>();
  const double expected = gpipe::testing::reference_step(reference.model, x, y, reference.loss).item<double>();
  EXPECT_NEAR(loss, expected, 1e-5 * expected);
  EXPECT_TRUE(gpipe::testing::same_parameters(piped.model, reference.model, /*values=*/false, 1e-4));
}

TEST(TiedWeightsTest, DeclaredTiesMustBeOneTensorInOneProcess) {
  torch::manual_seed(0);
  torch::nn::Sequential untied(torch::nn::Linear(4, 4), torch::nn::ReLU(), torch::nn::Linear(4, 4));
  const auto refused = [&](std::vector<std::vector<std::string>> tied, const std::string& words) {
    try {
      gpipe::Pipeline pipe(untied, PipelineOptions().devices(2).tied_parameters(std::move(tied)));
      ADD_FAILURE() << "accepted";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(words), std::string::npos) << e.what();
    }
  };
  refused({{"0.weight", "2.weight"}}, "are different tensors");
  refused({{"0.weight", "9.weight"}}, "no parameter 9.weight");
  refused({{"0.weight"}}, "at least two");
  torch::nn::Sequential tied = tied_transformer(1);
  gpipe::Pipeline pipe(tied, PipelineOptions().devices(2).tied_parameters({{"0.weight", "5.weight"}}));
  EXPECT_EQ(pipe.stages(), 2);
}

}  // namespace
