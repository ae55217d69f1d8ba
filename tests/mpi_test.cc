// mpi_test.cc: run under mpirun (tests/mpirun.sh NP mpi_test): one stage per rank equals the
// one-process pipeline and the single device, for every K that divides NP (D = NP/K replicas).
//
// Every test is collective: each rank runs the same tests in the same order and
// checks its own stage; a failure on any rank makes mpirun exit non-zero.
#include "helpers.h"
#include "rank_tests.h"

#include <gpipe/mpi.h>

#include <algorithm>
#include <map>
#include <numeric>
#include <random>

namespace gpipe::testing {
namespace {

int world_rank() {
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  return rank;
}

int world_size() {
  int size = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  return size;
}

// 8 layers, built in order with the same random numbers whatever `keep` is.
torch::nn::Sequential model_layers(uint64_t seed, LayerRange keep = {}, double dropout = 0.0) {
  torch::manual_seed(seed);
  namespace nn = torch::nn;
  std::vector<nn::AnyModule> layers{nn::AnyModule(nn::Linear(12, 16)), nn::AnyModule(nn::ReLU()),
                                    nn::AnyModule(nn::Linear(16, 16)), nn::AnyModule(nn::Tanh()),
                                    nn::AnyModule(nn::Dropout(dropout)), nn::AnyModule(nn::Linear(16, 16)),
                                    nn::AnyModule(nn::ReLU()),          nn::AnyModule(nn::Linear(16, 4))};
  torch::nn::Sequential model;
  for (size_t n = 0; n < layers.size(); ++n) add_layer(model, layers[n], static_cast<int>(n), keep);
  return model;
}

// The layers of stage `stage` of `balance`, as the plan cuts them.
LayerRange stage_range(const std::vector<int>& balance, int stage) {
  return make_plan(std::accumulate(balance.begin(), balance.end(), 0), PipelineOptions().balance(balance)).layers_of(stage);
}

std::vector<int> cut(int stages) {
  if (stages == 1) return {8};
  if (stages == 2) return {3, 5};
  if (stages == 3) return {2, 4, 2};
  return {2, 2, 3, 1};
}

struct Config {
  int stages;
  int micro_batches;
  Checkpoint checkpoint;
  int64_t batch;
  gpipe::ScheduleKind schedule = gpipe::ScheduleKind::kGPipe;
};

std::string name(const Config& c) {
  return "K=" + std::to_string(c.stages) + " D=" + std::to_string(world_size() / c.stages) +
         " M=" + std::to_string(c.micro_batches) + " " + to_string(c.checkpoint) + " N=" + std::to_string(c.batch) + " " +
         gpipe::to_string(c.schedule);
}

std::vector<Config> configs() {
  std::vector<Config> out;
  for (int K : {1, 2, 3, 4}) {
    if (world_size() % K != 0) continue;
    out.push_back({K, 1, Checkpoint::kNever, 24});
    out.push_back({K, 3, Checkpoint::kAlways, 24});
    out.push_back({K, 4, Checkpoint::kExceptLast, 23});  // replicas get unequal shares
    out.push_back({K, 5, Checkpoint::kExceptLast, 23, gpipe::ScheduleKind::k1F1B});
    out.push_back({K, 3, Checkpoint::kNever, 24, gpipe::ScheduleKind::kZB1P});
    out.push_back({K, 4, Checkpoint::kAlways, 23, gpipe::ScheduleKind::kZB1P});
  }
  return out;
}

// The named parameters of `full` that `stage` holds, in order.
std::vector<torch::Tensor> matching(const torch::nn::Sequential& full, const torch::nn::Sequential& stage, bool grads) {
  std::vector<torch::Tensor> out;
  const auto all = full->named_parameters();
  for (const auto& p : stage->named_parameters()) {
    const torch::Tensor& t = all[p.key()];
    out.push_back(grads ? t.grad() : t);
  }
  return out;
}

void expect_stage_matches(const torch::nn::Sequential& stage, const torch::nn::Sequential& full, bool grads,
                          const std::string& what, double tol = 1e-5) {
  const auto mine = stage->named_parameters();
  const auto theirs = matching(full, stage, grads);
  for (size_t n = 0; n < mine.size(); ++n) {
    const torch::Tensor a = grads ? mine[n].value().grad() : mine[n].value();
    EXPECT_TRUE(close(a, theirs[n], tol)) << "rank " << world_rank() << ", " << what << ": "
                                          << (grads ? "grad" : "value") << " of " << mine[n].key();
  }
}

// Three SGD+momentum steps three ways: one device, one-process pipeline, one stage per rank.
TEST(MpiPipeline, EqualsOneDeviceAndOneProcessPipeline) {
  for (const Config& c : configs()) {
    SCOPED_TRACE(name(c));
    const std::vector<int> balance = cut(c.stages);
    const mpi::Placement place = mpi::place(world_rank(), world_size(), c.stages);
    const auto [first, last] = stage_range(balance, place.device);

    torch::nn::Sequential single = model_layers(7);
    torch::nn::Sequential local = model_layers(7);
    torch::nn::Sequential mine = model_layers(7, {first, last});
    Pipeline pipe(local, PipelineOptions().balance(balance).micro_batches(c.micro_batches).checkpoint(c.checkpoint).schedule(c.schedule));
    mpi::MpiPipeline mpi_pipe(mine, PipelineOptions().balance(balance).micro_batches(c.micro_batches).checkpoint(c.checkpoint)
                                        .schedule(c.schedule));
    EXPECT_EQ(mine->size(), static_cast<size_t>(last - first));

    auto options = torch::optim::SGDOptions(0.05).momentum(0.9);
    torch::optim::SGD opt_single(single->parameters(), options), opt_local(pipe.parameters(), options),
        opt_mine(mpi_pipe.parameters(), options);
    for (int s = 0; s < 3; ++s) {
      torch::manual_seed(100 + s);  // the same batch on every rank
      const torch::Tensor x = torch::randn({c.batch, 12}), y = torch::randn({c.batch, 4});
      opt_single.zero_grad();
      opt_local.zero_grad();
      opt_mine.zero_grad();
      const torch::Tensor l1 = reference_step(single, x, y, mse_loss);
      const torch::Tensor l2 = pipe.train_step(x, y, mse_loss);
      const torch::Tensor l3 = mpi_pipe.train_step(x, y, mse_loss);
      EXPECT_NEAR(l3.item<double>(), l1.item<double>(), 1e-5 * std::abs(l1.item<double>()));
      EXPECT_NEAR(l3.item<double>(), l2.item<double>(), 1e-5 * std::abs(l2.item<double>()));
      if (s == 0) {
        expect_stage_matches(mine, single, true, "first step vs one device");
        expect_stage_matches(mine, local, true, "first step vs one-process pipeline");
      }
      opt_single.step();
      opt_local.step();
      opt_mine.step();
    }
    expect_stage_matches(mine, single, false, "after 3 steps vs one device");
    expect_stage_matches(mine, local, false, "after 3 steps vs one-process pipeline");
  }
}

// Tuples across ranks (hidden states and a mask, two towers, a tensor without a gradient): every
// tensor of a boundary in one message, the same losses and gradients as in one process.
TEST(MpiPipeline, TuplesCrossRanksAsInOneProcess) {
  const int K = world_size() <= 4 ? world_size() : 4;
  if (world_size() % K != 0) GTEST_SKIP();
  const std::map<int, std::vector<int>> cuts{{1, {6}}, {2, {3, 3}}, {3, {1, 3, 2}}, {4, {1, 2, 1, 2}}};
  const std::vector<int>& balance = cuts.at(K);
  const mpi::Placement place = mpi::place(world_rank(), world_size(), K);
  const auto [first, last] = stage_range(balance, place.device);
  torch::manual_seed(21);
  const int64_t N = 14;
  const Tensors x = Tensors::tuple_of({torch::randn({N, kSeq, kIn}), torch::rand({kIn})});
  const torch::Tensor y = torch::randn({N, kOut});
  for (auto schedule : {gpipe::ScheduleKind::kGPipe, gpipe::ScheduleKind::k1F1B, gpipe::ScheduleKind::kZB1P})
    for (auto mode : {Checkpoint::kAlways, Checkpoint::kExceptLast, Checkpoint::kNever}) {
      SCOPED_TRACE(gpipe::to_string(schedule) + " " + to_string(mode));
      const auto options = PipelineOptions().balance(balance).micro_batches(3).checkpoint(mode).schedule(schedule)
                               .whole_inputs({1});
      torch::nn::Sequential local = tuple_model(8), mine = tuple_model(8, {first, last});
      Pipeline pipe(local, options);
      mpi::MpiPipeline mpi_pipe(mine, options);
      const double l_local = pipe.train_step(x, y, mse_loss).item<double>();
      const double l_mine = mpi_pipe.train_step(x, y, mse_loss).item<double>();
      EXPECT_DOUBLE_EQ(l_mine, l_local);
      expect_stage_matches(mine, local, true, "tuple model", 1e-6);
    }
}

// Dropout: the same seeds per (step, stage, micro-batch) as in one process, so the same masks.
TEST(MpiPipeline, DropoutMasksEqualOneProcessPipeline) {
  const int K = world_size() <= 4 ? world_size() : 4;
  if (world_size() % K != 0) GTEST_SKIP();
  const std::vector<int> balance = cut(K);
  const mpi::Placement place = mpi::place(world_rank(), world_size(), K);
  const auto [first, last] = stage_range(balance, place.device);
  torch::nn::Sequential local = model_layers(3, {}, 0.5);
  torch::nn::Sequential mine = model_layers(3, {first, last}, 0.5);
  Pipeline pipe(local, PipelineOptions().balance(balance).micro_batches(4).checkpoint(Checkpoint::kAlways));
  mpi::MpiPipeline mpi_pipe(mine, PipelineOptions().balance(balance).micro_batches(4).checkpoint(Checkpoint::kAlways));
  for (int s = 0; s < 2; ++s) {
    torch::manual_seed(200 + s);
    const torch::Tensor x = torch::randn({16, 12}), y = torch::randn({16, 4});
    torch::manual_seed(300 + s);  // the default generator, from which both draw the step's seed
    const double l_local = pipe.train_step(x, y, mse_loss).item<double>();
    torch::manual_seed(300 + s);
    const double l_mine = mpi_pipe.train_step(x, y, mse_loss).item<double>();
    EXPECT_DOUBLE_EQ(l_mine, l_local);
  }
  expect_stage_matches(mine, local, true, "dropout, two steps", 1e-6);
}

// Deferred BatchNorm over D replicas: every replica's rows count in the running statistics, so
// they equal a one-process pipeline's that runs all D·M micro-batches, and the replicas' copies
// stay identical to the bit.
TEST(MpiPipeline, BatchNormStatisticsCoverEveryReplicasRows) {
  auto build = [](LayerRange keep) {
    torch::manual_seed(13);
    namespace nn = torch::nn;
    std::vector<nn::AnyModule> layers{nn::AnyModule(nn::Linear(12, 16)), nn::AnyModule(nn::BatchNorm1d(16)),
                                      nn::AnyModule(nn::ReLU()), nn::AnyModule(nn::Linear(16, 16)),
                                      nn::AnyModule(nn::BatchNorm1d(nn::BatchNormOptions(16).momentum(c10::nullopt))),
                                      nn::AnyModule(nn::Tanh()), nn::AnyModule(nn::Linear(16, 4))};
    torch::nn::Sequential model;
    for (size_t n = 0; n < layers.size(); ++n) add_layer(model, layers[n], static_cast<int>(n), keep);
    return model;
  };
  const std::map<int, std::vector<int>> cuts{{1, {7}}, {2, {3, 4}}, {3, {2, 3, 2}}, {4, {2, 2, 2, 1}}};
  for (int K : {1, 2, 3, 4}) {
    if (world_size() % K != 0) continue;
    const int D = world_size() / K, M = 3;
    SCOPED_TRACE("K=" + std::to_string(K) + " D=" + std::to_string(D));
    const std::vector<int>& balance = cuts.at(K);
    const mpi::Placement place = mpi::place(world_rank(), world_size(), K);
    const auto [first, last] = stage_range(balance, place.device);
    torch::nn::Sequential local = build({}), mine = build({first, last});
    // 72 rows: each replica's M micro-batches are the one-process pipeline's D·M micro-batches.
    Pipeline pipe(local, PipelineOptions().balance(balance).micro_batches(D * M));
    mpi::MpiPipeline mpi_pipe(mine, PipelineOptions().balance(balance).micro_batches(M));
    torch::optim::SGD opt_local(pipe.parameters(), 0.05), opt_mine(mpi_pipe.parameters(), 0.05);
    for (int s = 0; s < 2; ++s) {
      torch::manual_seed(60 + s);
      const torch::Tensor x = torch::randn({72, 12}) * 3 - 1, y = torch::randn({72, 4});
      opt_local.zero_grad();
      opt_mine.zero_grad();
      pipe.train_step(x, y, mse_loss);
      mpi_pipe.train_step(x, y, mse_loss);
      opt_local.step();
      opt_mine.step();
    }
    expect_stage_matches(mine, local, false, "after 2 steps");
    const auto all = local->named_buffers();
    MPI_Comm stage_ranks;
    MPI_Comm_split(MPI_COMM_WORLD, place.device, world_rank(), &stage_ranks);
    for (const auto& b : mine->named_buffers()) {
      EXPECT_TRUE(close(b.value(), all[b.key()])) << "rank " << world_rank() << ": buffer " << b.key();
      if (b.key().find("num_batches_tracked") != std::string::npos) EXPECT_EQ(b.value().item<int64_t>(), 2);
      // Every replica's copy, to the bit: the largest and the smallest over the replicas agree.
      torch::Tensor values = b.value().to(torch::kDouble).contiguous(), most = values.clone(), least = values.clone();
      MPI_Allreduce(MPI_IN_PLACE, most.data_ptr(), static_cast<int>(most.numel()), MPI_DOUBLE, MPI_MAX, stage_ranks);
      MPI_Allreduce(MPI_IN_PLACE, least.data_ptr(), static_cast<int>(least.numel()), MPI_DOUBLE, MPI_MIN, stage_ranks);
      EXPECT_TRUE(torch::equal(most, least)) << "rank " << world_rank() << ": replicas differ in " << b.key();
    }
    MPI_Comm_free(&stage_ranks);
  }
}

// Tied embeddings: the first and the last stage each hold a copy of one weight; the copies get
// the sum of both uses' gradients, equal the one-process pipeline (one shared tensor), and stay
// identical to the bit on every rank, replicas included.
TEST(MpiPipeline, TiedWeightsEqualOneProcessAndStayIdentical) {
  auto build = [](LayerRange keep) {
    torch::manual_seed(17);
    torch::nn::Embedding embedding(kVocab, 16);
    torch::nn::Sequential model;
    add_layer(model, torch::nn::AnyModule(embedding), 0, keep);
    for (int b = 1; b <= 4; ++b) add_layer(model, torch::nn::AnyModule(EncoderBlock(16, 2, 32, 0.0)), b, keep);
    add_layer(model, torch::nn::AnyModule(TiedProjection(embedding->weight)), 5, keep);
    return model;
  };
  const std::vector<std::vector<std::string>> tied{{"0.weight", "5.weight"}};
  for (int K : {1, 2, 3}) {
    if (world_size() % K != 0) continue;
    const int D = world_size() / K;
    SCOPED_TRACE("K=" + std::to_string(K) + " D=" + std::to_string(D));
    const std::vector<int> balance = K == 1 ? std::vector<int>{6} : K == 2 ? std::vector<int>{3, 3}
                                                                          : std::vector<int>{2, 2, 2};
    const mpi::Placement place = mpi::place(world_rank(), world_size(), K);
    const auto [first, last] = stage_range(balance, place.device);
    torch::nn::Sequential local = build({}), mine = build({first, last});
    Pipeline pipe(local, PipelineOptions().balance(balance).micro_batches(2 * D));
    mpi::MpiPipeline mpi_pipe(mine, PipelineOptions().balance(balance).micro_batches(2).tied_parameters(tied));
    // SGD: Adam would turn the key bias's gradient, zero up to rounding, into whole steps.
    torch::optim::SGD opt_local(pipe.parameters(), 0.05), opt_mine(mpi_pipe.parameters(), 0.05);
    for (int s = 0; s < 3; ++s) {
      torch::manual_seed(70 + s);
      const torch::Tensor x = torch::randint(kVocab, {8, 5}, torch::kLong), y = torch::randint(kVocab, {8, 5}, torch::kLong);
      opt_local.zero_grad();
      opt_mine.zero_grad();
      const double a = pipe.train_step(x, y, cross_entropy_loss).item<double>();
      const double b = mpi_pipe.train_step(x, y, cross_entropy_loss).item<double>();
      EXPECT_NEAR(b, a, 1e-5 * std::abs(a));
      opt_local.step();
      opt_mine.step();
    }
    expect_stage_matches(mine, local, false, "after 3 steps", 1e-4);
    // Every copy of the tied weight, on every rank that holds one, to the bit.
    const auto named = mine->named_parameters();
    const bool holds = named.contains("0.weight") || named.contains("5.weight");
    MPI_Comm holders;
    MPI_Comm_split(MPI_COMM_WORLD, holds ? 0 : MPI_UNDEFINED, world_rank(), &holders);
    if (holds) {
      const torch::Tensor copy = named.contains("0.weight") ? named["0.weight"] : named["5.weight"];
      torch::Tensor most = copy.detach().to(torch::kDouble).contiguous(), least = most.clone();
      MPI_Allreduce(MPI_IN_PLACE, most.data_ptr(), static_cast<int>(most.numel()), MPI_DOUBLE, MPI_MAX, holders);
      MPI_Allreduce(MPI_IN_PLACE, least.data_ptr(), static_cast<int>(least.numel()), MPI_DOUBLE, MPI_MIN, holders);
      EXPECT_TRUE(torch::equal(most, least)) << "rank " << world_rank() << ": the copies of the tied weight differ";
      MPI_Comm_free(&holders);
    }
  }
}

TEST(MpiPipeline, TiedParametersNoRankHoldsAreRefusedOnEveryRank) {
  const int K = world_size() >= 2 ? 2 : 1;
  if (world_size() % K != 0) GTEST_SKIP();
  const std::vector<int> balance = K == 1 ? std::vector<int>{8} : cut(2);
  const mpi::Placement place = mpi::place(world_rank(), world_size(), K);
  const auto [first, last] = stage_range(balance, place.device);
  try {
    mpi::MpiPipeline pipe(model_layers(1, {first, last}),
                          PipelineOptions().balance(balance).tied_parameters({{"0.weight", "1.weight"}}));
    ADD_FAILURE() << "accepted a tie of a parameter no rank holds";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("no rank holds a parameter 1.weight"), std::string::npos) << e.what();
  }
}

// Skip connections under MPI: each stashed tensor goes straight to the rank that pops it; the
// training equals the one-process pipeline's, every schedule.
TEST(MpiPipeline, SkipConnectionsEqualOneProcessPipeline) {
  auto build = [](LayerRange keep) {
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
  const std::map<int, std::vector<int>> cuts{{1, {11}}, {2, {2, 9}}, {3, {2, 6, 3}}, {4, {2, 3, 3, 3}}};
  for (int K : {1, 2, 3, 4})
    for (ScheduleKind schedule : {ScheduleKind::kGPipe, ScheduleKind::k1F1B, ScheduleKind::kZB1P}) {
      if (world_size() % K != 0) continue;
      const int D = world_size() / K;
      SCOPED_TRACE("K=" + std::to_string(K) + " D=" + std::to_string(D) + " " + to_string(schedule));
      const std::vector<int>& balance = cuts.at(K);
      const mpi::Placement place = mpi::place(world_rank(), world_size(), K);
      const auto [first, last] = stage_range(balance, place.device);
      torch::nn::Sequential local = build({}), mine = build({first, last});
      Pipeline pipe(local, PipelineOptions().balance(balance).micro_batches(3 * D).schedule(schedule));
      mpi::MpiPipeline mpi_pipe(mine, PipelineOptions().balance(balance).micro_batches(3).schedule(schedule));
      torch::optim::SGD opt_local(pipe.parameters(), 0.05), opt_mine(mpi_pipe.parameters(), 0.05);
      for (int s = 0; s < 2; ++s) {
        torch::manual_seed(80 + s);
        const torch::Tensor x = torch::randn({24, 12}), y = torch::randn({24, 4});
        opt_local.zero_grad();
        opt_mine.zero_grad();
        const double a = pipe.train_step(x, y, mse_loss).item<double>();
        const double b = mpi_pipe.train_step(x, y, mse_loss).item<double>();
        EXPECT_NEAR(b, a, 1e-5 * std::abs(a));
        opt_local.step();
        opt_mine.step();
      }
      expect_stage_matches(mine, local, false, "after 2 steps");
    }
}

// A plan made once (as gpipe train makes it) is every rank's as it is: the ranks do not resolve the
// cut again (the options alone would cut evenly, {4, 4}), and they train as threads on the same plan.
TEST(MakePipeline, APlanMadeOnceIsEveryRanksAsItIs) {
  if (world_size() % 2 != 0) return;
  const LayerBuilder build = [](LayerRange keep) { return model_layers(5, keep); };
  const auto options = PipelineOptions().devices(2).micro_batches(2);
  const PipelinePlan plan = make_plan(8, PipelineOptions(options).cut(CutRequest::given({3, 5})));
  auto ranks = make_pipeline(build, plan, options, Runtime::kMpi);
  auto threads = make_pipeline(build, plan, options, Runtime::kThreads);
  EXPECT_EQ(ranks->balance(), (std::vector<int>{3, 5}));
  EXPECT_EQ(threads->balance(), (std::vector<int>{3, 5}));
  torch::manual_seed(41);
  const torch::Tensor x = torch::randn({16, 12}), y = torch::randn({16, 4});
  const double a = ranks->train_step(x, y, mse_loss).item<double>();
  const double b = threads->train_step(x, y, mse_loss).item<double>();
  EXPECT_NEAR(a, b, 1e-5 * std::abs(b));
}

// make_pipeline under MPI: each rank builds its own stages (two per rank, interleaved) and trains
// and evaluates as the same pipeline on threads in one process.
TEST(MakePipeline, EachRankBuildsItsStagesAndTrainsAsThreads) {
  for (int K : {1, 2, 4}) {
    if (world_size() % K != 0 || 2 * K > 8) continue;
    SCOPED_TRACE("K=" + std::to_string(K) + " V=2");
    const LayerBuilder build = [](LayerRange keep) { return model_layers(5, keep); };
    const auto options = PipelineOptions().devices(K).virtual_stages(2).micro_batches(K).schedule(ScheduleKind::kInterleaved);
    auto ranks = make_pipeline(build, 8, options, Runtime::kMpi);
    auto threads = make_pipeline(build, 8, options, Runtime::kThreads);
    EXPECT_EQ(ranks->balance(), threads->balance());
    EXPECT_EQ(ranks->describe(), "MPI: " + std::to_string(world_size()) + " ranks = " + std::to_string(K) +
                                     " devices x " + std::to_string(world_size() / K) +
                                     (world_size() / K == 1 ? " replica" : " replicas"));
    torch::optim::SGD opt_ranks(ranks->parameters(), 0.05), opt_threads(threads->parameters(), 0.05);
    for (int s = 0; s < 2; ++s) {
      torch::manual_seed(40 + s);
      const torch::Tensor x = torch::randn({16, 12}), y = torch::randn({16, 4});
      opt_ranks.zero_grad();
      opt_threads.zero_grad();
      const double a = ranks->train_step(x, y, mse_loss).item<double>();
      const double b = threads->train_step(x, y, mse_loss).item<double>();
      EXPECT_NEAR(a, b, 1e-5 * std::abs(b));
      opt_ranks.step();
      opt_threads.step();
    }
    expect_stage_matches(ranks->layers(), threads->layers(), false, "after 2 steps");
    torch::manual_seed(50);
    const torch::Tensor x = torch::randn({21, 12}), labels = torch::randint(4, {21}, torch::kLong);
    const Evaluation e = ranks->evaluate(x, labels, cross_entropy_loss, true, 8);
    const Evaluation f = threads->evaluate(x, labels, cross_entropy_loss, true, 8);
    EXPECT_NEAR(e.loss, f.loss, 1e-5 * std::abs(f.loss));
    EXPECT_DOUBLE_EQ(e.accuracy, f.accuracy);
    EXPECT_NEAR(ranks->checksum(), threads->checksum(), 1e-6 * std::abs(threads->checksum()));
  }
}

// ZB-V and V-Half under mpirun: each rank holds stages d and 2K-1-d (the V), passes the V's turn
// to itself without a message, and ends with the same parameters as the same pipeline on threads
// in one process, bit for bit, in every checkpoint mode (Dropout included: the same masks).
TEST(MpiPipeline, VSchedulesEqualOneProcessBitForBit) {
  for (int K : {1, 2, 4}) {
    if (world_size() % K != 0 || 2 * K > 8) continue;
    for (ScheduleKind schedule : {ScheduleKind::kZBV, ScheduleKind::kVHalf}) {
      for (Checkpoint mode : {Checkpoint::kAlways, Checkpoint::kExceptLast, Checkpoint::kNever}) {
        SCOPED_TRACE("K=" + std::to_string(K) + " " + gpipe::to_string(schedule) + " " + to_string(mode));
        // One replica: the same micro-batches as on threads, bit for bit (Dropout too). Several split
        // the batch among them and sum the gradients: equal up to rounding.
        const bool one_replica = world_size() == K;
        const LayerBuilder build = [one_replica](LayerRange keep) { return model_layers(9, keep, one_replica ? 0.3 : 0.0); };
        const auto options = PipelineOptions().devices(K).micro_batches(4).checkpoint(mode).schedule(schedule);
        auto ranks = make_pipeline(build, 8, options, Runtime::kMpi);
        auto threads = make_pipeline(build, 8, options, Runtime::kThreads);
        ASSERT_EQ(ranks->plan().placement, threads->plan().placement);
        EXPECT_EQ(ranks->plan().placement.front(), ranks->plan().placement.back());  // first and last on device 0
        torch::optim::SGD opt_ranks(ranks->parameters(), 0.05), opt_threads(threads->parameters(), 0.05);
        for (int s = 0; s < 2; ++s) {
          torch::manual_seed(60 + s);
          const torch::Tensor x = torch::randn({16, 12}), y = torch::randn({16, 4});
          opt_ranks.zero_grad();
          opt_threads.zero_grad();
          torch::manual_seed(70 + s);  // each step draws its Dropout stream from the caller's: the same for both
          const double a = ranks->train_step(x, y, mse_loss).item<double>();
          torch::manual_seed(70 + s);
          const double b = threads->train_step(x, y, mse_loss).item<double>();
          if (one_replica) EXPECT_EQ(a, b);
          EXPECT_NEAR(a, b, 1e-5 * std::abs(b));
          opt_ranks.step();
          opt_threads.step();
        }
        const auto all = threads->layers()->named_parameters();
        for (const auto& p : ranks->layers()->named_parameters())
          EXPECT_TRUE(one_replica ? torch::equal(p.value(), all[p.key()]) : close(p.value(), all[p.key()], 1e-5))
              << "rank " << world_rank() << ": " << p.key();
      }
    }
  }
}

// Boundary tensors of any dtype and shape, known only to the sender.
TEST(MpiTransport, CarriesAnyDtypeAndShape) {
  MPI_Comm pair;
  MPI_Comm_split(MPI_COMM_WORLD, world_rank() < 2 ? 0 : 1, world_rank(), &pair);
  {
    mpi::ErrorChannel errors(pair);
    // Stages 0 and 2 on rank 0, 1 and 3 on rank 1 (two stages per rank, as interleaved).
    mpi::MpiTransport transport(pair, &errors, {0, 1, 0, 1}, 8);
    torch::manual_seed(5);
    const std::vector<torch::Tensor> sent{
        torch::randn({2, 3, 4}, torch::kDouble),
        torch::randint(1000, {5}, torch::kLong),
        torch::randn({3, 1}) > 0,
        torch::tensor(1.5).to(torch::kHalf),
        torch::empty({0, 7}),
        torch::randn({4, 6}).t(),  // not contiguous
        torch::randn({2, 1, 1, 1, 1, 1, 1, 3}).to(torch::kBFloat16),
    };
    if (world_rank() == 0) {
      for (size_t i = 0; i < sent.size(); ++i) transport.send(0, 1, Channel::kActivation, static_cast<int>(i), sent[i]);
      transport.send(0, 1, Channel::kGradient, 0, sent[0] * 2);
      transport.send(2, 3, Channel::kActivation, 0, sent[0] * 3);  // same ranks, micro-batch and channel
      // A tuple: every tensor in one message, in order, an undefined gradient entry kept as one.
      transport.send(0, 1, Channel::kGradient, 1, Tensors::tuple_of({sent[1], torch::Tensor(), sent[5], sent[2]}));
      transport.finish();
      EXPECT_EQ(transport.messages_sent(), static_cast<int64_t>(sent.size()) + 3);
    } else if (world_rank() == 1) {
      // Out of order, and the gradient channel before the activations: tags keep them apart.
      const Tensors tuple = transport.recv(0, 1, Channel::kGradient, 1);
      EXPECT_TRUE(tuple.tuple);
      ASSERT_EQ(tuple.size(), 4u);
      EXPECT_TRUE(torch::equal(tuple.items[0], sent[1]));
      EXPECT_FALSE(tuple.items[1].defined());
      EXPECT_TRUE(torch::equal(tuple.items[2], sent[5]));
      EXPECT_TRUE(torch::equal(tuple.items[3], sent[2]));
      EXPECT_TRUE(torch::equal(transport.recv(0, 1, Channel::kGradient, 0).only(), sent[0] * 2));
      EXPECT_TRUE(torch::equal(transport.recv(2, 3, Channel::kActivation, 0).only(), sent[0] * 3));  // tags name the stages
      for (int i = static_cast<int>(sent.size()) - 1; i >= 0; --i) {
        const Tensors message = transport.recv(0, 1, Channel::kActivation, i);
        EXPECT_FALSE(message.tuple);
        const torch::Tensor got = message.only();
        EXPECT_EQ(got.scalar_type(), sent[static_cast<size_t>(i)].scalar_type()) << "message " << i;
        EXPECT_EQ(got.sizes(), sent[static_cast<size_t>(i)].sizes()) << "message " << i;
        EXPECT_TRUE(torch::equal(got, sent[static_cast<size_t>(i)])) << "message " << i;
      }
    }
  }
  MPI_Comm_free(&pair);
}

// A cancel on one rank (its stage failed) wakes the other rank's blocked recv with the reason; a
// later recv on the cancelling rank throws too.
TEST(MpiTransport, CancelStopsTheOtherRanksReceive) {
  MPI_Comm pair;
  MPI_Comm_split(MPI_COMM_WORLD, world_rank() < 2 ? 0 : 1, world_rank(), &pair);
  if (world_rank() < 2) {
    mpi::ErrorChannel errors(pair);
    mpi::MpiTransport transport(pair, &errors, {0, 1}, 2);
    transport.begin({});
    if (world_rank() == 0) {
      transport.cancel("gpipe: stage 0 failed on purpose");
      EXPECT_THROW(transport.recv(1, 0, Channel::kGradient, 0), Cancelled);
      EXPECT_THROW(transport.send(0, 1, Channel::kActivation, 0, torch::ones({1})), Cancelled) << "and a later send";
      // The Transport contract (transport.h), as InProcessTransport keeps it (transport_test.cc).
      EXPECT_THROW(transport.begin({}), std::logic_error) << "a cancelled transport takes no further step";
      EXPECT_TRUE(transport.cancelled());
    } else {
      try {
        transport.recv(0, 1, Channel::kActivation, 1);  // never sent
        ADD_FAILURE() << "the receive returned";
      } catch (const mpi::RemoteError& e) {
        EXPECT_EQ(e.rank(), 0);
        EXPECT_NE(std::string(e.what()).find("stage 0 failed on purpose"), std::string::npos) << e.what();
      }
    }
  }
  MPI_Comm_free(&pair);
}

// A rank's leave notice (mpi::leave: its pipeline deleted, its program ended) and then another
// rank's failure: the failure is reported as that rank's, with its message, at once; the leaver is
// not blamed for it after the grace for leavers (the receive of the channel is posted again after a
// leave notice).
TEST(MpiErrorChannel, AFailureAfterALeaveNoticeIsTheFailingRanks) {
  if (world_size() < 3) GTEST_SKIP() << "needs 3 ranks";
  MPI_Comm trio;
  MPI_Comm_split(MPI_COMM_WORLD, world_rank() < 3 ? 0 : 1, world_rank(), &trio);
  if (world_rank() < 3) {
    mpi::ErrorChannel errors(trio);
    MPI_Comm data;
    MPI_Comm_dup(trio, &data);
    char go = 1;
    if (world_rank() == 2) {
      errors.leave("rank 2 left");
    } else if (world_rank() == 1) {
      MPI_Recv(&go, 1, MPI_CHAR, 0, 0, data, MPI_STATUS_IGNORE);  // rank 2's notice came to rank 0 before
      errors.raise("gpipe: rank 1 failed on purpose");
      MPI_Send(&go, 1, MPI_CHAR, 0, 0, data);  // sent: rank 0's wait need not outlast the grace for leavers
    } else {
      // A receive rank 2 never sends: the wait ends only after rank 2's notice and the grace for leavers.
      MPI_Request request;
      char never = 0;
      MPI_Irecv(&never, 1, MPI_CHAR, 2, 0, data, &request);
      try {
        errors.wait(request);
        ADD_FAILURE() << "the receive from the rank that left returned";
      } catch (const mpi::RemoteError& e) {
        EXPECT_EQ(e.rank(), 2) << e.what();
      }
      MPI_Cancel(&request);
      MPI_Wait(&request, MPI_STATUS_IGNORE);
      EXPECT_EQ(errors.left_rank(), 2);
      MPI_Send(&go, 1, MPI_CHAR, 1, 0, data);
      MPI_Recv(&go, 1, MPI_CHAR, 1, 0, data, MPI_STATUS_IGNORE);
      MPI_Irecv(&never, 1, MPI_CHAR, 1, 1, data, &request);  // never sent
      try {
        errors.wait(request);
        ADD_FAILURE() << "the receive returned";
      } catch (const mpi::RemoteError& e) {
        EXPECT_EQ(e.rank(), 1) << e.what();
        EXPECT_NE(std::string(e.what()).find("rank 1 failed on purpose"), std::string::npos) << e.what();
      }
      EXPECT_EQ(errors.left_rank(), 2);
      EXPECT_EQ(errors.left(), "rank 2 left");
      if (request != MPI_REQUEST_NULL) {
        MPI_Cancel(&request);
        MPI_Wait(&request, MPI_STATUS_IGNORE);
      }
    }
    errors.abandon();  // failures: messages may still be on their way
    MPI_Barrier(trio);
    MPI_Comm_free(&data);
  }
  MPI_Comm_free(&trio);
}

// Pipelines made and deleted on every rank free their communicators, the error channel's among
// them (once every rank's notice that it let go has come): a job that makes pipeline after pipeline
// does not pile communicators up. Open MPI gives a new communicator the lowest free index of its
// table, which MPI_Comm_c2f returns: of 32 new communicators the highest index is 31 above the
// lowest free one, and one higher for each communicator kept among them.
TEST(MpiPipeline, DeletedPipelinesFreeTheirCommunicators) {
#if !defined(OPEN_MPI)
  GTEST_SKIP() << "counts communicators by Open MPI's Fortran handles (small consecutive integers)";
#endif
  const auto next_index = [] {
    MPI_Barrier(MPI_COMM_WORLD);
    std::vector<MPI_Comm> comms(32);
    int highest = 0;
    for (MPI_Comm& comm : comms) {
      MPI_Comm_dup(MPI_COMM_WORLD, &comm);
      highest = std::max(highest, static_cast<int>(MPI_Comm_c2f(comm)));
    }
    for (MPI_Comm& comm : comms) MPI_Comm_free(&comm);
    return highest;
  };
  const int K = world_size();
  const std::vector<int> balance = cut(K);
  const auto [first, last] = stage_range(balance, world_rank());
  torch::manual_seed(3);
  const torch::Tensor x = torch::randn({4, 12}), y = torch::randn({4, 4});
  const auto make_train_delete = [&, first = first, last = last] {  // C++17 lambdas cannot capture bindings
    mpi::MpiPipeline pipe(model_layers(2, {first, last}), PipelineOptions().balance(balance).micro_batches(2));
    pipe.train_step(x, y, mse_loss);
  };
  make_train_delete();
  const int before = next_index();
  ASSERT_GT(before, 0) << "no communicator handle was read";
  constexpr int kPipelines = 6;
  for (int n = 0; n < kPipelines; ++n) make_train_delete();
  const int after = next_index();
  // The last pipeline's channel may wait for a notice still on its way; none of the others does.
  EXPECT_LE(after, before + 1) << "rank " << world_rank() << ": " << after - before << " communicators kept by "
                               << kPipelines << " pipelines made and deleted";
}

// Settings that differ between ranks: the same clear error on every rank, no hang.
TEST(MpiPipeline, DetectsConfigurationThatDiffersBetweenRanks) {
  const int K = world_size() >= 2 && world_size() % 2 == 0 ? 2 : world_size();
  const std::vector<int> balance = cut(K);
  const mpi::Placement place = mpi::place(world_rank(), world_size(), K);
  const LayerRange range = stage_range(balance, place.device);  // not a structured binding: lambdas capture it
  const bool odd_one = world_rank() == 1;
  auto options = [&] { return PipelineOptions().balance(balance).micro_batches(2); };

  expect_invalid([&] { mpi::MpiPipeline p(model_layers(1, range), options().micro_batches(odd_one ? 3 : 2)); },
                 "the ranks disagree on the number of micro-batches M: rank 0 has 2, rank 1 has 3");
  expect_invalid([&] {
    mpi::MpiPipeline p(model_layers(1, range),
                       options().checkpoint(odd_one ? Checkpoint::kAlways : Checkpoint::kExceptLast));
  }, "the ranks disagree on the checkpoint mode");
  expect_invalid([&] {  // a field of the pipeline's value (PipelineConfig), compared with the others
    mpi::MpiPipeline p(model_layers(1, range),
                       options().precision(odd_one ? gpipe::Precision::kBFloat16 : gpipe::Precision::kFloat32));
  }, "the ranks disagree on the precision: rank 0 has fp32, rank 1 has bf16");
  expect_invalid([&] {
    torch::nn::Sequential layers = model_layers(1, range);
    if (odd_one) layers->to(torch::kDouble);
    mpi::MpiPipeline p(layers, options());
  }, "the ranks disagree on the parameters' dtype");
  expect_invalid([&] {
    torch::nn::Sequential layers = model_layers(1, range);
    if (odd_one) layers->push_back("extra", torch::nn::ReLU());
    mpi::MpiPipeline p(layers, options());
  }, "rank 1 runs stage 1, which the balance");
  if (K == 2) {
    expect_invalid([&] {
      mpi::MpiPipeline p(model_layers(1, range), options().balance(odd_one ? std::vector<int>{2, 2, 4}
                                                                                   : balance));
    }, "the ranks disagree on the number of stages K");
    expect_invalid([&] {
      mpi::MpiPipeline p(model_layers(1, range),
                         options().balance(odd_one ? std::vector<int>{4, 5} : balance));
    }, "the ranks disagree on the model's layer count: rank 0 has 8, rank 1 has 9");
    expect_invalid([&] {
      mpi::MpiPipeline p(model_layers(1, range),
                         options().balance(odd_one ? std::vector<int>{4, 4} : balance));
    }, "the ranks disagree on the balance: rank 0 has {3, 5}, rank 1 has {4, 4}");
  }
  if (world_size() % 3 != 0)
    expect_invalid([&] { mpi::MpiPipeline p(model_layers(1), options().balance({2, 4, 2})); },
                   "not a multiple of the 3 devices");
  // Afterwards the ranks still work together.
  mpi::MpiPipeline good(model_layers(1, range), options());
  torch::manual_seed(9);
  const torch::Tensor x = torch::randn({8, 12}), y = torch::randn({8, 4});
  EXPECT_TRUE(std::isfinite(good.train_step(x, y, mse_loss).item<double>()));
}

class Faulty : public torch::nn::Module {
 public:
  explicit Faulty(bool armed) : armed_(armed) {}
  torch::Tensor forward(const torch::Tensor& x) {
    if (armed_ && ++calls_ == 2) throw std::runtime_error("injected fault in micro-batch 1");
    return x;
  }

 private:
  bool armed_;
  int calls_ = 0;
};

// Every call takes the same whole batch on every rank; a rank given another is refused on every rank.
TEST(MpiPipeline, RefusesBatchesThatDifferBetweenRanks) {
  const int K = world_size();
  const std::vector<int> balance = cut(K);
  const auto [first, last] = stage_range(balance, world_rank());
  mpi::MpiPipeline pipe(model_layers(3, {first, last}), PipelineOptions().balance(balance).micro_batches(2));
  torch::manual_seed(20);
  const torch::Tensor x = torch::randn({6, 12}), y = torch::randn({6, 4});
  const torch::Tensor mine = world_rank() == 1 ? x * 2 : x;
  expect_invalid([&] { pipe.train_step(mine, y, mse_loss); }, "the ranks were given different batches");
  expect_invalid([&] { pipe.forward(world_rank() == 1 ? x.narrow(0, 0, 5) : x); }, "sizes of the input differ");
  for (const auto& p : pipe.parameters()) EXPECT_FALSE(p.grad().defined()) << "no work done";
  EXPECT_TRUE(pipe.train_step(x, y, mse_loss).defined()) << "the same batch works";
}

// A failure outside a stage's actions (here, evaluate's loss on the rank of the last stage) ends
// the call on every rank too, and the next call works.
TEST(MpiFailure, AFailureOutsideTheStagesStopsEveryRank) {
  const int K = world_size();
  const std::vector<int> balance = cut(K);
  const auto [first, last] = stage_range(balance, world_rank());
  mpi::MpiPipeline pipe(model_layers(6, {first, last}), PipelineOptions().balance(balance).micro_batches(2));
  torch::manual_seed(12);
  const torch::Tensor x = torch::randn({6, 12}), y = torch::randn({6, 4});
  const LossFn failing = [](const torch::Tensor&, const torch::Tensor&) -> torch::Tensor {
    throw std::runtime_error("the loss failed on purpose");
  };
  std::string message;
  try {
    pipe.evaluate(x, y, failing, /*classification=*/false, 3);
    ADD_FAILURE() << "rank " << world_rank() << ": evaluate did not fail";
  } catch (const std::exception& e) {
    message = e.what();
  }
  EXPECT_NE(message.find("the loss failed on purpose"), std::string::npos) << "rank " << world_rank() << ": " << message;
  const Evaluation e = pipe.evaluate(x, y, mse_loss, false, 3);
  torch::nn::Sequential single = model_layers(6);
  single->eval();
  torch::NoGradGuard no_grad;
  EXPECT_NEAR(e.loss, gpipe::mse_loss(single->forward(x), y).item<double>(), 1e-5);
}

// The failing rank throws StageError, every other rank RemoteError with its
// message, at once; the gradients are as they were, and the next step works.
TEST(MpiFailure, OneRankFailingStopsEveryRank) {
  const int K = world_size();
  std::vector<int> balance = cut(K);
  balance.back() += 1;  // layer 8: a fault, armed on the last stage
  const int failing_stage = K - 1;
  const auto [first, last] = stage_range(balance, world_rank());
  torch::nn::Sequential layers = model_layers(4, {first, last});
  add_layer(layers, torch::nn::AnyModule(std::make_shared<Faulty>(world_rank() == failing_stage)), 8, {first, last});
  mpi::MpiPipeline pipe(layers, PipelineOptions().balance(balance).micro_batches(4));
  for (auto& p : pipe.parameters()) p.mutable_grad() = torch::full_like(p, 0.25);

  torch::manual_seed(11);
  const torch::Tensor x = torch::randn({8, 12}), y = torch::randn({8, 4});
  std::string message;
  try {
    pipe.train_step(x, y, mse_loss);
    ADD_FAILURE() << "rank " << world_rank() << ": the step did not fail";
  } catch (const StageError& e) {
    EXPECT_EQ(world_rank(), failing_stage);
    message = e.what();
  } catch (const mpi::RemoteError& e) {
    EXPECT_NE(world_rank(), failing_stage);
    EXPECT_EQ(e.rank(), failing_stage);
    message = e.what();
  }
  EXPECT_NE(message.find("injected fault in micro-batch 1"), std::string::npos) << message;
  EXPECT_NE(message.find("stage " + std::to_string(failing_stage)), std::string::npos) << message;
  for (const auto& p : pipe.parameters()) EXPECT_TRUE(torch::equal(p.grad(), torch::full_like(p, 0.25)));
  // The pipeline starts over on fresh communicators: the retried step (the fault fired once) works,
  // and adds the same gradient as one device.
  const torch::Tensor loss = pipe.train_step(x, y, mse_loss);
  torch::nn::Sequential single = model_layers(4);
  const torch::Tensor expected = reference_step(single, x, y, mse_loss);
  EXPECT_NEAR(loss.item<double>(), expected.item<double>(), 1e-5 * std::abs(expected.item<double>()));
  const auto all = single->named_parameters();
  for (const auto& p : pipe.layers()->named_parameters())
    EXPECT_TRUE(close(p.value().grad() - 0.25, all[p.key()].grad())) << p.key();
}

// Random faults at random stages, phases and moments over many steps under mpirun: every rank
// learns of each failure, the step is retried, and the end is the fault-free run, bit for bit.
TEST(MpiFailure, RandomFaultsRetriedEndAsAFaultFreeRun) {
  const int K = world_size() == 4 ? 2 : std::min(world_size(), 3);  // np=4: 2 stages x 2 replicas
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
        add_layer(m, torch::nn::AnyModule(torch::nn::Dropout(0.2)), n++, keep);
        add_layer(m, torch::nn::AnyModule(FaultPoint(point, 8, p)), n++, keep);
      }
      add_layer(m, torch::nn::AnyModule(torch::nn::Linear(8, 3)), n++, keep);
      return m;
    });
  };
  const auto options = PipelineOptions().devices(K).micro_batches(4).schedule(ScheduleKind::kZB1P);
  auto faulty = make_pipeline(builder(plan), 13, options, Runtime::kMpi);
  auto clean = make_pipeline(builder(std::make_shared<FaultPlan>()), 13, options, Runtime::kMpi);
  int failures = 0;  // StageError on the failing rank, RemoteError on the others
  ASSERT_NO_FATAL_FAILURE(train_with_random_faults<std::exception>(*faulty, *clean, *plan, 60, 5, &failures));
  EXPECT_GT(failures, 5);
  const auto pa = faulty->parameters(), pb = clean->parameters();
  for (size_t n = 0; n < pa.size(); ++n) EXPECT_TRUE(torch::equal(pa[n], pb[n])) << "parameter " << n;
}

}  // namespace
}  // namespace gpipe::testing

int main(int argc, char** argv) {
  gpipe::mpi::Environment mpi(&argc, &argv);
  ::testing::InitGoogleTest(&argc, argv);
  at::set_num_threads(1);
  gpipe::testing::print_only_failures_unless_first(mpi.rank());
  return RUN_ALL_TESTS();
}
