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

// The most bytes one micro-batch of `rows` rows sends from a stage to later ones: its output and
// what it stashes for them (their gradients come back as large).
double largest_send(const CostModel& costs, const PipelinePlan& plan, int64_t rows) {
  double most = 0;
  for (int s = 0; s + 1 < plan.stages(); ++s) {
    const LayerRange stage = plan.layers_of(s);
    double bytes = costs.layers[static_cast<size_t>(stage.last - 1)].output_bytes;
    for (const SkipCost& skip : costs.skips)
      if (stage.contains(skip.connection.stash_layer) && skip.connection.pop_layer >= stage.last) bytes += skip.bytes;
    most = std::max(most, bytes);
  }
  return most * static_cast<double>(rows);
}

// Measured and predicted peak bytes per device for one configuration: within `tolerance`, and with
// K > 1 within `in_flight` micro-batches' sends more. What a device sends counts on it until the
// receiving stage is done with it, and how many are alive at a device's peak depends on the
// threads' timing, which the simulation only approximates (runs differ by one or two).
void expect_predicted_peaks(const torch::nn::Sequential& model, const torch::Tensor& x, const torch::Tensor& y,
                            const LossFn& loss, const CostModel& costs, const Case& c, double tolerance = 0.15,
                            int in_flight = 0) {
  const std::vector<int> balance = even_balance(static_cast<int>(model->size()), c.K * c.V);
  Pipeline pipe(model, PipelineOptions()
                           .balance(balance)
                           .micro_batches(c.M)
                           .checkpoint(c.mode)
                           .schedule(c.schedule)
                           .virtual_stages(c.V)
                           .track_memory(true));
  // The largest of five steps after the first (which allocates the gradients).
  pipe.train_step(x, y, loss);
  std::vector<Pipeline::DeviceMemory> measured;
  for (int step = 0; step < 5; ++step) {
    pipe.train_step(x, y, loss);
    const auto now = pipe.memory();
    measured.resize(now.size());
    for (size_t d = 0; d < now.size(); ++d) {
      measured[d].peak_bytes = std::max(measured[d].peak_bytes, now[d].peak_bytes);
      measured[d].parameter_bytes = now[d].parameter_bytes;
    }
  }
  const std::vector<int64_t> rows = micro_batch_sizes(x.size(0), c.M);
  const Prediction p = predict(costs, pipe.plan(), rows);
  ASSERT_EQ(p.peak_bytes.size(), measured.size()) << name_of(c);
  const double sends = c.K > 1 ? in_flight * largest_send(costs, pipe.plan(), rows.front()) : 0.0;
  for (size_t d = 0; d < measured.size(); ++d) {
    const double got = static_cast<double>(measured[d].peak_bytes);
    const double want = static_cast<double>(p.peak_bytes[d]);
    EXPECT_NEAR(want, got, tolerance * got + sends) << name_of(c) << ", device " << d << ": predicted " << want
                                                     << " bytes, measured " << got;
    EXPECT_EQ(p.static_bytes[d], measured[d].parameter_bytes) << name_of(c) << ", device " << d
                                                               << ": parameters and gradients (plain SGD)";
  }
}

TEST(CostModelTest, PredictedPeakBytesMatchTheTrackingAllocatorForEveryScheduleAndMode) {
  const torch::nn::Sequential model = wide_mlp();
  torch::manual_seed(4);
  const torch::Tensor x = torch::randn({4 * kRows, kWidth}), y = torch::randn({4 * kRows, kWidth});
  const CostModel costs = profile_layers(model, x.narrow(0, 0, kRows),
                                         ProfileLayersOptions().loss(mse_loss).target(y.narrow(0, 0, kRows)));
  for (auto mode : {Checkpoint::kNever, Checkpoint::kExceptLast, Checkpoint::kAlways}) {
    for (int K : {1, 2, 3})
      for (auto schedule : {ScheduleKind::kGPipe, ScheduleKind::k1F1B})
        expect_predicted_peaks(model, x, y, mse_loss, costs, {K, 4, 1, schedule, mode}, 0.15, 4);
    expect_predicted_peaks(model, x, y, mse_loss, costs, {2, 4, 2, ScheduleKind::kInterleaved, mode}, 0.15, 4);
  }
}

