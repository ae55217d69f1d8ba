// tuple_test.cc: several tensors across layer and stage boundaries (hidden states beside a mask, two
// towers, a tensor no later layer differentiates, a whole input beside split ones): every schedule
// and re-materialization mode equals one device, parameter by parameter; bad tuples are named.
#include "helpers.h"

using gpipe::Checkpoint;
using gpipe::PipelineOptions;
using gpipe::ScheduleKind;
using gpipe::Tensors;
using gpipe::testing::close;
using gpipe::testing::Embed;
using gpipe::testing::Masked;
using gpipe::testing::expect_invalid;
using gpipe::testing::same_parameters;

namespace {

using gpipe::testing::kIn;
using gpipe::testing::kOut;
using gpipe::testing::kSeq;
using gpipe::testing::kWidth;
using gpipe::testing::tuple_model;

struct Batch {
  Tensors input;
  torch::Tensor target;
};

Batch batch(int64_t n) {
  torch::manual_seed(100 + n);
  return {Tensors::tuple_of({torch::randn({n, kSeq, kIn}), torch::rand({kIn}) + 0.5}), torch::randn({n, kOut})};
}

torch::Tensor reference_step(torch::nn::Sequential model, const Batch& b) {
  torch::Tensor loss = gpipe::mse_loss(model->forward(b.input.items), b.target);
  loss.backward();
  return loss.detach();
}

PipelineOptions options(ScheduleKind schedule, std::vector<int> balance, int M, Checkpoint mode) {
  return PipelineOptions()
      .balance(std::move(balance))
      .micro_batches(M)
      .checkpoint(mode)
      .schedule(schedule)
      .virtual_stages(gpipe::default_virtual_stages(schedule))
      .whole_inputs({1});
}

// Cuts at tuple boundaries: K stages, or K·2 for the schedules of two stages per device.
std::vector<std::vector<int>> cuts(ScheduleKind schedule) {
  if (gpipe::default_virtual_stages(schedule) == 2) return {{1, 2, 1, 2}, {2, 1, 1, 2}};
  return {{3, 3}, {4, 2}, {1, 3, 2}};
}

TEST(TupleTest, EverySchedulePassesTuplesExactlyAsOneDevice) {
  const Batch b = batch(13);
  auto reference = tuple_model(1);
  const torch::Tensor expected = reference_step(reference, b);
  for (ScheduleKind schedule : gpipe::all_schedules())
    for (const auto& cut : cuts(schedule))
      for (int M : {1, 3, 4})
        for (Checkpoint mode : {Checkpoint::kAlways, Checkpoint::kExceptLast, Checkpoint::kNever}) {
          if (schedule == ScheduleKind::kInterleaved && M % 2 != 0) continue;  // interleaved needs K | M
          const std::string what = gpipe::to_string(schedule) + " cut " + std::to_string(cut.size()) + "/" +
                                   std::to_string(cut.front()) + " M=" + std::to_string(M) + " " + gpipe::to_string(mode);
          auto piped = tuple_model(1);
          gpipe::Pipeline pipe(piped, options(schedule, cut, M, mode));
          const torch::Tensor loss = pipe.train_step(b.input, b.target, gpipe::mse_loss);
          EXPECT_TRUE(close(loss.to(torch::kFloat), expected)) << what;
          EXPECT_TRUE(same_parameters(piped, reference, /*values=*/false)) << what;
        }
}

TEST(TupleTest, ForwardAndEvaluationMatchOneDevice) {
  const Batch b = batch(10);
  auto reference = tuple_model(2);
  torch::NoGradGuard no_grad;
  const torch::Tensor expected = reference->forward(b.input.items);
  auto piped = tuple_model(2);
  gpipe::Pipeline pipe(piped, options(ScheduleKind::k1F1B, {1, 3, 2}, 3, Checkpoint::kNever));
  EXPECT_TRUE(close(pipe.forward(b.input), expected));
}

// Inside a stage too: a split backward (I then W) over layers that pass tuples.
TEST(TupleTest, OneStageSplitsItsBackwardOverTupleLayers) {
  const Batch b = batch(9);
  auto reference = tuple_model(3);
  const torch::Tensor expected = reference_step(reference, b);
  auto piped = tuple_model(3);
  gpipe::Pipeline pipe(piped, options(ScheduleKind::kZB1P, {6}, 3, Checkpoint::kNever));
  EXPECT_TRUE(close(pipe.train_step(b.input, b.target, gpipe::mse_loss).to(torch::kFloat), expected));
  EXPECT_TRUE(same_parameters(piped, reference, /*values=*/false));
}

TEST(TupleTest, BytesSentCountEveryTensorOfATuple) {
  const Batch b = batch(8);
  auto model = tuple_model(4);
  gpipe::Pipeline pipe(model, options(ScheduleKind::kGPipe, {3, 3}, 2, Checkpoint::kNever));
  torch::NoGradGuard no_grad;
  pipe.forward(b.input);
  // Stage 0 hands on (hidden [8, 6, 16] float, mask [8, 6] bool) in all.
  EXPECT_EQ(pipe.bytes_sent(), 8 * kSeq * kWidth * 4 + 8 * kSeq * 1);
}

TEST(TupleTest, TheCostModelCountsEveryTensorOfATuple) {
  const Batch b = batch(4);
  const Tensors sample = Tensors::tuple_of({b.input.items[0], b.input.items[1]});
  const gpipe::CostModel costs =
      gpipe::profile_layers(tuple_model(5), sample, gpipe::ProfileLayersOptions().warmup(0).repetitions(1));
  ASSERT_EQ(costs.layers.size(), 6u);
  // Per row: the embedding's (hidden, mask); the towers' five tensors (three float, positions, mask).
  EXPECT_DOUBLE_EQ(costs.layers[0].output_bytes, kSeq * kWidth * 4 + kSeq);
  EXPECT_DOUBLE_EQ(costs.layers[3].output_bytes, 3 * kSeq * kWidth * 4 + kSeq * 4 + kSeq);
  for (size_t l = 0; l < 6; ++l) EXPECT_GT(costs.layers[l].forward_s, 0) << "layer " << l;
}

std::string error_of(const std::function<void()>& work) {
  try {
    work();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

struct PairImpl : torch::nn::Module {
  std::tuple<torch::Tensor, int64_t> forward(const torch::Tensor& x) { return {x, 3}; }
};
TORCH_MODULE(Pair);

TEST(TupleTest, ALayerThatReturnsSomethingElseOrTakesTheWrongKindIsNamed) {
  const Batch b = batch(6);
  {
    torch::nn::Sequential m(torch::nn::Linear(kIn, kIn), Pair(), torch::nn::Linear(kIn, kOut));
    gpipe::Pipeline pipe(m, PipelineOptions().balance({2, 1}).micro_batches(2));
    const std::string what = error_of([&] { pipe.train_step(torch::randn({6, kIn}), torch::randn({6, kOut}), gpipe::mse_loss); });
    EXPECT_NE(what.find("layer 1 returned std::tuple<"), std::string::npos) << what;
    EXPECT_NE(what.find("not a torch::Tensor or a std::vector<torch::Tensor>"), std::string::npos) << what;
  }
  {
    torch::manual_seed(0);
    torch::nn::Sequential m{Embed(), torch::nn::Linear(kWidth, kOut)};
    gpipe::Pipeline pipe(m, PipelineOptions().balance({1, 1}).micro_batches(2).whole_inputs({1}));
    const std::string what = error_of([&] { pipe.train_step(b.input, b.target, gpipe::mse_loss); });
    EXPECT_NE(what.find("layer 1 does not take a tuple of 2 tensors"), std::string::npos) << what;
    EXPECT_NE(what.find("stage 1"), std::string::npos) << what;
  }
  {
    torch::manual_seed(0);
    torch::nn::Sequential m{Embed(), Masked()};
    gpipe::Pipeline pipe(m, PipelineOptions().balance({1, 1}).micro_batches(2).whole_inputs({1}));
    const std::string what = error_of([&] { pipe.train_step(b.input, b.target, gpipe::mse_loss); });
    EXPECT_NE(what.find("the model's output is a tuple of 2 tensors"), std::string::npos) << what;
  }
}

// Flips the mask in place: inside a stage it changes the layer before's output; at a stage's start
// it runs on a copy of the stage's input, which the backward and a re-materialization start from.
struct FlipImpl : torch::nn::Module {
  std::vector<torch::Tensor> forward(const std::vector<torch::Tensor>& xs) {
    torch::Tensor m = xs.at(1);
    m.logical_not_();
    return {xs.at(0), m};
  }
};
TORCH_MODULE(Flip);

TEST(TupleTest, ALayerThatChangesAKeptStageInputInPlaceTrainsAsOneDevice) {
  const Batch b = batch(6);
  for (Checkpoint mode : {Checkpoint::kAlways, Checkpoint::kExceptLast, Checkpoint::kNever}) {
    SCOPED_TRACE(gpipe::to_string(mode));
    const auto model = [] {
      torch::manual_seed(3);
      return torch::nn::Sequential{Embed(), Flip(), Masked(), gpipe::testing::Towers(), gpipe::testing::Merge(),
                                   torch::nn::Linear(kWidth, kOut)};
    };
    torch::nn::Sequential m = model(), reference = model();
    gpipe::Pipeline pipe(m, PipelineOptions().balance({1, 5}).micro_batches(3).checkpoint(mode).whole_inputs({1}));
    const std::string what = error_of([&] { pipe.train_step(b.input, b.target, gpipe::mse_loss); });
    EXPECT_EQ(what, "");
    reference_step(reference, batch(6));  // a batch of its own: the one-device Flip changes its mask
    EXPECT_TRUE(gpipe::testing::same_parameters(m, reference, /*values=*/false));
  }
}

TEST(TupleTest, TheInputsTuplesBatchDimensionIsChecked) {
  auto m = tuple_model(6);
  const Batch b = batch(6);
  {
    gpipe::Pipeline pipe(m, PipelineOptions().balance({3, 3}).micro_batches(2));  // the scale not named whole
    expect_invalid([&] { pipe.train_step(b.input, b.target, gpipe::mse_loss); },
                   "the input's tensor 1 has 8 rows but its tensor 0 has 6");
  }
  gpipe::Pipeline pipe(m, PipelineOptions().balance({3, 3}).micro_batches(2).whole_inputs({2}));
  expect_invalid([&] { pipe.train_step(b.input, b.target, gpipe::mse_loss); },
                 "whole_inputs names tensor 2 of the input, which is a tuple of 2 tensors");
  gpipe::Pipeline all_whole(m, PipelineOptions().balance({3, 3}).micro_batches(2).whole_inputs({0, 1}));
  expect_invalid([&] { all_whole.forward(b.input); }, "every tensor of the input is named in whole_inputs");
}

}  // namespace
