// Skip connections across stages: stash and pop by name, the tensor sent straight to the popping
// stage and its gradient straight back, exact against the same model on one device.
#include "helpers.h"

namespace {

using gpipe::Checkpoint;
using gpipe::PipelineOptions;
using gpipe::ScheduleKind;

// 12 layers with two nested skip connections, a residual one ("r", added) inside a long one
// ("u", concatenated), and one that starts and ends inside one layer's own forward.
struct InnerSkipImpl : torch::nn::Module {
  InnerSkipImpl()
      : linear(register_module("linear", torch::nn::Linear(16, 16))),
        stash(register_module("stash", gpipe::Stash("inner"))),
        pop(register_module("pop", gpipe::Pop("inner"))) {}
  torch::Tensor forward(const torch::Tensor& x) { return pop(torch::tanh(linear(stash(x)))); }
  torch::nn::Linear linear;
  gpipe::Stash stash;
  gpipe::Pop pop;
};
TORCH_MODULE(InnerSkip);

torch::nn::Sequential skipped_model(uint64_t seed) {
  namespace nn = torch::nn;
  torch::manual_seed(seed);
  return nn::Sequential(nn::Linear(6, 16), gpipe::Stash("u"), nn::Tanh(), nn::Linear(16, 16), gpipe::Stash("r"),
                        nn::ReLU(), nn::Linear(16, 16), gpipe::Pop("r"), InnerSkip(), nn::Linear(16, 8),
                        gpipe::Pop("u", gpipe::concat_skip), nn::Linear(24, 3));
}

TEST(SkipTest, OnOneDeviceStashAndPopAreTheModelsOwnForward) {
  torch::nn::Sequential m = skipped_model(1);
  const torch::Tensor x = torch::randn({5, 6});
  auto layer = [&](int n) { return *(m->begin() + n); };
  torch::Tensor u = layer(0).forward(x);
  torch::Tensor h = layer(3).forward(torch::tanh(u));
  torch::Tensor r = h;
  h = layer(6).forward(torch::relu(h)) + r;
  h = layer(8).forward(h);
  h = torch::cat({layer(9).forward(h), u}, 1);
  EXPECT_TRUE(torch::allclose(m->forward(x), layer(11).forward(h)));
}

struct Config {
  int K, M;
  Checkpoint mode;
  ScheduleKind schedule;
  int V = 1;
};

// Three SGD steps of 11 rows: every gradient and value as on one device.
void expect_as_one_device(const Config& c) {
  SCOPED_TRACE("K=" + std::to_string(c.K) + " V=" + std::to_string(c.V) + " M=" + std::to_string(c.M) + " " +
               gpipe::to_string(c.schedule) + " " + gpipe::to_string(c.mode));
  torch::nn::Sequential piped = skipped_model(3), reference = skipped_model(3);
  gpipe::Pipeline pipe(piped, PipelineOptions().devices(c.K).virtual_stages(c.V).micro_batches(c.M).checkpoint(c.mode)
                                  .schedule(c.schedule));
  torch::optim::SGD sgd_piped(pipe.parameters(), 0.05), sgd_reference(reference->parameters(), 0.05);
  for (int step = 0; step < 3; ++step) {
    torch::manual_seed(30 + step);
    const torch::Tensor x = torch::randn({11, 6}), y = torch::randn({11, 3});
    sgd_piped.zero_grad();
    sgd_reference.zero_grad();
    const double loss = pipe.train_step(x, y, gpipe::mse_loss).item<double>();
    const double expected = gpipe::testing::reference_step(reference, x, y, gpipe::mse_loss).item<double>();
    EXPECT_NEAR(loss, expected, 1e-5 * std::abs(expected));
    ASSERT_TRUE(gpipe::testing::same_parameters(piped, reference, /*values=*/false)) << "step " << step;
    sgd_piped.step();
    sgd_reference.step();
  }
  EXPECT_TRUE(gpipe::testing::same_parameters(piped, reference, /*values=*/true));
  const torch::Tensor x = torch::randn({9, 6});
  EXPECT_TRUE(gpipe::testing::close(pipe.forward(x), reference->forward(x))) << "inference";
}

TEST(SkipTest, EveryStageCountModeAndScheduleMatchesOneDevice) {
  for (int K : {1, 2, 3, 4})
    for (int M : {1, 4})
      for (Checkpoint mode : {Checkpoint::kAlways, Checkpoint::kExceptLast, Checkpoint::kNever})
        for (ScheduleKind schedule : {ScheduleKind::kGPipe, ScheduleKind::k1F1B, ScheduleKind::kZB1P})
          expect_as_one_device({K, M, mode, schedule});
  for (Checkpoint mode : {Checkpoint::kAlways, Checkpoint::kNever})
    expect_as_one_device({2, 4, mode, ScheduleKind::kInterleaved, 2});
  // ZB-V and V-Half: some routes join two stages of one device (handed over there), others cross devices.
  for (int K : {1, 2, 3})
    for (Checkpoint mode : {Checkpoint::kAlways, Checkpoint::kExceptLast, Checkpoint::kNever})
      for (ScheduleKind v : {ScheduleKind::kZBV, ScheduleKind::kVHalf}) expect_as_one_device({K, 4, mode, v, 2});
}

// Stage 0 stashes "u" and stage 2 pops it: the message goes from 0 to 2, and stage 1 never sees it.
TEST(SkipTest, AStashedTensorGoesStraightToThePoppingStage) {
  gpipe::Pipeline pipe(skipped_model(1), PipelineOptions().balance({2, 6, 4}).micro_batches(2));
  const gpipe::Schedule& program = pipe.schedule();
  ASSERT_EQ(program.skips.size(), 1u);
  EXPECT_EQ(program.skips[0].from, 0);
  EXPECT_EQ(program.skips[0].to, 2);
  auto has = [&](int device, const std::string& text) {
    for (const auto& a : program.actions[static_cast<size_t>(device)])
      if (a.str() == text) return true;
    return false;
  };
  EXPECT_TRUE(has(0, "0SEND_S0.1>2"));
  EXPECT_TRUE(has(2, "2RECV_S0.1<0"));
  EXPECT_TRUE(has(2, "2SEND_G0.1>0"));
  EXPECT_TRUE(has(0, "0RECV_G0.1<2"));
  for (const auto& a : program.actions[1]) EXPECT_LT(gpipe::skip_of(a.channel), 0) << a.str();
  EXPECT_EQ(gpipe::Action::parse("0SEND_S0.1>2").str(), "0SEND_S0.1>2");
}

TEST(SkipTest, SkipsThatDoNotConnectAreRefusedNamingLayersAndName) {
  namespace nn = torch::nn;
  const auto refused = [](nn::Sequential model, const std::string& words) {
    try {
      gpipe::Pipeline pipe(model, PipelineOptions().devices(2));
      ADD_FAILURE() << "accepted: " << words;
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(words), std::string::npos) << e.what();
    }
  };
  refused(nn::Sequential(nn::Linear(4, 4), gpipe::Pop("a"), nn::Linear(4, 4)),
          "Pop(\"a\") at layer 1 has no Stash(\"a\") before it");
  refused(nn::Sequential(gpipe::Stash("a"), nn::Linear(4, 4), gpipe::Stash("a"), gpipe::Pop("a")),
          "the name \"a\" is stashed twice, by layers 0 and 2");
  refused(nn::Sequential(gpipe::Stash("a"), nn::Linear(4, 4), nn::Linear(4, 4)),
          "Stash(\"a\") at layer 0 is never popped");
  refused(nn::Sequential(gpipe::Pop("a"), nn::Linear(4, 4), gpipe::Stash("a")),
          "Pop(\"a\") at layer 0 comes before its Stash(\"a\") at layer 2");
}

}  // namespace
