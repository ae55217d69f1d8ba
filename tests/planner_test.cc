// planner_test.cc: search_plans (planner.h), the search gpipe plan prints: every configuration of the
// cluster, each predicted as predict() predicts its plan, those that fit first and fastest first.
#include "helpers.h"

#include <gpipe/calibrate.h>
#include <gpipe/planner.h>

#include <algorithm>

namespace gpipe::testing {
namespace {

// A small Transformer by shape: 12 blocks, an embedding before them and a projection after.
CostModel small_transformer() {
  TransformerShape t;
  t.layers = 12;
  t.width = 256;
  t.heads = 4;
  t.ffn = 1024;
  t.vocab = 1000;
  t.sequence = 64;
  CostModel costs = transformer_costs(t, DeviceSpec{1e12}, 3);
  costs.link_latency_s = 5e-6;
  costs.link_bytes_per_s = 25e9;
  return costs;
}

PlanSearch search_of(int64_t memory) {
  PlanSearch s;
  s.devices = 8;
  s.memory_per_device = memory;
  s.batch = 64;
  s.lead = 1;
  s.blocks = 12;
  s.tail = 1;
  return s;
}

TEST(PlannerTest, EveryConfigurationIsPredictedAsPredictDoesAndSortedFastestFirst) {
  const CostModel costs = small_transformer();
  const PlanSearch search = search_of(int64_t{1} << 40);
  const std::vector<PlanCandidate> found = search_plans(costs, search);
  ASSERT_FALSE(found.empty());
  for (size_t n = 0; n < found.size(); ++n) {
    const PlanCandidate& c = found[n];
    SCOPED_TRACE("candidate " + std::to_string(n) + ": K=" + std::to_string(c.config.devices) + " M=" +
                 std::to_string(c.config.micro_batches) + " " + to_string(c.config.schedule) + " " +
                 to_string(c.config.checkpoint));
    EXPECT_TRUE(c.fits);
    EXPECT_EQ(c.config.devices * c.replicas, 8);
    EXPECT_EQ(c.config.virtual_stages, default_virtual_stages(c.config.schedule));
    // The cut: the blocks evenly, the embedding with the first stage and the projection with the last.
    std::vector<int> cut = even_balance(12, c.config.devices * c.config.virtual_stages);
    cut.front() += 1;
    cut.back() += 1;
    EXPECT_EQ(c.config.balance, cut);
    // A V schedule is ordered by its stages' times at the micro-batches' rows; the others by none.
    const int64_t rows = micro_batch_sizes(search.batch, c.replicas).front();
    if (schedule_traits(c.config.schedule).orders_by_times) {
      const std::vector<ActionTimes> times =
          stage_action_times(costs, c.config.balance, micro_batch_sizes(rows, c.config.micro_batches).front(),
                             c.config.checkpoint);
      ASSERT_EQ(c.config.stage_times.size(), times.size());
      for (size_t s = 0; s < times.size(); ++s) {
        EXPECT_EQ(c.config.stage_times[s].forward, times[s].forward);
        EXPECT_EQ(c.config.stage_times[s].input_grad, times[s].input_grad);
        EXPECT_EQ(c.config.stage_times[s].weight_grad, times[s].weight_grad);
      }
    } else {
      EXPECT_TRUE(c.config.stage_times.empty());
    }
    // The prediction is predict()'s of the same plan on a replica's rows.
    const PipelinePlan plan = make_plan(costs.layer_count(), PipelineOptions().balance(c.config.balance)
                                                                 .micro_batches(c.config.micro_batches)
                                                                 .schedule(c.config.schedule)
                                                                 .checkpoint(c.config.checkpoint)
                                                                 .stage_times(c.config.stage_times));
    const Prediction p = predict(costs, plan, micro_batch_sizes(rows, c.config.micro_batches));
    EXPECT_EQ(c.predicted.peak_bytes, p.peak_bytes);
    EXPECT_EQ(c.predicted.static_bytes, p.static_bytes);
    EXPECT_EQ(c.largest_total_bytes, p.largest_total_bytes());
    EXPECT_GE(c.step_s, p.step_s) << "the replicas' all-reduce comes on top";
    if (c.replicas == 1) EXPECT_EQ(c.step_s, p.step_s);
    EXPECT_DOUBLE_EQ(c.samples_per_s, static_cast<double>(search.batch) / c.step_s);
    if (n > 0) EXPECT_GE(found[n - 1].samples_per_s, c.samples_per_s);
  }
}

TEST(PlannerTest, WhatDoesNotFitComesAfterWhatDoesLeastMemoryFirst) {
  const CostModel costs = small_transformer();
  const std::vector<PlanCandidate> all = search_plans(costs, search_of(int64_t{1} << 40));
  // A device of the median need: some fit, some do not.
  std::vector<int64_t> needs;
  for (const PlanCandidate& c : all) needs.push_back(c.largest_total_bytes);
  std::sort(needs.begin(), needs.end());
  const int64_t memory = needs[needs.size() / 2];
  const std::vector<PlanCandidate> found = search_plans(costs, search_of(memory));
  ASSERT_EQ(found.size(), all.size());
  size_t n = 0;
  for (; n < found.size() && found[n].fits; ++n) EXPECT_LE(found[n].largest_total_bytes, memory);
  EXPECT_GT(n, 0u);
  EXPECT_LT(n, found.size());
  for (size_t m = n; m < found.size(); ++m) {
    EXPECT_FALSE(found[m].fits) << "a configuration that fits after one that does not";
    EXPECT_GT(found[m].largest_total_bytes, memory);
    if (m > n) EXPECT_LE(found[m - 1].largest_total_bytes, found[m].largest_total_bytes);
  }
}

TEST(PlannerTest, OnlyTheDepthsAndMicroBatchesAskedFor) {
  const CostModel costs = small_transformer();
  PlanSearch search = search_of(int64_t{1} << 40);
  search.stages = {2, 4};
  search.micro_batches = {4};
  search.schedules = {ScheduleKind::k1F1B};
  search.checkpoints = {Checkpoint::kAlways};
  const std::vector<PlanCandidate> found = search_plans(costs, search);
  ASSERT_EQ(found.size(), 2u);
  for (const PlanCandidate& c : found) {
    EXPECT_TRUE(c.config.devices == 2 || c.config.devices == 4);
    EXPECT_EQ(c.config.micro_batches, 4);
    EXPECT_EQ(c.config.schedule, ScheduleKind::k1F1B);
    EXPECT_EQ(c.config.checkpoint, Checkpoint::kAlways);
  }
}

TEST(PlannerTest, RefusesWhatNoConfigurationCanRun) {
  const CostModel costs = small_transformer();
  PlanSearch search = search_of(int64_t{1} << 30);
  search.stages = {3};
  expect_invalid([&] { search_plans(costs, search); }, "K = 3 devices per pipeline does not divide the 8 devices");
  search.stages = {2, 4, 2};
  expect_invalid([&] { search_plans(costs, search); }, "`stages` lists 2 twice; give each value once");
  search.stages = {2};
  search.schedules = {ScheduleKind::kGPipe, ScheduleKind::kGPipe};
  expect_invalid([&] { search_plans(costs, search); }, "`schedule` lists gpipe twice");
  search.schedules = {ScheduleKind::kGPipe};
  search.micro_batches = {32};  // 4 replicas of 16 rows
  expect_invalid([&] { search_plans(costs, search); }, "M = 32 micro-batches is more than the 16 rows");
  search = search_of(int64_t{1} << 30);
  search.batch = 0;
  expect_invalid([&] { search_plans(costs, search); }, "at least 1 row");
  search = search_of(int64_t{1} << 30);
  search.blocks = 11;  // 1 + 11 + 1 layers, but the model has 14
  expect_invalid([&] { search_plans(costs, search); }, "not the model's 14");
  search = search_of(int64_t{1} << 30);
  search.stages = {8};
  search.schedules = {ScheduleKind::kInterleaved};  // 16 stages of 12 blocks
  expect_invalid([&] { search_plans(costs, search); }, "no configuration of 8 devices");
}

// A layer whose output is a tuple of more tensors than one MPI message carries (65 > 64): no stage
// of a proposed cut ends after it; the min-max cut goes around it. With only two layers on either
// side of it and K = 4 stages, no cut can: K = 4 is not proposed at all.
TEST(PlannerTest, NoCutEndsAStageAfterALayerOfMoreTensorsThanAMessageCarries) {
  CostModel costs = uniform_costs(4, 1e-3, 2e-3);
  for (LayerCost& c : costs.layers) c.output_bytes = c.kept_bytes = 64;
  costs.layers[1].output_tensors = kMostBoundaryTensors + 1;
  PlanSearch search;
  search.devices = 4;
  search.memory_per_device = int64_t{1} << 40;
  search.batch = 8;
  search.schedules = {ScheduleKind::kGPipe};
  const std::vector<PlanCandidate> found = search_plans(costs, search);
  bool two_stages = false;
  for (const PlanCandidate& c : found) {
    const std::vector<int> offsets = stage_offsets(c.config.balance);
    for (size_t s = 1; s + 1 < offsets.size(); ++s)
      EXPECT_NE(offsets[s], 2) << "K=" << c.config.devices << " ends a stage after layer 1: "
                               << format_balance(c.config.balance);
    EXPECT_NE(c.config.devices, 4) << format_balance(c.config.balance);
    two_stages = two_stages || c.config.devices == 2;
  }
  EXPECT_TRUE(two_stages);  // {1, 3} or {3, 1}: around the layer, not refused
  search.stages = {4};
  expect_invalid([&] { search_plans(costs, search); }, "more than 64 tensors");
}


// No cut one boundary move away from `balance` has a step (`step_of`) shorter than `step`.
void expect_no_shorter_move(const std::vector<int>& balance, double step,
                            const std::function<double(const std::vector<int>&)>& step_of) {
  for (size_t b = 0; b + 1 < balance.size(); ++b)
    for (int shift : {-1, 1}) {
      std::vector<int> moved = balance;
      moved[b] += shift;
      moved[b + 1] -= shift;
      if (moved[b] >= 1 && moved[b + 1] >= 1) EXPECT_GE(step_of(moved), step * (1 - 1e-9)) << "moved: " << format_balance(moved);
    }
}

// The search's own min-max cut balances the sums of each device's layer times; the simulation then
// moves its boundaries while the predicted step shortens: every cut found is the min-max cut or one
// the simulation predicts faster, and no single move shortens it further.
TEST(PlannerTest, SearchPlansImprovesItsOwnCutBySimulation) {
  // A heavy first and last layer, outputs that take time to cross, and a skip connection across the
  // model: what the devices' sums of layer times do not see.
  CostModel costs = uniform_costs(10, 1e-3, 2e-3);
  costs.layers.front().forward_s = 3e-3, costs.layers.front().backward_s = 6e-3;
  costs.layers.back().forward_s = 4e-3, costs.layers.back().backward_s = 8e-3;
  for (size_t l = 0; l < costs.layers.size(); ++l) {
    LayerCost& c = costs.layers[l];
    c.input_grad_s = c.weight_grad_s = c.backward_s / 2;
    c.output_bytes = c.kept_bytes = static_cast<double>(1 << 16) * static_cast<double>(l + 1);
  }
  costs.skips.push_back({SkipConnection{"across", 1, 8}, double{1 << 18}});
  costs.link_latency_s = 5e-6;
  costs.link_bytes_per_s = 1e8;
  PlanSearch search;
  search.devices = 2;
  search.memory_per_device = int64_t{1} << 40;
  search.batch = 16;
  search.checkpoints = {Checkpoint::kNever};
  search.stages = {2};  // one replica: the pipeline's step is the candidate's
  const std::vector<PlanCandidate> refined = search_plans(costs, search);
  // The same search with the min-max cut taken as it is.
  std::vector<double> time;
  for (const LayerCost& c : costs.layers) time.push_back(c.forward_s + c.backward_s);
  PlanSearch plain = search;
  plain.given_cut = true;
  plain.cut = CutRequest::by_cost(time);
  const std::vector<PlanCandidate> min_max = search_plans(costs, plain);
  ASSERT_EQ(refined.size(), min_max.size());
  const std::vector<SkipConnection> skips{costs.skips.front().connection};
  auto step_of = [&](const PlanCandidate& c, const std::vector<int>& balance) {
    const PipelinePlan plan = make_plan(costs.layer_count(), PipelineOptions().devices(c.config.devices)
                                                                 .virtual_stages(c.config.virtual_stages)
                                                                 .balance(balance)
                                                                 .micro_batches(c.config.micro_batches)
                                                                 .schedule(c.config.schedule)
                                                                 .checkpoint(c.config.checkpoint),
                                        skips);
    const std::vector<int64_t> rows = micro_batch_sizes(search.batch / c.replicas, c.config.micro_batches);
    // A V schedule ordered by the stages' times, as the search orders it.
    const std::vector<gpipe::ActionTimes> times = stage_action_times(costs, balance, rows.front(), c.config.checkpoint);
    return predict(costs, with_stage_times(plan, times), rows).step_s;
  };
  int faster = 0;
  for (const PlanCandidate& c : refined) {
    const auto same = std::find_if(min_max.begin(), min_max.end(), [&](const PlanCandidate& m) {
      return m.config.devices == c.config.devices && m.config.micro_batches == c.config.micro_batches &&
             m.config.schedule == c.config.schedule && m.config.virtual_stages == c.config.virtual_stages;
    });
    ASSERT_NE(same, min_max.end());
    SCOPED_TRACE("K=" + std::to_string(c.config.devices) + " M=" + std::to_string(c.config.micro_batches) + " " +
                 to_string(c.config.schedule) + ": " + format_balance(c.config.balance) + " against the min-max cut " +
                 format_balance(same->config.balance));
    const double step = c.predicted.step_s;  // the pipeline's, without the replicas' all-reduce
    EXPECT_DOUBLE_EQ(step, step_of(c, c.config.balance));
    EXPECT_LE(step, same->predicted.step_s);
    if (step < same->predicted.step_s * (1 - 1e-9)) ++faster;
    expect_no_shorter_move(c.config.balance, step, [&](const std::vector<int>& moved) { return step_of(c, moved); });
  }
  EXPECT_GT(faster, 0) << "the simulation improved no configuration's cut";
}

// The V's devices balanced by the sums of their layer times can still wait at every turn (a stage of
// many layers against one of few): refined_plan predicts every cut where that is cheap, and takes the
// best; on a model of too many cuts it moves boundaries from the min-max cut and from the even cut.
// Layers of random times, as profiles differ.
TEST(PlannerTest, RefinedPlanTakesTheBestPredictedCut) {
  std::mt19937 random(11);
  std::uniform_real_distribution<double> ms(0.5e-3, 3e-3);
  for (int model = 0; model < 24; ++model) {
    const int layers = model < 20 ? 10 : 64;
    SCOPED_TRACE("model " + std::to_string(model) + ", " + std::to_string(layers) + " layers");
    CostModel costs = uniform_costs(layers, 1e-3, 2e-3);
    for (LayerCost& c : costs.layers) {
      c.forward_s = ms(random);
      c.backward_s = 2 * c.forward_s;
      c.input_grad_s = c.weight_grad_s = c.forward_s;
      c.output_bytes = c.kept_bytes = 1024;
    }
    const int M = 4;
    const std::vector<int64_t> rows(M, 8);
    std::vector<double> time;
    for (const LayerCost& c : costs.layers) time.push_back(c.forward_s + c.backward_s);
    const PipelineOptions asked =
        PipelineOptions().devices(2).virtual_stages(2).micro_batches(M).schedule(ScheduleKind::kZBV).cut(CutRequest::by_cost(time));
    // Each cut's V ordered by its stages' times, as the planner orders it.
    const auto step_of = [&](const std::vector<int>& balance) {
      const PipelinePlan plan = make_plan(layers, PipelineOptions(asked).cut(CutRequest::given(balance)));
      const PipelinePlan timed =
          with_stage_times(plan, stage_action_times(costs, balance, rows.front(), plan.checkpoint));
      return predict(costs, timed, rows).step_s;
    };
    const PipelinePlan refined = refined_plan(costs, asked, rows);
    const double step = predict(costs, refined, rows).step_s;
    EXPECT_LE(step, step_of(make_plan(layers, asked).balance)) << format_balance(refined.balance);
    EXPECT_LE(step, step_of(even_balance(layers, 4))) << format_balance(refined.balance);
    if (layers == 10) {  // 84 cuts: every one predicted
      double best = std::numeric_limits<double>::infinity();
      std::vector<int> best_cut;
      for (int a = 1; a <= layers - 3; ++a)
        for (int b = 1; a + b <= layers - 2; ++b)
          for (int c = 1; a + b + c <= layers - 1; ++c) {
            const std::vector<int> cut{a, b, c, layers - a - b - c};
            const double s = step_of(cut);
            if (s < best) best = s, best_cut = cut;
          }
      EXPECT_DOUBLE_EQ(step, best) << format_balance(refined.balance) << " against " << format_balance(best_cut);
    }
    expect_no_shorter_move(refined.balance, step, step_of);
  }
}

// The fit of the pipeline's own overhead: the residuals' time per step and per action on the path,
// by least squares, neither below 0.
TEST(PlannerTest, ThePipelinesOwnOverheadIsFittedPerStepAndPerActionNeitherBelowZero) {
  auto expect_fit = [](const std::vector<std::pair<double, double>>& residuals, double step, double action) {
    const PipelineOverhead o = fit_pipeline_overhead(residuals);
    EXPECT_NEAR(o.step_s, step, 1e-12);
    EXPECT_NEAR(o.action_s, action, 1e-12);
  };
  expect_fit({{5e-4 + 4 * 2e-5, 4}, {5e-4 + 10 * 2e-5, 10}, {5e-4 + 34 * 2e-5, 34}}, 5e-4, 2e-5);  // exact
  expect_fit({{3e-4, 4}, {2e-4, 10}, {1e-4, 34}}, 2e-4, 0.0);          // falling with the actions: the mean
  expect_fit({{0.0, 4}, {2e-4, 10}, {8e-4, 34}}, 0.0, (10 * 2e-4 + 34 * 8e-4) / (16 + 100 + 34 * 34));
  expect_fit({{-1e-3, 4}, {-2e-3, 10}}, 0.0, 0.0);                      // faster than predicted: none
  expect_fit({{std::nan(""), 4}, {4e-4, 4}}, 2e-4, 0.0);                 // one count: the mean, NaN as 0
  expect_fit({}, 0.0, 0.0);
}

// The pipeline's own overhead is measured once per process and thread count, and profile_model puts
// it into the costs unless told not to.
TEST(PlannerTest, TheProfileCarriesThePipelinesOwnOverheadMeasuredOnce) {
  const PipelineOverhead first = pipeline_overhead(1);
  EXPECT_TRUE(std::isfinite(first.action_s) && std::isfinite(first.step_s));
  EXPECT_GE(first.action_s, 0.0);
  EXPECT_GE(first.step_s, 0.0);
  const PipelineOverhead again = pipeline_overhead(1);
  EXPECT_EQ(again.action_s, first.action_s);
  EXPECT_EQ(again.step_s, first.step_s);
  EXPECT_THROW(pipeline_overhead(0), std::invalid_argument);
  torch::nn::Sequential model(torch::nn::Linear(8, 8), torch::nn::ReLU(), torch::nn::Linear(8, 2));
  const torch::Tensor sample = torch::randn({4, 8});
  const CostModel with = profile_model(model, sample);
  EXPECT_EQ(with.action_overhead_s, first.action_s);
  EXPECT_EQ(with.step_overhead_s, first.step_s);
  const CostModel without = profile_model(model, sample, PlanProfileOptions().count_pipeline_overhead(false));
  EXPECT_EQ(without.action_overhead_s, 0.0);
  EXPECT_EQ(without.step_overhead_s, 0.0);
}

}  // namespace
}  // namespace gpipe::testing
