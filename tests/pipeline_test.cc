// pipeline_test.cc: the facade's configuration, its errors before any work, and inference.
#include "helpers.h"

#include <chrono>
#include <cmath>
#include <fstream>
#include <map>
#include <mutex>
#include <set>
#include <thread>

using gpipe::PipelineOptions;
using gpipe::testing::expect_invalid;
using gpipe::testing::small_mlp;

namespace {
torch::Tensor mse(const torch::Tensor& out, const torch::Tensor& t) { return torch::mse_loss(out, t); }
}  // namespace

TEST(PipelineTest, CutsEvenlyOrByBalance) {
  gpipe::Pipeline even(small_mlp(0), PipelineOptions().devices(3));
  EXPECT_EQ(even.balance(), (std::vector<int>{3, 2, 2}));
  EXPECT_EQ(even.stage(1)->size(), 2u);
  gpipe::Pipeline given(small_mlp(0), PipelineOptions().balance({1, 6}).micro_batches(2));
  EXPECT_EQ(given.stages(), 2);
  EXPECT_EQ(given.stage(0)->size(), 1u);
}

TEST(PipelineTest, StagesShareTheModelsParameters) {
  auto model = small_mlp(0);
  gpipe::Pipeline pipe(model, PipelineOptions().devices(2));
  auto from_stages = pipe.stage(0)->parameters();
  for (const auto& p : pipe.stage(1)->parameters()) from_stages.push_back(p);
  auto from_model = model->parameters();
  ASSERT_EQ(from_stages.size(), from_model.size());
  for (size_t n = 0; n < from_model.size(); ++n)
    EXPECT_TRUE(from_stages[n].is_same(from_model[n]));
}

TEST(PipelineTest, RejectsBadConfigurationBeforeAnyWork) {
  expect_invalid([] { gpipe::Pipeline(torch::nn::Sequential(), PipelineOptions().devices(1)); },
                 "the model is empty");
  expect_invalid([] { gpipe::Pipeline(small_mlp(0), PipelineOptions().devices(0)); },
                 "the number of devices K is not given");
  expect_invalid([] { gpipe::Pipeline(small_mlp(0), PipelineOptions().devices(8)); },
                 "cannot cut 7 layers into 8 devices");
  expect_invalid([] { gpipe::Pipeline(small_mlp(0), PipelineOptions().balance({3, 3})); },
                 "sum of balance {3, 3}: 6");
  expect_invalid([] { gpipe::Pipeline(small_mlp(0), PipelineOptions().balance({7, 0})); },
                 "has 0 layers");
  expect_invalid([] { gpipe::Pipeline(small_mlp(0), PipelineOptions().balance({3, 4}).devices(3)); },
                 "disagree");
  expect_invalid([] { gpipe::Pipeline(small_mlp(0), PipelineOptions().devices(2).micro_batches(0)); },
                 "micro-batches M must be at least 1 (got 0)");
  expect_invalid(
      [] {
        gpipe::Pipeline(small_mlp(0),
                        PipelineOptions().devices(2).device_list({gpipe::Device::cpu(1)}));
      },
      "got 1 devices in the device list for 2 devices");
  expect_invalid([] { gpipe::Pipeline(small_mlp(0), PipelineOptions().devices(2).threads_per_device(0)); },
                 "intra-op threads per device must be at least 1");
}

TEST(PipelineTest, RejectsBadBatchesBeforeAnyWork) {
  auto model = small_mlp(0);
  gpipe::Pipeline pipe(model, PipelineOptions().devices(2).micro_batches(4));
  const torch::Tensor x = torch::randn({8, 12}), y = torch::randn({8, 4});
  expect_invalid([&] { pipe.train_step(torch::tensor(1.0), y, mse); }, "the input has no batch dimension");
  expect_invalid([&] { pipe.train_step(x.narrow(0, 0, 0), y.narrow(0, 0, 0), mse); }, "the input is an empty batch");
  expect_invalid([&] { pipe.train_step(x, y.narrow(0, 0, 7), mse); },
                 "the target's batch size differs from the input's");
  expect_invalid([&] { pipe.forward(torch::tensor(1.0)); }, "the input has no batch dimension");
  for (const auto& p : model->parameters()) EXPECT_FALSE(p.grad().defined());  // no work done
}

