// c10d_test.cc: run under torchrun (tests/torchrun.sh NP c10d_test): a pipeline over c10d, one device
// per process, trains as the same pipeline on threads in one process: bit for bit with one replica,
// up to rounding with several (D = NP/K); every schedule, skips, tuples, tied weights, BatchNorm; a
// failing rank stops the others, and a rank that lets go of its pipeline ends their waits. Ranks of one
// machine meet through shared memory, except where GPIPE_SHM=0 says Gloo.
//
// Every test is collective: each rank runs the same tests in the same order and checks its own
// stages; a failure on any rank makes torchrun exit non-zero.
#include "helpers.h"
#include "rank_tests.h"

#include <gpipe/backend.h>

#include <cstdlib>
#include <functional>
#include <map>

namespace gpipe::testing {
namespace {

int world_rank() { return backend(Runtime::kC10d).process().first; }
int world_size() { return backend(Runtime::kC10d).process().second; }

using Batch = std::function<std::pair<Tensors, torch::Tensor>()>;

Batch rows_of(int64_t rows, int64_t in, int64_t out, double scale = 1.0) {
  return [=] { return std::make_pair(Tensors(torch::randn({rows, in}) * scale), torch::randn({rows, out})); };
}

// Two SGD steps of the pipeline over c10d (K devices, D replicas of M micro-batches) and of the same
// on threads in one process (D·M micro-batches: the same rows in each), on the same batches and
// Dropout streams; then every parameter and buffer this rank holds compared. How the c10d pipeline
// describes its backend goes to `described`, if given.
void expect_trains_as_threads(const LayerBuilder& build, int layers, const PipelineOptions& options,
                              const Batch& batch, bool bitwise = true, double tolerance = 1e-5,
                              std::string* described = nullptr) {
  const int K = options.devices();
  if (world_size() % K != 0) return;
  const int D = world_size() / K;
  bitwise = bitwise && D == 1;
  auto ranks = make_pipeline(build, layers, options, Runtime::kC10d);
  auto threads = make_pipeline(build, layers, PipelineOptions(options).micro_batches(options.micro_batches() * D),
                               Runtime::kThreads);
  ASSERT_EQ(ranks->balance(), threads->balance());
  torch::optim::SGD opt_ranks(ranks->parameters(), 0.05), opt_threads(threads->parameters(), 0.05);
  for (int s = 0; s < 2; ++s) {
    torch::manual_seed(60 + s);
    const auto [x, y] = batch();
    opt_ranks.zero_grad();
    opt_threads.zero_grad();
    torch::manual_seed(70 + s);  // each step draws its Dropout stream from the caller's: the same for both
    const double a = ranks->train_step(x, y, mse_loss).item<double>();
    torch::manual_seed(70 + s);
    const double b = threads->train_step(x, y, mse_loss).item<double>();
    if (bitwise) EXPECT_EQ(a, b);
    EXPECT_NEAR(a, b, tolerance * std::abs(b));
    opt_ranks.step();
    opt_threads.step();
  }
  const auto theirs = threads->layers()->named_parameters();
  for (const auto& p : ranks->layers()->named_parameters())
    EXPECT_TRUE(bitwise ? torch::equal(p.value(), theirs[p.key()]) : close(p.value(), theirs[p.key()], tolerance))
        << "rank " << world_rank() << ": " << p.key();
  const auto their_buffers = threads->layers()->named_buffers();
  for (const auto& b : ranks->layers()->named_buffers())
    EXPECT_TRUE(close(b.value().to(torch::kDouble), their_buffers[b.key()].to(torch::kDouble), tolerance))
        << "rank " << world_rank() << ": buffer " << b.key();
  if (described) *described = ranks->describe();
}

// small_mlp: 7 layers, 10 with Dropout.
LayerBuilder mlp(double dropout) {
  return [dropout](LayerRange keep) {
    torch::nn::Sequential all = small_mlp(5, dropout), mine;
    int n = 0;
    for (auto it = all->begin(); it != all->end(); ++it) add_layer(mine, *it, n++, keep);
    return mine;
  };
}

TEST(C10dPipeline, EverySchedulesTrainingEqualsThreads) {
  for (int K : {1, 2, 4})
    for (ScheduleKind schedule : {ScheduleKind::kGPipe, ScheduleKind::k1F1B, ScheduleKind::kZB1P,
                                  ScheduleKind::kInterleaved, ScheduleKind::kZBV, ScheduleKind::kVHalf})
      for (Checkpoint mode : {Checkpoint::kAlways, Checkpoint::kExceptLast, Checkpoint::kNever}) {
        const bool two_per_device = schedule == ScheduleKind::kInterleaved || schedule == ScheduleKind::kZBV ||
                                    schedule == ScheduleKind::kVHalf;
        // Dropout with one replica, whose micro-batches and masks are the threads' own.
        const double dropout = world_size() == K ? 0.3 : 0.0;
        const int layers = dropout > 0 ? 10 : 7;
        if ((two_per_device ? 2 * K : K) > layers || world_size() % K != 0) continue;
        SCOPED_TRACE("K=" + std::to_string(K) + " " + to_string(schedule) + " " + to_string(mode));
        auto options = PipelineOptions().devices(K).micro_batches(4).checkpoint(mode).schedule(schedule);
        if (schedule == ScheduleKind::kInterleaved) options.virtual_stages(2);
        expect_trains_as_threads(mlp(dropout), layers, options, rows_of(16, 12, 4));
      }
}

// Between ranks of one machine, a boundary of 32 MiB a micro-batch, larger than a shared-memory ring
// (8 MiB), crosses in parts, and the same through Gloo (GPIPE_SHM=0). The test's ranks share one
// machine: each reaches every other through shared memory, unless told not to.
TEST(C10dPipeline, ABoundaryLargerThanARingEqualsThreads) {
  const LayerBuilder wide = [](LayerRange keep) {
    torch::manual_seed(3);
    torch::nn::Sequential all(torch::nn::Linear(16, 4096), torch::nn::ReLU(), torch::nn::Linear(4096, 4)), mine;
    int n = 0;
    for (auto it = all->begin(); it != all->end(); ++it) add_layer(mine, *it, n++, keep);
    return mine;
  };
  const auto options = PipelineOptions().devices(2).micro_batches(2).balance({2, 1});
  const std::string others = std::to_string(world_size() - 1);
  std::string described;
  expect_trains_as_threads(wide, 3, options, rows_of(4096 * world_size() / 2, 16, 4), true, 1e-5, &described);
  if (world_size() % 2 != 0) return;  // no replica of 2 devices: nothing ran
  EXPECT_EQ(described, "c10d (Gloo; shared memory with " + others + " of " + others + " other rank" +
                           (world_size() == 2 ? "" : "s") + "): " +
                std::to_string(world_size()) + " ranks = 2 devices x " + std::to_string(world_size() / 2) +
                (world_size() == 2 ? " replica" : " replicas"));
  struct GlooOnly {
    GlooOnly() { setenv("GPIPE_SHM", "0", 1); }
    ~GlooOnly() { unsetenv("GPIPE_SHM"); }
  } gloo_only;
  expect_trains_as_threads(wide, 3, options, rows_of(4096 * world_size() / 2, 16, 4), true, 1e-5, &described);
  EXPECT_EQ(described.rfind("c10d (Gloo): ", 0), 0u) << described;
}

TEST(C10dPipeline, SkipConnectionsEqualThreads) {
  const LayerBuilder build = [](LayerRange keep) {
    torch::manual_seed(19);
    namespace nn = torch::nn;
    std::vector<nn::AnyModule> layers{
        nn::AnyModule(nn::Linear(12, 16)), nn::AnyModule(Stash("u")),         nn::AnyModule(nn::Tanh()),
        nn::AnyModule(nn::Linear(16, 16)), nn::AnyModule(Stash("r")),         nn::AnyModule(nn::ReLU()),
        nn::AnyModule(nn::Linear(16, 16)), nn::AnyModule(Pop("r")),           nn::AnyModule(nn::Linear(16, 8)),
        nn::AnyModule(Pop("u", concat_skip)), nn::AnyModule(nn::Linear(24, 4))};
    torch::nn::Sequential model;
    for (size_t n = 0; n < layers.size(); ++n) add_layer(model, layers[n], static_cast<int>(n), keep);
    return model;
  };
  for (int K : {2, 4})
    for (ScheduleKind schedule : {ScheduleKind::kGPipe, ScheduleKind::k1F1B, ScheduleKind::kZB1P}) {
      SCOPED_TRACE("K=" + std::to_string(K) + " " + to_string(schedule));
      expect_trains_as_threads(build, 11, PipelineOptions().devices(K).micro_batches(3).schedule(schedule),
                               rows_of(12, 12, 4));
    }
}

TEST(C10dPipeline, TuplesCrossRanksAsOnThreads) {
  const LayerBuilder build = [](LayerRange keep) { return tuple_model(8, keep); };
  const Batch batch = [] {
    return std::make_pair(Tensors::tuple_of({torch::randn({14, kSeq, kIn}), torch::rand({kIn})}),
                          torch::randn({14, kOut}));
  };
  for (int K : {2, 4})
    for (Checkpoint mode : {Checkpoint::kAlways, Checkpoint::kNever}) {
      SCOPED_TRACE("K=" + std::to_string(K) + " " + to_string(mode));
      expect_trains_as_threads(build, 6, PipelineOptions().devices(K).micro_batches(3).checkpoint(mode).whole_inputs({1}),
                               batch);
    }
}

TEST(C10dPipeline, TiedWeightsEqualThreads) {
  const LayerBuilder build = [](LayerRange keep) {
    torch::manual_seed(17);
    torch::nn::Embedding embedding(kVocab, 16);
    torch::nn::Sequential model;
    add_layer(model, torch::nn::AnyModule(embedding), 0, keep);
    for (int b = 1; b <= 4; ++b) add_layer(model, torch::nn::AnyModule(EncoderBlock(16, 2, 32, 0.0)), b, keep);
    add_layer(model, torch::nn::AnyModule(TiedProjection(embedding->weight)), 5, keep);
    return model;
  };
  const Batch tokens = [] {
    return std::make_pair(Tensors(torch::randint(kVocab, {8, 5}, torch::kLong)), torch::randn({8, 5, kVocab}));
  };
  for (int K : {2, 4}) {
    SCOPED_TRACE("K=" + std::to_string(K));
    // The copies' gradients are summed in another order than one process sums a shared weight's.
    expect_trains_as_threads(build, 6, PipelineOptions().devices(K).micro_batches(2).tied_parameters({{"0.weight", "5.weight"}}),
                             tokens, /*bitwise=*/false);
  }
}

TEST(C10dPipeline, BatchNormStatisticsEqualThreads) {
  const LayerBuilder build = [](LayerRange keep) {
    torch::manual_seed(13);
    namespace nn = torch::nn;
    std::vector<nn::AnyModule> layers{nn::AnyModule(nn::Linear(12, 16)), nn::AnyModule(nn::BatchNorm1d(16)),
                                      nn::AnyModule(nn::ReLU()), nn::AnyModule(nn::Linear(16, 16)),
                                      nn::AnyModule(nn::BatchNorm1d(16)), nn::AnyModule(nn::Tanh()),
                                      nn::AnyModule(nn::Linear(16, 4))};
    torch::nn::Sequential model;
    for (size_t n = 0; n < layers.size(); ++n) add_layer(model, layers[n], static_cast<int>(n), keep);
    return model;
  };
  for (int K : {1, 2}) {
    SCOPED_TRACE("K=" + std::to_string(K));
    expect_trains_as_threads(build, 7, PipelineOptions().devices(K).micro_batches(3).deferred_batch_norm(true),
                             rows_of(72, 12, 4, 3.0));
  }
}

// Random faults at random stages, phases and moments: every rank learns of each failure, the step is
// retried on fresh connections, and the end is the fault-free run, bit for bit.
TEST(C10dFailure, RandomFaultsRetriedEndAsAFaultFreeRun) {
  const int K = world_size() == 4 ? 2 : std::min(world_size(), 3);
  if (world_size() % K != 0) GTEST_SKIP();
  auto plan = std::make_shared<FaultPlan>();  // every rank arms the same plan; the owning stage fires
  auto builder = [](std::shared_ptr<FaultPlan> p) {
    return LayerBuilder([p](LayerRange keep) {
      torch::manual_seed(21);
      torch::nn::Sequential m;
      int n = 0;
      for (int point = 0; point < 3; ++point) {
        add_layer(m, torch::nn::AnyModule(torch::nn::Linear(8, 8)), n++, keep);
        add_layer(m, torch::nn::AnyModule(torch::nn::Tanh()), n++, keep);
        add_layer(m, torch::nn::AnyModule(FaultPoint(point, 8, p)), n++, keep);
      }
      add_layer(m, torch::nn::AnyModule(torch::nn::Linear(8, 3)), n++, keep);
      return m;
    });
  };
  const auto options = PipelineOptions().devices(K).micro_batches(4).schedule(ScheduleKind::k1F1B);
  auto faulty = make_pipeline(builder(plan), 10, options, Runtime::kC10d);
  auto clean = make_pipeline(builder(std::make_shared<FaultPlan>()), 10, options, Runtime::kC10d);
  int failures = 0;  // StageError on the failing rank, RemoteError on the others
  ASSERT_NO_FATAL_FAILURE(train_with_random_faults<std::exception>(*faulty, *clean, *plan, 30, 5, &failures));
  EXPECT_GT(failures, 3);
  const auto pa = faulty->parameters(), pb = clean->parameters();
  for (size_t n = 0; n < pa.size(); ++n) EXPECT_TRUE(torch::equal(pa[n], pb[n])) << "parameter " << n;
}

// A rank that lets go of its pipeline while the others still call it: their call throws, naming it,
// rather than waiting.
TEST(C10dFailure, ARankThatLetsGoEndsTheOthersWaits) {
  if (world_size() < 2) GTEST_SKIP();
  const auto options = PipelineOptions().devices(2).micro_batches(2);
  auto pipe = make_pipeline(mlp(0.0), 7, options, Runtime::kC10d);
  const torch::Tensor x = torch::randn({8, 12}), y = torch::randn({8, 4});
  pipe->train_step(x, y, mse_loss);
  if (world_rank() == 1) {
    pipe.reset();
    all_gather_processes("");  // the others' calls are under way
    return;
  }
  try {
    pipe->train_step(x, y, mse_loss);
    ADD_FAILURE() << "rank " << world_rank() << ": the call went on without rank 1";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("rank 1"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("let go of its pipeline"), std::string::npos) << e.what();
  }
  all_gather_processes("");
}

}  // namespace
}  // namespace gpipe::testing

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  gpipe::start_backends(gpipe::Runtime::kC10d);
  at::set_num_threads(1);
  const int rank = gpipe::backend(gpipe::Runtime::kC10d).process().first;
  gpipe::testing::print_only_failures_unless_first(rank);
  return RUN_ALL_TESTS();
}
