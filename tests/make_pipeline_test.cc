// make_pipeline_test.cc: make_pipeline in one process: the builder contract, training equal to one device,
// evaluation equal to the model's own, and the errors; the backend boundary (backend.h): a Pipeline over a
// backend of one's own, the backends by name.
#include "helpers.h"

namespace gpipe::testing {
namespace {

// The 7-layer MLP of helpers.h, as a builder: every range draws the same initial values.
torch::nn::Sequential build_mlp(LayerRange keep) {
  const torch::nn::Sequential whole = small_mlp(3);
  torch::nn::Sequential part;
  int n = 0;
  for (auto it = whole->begin(); it != whole->end(); ++it, ++n) add_layer(part, *it, n, keep);
  return part;
}

TEST(MakePipelineTest, ThreadsTrainAsOneDevice) {
  auto pipe = make_pipeline(build_mlp, 7, PipelineOptions().devices(3).micro_batches(4), Runtime::kThreads);
  const torch::nn::Sequential reference = build_mlp({});
  torch::manual_seed(1);
  const torch::Tensor x = torch::randn({22, 12}), y = torch::randn({22, 4});
  const torch::Tensor loss = pipe->train_step(x, y, mse_loss);
  const torch::Tensor expected = reference_step(reference, x, y, mse_loss);
  EXPECT_TRUE(close(loss.to(torch::kFloat), expected));
  EXPECT_TRUE(same_parameters(pipe->layers(), reference, /*values=*/false));
  EXPECT_EQ(pipe->balance(), (std::vector<int>{3, 2, 2}));
  EXPECT_TRUE(pipe->root());
  EXPECT_EQ(pipe->replica(), 0);
  EXPECT_DOUBLE_EQ(pipe->sum(2.5), 2.5);
  EXPECT_TRUE(pipe->same_everywhere(4.0));
}

TEST(MakePipelineTest, EvaluateEqualsTheModelInEvalMode) {
  auto pipe = make_pipeline(build_mlp, 7, PipelineOptions().devices(2).micro_batches(3), Runtime::kThreads);
  torch::manual_seed(2);
  const torch::Tensor x = torch::randn({25, 12});
  const torch::Tensor labels = torch::randint(4, {25}, torch::kLong);
  // Batches of 10 rows: 10, 10 and 5, the last one smaller than M... and larger.
  const Evaluation e = pipe->evaluate(x, labels, cross_entropy_loss, /*classification=*/true, 10);
  torch::nn::Sequential reference = build_mlp({});
  reference->eval();
  torch::NoGradGuard no_grad;
  const torch::Tensor out = reference->forward(x);
  EXPECT_NEAR(e.loss, gpipe::cross_entropy_loss(out, labels).item<double>(), 1e-6);
  EXPECT_DOUBLE_EQ(e.accuracy, out.argmax(-1).eq(labels).to(torch::kDouble).mean().item<double>());
  EXPECT_TRUE(pipe->layers()->is_training()) << "evaluate puts the layers back in train mode";
  pipe->layers()->eval();
  pipe->evaluate(x, labels, cross_entropy_loss, /*classification=*/true, 10);
  EXPECT_FALSE(pipe->layers()->is_training()) << "and layers in eval mode back in eval mode";
  pipe->layers()->train();
  EXPECT_DOUBLE_EQ(pipe->evaluate(x, torch::randn({25, 4}), mse_loss, false, 10).accuracy, 0.0);
}

TEST(MakePipelineTest, ChecksumIsTheWeightedSumOfTheParameters) {
  auto pipe = make_pipeline(build_mlp, 7, PipelineOptions().devices(2).micro_batches(1), Runtime::kThreads);
  double expected = 0;
  for (const auto& p : pipe->parameters()) {
    const torch::Tensor flat = p.detach().to(torch::kDouble).flatten();
    for (int64_t k = 0; k < flat.numel(); ++k) expected += flat[k].item<double>() * static_cast<double>(k % 7 + 1);
  }
  EXPECT_NEAR(pipe->checksum(), expected, 1e-9 * std::abs(expected));
}

// A plan made once (gpipe train makes it to check its flags) is the pipeline's as it is: K, V, M and
// the cut are not resolved again (the options alone would cut evenly, {3, 2, 2}), and a plan of other
// options is refused.
TEST(MakePipelineTest, APlanMadeOnceIsTakenAsItIs) {
  const PipelineOptions options = PipelineOptions().devices(3).micro_batches(4);
  const PipelinePlan plan = make_plan(7, PipelineOptions(options).cut(CutRequest::given({1, 2, 4})));
  auto pipe = make_pipeline(build_mlp, plan, options, Runtime::kThreads);
  EXPECT_EQ(pipe->balance(), (std::vector<int>{1, 2, 4}));
  EXPECT_EQ(pipe->plan().cut, CutKind::kGiven);
  torch::manual_seed(1);
  const torch::Tensor x = torch::randn({22, 12}), y = torch::randn({22, 4});
  const torch::Tensor loss = pipe->train_step(x, y, mse_loss);
  EXPECT_TRUE(close(loss.to(torch::kFloat), reference_step(build_mlp({}), x, y, mse_loss)));
  EXPECT_THROW(make_pipeline(build_mlp, plan, PipelineOptions(options).micro_batches(2), Runtime::kThreads),
               std::invalid_argument);
  EXPECT_THROW(make_pipeline(build_mlp, plan, PipelineOptions(options).devices(2), Runtime::kThreads),
               std::invalid_argument);
}

TEST(MakePipelineTest, RefusesABuilderThatDoesNotKeepItsPromise) {
  expect_invalid([] { make_pipeline(build_mlp, 8, PipelineOptions().devices(2), Runtime::kThreads); },
                 "the layer builder made 7 layers, but the model was said to have 8");
  expect_invalid([] { make_pipeline(LayerBuilder(), 7, PipelineOptions().devices(2), Runtime::kThreads); },
                 "needs a layer builder");
  expect_invalid([] { make_pipeline(build_mlp, 7, PipelineOptions().devices(9), Runtime::kThreads); }, "into 9 devices");
}

TEST(MakePipelineTest, MpiRuntimeNeedsMpi) {
  EXPECT_FALSE(mpi_runtime());  // not started by mpirun: Runtime::kAuto runs threads
#if defined(GPIPE_HAS_MPI) && GPIPE_HAS_MPI
  expect_invalid([] { make_pipeline(build_mlp, 7, PipelineOptions().devices(2), Runtime::kMpi); },
                 "create a gpipe::mpi::Environment");
#else
  expect_invalid([] { make_pipeline(build_mlp, 7, PipelineOptions().devices(2), Runtime::kMpi); },
                 "rebuild with -DGPIPE_MPI=ON");
#endif
  auto pipe = make_pipeline(build_mlp, 7, PipelineOptions().devices(2));
  EXPECT_EQ(pipe->describe(), "one process, 2 device threads");
}

// A backend written from include/gpipe/backend.h alone: this process, a thread per device, the
// in-process transport; it counts the runtime's calls.
class CountingBackend : public Backend {
 public:
  PipelinePlan plan(const torch::nn::Sequential& layers, const PipelineOptions& options,
                    const SkipUseFinder& skip_uses) override {
    plan_ = make_plan(static_cast<int>(layers->size()), options, connect_skips(skip_uses(layers, false)));
    return plan_;
  }
  std::vector<int> local_devices() const override {
    std::vector<int> all;
    for (int d = 0; d < plan_.devices; ++d) all.push_back(d);
    return all;
  }
  bool on_caller_thread() const override { return false; }
  void agree(std::exception_ptr failure) override {
    if (failure) std::rethrow_exception(failure);
  }
  void connect(const PipelinePlan& plan, const torch::nn::Sequential&, const PipelineOptions&) override {
    transport_ = std::make_unique<InProcessTransport>(plan.stages());
  }
  void begin_call() override { ++calls; }
  Transport& transport() override { return *transport_; }
  void reduce_gradients(const std::vector<torch::Tensor>&) override { ++reductions; }
  std::string describe() const override { return "counting"; }