TEST(CostModelTest, TheBackwardSplitsMemoryIsPredictedWithinAThird) {
  // zb1p keeps what W needs from I to W; the model counts each layer's recorded input, its
  // output's gradient and what its graph keeps, which overstates a chain of small layers.
  const torch::nn::Sequential model = wide_mlp();
  torch::manual_seed(4);
  const torch::Tensor x = torch::randn({4 * kRows, kWidth}), y = torch::randn({4 * kRows, kWidth});
  const CostModel costs = profile_layers(model, x.narrow(0, 0, kRows));
  for (auto mode : {Checkpoint::kNever, Checkpoint::kAlways})
    expect_predicted_peaks(model, x, y, mse_loss, costs, {2, 4, 1, ScheduleKind::kZB1P, mode}, 0.35, 4);
}

TEST(CostModelTest, SkipConnectionsAcrossStagesArePredictedWithin15Percent) {
  // A ResNet whose middle block's shortcut crosses the cut, and a U-Net whose two long skips both
  // do: a stashed tensor stays on the stashing device until the popping stage is done with it, and
  // its gradient on the popping device until the stashing stage's backward is. (Before the replay
  // followed the program's sends, the U-Net's first device was predicted at 0.54 of its peak.)
  for (const std::string name : {"resnet", "unet"}) {
    SCOPED_TRACE(name);
    const Workload w = make_workload(name);
    const int64_t rows = 32;
    const torch::Tensor x = w.input.narrow(0, 0, rows), y = w.target.narrow(0, 0, rows);
    const CostModel costs = profile_layers(w.model, x.narrow(0, 0, rows / 4),
                                           ProfileLayersOptions().loss(w.loss).target(y.narrow(0, 0, rows / 4)));
    for (const Case& c : {Case{2, 4, 1, ScheduleKind::kGPipe, Checkpoint::kNever},
                          Case{2, 4, 1, ScheduleKind::kGPipe, Checkpoint::kExceptLast},
                          Case{2, 4, 1, ScheduleKind::k1F1B, Checkpoint::kAlways},
                          Case{2, 4, 1, ScheduleKind::k1F1B, Checkpoint::kExceptLast}})
      // The slack of one micro-batch's largest send is needed: whether a boundary tensor or a
      // stashed one is still held at a device's peak depends on the threads' timing, which the
      // simulation only approximates. Without it, 2 of 3 runs failed here (resnet, K=2 M=4 gpipe
      // except_last, device 1: predicted 2412032 bytes, measured 2045768 in that run).
      expect_predicted_peaks(w.model, x, y, w.loss, costs, c, 0.15, 1);
  }
}

