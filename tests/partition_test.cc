// partition_test.cc: even cuts and the errors of a bad balance.
#include "helpers.h"

#include <functional>
#include <random>

using gpipe::testing::expect_invalid;

TEST(EvenBalanceTest, FirstStagesTakeTheRemainder) {
  EXPECT_EQ(gpipe::even_balance(10, 3), (std::vector<int>{4, 3, 3}));
  EXPECT_EQ(gpipe::even_balance(4, 4), (std::vector<int>{1, 1, 1, 1}));
  EXPECT_EQ(gpipe::even_balance(7, 1), (std::vector<int>{7}));
}

TEST(EvenBalanceTest, RejectsMoreStagesThanLayers) {
  expect_invalid([] { gpipe::even_balance(3, 4); }, "cannot cut 3 layers into 4 stages");
  expect_invalid([] { gpipe::even_balance(3, 0); }, "at least 1 (got 0)");
}

TEST(CheckBalanceTest, NamesTheProblem) {
  EXPECT_NO_THROW(gpipe::check_balance({2, 3}, 5));
  expect_invalid([] { gpipe::check_balance({2, 2}, 5); }, "model: 5 layers, sum of balance {2, 2}: 4");
  expect_invalid([] { gpipe::check_balance({5, 0}, 5); }, "stage 1 of balance {5, 0} has 0 layers");
  expect_invalid([] { gpipe::check_balance({}, 5); }, "the balance is empty");
}

TEST(StageOffsetsTest, CumulativeStarts) {
  EXPECT_EQ(gpipe::stage_offsets({4, 3, 3}), (std::vector<int>{0, 4, 7, 10}));
}

TEST(WorkloadBalanceTest, EmbeddingAndHeadRideWithTheEnds) {
  gpipe::Workload w = gpipe::make_workload("transformer");
  EXPECT_EQ(w.model->size(), 10u);
  EXPECT_EQ(w.balance(2), (std::vector<int>{5, 5}));
  EXPECT_EQ(w.balance(4), (std::vector<int>{3, 2, 2, 3}));
  gpipe::Workload mlp = gpipe::make_workload("tiny");
  EXPECT_EQ(mlp.balance(3), (std::vector<int>{6, 6, 4}));
}

namespace {

struct Objective {
  double bottleneck;
  double squares;
};

Objective objective(const std::vector<double>& costs, const std::vector<int>& balance) {
  Objective o{0, 0};
  for (double c : gpipe::stage_costs(costs, balance)) {
    o.bottleneck = std::max(o.bottleneck, c);
    o.squares += c * c;
  }
  return o;
}

// Every cut of costs.size() layers into k stages, by recursion.
void all_cuts(int layers, int k, std::vector<int>& prefix, const std::function<void(const std::vector<int>&)>& visit) {
  if (k == 1) {
    prefix.push_back(layers);
    visit(prefix);
    prefix.pop_back();
    return;
  }
  for (int first = 1; first <= layers - (k - 1); ++first) {
    prefix.push_back(first);
    all_cuts(layers - first, k - 1, prefix, visit);
    prefix.pop_back();
  }
}

}  // namespace

TEST(BalanceByCostTest, OptimalAgainstBruteForceOnRandomCases) {
  std::mt19937 rng(1234);
  for (int trial = 0; trial < 400; ++trial) {
    const int L = 1 + static_cast<int>(rng() % 10);
    const int K = 1 + static_cast<int>(rng() % static_cast<unsigned>(L));
    std::vector<double> costs;
    // Small integers: sums are exact, so ties are real ties.
    for (int l = 0; l < L; ++l) costs.push_back(static_cast<double>(rng() % (trial % 2 ? 5 : 40)));
    Objective best{std::numeric_limits<double>::infinity(), 0};
    std::vector<int> prefix;
    all_cuts(L, K, prefix, [&](const std::vector<int>& cut) {
      const Objective o = objective(costs, cut);
      if (o.bottleneck < best.bottleneck || (o.bottleneck == best.bottleneck && o.squares < best.squares)) best = o;
    });
    const std::vector<int> got = gpipe::balance_by_cost(costs, K);
    ASSERT_NO_THROW(gpipe::check_balance(got, L));
    ASSERT_EQ(got.size(), static_cast<size_t>(K));
    const Objective o = objective(costs, got);
    EXPECT_EQ(o.bottleneck, best.bottleneck) << "trial " << trial;
    EXPECT_EQ(o.squares, best.squares) << "trial " << trial;
  }
}

