// fault_test.cc: an exception in a stage stops the step, names the stage and micro-batch, and changes nothing.
#include "helpers.h"

#include <random>
#include <sstream>

#include <future>

using gpipe::PipelineOptions;

namespace {

// Identity that throws in its forward or its backward while armed.
class FaultImpl : public torch::nn::Module {
 public:
  torch::Tensor forward(const torch::Tensor& x) {
    if (fail_forward) throw std::runtime_error("injected forward fault");
    // Forwards with a graph: a stage also runs its layers once without one, to find those that work in place.
    if (forwards_before_fault >= 0 && torch::GradMode::is_enabled() && forwards_before_fault-- == 0)
      throw std::runtime_error("injected fault");
    torch::Tensor y = x * 1.0;
    if (fail_backward && y.requires_grad())
      y.register_hook([](torch::Tensor) -> torch::Tensor {
        throw std::runtime_error("injected backward fault");
      });
    return y;
  }
  bool fail_forward = false;
  bool fail_backward = false;
  int forwards_before_fault = -1;  // n >= 0: the forward after n more throws (once)
};
TORCH_MODULE(Fault);

struct FaultyModel {
  torch::nn::Sequential model;
  Fault fault;
};

// 8 layers; the fault is layer 5, in stage 1 of the even cut {3, 3, 2}.
FaultyModel make(uint64_t seed) {
  torch::manual_seed(seed);
  FaultyModel s;
  s.model = torch::nn::Sequential(torch::nn::Linear(6, 8), torch::nn::ReLU(), torch::nn::Linear(8, 8),
                                  torch::nn::Tanh(), torch::nn::Linear(8, 8));
  s.model->push_back(s.fault);
  s.model->push_back(torch::nn::Linear(8, 8));
  s.model->push_back(torch::nn::Linear(8, 3));
  return s;
}

template <typename Fn>
std::string step_error(Fn&& fn) {
  auto result = std::async(std::launch::async, [&]() -> std::string {
    try {
      fn();
    } catch (const gpipe::StageError& e) {
      return e.what();
    }
    return "no error";
  });
  // A bounded wait: a hang fails the test instead of stalling it.
  if (result.wait_for(std::chrono::seconds(60)) != std::future_status::ready) {
    ADD_FAILURE() << "the step did not end within 60 s";
    std::abort();
  }
  return result.get();
}

class FaultTest : public ::testing::TestWithParam<gpipe::Checkpoint> {};

TEST_P(FaultTest, ForwardFaultIsReportedAndChangesNothing) {
  FaultyModel s = make(1);
  gpipe::Pipeline pipe(s.model, PipelineOptions().devices(3).micro_batches(4).checkpoint(GetParam()));
  for (auto& p : s.model->parameters()) p.mutable_grad() = torch::full_like(p, 0.25);
  std::vector<torch::Tensor> values;
  for (auto& p : s.model->parameters()) values.push_back(p.detach().clone());
  const torch::Tensor x = torch::randn({8, 6}), y = torch::randn({8, 3});

  s.fault->fail_forward = true;
  const std::string what = step_error([&] { pipe.train_step(x, y, gpipe::mse_loss); });
  EXPECT_NE(what.find("stage 1 failed in the forward of micro-batch 0"), std::string::npos) << what;
  EXPECT_NE(what.find("injected forward fault"), std::string::npos) << what;

  size_t n = 0;
  for (auto& p : s.model->parameters()) {
    EXPECT_TRUE(torch::equal(p, values[n++]));
    EXPECT_TRUE(torch::equal(p.grad(), torch::full_like(p, 0.25)));
  }

  // The next step works and is exact.
  s.fault->fail_forward = false;
  FaultyModel ref = make(1);
  for (auto& p : ref.model->parameters()) p.mutable_grad() = torch::full_like(p, 0.25);
  gpipe::testing::reference_step(ref.model, x, y, gpipe::mse_loss);
  pipe.train_step(x, y, gpipe::mse_loss);
  EXPECT_TRUE(gpipe::testing::same_parameters(s.model, ref.model, /*values=*/false));
}

TEST_P(FaultTest, BackwardFaultIsReportedAndChangesNothing) {
  FaultyModel s = make(2);
  gpipe::Pipeline pipe(s.model, PipelineOptions().devices(3).micro_batches(4).checkpoint(GetParam()));
  const torch::Tensor x = torch::randn({8, 6}), y = torch::randn({8, 3});

  s.fault->fail_backward = true;
  const std::string what = step_error([&] { pipe.train_step(x, y, gpipe::mse_loss); });
  // The last micro-batch's backward runs first.
  EXPECT_NE(what.find("stage 1 failed in the backward of micro-batch 3"), std::string::npos) << what;
  EXPECT_NE(what.find("injected backward fault"), std::string::npos) << what;
  for (auto& p : s.model->parameters()) EXPECT_FALSE(p.grad().defined());

  s.fault->fail_backward = false;
  FaultyModel ref = make(2);
  gpipe::testing::reference_step(ref.model, x, y, gpipe::mse_loss);
  pipe.train_step(x, y, gpipe::mse_loss);
  EXPECT_TRUE(gpipe::testing::same_parameters(s.model, ref.model, /*values=*/false));
}

TEST(FaultTest, ShapeMismatchInALayerNamesStageAndMicroBatch) {
  torch::manual_seed(3);
  // Layer 5 expects 9 features but gets 8.
  auto model = torch::nn::Sequential(torch::nn::Linear(4, 8), torch::nn::ReLU(), torch::nn::Linear(8, 8),
                                     torch::nn::ReLU(), torch::nn::Linear(8, 8), torch::nn::Linear(9, 2));
  gpipe::Pipeline pipe(model, PipelineOptions().balance({2, 2, 2}).micro_batches(3));
  const std::string what = step_error(
      [&] { pipe.train_step(torch::randn({6, 4}), torch::randn({6, 2}), gpipe::mse_loss); });
  EXPECT_NE(what.find("stage 2 failed in the forward of micro-batch 0 (action 2F0"), std::string::npos) << what;
  // The shape the stage was given, libtorch's message, and none of its C++ stack frames.
  EXPECT_NE(what.find("input [2, 8]): mat1 and mat2 shapes cannot be multiplied (2x8 and 9x2)"), std::string::npos)
      << what;
  EXPECT_EQ(what.find("Exception raised from"), std::string::npos) << what;
  EXPECT_EQ(what.find("frame #"), std::string::npos) << what;
  try {
    pipe.train_step(torch::randn({6, 4}), torch::randn({6, 2}), gpipe::mse_loss);
    ADD_FAILURE() << "no error";
  } catch (const gpipe::StageError& e) {
    EXPECT_NE(e.backtrace().find("mat1 and mat2"), std::string::npos) << "the full report stays available";
  }
}

// The error of a failing action shows, after its message, the device's program around it with the
// action marked; the other processes are told the message alone.
TEST(FaultTest, AFailureShowsTheProgramAroundTheFailingAction) {
  FaultyModel s = make(4);
  gpipe::Pipeline pipe(s.model, PipelineOptions().devices(3).micro_batches(6).checkpoint(gpipe::Checkpoint::kNever));
  const torch::Tensor x = torch::randn({12, 6}), y = torch::randn({12, 3});
  s.fault->forwards_before_fault = 2;  // stage 1's third forward: micro-batch 2's
  const std::string what = step_error([&] { pipe.train_step(x, y, gpipe::mse_loss); });
  std::istringstream text(what);
  std::string message, heading, program, more;
  std::getline(text, message);
  std::getline(text, heading);
  std::getline(text, program);
  EXPECT_EQ(message, "gpipe: stage 1 failed in the forward of micro-batch 2 (action 1F2, input [2, 8]): injected fault");
  // Fill-drain's device 1: 6 x (receive, F, send) forwards, then as many backwards.
  EXPECT_EQ(heading, "device 1's program at its action 8 of 36 (>>):");
  EXPECT_EQ(program, "device 1 | ... 1RECV_F1<0 1F1 1SEND_F1>2 1RECV_F2<0 >> 1F2 1SEND_F2>2 1RECV_F3<0 1F3 1SEND_F3>2 ...");
  EXPECT_FALSE(std::getline(text, more)) << what;

  // Near the start of the program nothing is cut before the failing action; the message alone is
  // what the other processes hear.
  s.fault->forwards_before_fault = 0;
  try {
    pipe.train_step(x, y, gpipe::mse_loss);
    ADD_FAILURE() << "no error";
  } catch (const gpipe::StageError& e) {
    EXPECT_EQ(e.message(), "gpipe: stage 1 failed in the forward of micro-batch 0 (action 1F0, input [2, 8]): "
                           "injected fault");
    EXPECT_EQ(std::string(e.what()), e.message() + "\ndevice 1's program at its action 2 of 36 (>>):\n"
                                                   "device 1 | 1RECV_F0<0 >> 1F0 1SEND_F0>2 1RECV_F1<0 1F1 1SEND_F1>2 ...");
    EXPECT_EQ(e.action(), gpipe::Action::parse("1F0"));
  }
}

TEST(FaultTest, LossThatIsNotAScalarIsReported) {
  gpipe::Pipeline pipe(gpipe::testing::small_mlp(0), PipelineOptions().devices(2).micro_batches(2));
  const std::string what = step_error([&] {
    pipe.train_step(torch::randn({4, 12}), torch::randn({4, 4}),
                    [](const torch::Tensor& o, const torch::Tensor& t) { return (o - t).pow(2); });
  });
  EXPECT_NE(what.find("the loss must return a scalar"), std::string::npos) << what;
}

// Three blocks of [Linear, Tanh, Dropout, FaultPoint] and a head: 13 layers, each fault point
// able to fail its forward, its input path's backward or its weight's backward.
torch::nn::Sequential stress_model(const std::shared_ptr<gpipe::testing::FaultPlan>& plan) {
  torch::manual_seed(21);
  torch::nn::Sequential m;
  for (int point = 0; point < 3; ++point) {
    m->push_back(torch::nn::Linear(8, 8));
    m->push_back(torch::nn::Tanh());
    m->push_back(torch::nn::Dropout(0.2));
    m->push_back(gpipe::testing::FaultPoint(point, 8, plan));
  }
  m->push_back(torch::nn::Linear(8, 3));
  return m;
}

// Random faults over many steps, at random points, phases and moments; every failed step leaves
// the gradients as they were and is retried; in the end the parameters equal, bit for bit, those
// of the same run without faults (Dropout included: a retried step draws the same masks).
TEST(FaultStressTest, RandomFaultsRetriedEndAsAFaultFreeRun) {
  using gpipe::testing::FaultPlan;
  for (gpipe::ScheduleKind kind : {gpipe::ScheduleKind::kZB1P, gpipe::ScheduleKind::k1F1B,
                                   gpipe::ScheduleKind::kGPipe}) {
    SCOPED_TRACE(gpipe::to_string(kind));
    auto plan = std::make_shared<FaultPlan>();
    auto faulty = stress_model(plan), clean = stress_model(std::make_shared<FaultPlan>());
    const auto options = PipelineOptions().balance({4, 4, 5}).micro_batches(4).schedule(kind);
    gpipe::Pipeline a(faulty, options), b(clean, options);
    int failures = 0;
    ASSERT_NO_FATAL_FAILURE(gpipe::testing::train_with_random_faults<gpipe::StageError>(
        a, b, *plan, 120, static_cast<unsigned>(kind) + 1, &failures));
    EXPECT_GT(failures, 20);
    const auto pa = faulty->parameters(), pb = clean->parameters();
    for (size_t n = 0; n < pa.size(); ++n) EXPECT_TRUE(torch::equal(pa[n], pb[n])) << "parameter " << n;
  }
}

INSTANTIATE_TEST_SUITE_P(Modes, FaultTest,
                         ::testing::Values(gpipe::Checkpoint::kAlways, gpipe::Checkpoint::kExceptLast,
                                           gpipe::Checkpoint::kNever),
                         [](const auto& info) { return gpipe::to_string(info.param); });

}  // namespace