TEST(CostModelTest, ATiedWeightCountsOncePerDeviceThatHoldsItAndItsGradientsAreSummedOverTheLink) {
  // The first Linear's weight read again by a last layer (a tied projection, as a language model's
  // head reads its embedding). The V runs both ends on device 0, which holds the tensor once;
  // fill-drain puts them on two devices, each holding it.
  torch::nn::Sequential model = wide_mlp();
  const torch::Tensor tied = model[0]->as<torch::nn::Linear>()->weight;
  model->push_back(TiedProjection(tied));
  torch::manual_seed(4);
  const torch::Tensor x = torch::randn({4 * kRows, kWidth}), y = torch::randn({4 * kRows, kWidth});
  const CostModel costs = profile_layers(model, x.narrow(0, 0, kRows),
                                         ProfileLayersOptions().loss(mse_loss).target(y.narrow(0, 0, kRows)));
  const int last = static_cast<int>(model->size()) - 1;
  ASSERT_EQ(costs.tied.size(), 1u);
  EXPECT_EQ(costs.tied[0].bytes, static_cast<int64_t>(tied.nbytes()));
  EXPECT_EQ(costs.tied[0].layers, (std::vector<int>{0, last}));

  int64_t unique = 0;  // every parameter once, with its gradient (plain SGD); parameters() lists the tied one twice
  std::set<const void*> seen;
  for (const auto& p : model->parameters())
    if (seen.insert(p.unsafeGetTensorImpl()).second) unique += 2 * static_cast<int64_t>(p.nbytes());
  const int64_t copy = 2 * static_cast<int64_t>(tied.nbytes());
  for (const Case& c : {Case{2, 4, 2, ScheduleKind::kZBV, Checkpoint::kNever},
                        Case{2, 4, 1, ScheduleKind::kGPipe, Checkpoint::kNever}}) {
    SCOPED_TRACE(name_of(c));
    expect_predicted_peaks(model, x, y, mse_loss, costs, c, 0.35, 4);  // the static bytes exactly
    const PipelinePlan plan = make_plan(last + 1, PipelineOptions()
                                                      .balance(even_balance(last + 1, c.K * c.V))
                                                      .micro_batches(c.M)
                                                      .schedule(c.schedule)
                                                      .virtual_stages(c.V));
    const std::vector<int64_t> rows = micro_batch_sizes(x.size(0), c.M);
    const Prediction p = predict(costs, plan, rows);
    const bool apart = c.schedule == ScheduleKind::kGPipe;  // the two ends on two devices
    EXPECT_EQ(p.static_bytes[0] + p.static_bytes[1], unique + (apart ? copy : 0));

    // Over a link of 1 MB/s, two copies' gradients are summed after the step: the ring all-reduce of
    // two holders, two steps of a latency and half the tensor.
    CostModel linked = costs;
    linked.link_latency_s = 1e-3;
    linked.link_bytes_per_s = 1e6;
    CostModel untied = linked;
    untied.tied.clear();
    const double extra = predict(linked, plan, rows).step_s - predict(untied, plan, rows).step_s;
    const double update = costs.update_s_per_parameter_byte * static_cast<double>(tied.nbytes());  // stepped once
    EXPECT_NEAR(extra, (apart ? 2e-3 + static_cast<double>(tied.nbytes()) / 1e6 : 0.0) - update, 1e-9);
  }
}

TEST(CostModelTest, FillDrainHoldsEveryMicroBatchAndOneFOneBOnlyKMinusD) {
  // Without re-materialization, one device under fill-drain holds all M micro-batches' activations
  // at once, under 1F1B one: the prediction says so before anything runs.
  const torch::nn::Sequential model = wide_mlp();
  torch::manual_seed(4);
  const CostModel costs = profile_layers(model, torch::randn({kRows, kWidth}));
  const std::vector<int64_t> rows(8, kRows);
  auto plan = [](ScheduleKind schedule, Checkpoint mode) {
    return make_plan(32, PipelineOptions().devices(1).micro_batches(8).schedule(schedule).checkpoint(mode));
  };
  const Prediction fill = predict(costs, plan(ScheduleKind::kGPipe, Checkpoint::kNever), rows);
  const Prediction one = predict(costs, plan(ScheduleKind::k1F1B, Checkpoint::kNever), rows);
  EXPECT_GT(fill.peak_bytes[0], 5 * one.peak_bytes[0]);
  const Prediction always = predict(costs, plan(ScheduleKind::kGPipe, Checkpoint::kAlways), rows);
  EXPECT_LT(always.peak_bytes[0], fill.peak_bytes[0] / 3);
}