TEST(BalanceByCostTest, EdgeCases) {
  EXPECT_EQ(gpipe::balance_by_cost({1, 2, 3, 4}, 4), (std::vector<int>{1, 1, 1, 1}));  // K = L
  EXPECT_EQ(gpipe::balance_by_cost({2, 2, 2, 2, 2, 2}, 3), (std::vector<int>{2, 2, 2}));  // all equal
  // One layer costlier than all others together: it stands alone.
  EXPECT_EQ(gpipe::balance_by_cost({1, 1, 1, 100, 1, 1}, 2), (std::vector<int>{3, 3}));
  const auto heavy = gpipe::balance_by_cost({1, 1, 1, 100, 1, 1}, 3);
  EXPECT_EQ(gpipe::stage_costs({1, 1, 1, 100, 1, 1}, heavy), (std::vector<double>{3, 100, 2}));
  // Zero-cost layers still get a stage each when K = L, and never break the bottleneck.
  EXPECT_EQ(gpipe::balance_by_cost({0, 0, 0}, 3), (std::vector<int>{1, 1, 1}));
  const auto zeros = gpipe::balance_by_cost({0, 5, 0, 0, 5, 0}, 2);
  EXPECT_EQ(objective({0, 5, 0, 0, 5, 0}, zeros).bottleneck, 5);
  EXPECT_EQ(gpipe::balance_by_cost({1, 1, 1, 6}, 2), (std::vector<int>{3, 1}));
}

TEST(BalanceByCostTest, RejectsBadInput) {
  using gpipe::testing::expect_invalid;
  expect_invalid([] { gpipe::balance_by_cost({1, 2}, 3); }, "cannot cut 2 layers into 3 stages");
  expect_invalid([] { gpipe::balance_by_cost({1, -2}, 1); }, "the cost of layer 1 is -2");
  expect_invalid([] { gpipe::balance_by_cost({1, std::nan("")}, 1); }, "the cost of layer 1 is nan");
  expect_invalid([] { gpipe::balance_by_cost({std::numeric_limits<double>::infinity()}, 1); },
                 "the cost of layer 0 is inf");
  expect_invalid([] { gpipe::balance_by_cost({1}, 0); }, "at least 1 (got 0)");
}

TEST(BalanceByCostTest, ThousandLayersIntoHundredTwentyEightStagesQuickly) {
  std::mt19937 rng(7);
  std::vector<double> costs;
  for (int l = 0; l < 1000; ++l) costs.push_back(1.0 + static_cast<double>(rng() % 1000));
  // Correctness here; the time is measured in bench, not asserted in a test.
  const auto balance = gpipe::balance_by_cost(costs, 128);
  EXPECT_EQ(balance.size(), 128u);
  EXPECT_NO_THROW(gpipe::check_balance(balance, 1000));
}

namespace {

// The largest device cost and the sum of squared device costs of `balance` under `placement`.
Objective device_objective(const std::vector<double>& costs, const std::vector<int>& balance,
                           const std::vector<int>& placement) {
  const std::vector<double> stage = gpipe::stage_costs(costs, balance);
  std::vector<double> device(static_cast<size_t>(*std::max_element(placement.begin(), placement.end()) + 1), 0.0);
  for (size_t s = 0; s < stage.size(); ++s) device[static_cast<size_t>(placement[s])] += stage[s];
  Objective o{0, 0};
  for (double c : device) {
    o.bottleneck = std::max(o.bottleneck, c);
    o.squares += c * c;
  }
  return o;
}

}  // namespace