  int calls = 0, reductions = 0;

 private:
  PipelinePlan plan_;
  std::unique_ptr<InProcessTransport> transport_;
};

TEST(BackendTest, APipelineRunsOnABackendOfOnesOwn) {
  const PipelineOptions options = PipelineOptions().devices(3).micro_batches(4);
  auto backend = std::make_unique<CountingBackend>();
  const CountingBackend& counted = *backend;
  Pipeline mine(std::move(backend), build_mlp({}), options);
  Pipeline reference(build_mlp({}), options);
  torch::manual_seed(1);
  const torch::Tensor x = torch::randn({22, 12}), y = torch::randn({22, 4});
  EXPECT_TRUE(torch::equal(mine.train_step(x, y, mse_loss), reference.train_step(x, y, mse_loss)));
  const auto a = mine.parameters(), b = reference.parameters();
  ASSERT_EQ(a.size(), b.size());
  for (size_t n = 0; n < a.size(); ++n) EXPECT_TRUE(torch::equal(a[n].grad(), b[n].grad())) << n;  // bit for bit
  EXPECT_EQ(counted.calls, 1);
  EXPECT_EQ(counted.reductions, 1);
  EXPECT_EQ(mine.describe(), "counting");
  EXPECT_EQ(&mine.backend(), &counted);
}

TEST(BackendTest, TheBackendsAreChosenByName) {
  EXPECT_EQ(parse_runtime("auto"), Runtime::kAuto);
  EXPECT_EQ(parse_runtime("threads"), Runtime::kThreads);
  EXPECT_EQ(parse_runtime("mpi"), Runtime::kMpi);
  EXPECT_EQ(parse_runtime("c10d"), Runtime::kC10d);
  expect_invalid([] { parse_runtime("nccl"); },
                 "runtime must be \"auto\", \"threads\", \"mpi\" or \"c10d\" (got \"nccl\")");
  ASSERT_EQ(backends().size(), 2u);
  EXPECT_EQ(backends()[0].runtime, Runtime::kMpi);
  EXPECT_EQ(backends()[1].runtime, Runtime::kC10d);
#if defined(GPIPE_HAS_MPI) && GPIPE_HAS_MPI
  EXPECT_TRUE(backends()[0].built);
#else
  EXPECT_FALSE(backends()[0].built);
  expect_invalid([] { backend(Runtime::kMpi); }, "rebuild with -DGPIPE_MPI=ON");
#endif
#if defined(GPIPE_HAS_C10D) && GPIPE_HAS_C10D
  EXPECT_TRUE(backends()[1].built);
  // Not started by torchrun: the backend says how to start it.
  expect_invalid([] { backend(Runtime::kC10d).process(); }, "start the program with torchrun");
#else
  EXPECT_FALSE(backends()[1].built);
  expect_invalid([] { backend(Runtime::kC10d); }, "rebuild with -DGPIPE_C10D=ON");
#endif
  // Not started by a launcher: one process, and the front ends' calls are those of one process.
  EXPECT_EQ(running_backend(), Runtime::kThreads);
  EXPECT_EQ(all_gather_processes("mine"), std::vector<std::string>{"mine"});
  const Placement p = place(5, 6, 3);
  EXPECT_EQ(p.device, 2);
  EXPECT_EQ(p.replica, 1);
  EXPECT_EQ(p.replicas, 2);
  expect_invalid([] { place(0, 4, 3); }, "not a multiple of the 3 devices");
}

}  // namespace
}  // namespace gpipe::testing