// The last batch of an epoch may have fewer rows than M: it runs one row per micro-batch, by the
// same schedule or, where that schedule cannot take so few (interleaved), fill-drain, and stays exact.
TEST(PipelineTest, BatchSmallerThanTheMicroBatchCountTrainsExactly) {
  for (gpipe::ScheduleKind kind : {gpipe::ScheduleKind::kGPipe, gpipe::ScheduleKind::kZB1P,
                                   gpipe::ScheduleKind::kInterleaved, gpipe::ScheduleKind::kZBV,
                                   gpipe::ScheduleKind::kVHalf}) {
    SCOPED_TRACE(gpipe::to_string(kind));
    const int V = gpipe::default_virtual_stages(kind);
    auto model = small_mlp(1), reference = small_mlp(1);
    gpipe::Pipeline pipe(model, PipelineOptions().devices(2).virtual_stages(V).schedule(kind).micro_batches(4));
    torch::manual_seed(2);
    const torch::Tensor x = torch::randn({3, 12}), y = torch::randn({3, 4});
    const torch::Tensor loss = pipe.train_step(x, y, mse);
    EXPECT_TRUE(gpipe::testing::close(loss.to(torch::kFloat), gpipe::testing::reference_step(reference, x, y, mse)));
    EXPECT_TRUE(gpipe::testing::same_parameters(model, reference, /*values=*/false));
  }
}

// A program given as text (PipelineOptions::program), the one the named schedule would run printed
// (compute-only, or lowered as gpipe schedule --program prints it), trains bit for bit as the named
// schedule does, and as one device does within rounding.
TEST(PipelineProgramTest, AProgramGivenAsTextTrainsAsItsSchedule) {
  torch::manual_seed(6);
  const torch::Tensor x = torch::randn({8, 12}), y = torch::randn({8, 4});
  for (gpipe::ScheduleKind kind : gpipe::all_schedules()) {
    SCOPED_TRACE(gpipe::to_string(kind));
    const PipelineOptions named =
        PipelineOptions().devices(2).schedule(kind).micro_batches(4).checkpoint(gpipe::Checkpoint::kExceptLast);
    const gpipe::Schedule compute = gpipe::make_schedule(kind, 2, 4, gpipe::default_virtual_stages(kind));
    for (const std::string& text :
         {gpipe::format_program(compute), gpipe::format_program(gpipe::lower(compute, gpipe::Checkpoint::kExceptLast))}) {
      auto given_model = small_mlp(1), named_model = small_mlp(1), reference = small_mlp(1);
      gpipe::Pipeline given(given_model, PipelineOptions(named).program(text));
      gpipe::Pipeline pipe(named_model, named);
      EXPECT_EQ(given.plan().training.actions, pipe.plan().training.actions);
      const torch::Tensor loss = given.train_step(x, y, mse);
      EXPECT_TRUE(torch::equal(loss, pipe.train_step(x, y, mse)));
      EXPECT_TRUE(gpipe::testing::close(loss.to(torch::kFloat), gpipe::testing::reference_step(reference, x, y, mse)));
      EXPECT_TRUE(gpipe::testing::same_parameters(given_model, reference, /*values=*/false));
      // After an update, the parameters are the named schedule's to the bit.
      for (auto* model : {&given_model, &named_model}) torch::optim::SGD((*model)->parameters(), 0.1).step();
      EXPECT_TRUE(gpipe::testing::same_parameters(given_model, named_model, /*values=*/true, /*tol=*/0.0));
    }
  }
  // Written by hand, as docs/schedules.md's example: 1F1B's order under the gpipe schedule's placement.
  const std::string text = "device 0 | 0F0 0F1 0B0 0B1\ndevice 1 | 1F0 1B0 1F1 1B1\n";
  auto model = small_mlp(1), reference = small_mlp(1);
  gpipe::Pipeline pipe(model, PipelineOptions().devices(2).micro_batches(2).program(text));
  const auto lowered = [](const gpipe::Schedule& s) { return gpipe::lower(s, gpipe::Checkpoint::kExceptLast).actions; };
  EXPECT_EQ(pipe.schedule().actions, lowered(gpipe::parse_program(text)));  // the program, not gpipe's
  EXPECT_NE(pipe.schedule().actions, lowered(gpipe::fill_drain(2, 2)));
  const torch::Tensor loss = pipe.train_step(x, y, mse);
  EXPECT_TRUE(gpipe::testing::close(loss.to(torch::kFloat), gpipe::testing::reference_step(reference, x, y, mse)));
  EXPECT_TRUE(gpipe::testing::same_parameters(model, reference, /*values=*/false));
}