// Against every cut, for the placements of the interleaved and the V schedules (and one device
// running every stage): the least largest device cost, then the least variance.
TEST(BalanceDevicesByCostTest, OptimalAgainstBruteForceOnRandomCases) {
  std::mt19937 rng(4321);
  for (int trial = 0; trial < 600; ++trial) {
    const int K = 1 + static_cast<int>(rng() % 3), V = 2 + static_cast<int>(rng() % 2);
    const gpipe::StagePlacement kind = trial % 2 ? gpipe::StagePlacement::kV : gpipe::StagePlacement::kLoop;
    if (kind == gpipe::StagePlacement::kV && V != 2) continue;
    const std::vector<int> placement = gpipe::place_stages(kind, K, V);
    const int S = K * V, L = S + static_cast<int>(rng() % 7);
    std::vector<double> costs;
    for (int l = 0; l < L; ++l) costs.push_back(static_cast<double>(rng() % (trial % 3 ? 9 : 40)));
    Objective best{std::numeric_limits<double>::infinity(), 0};
    std::vector<int> prefix;
    all_cuts(L, S, prefix, [&](const std::vector<int>& cut) {
      const Objective o = device_objective(costs, cut, placement);
      if (o.bottleneck < best.bottleneck || (o.bottleneck == best.bottleneck && o.squares < best.squares)) best = o;
    });
    const std::vector<int> got = gpipe::balance_devices_by_cost(costs, placement);
    ASSERT_NO_THROW(gpipe::check_balance(got, L));
    ASSERT_EQ(got.size(), static_cast<size_t>(S));
    const Objective o = device_objective(costs, got, placement);
    EXPECT_EQ(o.bottleneck, best.bottleneck) << "trial " << trial;
    EXPECT_EQ(o.squares, best.squares) << "trial " << trial;
  }
}

TEST(BalanceDevicesByCostTest, BalancesDevicesWhereStagesAreBalanced) {
  const std::vector<double> costs{4, 1, 1, 1, 1, 1, 1, 6};
  const std::vector<int> interleaved{0, 1, 0, 1};
  EXPECT_EQ(gpipe::balance_by_cost(costs, 4), (std::vector<int>{1, 3, 3, 1}));
  EXPECT_EQ(device_objective(costs, {1, 3, 3, 1}, interleaved).bottleneck, 9);
  EXPECT_EQ(gpipe::balance_devices_by_cost(costs, interleaved), (std::vector<int>{1, 1, 4, 2}));
  // A stage per device: the stages' cut, whatever the order of the devices.
  EXPECT_EQ(gpipe::balance_devices_by_cost(costs, {1, 0}), gpipe::balance_by_cost(costs, 2));
  // A tie with the stages' cut keeps it.
  EXPECT_EQ(gpipe::balance_devices_by_cost({2, 2, 2, 2}, {0, 1, 1, 0}), (std::vector<int>{1, 1, 1, 1}));
}

TEST(BalanceDevicesByCostTest, RejectsBadInput) {
  using gpipe::testing::expect_invalid;
  expect_invalid([] { gpipe::balance_devices_by_cost({1, 2, 3}, {0, 2, 0}); }, "device 1 of the placement runs no stage");
  expect_invalid([] { gpipe::balance_devices_by_cost({1, 2}, {0, 1, 0}); }, "cannot cut 2 layers into 3 stages");
  expect_invalid([] { gpipe::balance_devices_by_cost({1, -1, 2}, {0, 1, 0}); }, "the cost of layer 1 is -1");
}

// Past the budget of branches it still gives a valid cut no worse than the stages' one.
TEST(BalanceDevicesByCostTest, ManyLayersOfEqualCostEndWithinTheBudget) {
  const std::vector<double> costs(400, 1.0);
  const std::vector<int> placement = gpipe::place_stages(gpipe::StagePlacement::kLoop, 8, 4);
  const std::vector<int> got = gpipe::balance_devices_by_cost(costs, placement);
  ASSERT_NO_THROW(gpipe::check_balance(got, 400));
  EXPECT_LE(device_objective(costs, got, placement).bottleneck,
            device_objective(costs, gpipe::balance_by_cost(costs, 32), placement).bottleneck);
}

TEST(ParameterCostsTest, CountsEachLayersParameters) {
  torch::nn::Sequential m(torch::nn::Linear(4, 3), torch::nn::ReLU(), torch::nn::Linear(3, 2));
  EXPECT_EQ(gpipe::parameter_costs(m), (std::vector<double>{15, 0, 8}));
}

TEST(CostsFromTest, AsksForEveryLayerInOrder) {
  torch::nn::Sequential m(torch::nn::Linear(4, 3), torch::nn::ReLU(), torch::nn::Linear(3, 2));
  const auto costs = gpipe::costs_from(m, [](size_t i, torch::nn::Module& layer) {
    return layer.parameters().empty() ? 0.5 : static_cast<double>(i + 1);
  });
  EXPECT_EQ(costs, (std::vector<double>{1, 0.5, 3}));
  EXPECT_EQ(gpipe::balance_by_cost(costs, 2), (std::vector<int>{2, 1}));
}