TEST(CostModelTest, LayerCostsForThePartitionerComeFromTheProfile) {
  torch::manual_seed(0);
  torch::nn::Sequential m(torch::nn::Linear(100, 200), torch::nn::ReLU(), torch::nn::Linear(200, 10));
  const CostModel profile = profile_layers(m, torch::randn({50, 100}), ProfileLayersOptions().state_per_parameter_byte(3.0));
  const std::vector<double> bytes = layer_memory(profile, 50);
  ASSERT_EQ(bytes.size(), 3u);
  // Linear(100, 200): its output (50x200 floats) at least, plus 4x its 20200 parameters.
  EXPECT_GE(bytes[0], 50 * 200 * 4 + 4.0 * 20200 * 4);
  // ReLU keeps its output (50x200 floats), has no parameters.
  EXPECT_GE(bytes[1], 50 * 200 * 4);
  EXPECT_LT(bytes[1], 3 * 50 * 200 * 4);
  EXPECT_GT(bytes[0], bytes[2]);
  const std::vector<double> seconds = layer_times(profile, 50);
  ASSERT_EQ(seconds.size(), 3u);
  for (size_t l = 0; l < 3; ++l)
    EXPECT_DOUBLE_EQ(seconds[l], (profile.layers[l].forward_s + profile.layers[l].backward_s) * 50);
  expect_invalid([&] { profile_layers(m, torch::randn({5, 100}), ProfileLayersOptions().state_per_parameter_byte(-1)); }, "state_per_parameter_byte");
}

// The model's first layer is profiled on the data as it comes, as the first stage runs it: without a
// gradient of its input unless the data asks for one (a convolution's input gradient can cost more
// than its weights'). Every other layer is profiled as a stage's first, whose input takes one.
TEST(CostModelTest, TheFirstLayerIsProfiledWithoutAnInputGradientUnlessTheDataAsksForOne) {
  torch::manual_seed(0);
  torch::nn::Sequential m(torch::nn::Linear(1000, 4), torch::nn::Linear(4, 1000), torch::nn::Linear(1000, 4));
  const torch::Tensor x = torch::randn({50, 1000});
  const double input_grad_bytes = 1000 * 4;  // per row, of a layer whose input is 1000 floats
  const CostModel data = profile_layers(m, x);
  const CostModel asks = profile_layers(m, x.clone().requires_grad_(true));
  EXPECT_LT(data.layers[0].backward_peak_bytes, input_grad_bytes / 2);
  EXPECT_GE(asks.layers[0].backward_peak_bytes, input_grad_bytes);
  EXPECT_GE(data.layers[2].backward_peak_bytes, input_grad_bytes);
  // Layers that change their input in place are timed on a copy of it: the sample stays as it was,
  // and each is profiled as its copy that works on a new tensor is.
  const auto relu = [](bool in_place) { return torch::nn::ReLU(torch::nn::ReLUOptions().inplace(in_place)); };
  torch::nn::Sequential in_place(relu(true), torch::nn::Linear(1000, 4), relu(true));
  torch::nn::Sequential out_of_place(relu(false), torch::nn::Linear(1000, 4), relu(false));
  const torch::Tensor sample = x.clone();
  const CostModel a = profile_layers(in_place, sample), b = profile_layers(out_of_place, sample);
  EXPECT_TRUE(torch::equal(sample, x)) << "the profile changed its sample";
  ASSERT_EQ(a.layers.size(), 3u);
  for (size_t l = 0; l < 3; ++l) {
    EXPECT_GT(a.layers[l].forward_s, 0.0);
    EXPECT_EQ(a.layers[l].output_bytes, b.layers[l].output_bytes) << "layer " << l;
    // The copy it runs on is counted: what the layer keeps is what its out-of-place twin keeps.
    EXPECT_EQ(a.layers[l].kept_bytes, b.layers[l].kept_bytes) << "layer " << l;
  }
}

// A stage that holds a skip connection's Stash or Pop splits its backward in one piece: I takes the
// input's gradient from the whole graph and W walks the graph again into the parameters, so W is
// predicted as the stage's whole backward, not as its layers' weight gradients. zb1p at K=2, M=1
// ends with stage 0's W after its I: the step is longer by stage 0's B - W.
TEST(CostModelTest, AStageWithASkipInsideIsPredictedToWalkItsGraphTwice) {
  CostModel costs = uniform_costs(4, 1e-3, 2e-3);
  for (LayerCost& c : costs.layers) c.input_grad_s = c.weight_grad_s = 1e-3;
  const std::vector<int64_t> rows{8};
  const PipelinePlan plain =
      make_plan(4, PipelineOptions().devices(2).micro_batches(1).balance({2, 2}).schedule(ScheduleKind::kZB1P));
  const double split = predict(costs, plain, rows).step_s;
  const SkipConnection inside{"inside", 0, 1};
  costs.skips.push_back({inside, 4.0});
  const PipelinePlan skipped = make_plan(4, PipelineOptions().devices(2).micro_batches(1).balance({2, 2})
                                                .schedule(ScheduleKind::kZB1P), {inside});
  EXPECT_NEAR(predict(costs, skipped, rows).step_s - split, 2 * (2e-3 - 1e-3) * 8, 1e-12);
}