// A program that does not fit the pipeline, or cannot run, is refused before any work, naming what
// differs and the fix.
TEST(PipelineProgramTest, AProgramThatDoesNotFitIsRefusedBeforeAnyWork) {
  const std::string zbv = gpipe::format_program(gpipe::zbv(2, 4));
  const std::string gpipe_never = gpipe::format_program(gpipe::lower(gpipe::fill_drain(2, 4), gpipe::Checkpoint::kNever));
  auto model = small_mlp(1);
  auto refused = [&](const PipelineOptions& options, const std::string& needle) {
    expect_invalid([&] { gpipe::Pipeline pipe(model, options); }, needle);
  };
  const PipelineOptions two = PipelineOptions().devices(2).micro_batches(4).checkpoint(gpipe::Checkpoint::kNever);
  refused(PipelineOptions(two).devices(3).program(gpipe_never), "the program given has rows for 2 devices, the "
                                                                "pipeline 3 (K); give a program of one row per "
                                                                "device, or devices(2)");
  refused(PipelineOptions(two).micro_batches(8).program(gpipe_never),
          "the program given runs 4 micro-batches (its highest is 3), the pipeline 8 (M)");
  refused(PipelineOptions(two).program(zbv), "the program given runs 4 stages on its 2 devices, the pipeline 2 (1 per "
                                             "device, V)");
  refused(PipelineOptions(two).schedule(gpipe::ScheduleKind::kInterleaved).program(zbv),
          "the program given runs stage 2 on device 1, but the interleaved schedule places it on device 0; the "
          "program places its stages as zbv or v-half do: name one of them");
  refused(PipelineOptions(two).checkpoint(gpipe::Checkpoint::kAlways).program(gpipe_never),
          "in the row of device 0 of the program given, action 1 is 0F0 where lowering its compute actions with "
          "checkpoint always puts 0F0r");
  refused(PipelineOptions(two).program("device 0 | 0F0 0F1 0F2 0F3 0B3 0B2 0B1 0B0\ndevice 1 | 1F0 1F1 1F2 1F3 "
                                       "1B3 1B2 1B1 1B0 1Q0\n"),
          "line 2 of the program: cannot parse action \"1Q0\"");
  refused(PipelineOptions(two).program("device 0 | 0F0 0F1 0F2 0F3 0B3 0B2 0B1 0B0\ndevice 1 | 1F0 1F1 1F2 1B3 1F3 "
                                       "1B2 1B1 1B0\n"),
          "1B3 comes before its forward");
  for (const auto& p : model->parameters()) EXPECT_FALSE(p.grad().defined());  // no work done
  // A plan made with a program is another pipeline's than the options without it.
  const gpipe::PipelinePlan plan = gpipe::make_plan(7, PipelineOptions(two).program(gpipe_never));
  expect_invalid([&] { gpipe::check_plan_of(plan, 7, two); }, "it has a program given, the options none");
  EXPECT_NO_THROW(gpipe::check_plan_of(plan, 7, PipelineOptions(two).program(gpipe_never)));
}