TEST(PlanPartitionTest, PredictsStepAndEfficiencyBySimulatingTheSchedule) {
  // Fill-drain over balanced stages: (M+K-1) slots of the bottleneck, exactly.
  const auto even = gpipe::plan_partition({3, 3, 2, 4}, {2, 2}, gpipe::fill_drain(2, 4));
  EXPECT_EQ(even.stage_costs, (std::vector<double>{6, 6}));
  EXPECT_DOUBLE_EQ(even.predicted_step, (4 + 2 - 1) * 6.0);
  EXPECT_DOUBLE_EQ(even.predicted_efficiency, 4.0 / 5);  // M/(M+K-1)
  EXPECT_DOUBLE_EQ(even.balanced_efficiency, 4.0 / 5);
  // Uneven stages: the slow stage's M slots and one pass through the other, less than (M+K-1) x 6.
  const auto plan = gpipe::plan_partition({1, 2, 3, 4}, {3, 1}, gpipe::fill_drain(2, 4));
  EXPECT_EQ(plan.stage_costs, (std::vector<double>{6, 4}));
  EXPECT_EQ(plan.bottleneck_stage, 0);
  EXPECT_EQ(plan.bottleneck, 6);
  EXPECT_EQ(plan.schedule, "gpipe");
  EXPECT_DOUBLE_EQ(plan.predicted_step, 4 * 6.0 + 4);
  EXPECT_DOUBLE_EQ(plan.predicted_efficiency, 4 * 10.0 / (2 * 28));  // M·Σ / (K·step)
  EXPECT_EQ(gpipe::format_plan(gpipe::plan_partition({0.002, 0.002, 0.001}, {2, 1}, gpipe::fill_drain(2, 3)), "s"),
            "stage  layers              cost    share\n"
            "    0  0-1 (2)          4.00 ms    80.0%  <- bottleneck\n"
            "    1  2-2 (1)          1.00 ms    20.0%\n"
            "bottleneck: stage 0, 4.00 ms per micro-batch\n"
            "predicted step: 13.00 ms for M=3 (gpipe simulated, F 1/3 and B 2/3 of a stage), pipeline efficiency "
            "57.7% (balanced stages: 75.0%)\n");
  EXPECT_EQ(gpipe::format_plan(gpipe::plan_partition({3 << 20, 1 << 20}, {1, 1}, gpipe::fill_drain(2, 2)), "bytes"),
            "stage  layers              cost    share\n"
            "    0  0-0 (1)         3.00 MiB    75.0%  <- bottleneck\n"
            "    1  1-1 (1)         1.00 MiB    25.0%\n"
            "bottleneck: stage 0, 3.00 MiB\n");
  gpipe::testing::expect_invalid([] { gpipe::plan_partition({1, 2, 3}, {2, 1}, gpipe::fill_drain(3, 4)); },
                                 "the balance {2, 1} has 2 stages but the schedule runs 3");
}

TEST(PlanPartitionTest, EachScheduleHasItsOwnStep) {
  auto step = [](const std::vector<int>& balance, gpipe::ScheduleKind kind) {
    return gpipe::plan_partition({3, 3, 2, 4}, balance, gpipe::make_schedule(kind, 2, 4)).predicted_step;
  };
  // Balanced stages: 1F1B has fill-drain's bubble; zero bubble fills it with W's, (K-1)/(3M+K-1) idle.
  EXPECT_DOUBLE_EQ(step({2, 2}, gpipe::ScheduleKind::k1F1B), 30);
  EXPECT_DOUBLE_EQ(step({2, 2}, gpipe::ScheduleKind::kZB1P), 4 * 6.0 * 13 / 12);
  // Uneven stages (8 and 4): fill-drain idles the slow stage between its forwards and backwards,
  // 1F1B fills that gap with backwards.
  EXPECT_DOUBLE_EQ(step({3, 1}, gpipe::ScheduleKind::kGPipe), 4 * 8.0 + 4);
  EXPECT_LT(step({3, 1}, gpipe::ScheduleKind::k1F1B), 4 * 8.0 + 4);
}
