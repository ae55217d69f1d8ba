// cost_model_test.cc: the cost model's predicted peak bytes against the tracking allocator's
// measurement of real steps (deterministic: allocation sizes do not depend on timing), its
// Transformer formulas against libtorch's layer, and the byte sizes it reads and writes.
#include "helpers.h"

#include <gpipe/cost_model.h>

namespace gpipe::testing {
namespace {

// A Linear+ReLU chain whose activations outweigh its weights' gradients (as in the models the
// cost model is for: a micro-batch of 128 rows against a width of 64).
constexpr int64_t kWidth = 64, kRows = 128;

torch::nn::Sequential wide_mlp() {
  torch::manual_seed(3);
  torch::nn::Sequential m;
  for (int l = 0; l < 16; ++l) {
    m->push_back(torch::nn::Linear(kWidth, kWidth));
    m->push_back(torch::nn::ReLU());
  }
  return m;
}

struct Case {
  int K, M, V;
  ScheduleKind schedule;
  Checkpoint mode;
};

std::string name_of(const Case& c) {
  return "K=" + std::to_string(c.K) + " M=" + std::to_string(c.M) + " " + to_string(c.schedule) + " " +
         to_string(c.mode);
}

// Measured and predicted peak bytes per device for one configuration.
// Within 15%, and with K > 1 within M boundary tensors more: a boundary tensor counts on the stage
// that made it until the other stage has used it, and how many are alive at a stage's peak depends
// on the threads' timing, which the simulation only approximates (here a boundary tensor is 32 KiB
// against stage peaks of 150-700 KiB; runs differ by up to two).
void expect_predicted_peaks(const torch::nn::Sequential& model, const torch::Tensor& x, const torch::Tensor& y,
                            const LossFn& loss, const CostModel& costs, const Case& c, double tolerance = 0.15) {
  const std::vector<int> balance = even_balance(static_cast<int>(model->size()), c.K * c.V);
  Pipeline pipe(model, PipelineOptions()
                           .balance(balance)
                           .chunks(c.M)
                           .checkpoint(c.mode)
                           .schedule(c.schedule)
                           .virtual_stages(c.V)
                           .track_memory(true));
  // The largest of three steps after the first (which allocates the gradients): which device frees a
  // boundary tensor first depends on the threads' timing, so one step may hold a tensor more.
  pipe.train_step(x, y, loss);
  std::vector<Pipeline::StageMemory> measured;
  for (int step = 0; step < 3; ++step) {
    pipe.train_step(x, y, loss);
    const auto now = pipe.memory();
    measured.resize(now.size());
    for (size_t d = 0; d < now.size(); ++d) {
      measured[d].peak_bytes = std::max(measured[d].peak_bytes, now[d].peak_bytes);
      measured[d].parameter_bytes = now[d].parameter_bytes;
    }
  }
  const Prediction p = predict(costs, balance, pipe.schedule(), chunk_sizes(x.size(0), c.M));
  ASSERT_EQ(p.peak_bytes.size(), measured.size()) << name_of(c);
  for (size_t d = 0; d < measured.size(); ++d) {
    const double got = static_cast<double>(measured[d].peak_bytes);
    const double want = static_cast<double>(p.peak_bytes[d]);
    const double boundary = static_cast<double>(x.size(1) * x.element_size()) * static_cast<double>(x.size(0)) / c.M;
    const double slack = tolerance * got + (c.K > 1 ? c.M * boundary : 0.0);
    EXPECT_NEAR(want, got, slack) << name_of(c) << ", device " << d << ": predicted " << want << " bytes, measured "
                                  << got;
    EXPECT_EQ(p.static_bytes[d], measured[d].parameter_bytes) << name_of(c) << ", device " << d
                                                               << ": parameters and gradients (plain SGD)";
  }
}

TEST(CostModelTest, PredictedPeakBytesMatchTheTrackingAllocatorForEveryScheduleAndMode) {
  const torch::nn::Sequential model = wide_mlp();
  torch::manual_seed(4);
  const torch::Tensor x = torch::randn({4 * kRows, kWidth}), y = torch::randn({4 * kRows, kWidth});
  const CostModel costs = profile_layers(model, x.narrow(0, 0, kRows), 1, /*state_per_parameter_byte=*/1, 1, 3,
                                         mse_loss, y.narrow(0, 0, kRows));
  for (auto mode : {Checkpoint::kNever, Checkpoint::kExceptLast, Checkpoint::kAlways}) {
    for (int K : {1, 2, 3})
      for (auto schedule : {ScheduleKind::kGPipe, ScheduleKind::k1F1B})
        expect_predicted_peaks(model, x, y, mse_loss, costs, {K, 4, 1, schedule, mode});
    expect_predicted_peaks(model, x, y, mse_loss, costs, {2, 4, 2, ScheduleKind::kInterleaved, mode});
  }
}

TEST(CostModelTest, TheBackwardSplitsMemoryIsPredictedWithinAThird) {
  // zb1p keeps what W needs from I to W; the model counts each layer's recorded input, its
  // output's gradient and what its graph keeps, which overstates a chain of small layers.
  const torch::nn::Sequential model = wide_mlp();
  torch::manual_seed(4);
  const torch::Tensor x = torch::randn({4 * kRows, kWidth}), y = torch::randn({4 * kRows, kWidth});
  const CostModel costs = profile_layers(model, x.narrow(0, 0, kRows), 1, 1);
  for (auto mode : {Checkpoint::kNever, Checkpoint::kAlways})
    expect_predicted_peaks(model, x, y, mse_loss, costs, {2, 4, 1, ScheduleKind::kZB1P, mode}, 0.35);
}

TEST(CostModelTest, FillDrainHoldsEveryMicroBatchAndOneFOneBOnlyKMinusD) {
  // Without re-materialization, one device under fill-drain holds all M micro-batches' activations
  // at once, under 1F1B one: the prediction says so before anything runs.
  const torch::nn::Sequential model = wide_mlp();
  torch::manual_seed(4);
  const CostModel costs = profile_layers(model, torch::randn({kRows, kWidth}), 1, 1);
  const std::vector<int64_t> rows(8, kRows);
  const Prediction fill = predict(costs, {32}, lower(fill_drain(1, 8), Checkpoint::kNever), rows);
  const Prediction one = predict(costs, {32}, lower(one_f_one_b(1, 8), Checkpoint::kNever), rows);
  EXPECT_GT(fill.peak_bytes[0], 5 * one.peak_bytes[0]);
  const Prediction always = predict(costs, {32}, lower(fill_drain(1, 8), Checkpoint::kAlways), rows);
  EXPECT_LT(always.peak_bytes[0], fill.peak_bytes[0] / 3);
}

TEST(CostModelTest, TransformerFormulasMatchLibtorchsLayer) {
  for (auto [width, heads, ffn, sequence] :
       std::vector<std::array<int64_t, 4>>{{64, 4, 256, 16}, {128, 8, 256, 32}, {96, 2, 160, 24}}) {
    const TransformerShape shape{2, width, heads, ffn, 50, sequence};
    torch::nn::Sequential model;
    model->push_back(torch::nn::Embedding(shape.vocab, width));
    model->push_back(EncoderBlock(width, heads, ffn, 0.0));
    model->push_back(EncoderBlock(width, heads, ffn, 0.0));
    model->push_back(torch::nn::Linear(width, shape.vocab));
    int64_t parameters = 0;
    for (const auto& p : model->parameters()) parameters += p.numel();
    EXPECT_EQ(shape.parameters(), parameters) << "width " << width;
    const CostModel profiled = profile_layers(model, torch::randint(shape.vocab, {4, sequence}), 1, 3);
    const CostModel formula = transformer_costs(shape, DeviceSpec{1e12}, 3);
    ASSERT_EQ(formula.layer_count(), profiled.layer_count());
    const LayerCost& got = profiled.layers[2];
    const LayerCost& want = formula.layers[2];
    EXPECT_EQ(want.parameter_bytes, got.parameter_bytes);
    EXPECT_NEAR(want.kept_bytes / got.kept_bytes, 1.0, 0.02) << "width " << width << ": formula " << want.kept_bytes
                                                             << " bytes per sample, measured " << got.kept_bytes;
    EXPECT_NEAR(want.weight_kept_bytes / got.weight_kept_bytes, 1.0, 0.02) << "width " << width;
    EXPECT_EQ(want.output_bytes, got.output_bytes);
  }
}

TEST(CostModelTest, BytesParseAndPrint) {
  EXPECT_EQ(parse_bytes("16GiB"), int64_t{16} << 30);
  EXPECT_EQ(parse_bytes("512MiB"), int64_t{512} << 20);
  EXPECT_EQ(parse_bytes("1.5GB"), 1500000000);
  EXPECT_EQ(parse_bytes("4096"), 4096);
  EXPECT_EQ(parse_bytes("2 KiB"), 2048);
  for (const char* bad : {"", "GiB", "-1GiB", "16 gigs", "nan", "1e30TB", "0", "0.1"})
    EXPECT_THROW(parse_bytes(bad), std::invalid_argument) << bad;
  EXPECT_EQ(format_bytes(41.2 * (1 << 30)), "41.2 GiB");
  EXPECT_EQ(format_bytes(512), "512 B");
}

TEST(CostModelTest, MismatchedInputsAreRefused) {
  const CostModel costs = profile_layers(wide_mlp(), torch::randn({4, kWidth}), 1, 1);
  const std::vector<int64_t> rows(4, 4);
  EXPECT_THROW(predict(costs, {16, 16}, lower(fill_drain(3, 4), Checkpoint::kNever), rows), std::invalid_argument);
  EXPECT_THROW(predict(costs, {16, 15}, lower(fill_drain(2, 4), Checkpoint::kNever), rows), std::invalid_argument);
  EXPECT_THROW(predict(costs, {16, 16}, lower(fill_drain(2, 3), Checkpoint::kNever), rows), std::invalid_argument);
}

}  // namespace
}  // namespace gpipe::testing