// Between two stages of one device the executor hands the tensor over itself: the transport carries
// nothing there. small_mlp cut into 4 stages has 3 boundaries of 16 floats a row. Fill-drain over 4
// devices sends an activation and a gradient across each; zbv over 2 devices (stages 0 and 3 on device
// 0, 1 and 2 on device 1) across 2 of them, the V's turn (1 -> 2) staying on device 1; on one device
// (zbv or interleaved, 2 stages) nothing travels. Each still trains exactly.
TEST(PipelineTest, StagesOfOneDeviceSendNoTransportMessage) {
  torch::manual_seed(4);
  const torch::Tensor x = torch::randn({8, 12}), y = torch::randn({8, 4});
  auto bytes = [&](gpipe::ScheduleKind kind, int K) {
    auto model = small_mlp(1), reference = small_mlp(1);
    gpipe::Pipeline pipe(model, PipelineOptions().devices(K).schedule(kind).micro_batches(4));
    const int64_t before = pipe.bytes_sent();
    const torch::Tensor loss = pipe.train_step(x, y, mse);
    EXPECT_TRUE(gpipe::testing::close(loss.to(torch::kFloat), gpipe::testing::reference_step(reference, x, y, mse)));
    EXPECT_TRUE(gpipe::testing::same_parameters(model, reference, /*values=*/false));
    return pipe.bytes_sent() - before;
  };
  const int64_t boundary = 8 * 16 * 4 * 2;  // a step's activations and gradients across one boundary
  EXPECT_EQ(bytes(gpipe::ScheduleKind::kGPipe, 4), 3 * boundary);
  EXPECT_EQ(bytes(gpipe::ScheduleKind::kZBV, 2), 2 * boundary);
  EXPECT_EQ(bytes(gpipe::ScheduleKind::kZBV, 1), 0);
  EXPECT_EQ(bytes(gpipe::ScheduleKind::kVHalf, 2), 2 * boundary);
  EXPECT_EQ(bytes(gpipe::ScheduleKind::kInterleaved, 1), 0);
  EXPECT_EQ(bytes(gpipe::ScheduleKind::kInterleaved, 2), 3 * boundary);  // stages alternate devices
}

// A layer that cuts the graph (its output takes no gradient) at the end of a middle stage: the
// stages before it get zero gradients, as one device gets none, under every schedule (a split
// backward must not hand the stage's output gradient upstream as its input's).
struct DetachImpl : torch::nn::Module {
  torch::Tensor forward(const torch::Tensor& x) { return x.detach(); }
};
TORCH_MODULE(Detach);

TEST(PipelineTest, AStageWhoseOutputTakesNoGradientSendsZerosUpstream) {
  for (gpipe::ScheduleKind kind : {gpipe::ScheduleKind::kGPipe, gpipe::ScheduleKind::k1F1B,
                                   gpipe::ScheduleKind::kZB1P}) {
    SCOPED_TRACE(gpipe::to_string(kind));
    auto build = [] {
      torch::manual_seed(8);
      return torch::nn::Sequential(torch::nn::Linear(4, 4), torch::nn::Linear(4, 4), Detach(), torch::nn::Linear(4, 2));
    };
    auto model = build(), reference = build();
    gpipe::Pipeline pipe(model, PipelineOptions().balance({1, 2, 1}).schedule(kind).micro_batches(2));
    torch::manual_seed(9);
    const torch::Tensor x = torch::randn({6, 4}), y = torch::randn({6, 2});
    pipe.train_step(x, y, mse);
    gpipe::testing::reference_step(reference, x, y, mse);
    const auto got = model->parameters(), want = reference->parameters();
    for (size_t n = 0; n < got.size(); ++n) {
      const torch::Tensor a = got[n].grad().defined() ? got[n].grad() : torch::zeros_like(got[n]);
      const torch::Tensor b = want[n].grad().defined() ? want[n].grad() : torch::zeros_like(want[n]);
      EXPECT_TRUE(gpipe::testing::close(a, b)) << "parameter " << n;
    }
  }
}