// The update on the devices (CostModel::update_on_devices) is predicted where the Trainer applies
// it: fill-drain on 2 devices, device 0 starts with its forward, so its share comes first and delays
// the whole step; device 1 starts by waiting for its input, and its share (shorter than that wait)
// is hidden. After the step on one thread, the whole update adds to the step.
TEST(CostModelTest, TheUpdateOnTheDevicesIsPredictedWhereItRuns) {
  CostModel costs = uniform_costs(4, 1e-3, 2e-3);
  for (LayerCost& c : costs.layers) c.parameter_bytes = 1000;
  costs.layers[3].parameter_bytes = 3000;  // stage 1's share: 4000 bytes, stage 0's 2000
  const PipelinePlan plan = make_plan(4, PipelineOptions().devices(2).micro_batches(2).balance({2, 2}));
  const std::vector<int64_t> rows{1, 1};
  const double none = predict(costs, plan, rows).step_s;
  costs.update_s_per_parameter_byte = 1e-7;  // stage 0's share 0.2 ms, stage 1's 0.4 ms < stage 0's forward (2 ms)
  const double after = predict(costs, plan, rows).step_s;
  costs.update_on_devices = true;
  const Prediction devices = predict(costs, plan, rows);
  EXPECT_NEAR(after, none + 6e-4, 1e-12);
  EXPECT_NEAR(devices.step_s, none + 2e-4, 1e-12);
  // Counted busy: the same step with the shares as idle would have a larger bubble.
  EXPECT_LT(devices.bubble, 1.0 - (2 * 2 * 2 * 3e-3) / (2 * devices.step_s));
}

// The pipeline's own overhead (CostModel::action_overhead_s, step_overhead_s): fill-drain on 2
// devices at M=2 has 6 actions one after the other (device 0's two forwards, device 1's forward and
// backward of micro-batch 1, device 0's two backwards), each that much longer, and the step longer by
// the step's overhead.
TEST(CostModelTest, ThePipelinesOwnOverheadLengthensEachActionOnThePathAndTheStep) {
  CostModel costs = uniform_costs(4, 1e-3, 2e-3);
  const PipelinePlan plan =
      make_plan(4, PipelineOptions().devices(2).micro_batches(2).balance({2, 2}).checkpoint(Checkpoint::kNever));
  const std::vector<int64_t> rows{1, 1};
  const Prediction none = predict(costs, plan, rows);
  EXPECT_NEAR(none.step_s, 18e-3, 1e-12);
  costs.action_overhead_s = 1e-4;
  costs.step_overhead_s = 5e-4;
  EXPECT_NEAR(predict(costs, plan, rows).step_s, 18e-3 + 6 * 1e-4 + 5e-4, 1e-12);
  // A device slower by a factor computes longer; the pipeline's own overhead stays.
  EXPECT_NEAR(predict(with_compute_scaled(costs, 2.0), plan, rows).step_s, 36e-3 + 6 * 1e-4 + 5e-4, 1e-12);
}