// Layers that change their input in place (ReLU(inplace=true)) train as one device trains them,
// wherever the cut puts them: at the start of the first stage (whose input is the caller's data,
// left as it was), of a later stage (whose input the backward and a re-materialization start from),
// and inside a stage under a split backward (which keeps every layer's input); in evaluation too.
TEST(PipelineTest, InPlaceLayersTrainAsOneDeviceWhereverTheCutPutsThem) {
  auto model = [] {
    torch::manual_seed(5);
    const auto relu = [] { return torch::nn::ReLU(torch::nn::ReLUOptions().inplace(true)); };
    return torch::nn::Sequential(relu(), torch::nn::Linear(4, 6), relu(), torch::nn::Linear(6, 6), relu(),
                                 torch::nn::Linear(6, 2));
  };
  torch::manual_seed(6);
  const torch::Tensor x = torch::randn({6, 4}), y = torch::randn({6, 2});
  const torch::Tensor data = x.clone();
  for (gpipe::ScheduleKind kind : {gpipe::ScheduleKind::kGPipe, gpipe::ScheduleKind::k1F1B,
                                   gpipe::ScheduleKind::kZB1P, gpipe::ScheduleKind::kInterleaved,
                                   gpipe::ScheduleKind::kZBV}) {
    const int V = gpipe::default_virtual_stages(kind);
    for (const std::vector<int>& balance : V == 1 ? std::vector<std::vector<int>>{{2, 4}, {4, 2}, {1, 3, 2}}
                                                  : std::vector<std::vector<int>>{{2, 1, 1, 2}, {1, 1, 2, 2}}) {
      for (gpipe::Checkpoint mode : {gpipe::Checkpoint::kNever, gpipe::Checkpoint::kAlways}) {
        SCOPED_TRACE(gpipe::to_string(kind) + " " + gpipe::format_balance(balance) + " " + gpipe::to_string(mode));
        auto pipelined = model(), reference = model();
        gpipe::Pipeline pipe(pipelined, PipelineOptions().balance(balance).virtual_stages(V).schedule(kind)
                                            .micro_batches(4).checkpoint(mode));
        const torch::Tensor loss = pipe.train_step(x, y, mse);
        EXPECT_TRUE(torch::equal(x, data)) << "the caller's data changed";
        // One device on a copy: its first ReLU changes what it is given.
        EXPECT_TRUE(gpipe::testing::close(loss.to(torch::kFloat),
                                          gpipe::testing::reference_step(reference, x.clone(), y, mse)));
        EXPECT_TRUE(gpipe::testing::same_parameters(pipelined, reference, /*values=*/false));
        EXPECT_TRUE(gpipe::testing::close(pipe.forward(x), reference->forward(x.clone())));
        EXPECT_TRUE(torch::equal(x, data)) << "the caller's data changed in evaluation";
      }
    }
  }
}

// What a layer changes in place depends on what is before it and on the mode: behind a Flatten (a
// view of the stage's input) a ReLU(inplace) changes the kept input too; Dropout(inplace) changes its
// input in training only, so a pipeline that evaluated first must find it again when it trains.
TEST(PipelineTest, InPlaceLayersBehindAViewAndInTrainingOnlyTrainAsOneDevice) {
  auto model = [] {
    torch::manual_seed(7);
    return torch::nn::Sequential(torch::nn::Flatten(), torch::nn::ReLU(torch::nn::ReLUOptions().inplace(true)),
                                 torch::nn::Linear(8, 6), torch::nn::Flatten(),
                                 torch::nn::Dropout(torch::nn::DropoutOptions(0.25).inplace(true)),
                                 torch::nn::Linear(6, 2));
  };
  torch::manual_seed(8);
  const torch::Tensor x = torch::randn({6, 2, 4}), y = torch::randn({6, 2});
  const torch::Tensor data = x.clone();
  for (gpipe::ScheduleKind kind : {gpipe::ScheduleKind::kGPipe, gpipe::ScheduleKind::kZB1P}) {
    SCOPED_TRACE(gpipe::to_string(kind));
    auto pipelined = model(), reference = model();
    gpipe::Pipeline pipe(pipelined, PipelineOptions().balance({3, 3}).schedule(kind).micro_batches(1)
                                        .checkpoint(gpipe::Checkpoint::kAlways));
    pipelined->eval();
    reference->eval();
    EXPECT_TRUE(gpipe::testing::close(pipe.forward(x), reference->forward(x.clone())));
    EXPECT_TRUE(torch::equal(x, data)) << "the caller's data changed in evaluation";
    pipelined->train();
    reference->train();
    // One micro-batch on K=2: the Dropout masks are drawn as one device draws them after the same seed.
    const torch::Tensor loss = pipe.train_step(x, y, mse);
    EXPECT_TRUE(torch::equal(x, data)) << "the caller's data changed in training";
    EXPECT_TRUE(std::isfinite(loss.item<double>()));
    for (const auto& p : pipelined->parameters()) EXPECT_TRUE(p.grad().defined());
  }
}

TEST(PipelineTest, ForwardMatchesTheModelAndKeepsNoGraph) {
  auto model = small_mlp(0);
  gpipe::Pipeline pipe(model, PipelineOptions().devices(3).micro_batches(4));
  const torch::Tensor x = torch::randn({10, 12});
  torch::Tensor out = pipe.forward(x);
  EXPECT_FALSE(out.requires_grad());
  EXPECT_TRUE(gpipe::testing::close(out, model->forward(x).detach()));
  // A batch smaller than M runs in fewer micro-batches.
  EXPECT_TRUE(gpipe::testing::close(pipe.forward(x.narrow(0, 0, 2)), model->forward(x.narrow(0, 0, 2)).detach()));
}

TEST(PipelineTest, TraceRecordsEveryAction) {
  gpipe::Pipeline pipe(small_mlp(0), PipelineOptions().devices(2).micro_batches(3));
  pipe.train_step(torch::randn({6, 12}), torch::randn({6, 4}), mse);
  const gpipe::StepTrace& trace = pipe.last_trace();
  ASSERT_EQ(trace.devices.size(), 2u);
  for (int j = 0; j < 2; ++j) {
    std::vector<gpipe::Action> compute;  // the program's F and B; sends and receives are not work
    for (const auto& a : pipe.schedule().actions[static_cast<size_t>(j)])
      if (a.is_compute()) compute.push_back(a);
    ASSERT_EQ(trace.devices[static_cast<size_t>(j)].size(), 6u);
    ASSERT_EQ(compute.size(), 6u);
    for (size_t n = 0; n < 6; ++n) {
      const auto& span = trace.devices[static_cast<size_t>(j)][n];
      EXPECT_EQ(span.action, compute[n]);
      EXPECT_LE(trace.begin_ns, span.begin_ns);
      EXPECT_LE(span.begin_ns, span.end_ns);
      EXPECT_LE(span.end_ns, trace.end_ns);
    }
  }
  EXPECT_GE(trace.bubble(), 0.0);
  EXPECT_LT(trace.bubble(), 1.0);
}

TEST(PipelineTest, ChromeTraceHasOneEventPerActionOnItsDevicesRow) {
  gpipe::Pipeline pipe(small_mlp(0), PipelineOptions().devices(2).micro_batches(2).checkpoint(gpipe::Checkpoint::kNever));
  pipe.train_step(torch::randn({4, 12}), torch::randn({4, 4}), mse);
  const std::string json = gpipe::chrome_trace_json(pipe.last_trace());
  for (const char* action : {"0F0", "0F1", "0B1", "0B0", "1F0", "1F1", "1B1", "1B0"})
    EXPECT_NE(json.find(std::string("\"name\": \"") + action + "\""), std::string::npos) << action;
  EXPECT_NE(json.find("\"name\": \"1B0\", \"cat\": \"backward\", \"ph\": \"X\", \"pid\": 0, \"tid\": 1"),
            std::string::npos) << json;
  EXPECT_NE(json.find("\"args\": {\"name\": \"device 1\"}"), std::string::npos);
  const std::string path = ::testing::TempDir() + "/gpipe_trace.json";
  gpipe::write_chrome_trace(pipe.last_trace(), path);
  std::ifstream in(path);
  EXPECT_EQ(std::string(std::istreambuf_iterator<char>(in), {}), json);
  EXPECT_THROW(gpipe::write_chrome_trace(pipe.last_trace(), "/nonexistent-dir/t.json"), std::runtime_error);
}