// Profiling runs the layers in training mode, forward and backward, many times: the model is left as
// it was, BatchNorm's running statistics, the gradients already there and the random numbers.
TEST(CostModelTest, ProfilingLeavesTheModelsBuffersGradientsAndRandomNumbers) {
  torch::manual_seed(0);
  torch::nn::Sequential m(torch::nn::Linear(8, 16), torch::nn::BatchNorm1d(16), torch::nn::Dropout(0.5),
                          torch::nn::Linear(16, 4));
  for (auto& p : m->parameters()) p.mutable_grad() = torch::full_like(p, 0.25);
  std::vector<torch::Tensor> buffers, grads, values;
  for (const auto& b : m->buffers()) buffers.push_back(b.clone());
  for (const auto& p : m->parameters()) grads.push_back(p.grad().clone()), values.push_back(p.detach().clone());
  const torch::Tensor sample = torch::randn({6, 8});
  at::Generator generator = at::globalContext().defaultGenerator(torch::kCPU);
  const torch::Tensor random_state = generator.get_state();
  // The optimizer's update is timed (Adam's, for 3 bytes of state per parameter byte) on copies.
  const CostModel costs = profile_layers(m, sample, ProfileLayersOptions().state_per_parameter_byte(3));
  EXPECT_GT(costs.update_s_per_parameter_byte, 0);
  // Three micro-batches in flight: every layer timed, and the model left as it was too.
  const CostModel three = profile_layers(m, sample, ProfileLayersOptions().state_per_parameter_byte(3).in_flight(3));
  for (const LayerCost& layer : three.layers) EXPECT_GT(layer.forward_s, 0);
  expect_invalid([&] { profile_layers(m, sample, ProfileLayersOptions().state_per_parameter_byte(3).in_flight(0)); }, "in flight");
  for (size_t n = 0; n < values.size(); ++n) EXPECT_TRUE(torch::equal(m->parameters()[n], values[n])) << "parameter " << n;
  const torch::Tensor random_after = generator.get_state();
  EXPECT_TRUE(torch::equal(random_after, random_state));
  const auto now = m->buffers();
  ASSERT_EQ(now.size(), buffers.size());
  for (size_t n = 0; n < buffers.size(); ++n) EXPECT_TRUE(torch::equal(now[n], buffers[n])) << "buffer " << n;
  const auto params = m->parameters();
  for (size_t n = 0; n < grads.size(); ++n) EXPECT_TRUE(torch::equal(params[n].grad(), grads[n])) << "gradient " << n;
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
    const CostModel profiled = profile_layers(model, torch::randint(shape.vocab, {4, sequence}),
                                                ProfileLayersOptions().state_per_parameter_byte(3));
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
  // A size read but out of range says so, not that it cannot be read.
  auto message = [](const char* text) {
    try {
      parse_bytes(text);
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_NE(message("0GiB").find("\"0GiB\" is less than one byte"), std::string::npos) << message("0GiB");
  EXPECT_NE(message("1e30TB").find("\"1e30TB\" is more bytes than a machine has"), std::string::npos);
  EXPECT_NE(message("16 gigs").find("cannot read \"16 gigs\" as a size in bytes"), std::string::npos);
  EXPECT_EQ(format_bytes(41.2 * (1 << 30)), "41.2 GiB");
  EXPECT_EQ(format_bytes(512), "512 B");
}

TEST(CostModelTest, MismatchedInputsAreRefused) {
  const CostModel costs = profile_layers(wide_mlp(), torch::randn({4, kWidth}));
  const std::vector<int64_t> rows(4, 4);
  EXPECT_NO_THROW(predict(costs, make_plan(32, PipelineOptions().devices(2).micro_batches(4)), rows));
  EXPECT_THROW(predict(costs, make_plan(31, PipelineOptions().devices(2).micro_batches(4)), rows),
               std::invalid_argument);
  EXPECT_THROW(predict(costs, make_plan(32, PipelineOptions().devices(2).micro_batches(3)), rows),
               std::invalid_argument);
  // A skip connection the profiled model does not have.
  const PipelinePlan skipping = make_plan(32, PipelineOptions().devices(2).micro_batches(4), {{"e1", 3, 20}});
  expect_invalid([&] { predict(costs, skipping, rows); }, "skip connection \"e1\" is not in the cost model");
}

}  // namespace
}  // namespace gpipe::testing