// Work a device does before a stage's first action (set_before_stage: a trainer's held update) runs
// once per stage and step on the stage's device, and the trace shows it ("1U") and counts it busy.
TEST(PipelineTest, WorkBeforeEachStageRunsOnItsDeviceAndCountsBusy) {
  gpipe::Pipeline pipe(small_mlp(0), PipelineOptions().devices(2).micro_batches(2).checkpoint(gpipe::Checkpoint::kNever));
  std::mutex mutex;
  std::map<int, std::set<std::thread::id>> threads;  // per stage: the threads that ran its work
  std::map<int, int> calls;
  pipe.set_before_stage([&](int stage) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));  // work the trace must count
    std::lock_guard<std::mutex> lock(mutex);
    threads[stage].insert(std::this_thread::get_id());
    ++calls[stage];
  });
  for (int step = 0; step < 2; ++step) pipe.train_step(torch::randn({4, 12}), torch::randn({4, 4}), mse);
  EXPECT_EQ(calls, (std::map<int, int>{{0, 2}, {1, 2}}));
  ASSERT_EQ(threads.size(), 2u);
  EXPECT_EQ(threads[0].size(), 1u);
  EXPECT_NE(*threads[0].begin(), *threads[1].begin());  // each on its own device's thread
  EXPECT_NE(*threads[0].begin(), std::this_thread::get_id());
  const gpipe::StepTrace& trace = pipe.last_trace();
  ASSERT_EQ(trace.other.size(), 2u);
  for (int d = 0; d < 2; ++d) {
    ASSERT_EQ(trace.other[static_cast<size_t>(d)].size(), 1u);
    EXPECT_EQ(trace.other[static_cast<size_t>(d)][0].stage, d);
    double actions = 0;
    for (const gpipe::ActionSpan& span : trace.devices[static_cast<size_t>(d)])
      actions += static_cast<double>(span.end_ns - span.begin_ns) * 1e-9;
    EXPECT_GE(trace.busy_seconds(d), actions + 0.005);
  }
  const std::string json = gpipe::chrome_trace_json(trace);
  EXPECT_NE(json.find("\"name\": \"1U\", \"cat\": \"update\", \"ph\": \"X\", \"pid\": 0, \"tid\": 1"), std::string::npos)
      << json;
  EXPECT_NE(gpipe::timeline_svg(trace).find("<title>0U: stage 0's update"), std::string::npos);
  // A failing work fails the step as a stage's error, naming the stage.
  pipe.set_before_stage([](int stage) {
    if (stage == 1) throw std::runtime_error("held update broke");
  });
  try {
    pipe.train_step(torch::randn({4, 12}), torch::randn({4, 4}), mse);
    ADD_FAILURE() << "the step did not fail";
  } catch (const gpipe::StageError& e) {
    EXPECT_NE(std::string(e.what()).find("held update broke"), std::string::npos) << e.what();
    EXPECT_EQ(e.action().stage, 1);
  }
  pipe.set_before_stage(nullptr);
  EXPECT_NO_THROW(pipe.train_step(torch::randn({4, 12}), torch::randn({4, 4}), mse));
}

TEST(PipelineTest, SvgTimelineDrawsEveryActionOnItsDevicesRow) {
  gpipe::Pipeline pipe(small_mlp(0), PipelineOptions().devices(3).micro_batches(2).checkpoint(gpipe::Checkpoint::kNever));
  pipe.train_step(torch::randn({4, 12}), torch::randn({4, 4}), mse);
  const std::string svg = gpipe::timeline_svg(pipe.last_trace());
  EXPECT_EQ(svg.rfind("<svg ", 0), 0u);
  EXPECT_NE(svg.find("Pipeline step: 3 devices"), std::string::npos);
  size_t forward = 0, backward = 0;
  for (size_t at = 0; (at = svg.find("fill=\"#4c78a8\" stroke", at)) != std::string::npos; ++at) ++forward;
  for (size_t at = 0; (at = svg.find("fill=\"#f58518\" stroke", at)) != std::string::npos; ++at) ++backward;
  EXPECT_EQ(forward, 6u);   // K x M forwards
  EXPECT_EQ(backward, 6u);  // and backwards
  for (const char* action : {"<title>0F0:", "<title>2B1:", "<title>1B0:"})
    EXPECT_NE(svg.find(action), std::string::npos) << action;
  const std::string path = ::testing::TempDir() + "/gpipe_timeline.svg";
  gpipe::write_trace(pipe.last_trace(), path);
  std::ifstream in(path);
  EXPECT_EQ(std::string(std::istreambuf_iterator<char>(in), {}), svg);
  // The suffix decides the format in any case: x.SVG is the chart too, x.JSON Chrome-trace JSON.
  const std::string upper = ::testing::TempDir() + "/gpipe_timeline.SVG";
  gpipe::write_trace(pipe.last_trace(), upper);
  std::ifstream in_upper(upper);
  EXPECT_EQ(std::string(std::istreambuf_iterator<char>(in_upper), {}), svg);
  const std::string json = ::testing::TempDir() + "/gpipe_timeline.JSON";
  gpipe::write_trace(pipe.last_trace(), json);
  std::ifstream in_json(json);
  EXPECT_EQ(std::string(std::istreambuf_iterator<char>(in_json), {}), gpipe::chrome_trace_json(pipe.last_trace()));
}

TEST(PipelineTest, OverheadIsStepTimeLessTheSimulatedSchedule) {
  // A hand-made trace: 2 stages, 1 micro-batch, each action 10 ns, the step 50 ns.
  auto span = [](int stage, gpipe::ActionKind kind, int64_t begin) {
    gpipe::ActionSpan out;
    out.action.stage = stage;
    out.action.kind = kind;
    out.begin_ns = begin;
    out.end_ns = begin + 10;
    return out;
  };
  gpipe::StepTrace trace;
  trace.begin_ns = 0;
  trace.end_ns = 50;
  trace.devices = {{span(0, gpipe::ActionKind::kForward, 0), span(0, gpipe::ActionKind::kBackward, 38)},
                   {span(1, gpipe::ActionKind::kForward, 12), span(1, gpipe::ActionKind::kBackward, 25)}};
  // With no overhead the chain F0 F1 B1 B0 would take 40 ns.
  EXPECT_NEAR(gpipe::overhead_seconds(trace, gpipe::fill_drain(2, 1)), 10e-9, 1e-15);
  // A step no longer than its chain of actions has no overhead; the simulation never exceeds it.
  trace.end_ns = 40;
  trace.devices[0][1] = span(0, gpipe::ActionKind::kBackward, 30);
  trace.devices[1][0] = span(1, gpipe::ActionKind::kForward, 10);
  trace.devices[1][1] = span(1, gpipe::ActionKind::kBackward, 20);
  EXPECT_NEAR(gpipe::overhead_seconds(trace, gpipe::fill_drain(2, 1)), 0.0, 1e-15);
  gpipe::Pipeline pipe(small_mlp(0), PipelineOptions().devices(2).micro_batches(4));
  pipe.train_step(torch::randn({8, 12}), torch::randn({8, 4}), mse);
  const double overhead = gpipe::overhead_seconds(pipe.last_trace(), pipe.schedule());
  // A span covers its action's compute alone (not the wait for or the send of a tensor), so the
  // simulated chain of measured spans fits in the step: spans that overlapped would fail this.
  EXPECT_GE(overhead, 0.0);
}

TEST(CheckpointModeTest, TextFormParsesBack) {
  for (auto mode : {gpipe::Checkpoint::kAlways, gpipe::Checkpoint::kExceptLast, gpipe::Checkpoint::kNever})
    EXPECT_EQ(gpipe::parse_checkpoint(gpipe::to_string(mode)), mode);
  expect_invalid([] { gpipe::parse_checkpoint("sometimes"); }, "use always, except_last or never");
}
