// plan_test.cc: make_plan's one policy: each cut request (even, given, blocks, by cost) against
// hand-computed cuts, over K·V stages, the V and placement from the schedule table, and the errors.
#include "helpers.h"

#include <chrono>

using gpipe::CutKind;
using gpipe::CutRequest;
using gpipe::PipelineOptions;
using gpipe::ScheduleKind;
using gpipe::testing::expect_invalid;

TEST(CutRequestTest, EvenFirstStagesTakeTheRemainder) {
  const gpipe::PipelinePlan plan = gpipe::make_plan(10, PipelineOptions().devices(3));
  EXPECT_EQ(plan.balance, (std::vector<int>{4, 3, 3}));
  EXPECT_EQ(plan.cut, CutKind::kEven);
  EXPECT_EQ(gpipe::to_string(plan.cut), "even");
  EXPECT_EQ(CutRequest::even().resolve(7, 2), (std::vector<int>{4, 3}));
}

TEST(CutRequestTest, GivenIsTheBalanceAndSetsK) {
  const gpipe::PipelinePlan plan = gpipe::make_plan(11, PipelineOptions().cut(CutRequest::given({3, 8})));
  EXPECT_EQ(plan.balance, (std::vector<int>{3, 8}));
  EXPECT_EQ(plan.devices, 2);
  EXPECT_EQ(plan.cut, CutKind::kGiven);
  // PipelineOptions::balance is the same request.
  const PipelineOptions options = PipelineOptions().balance({3, 8});
  EXPECT_EQ(options.cut().kind, CutKind::kGiven);
  EXPECT_EQ(options.balance(), (std::vector<int>{3, 8}));
  EXPECT_EQ(gpipe::make_plan(11, options).balance, plan.balance);
  // An empty balance clears a given one, and leaves another request as it is.
  EXPECT_EQ(PipelineOptions().balance({3, 8}).balance({}).cut().kind, CutKind::kEven);
  EXPECT_EQ(PipelineOptions().cut(CutRequest::by_cost({1, 2})).balance({}).cut().kind, CutKind::kByCost);
  EXPECT_TRUE(PipelineOptions().cut(CutRequest::by_cost({1, 2})).balance().empty());
  // With V = 2 stages per device, K is the balance's length / V.
  const gpipe::PipelinePlan interleaved =
      gpipe::make_plan(11, PipelineOptions().balance({3, 1, 2, 5}).schedule(ScheduleKind::kInterleaved).micro_batches(2));
  EXPECT_EQ(interleaved.devices, 2);
  EXPECT_EQ(interleaved.virtual_stages, 2);
  EXPECT_EQ(interleaved.placement, (std::vector<int>{0, 1, 0, 1}));
  EXPECT_EQ(CutRequest::given({3, 8}).str(), "given {3, 8}");
}

// Blocks split evenly, the lead layers with the first stage and the tail layers with the last: the
// cut a GPT of 1 embedding, 4 blocks of 2 layers and a norm and a head (2 tail layers) asks for.
TEST(CutRequestTest, BlocksLeadWithTheFirstTailWithTheLast) {
  const CutRequest gpt = CutRequest::blocks({2, 2, 2, 2}, 1, 2);
  EXPECT_EQ(gpt.resolve(11, 2), (std::vector<int>{5, 6}));
  EXPECT_EQ(gpt.resolve(11, 3), (std::vector<int>{5, 2, 4}));
  EXPECT_EQ(gpt.resolve(11, 4), (std::vector<int>{3, 2, 2, 4}));
  EXPECT_EQ(gpt.str(), "blocks (1 lead layer, 4 blocks, 2 tail layers)");
  // Blocks of unequal sizes are counted as blocks, not layers.
  EXPECT_EQ(CutRequest::blocks({1, 3, 1, 3}).resolve(8, 2), (std::vector<int>{4, 4}));
  EXPECT_EQ(CutRequest::blocks({1, 3, 1}).resolve(5, 2), (std::vector<int>{4, 1}));
  const gpipe::PipelinePlan plan = gpipe::make_plan(11, PipelineOptions().devices(2).cut(gpt));
  EXPECT_EQ(plan.balance, (std::vector<int>{5, 6}));
  EXPECT_EQ(plan.cut, CutKind::kBlocks);
  // The benchmark transformer's blocks, as Workload::balance gives them.
  const gpipe::Workload w = gpipe::make_workload("transformer", 0, gpipe::LayerRange{0, 0});
  EXPECT_EQ(w.cut().kind, CutKind::kBlocks);
  EXPECT_EQ(gpipe::make_plan(w.layers, PipelineOptions().devices(4).cut(w.cut())).balance, w.balance(4));
}

// With V > 1 the cut is over all S = K·V stages, and V is the schedule's own unless given.
TEST(CutRequestTest, OverEveryStageWithSeveralPerDevice) {
  const CutRequest gpt = CutRequest::blocks({2, 2, 2, 2}, 1, 2);
  const gpipe::PipelinePlan zbv = gpipe::make_plan(11, PipelineOptions().devices(2).cut(gpt).schedule(ScheduleKind::kZBV));
  EXPECT_EQ(zbv.virtual_stages, 2);
  EXPECT_EQ(zbv.balance, (std::vector<int>{3, 2, 2, 4}));
  EXPECT_EQ(zbv.placement, (std::vector<int>{0, 1, 1, 0}));
  const gpipe::PipelinePlan inter = gpipe::make_plan(
      12, PipelineOptions().devices(2).virtual_stages(3).schedule(ScheduleKind::kInterleaved).micro_batches(4));
  EXPECT_EQ(inter.balance, (std::vector<int>{2, 2, 2, 2, 2, 2}));
  EXPECT_EQ(inter.placement, (std::vector<int>{0, 1, 0, 1, 0, 1}));
  const gpipe::PipelinePlan by_cost = gpipe::make_plan(
      4, PipelineOptions().devices(1).cut(CutRequest::by_cost({1, 1, 1, 6})).schedule(ScheduleKind::kInterleaved));
  EXPECT_EQ(by_cost.balance, (std::vector<int>{3, 1}));
}

TEST(CutRequestTest, ByCostIsTheMinMaxCut) {
  const std::vector<double> costs{1, 1, 1, 6};
  const gpipe::PipelinePlan plan = gpipe::make_plan(4, PipelineOptions().devices(2).cut(CutRequest::by_cost(costs)));
  EXPECT_EQ(plan.balance, (std::vector<int>{3, 1}));
  EXPECT_EQ(plan.cut, CutKind::kByCost);
  EXPECT_EQ(plan.balance, gpipe::balance_by_cost(costs, 2));
  EXPECT_EQ(CutRequest::by_cost({4, 1, 1, 1, 1}).resolve(5, 2), (std::vector<int>{1, 4}));
  EXPECT_EQ(CutRequest::by_cost(costs).str(), "by cost");
}

// By cost with several stages per device, the cut balances the devices the schedule places them on.
TEST(CutRequestTest, ByCostBalancesDevicesOfTheSchedulesPlacement) {
  const std::vector<double> costs{4, 1, 1, 1, 1, 1, 1, 6};
  const gpipe::PipelinePlan inter = gpipe::make_plan(8, PipelineOptions().devices(2).virtual_stages(2).micro_batches(4)
                                                            .cut(CutRequest::by_cost(costs))
                                                            .schedule(ScheduleKind::kInterleaved));
  EXPECT_EQ(inter.placement, (std::vector<int>{0, 1, 0, 1}));
  EXPECT_EQ(inter.balance, gpipe::balance_devices_by_cost(costs, inter.placement));
  EXPECT_EQ(inter.balance, (std::vector<int>{1, 1, 4, 2}));  // devices 8 and 8; the stages' {1, 3, 3, 1}: 7 and 9
  const gpipe::PipelinePlan zbv = gpipe::make_plan(8, PipelineOptions().devices(2).cut(CutRequest::by_cost(costs))
                                                          .schedule(ScheduleKind::kZBV));
  EXPECT_EQ(zbv.balance, gpipe::balance_devices_by_cost(costs, {0, 1, 1, 0}));
}

TEST(CutRequestTest, ErrorsNameTheRequestAndTheFix) {
  expect_invalid([] { gpipe::make_plan(10, PipelineOptions().devices(2).cut(CutRequest::blocks({2, 2, 2}, 1, 2))); },
                 "the cut blocks (1 lead layer, 3 blocks, 2 tail layers) covers 9 layers, not the model's 10");
  expect_invalid([] { gpipe::make_plan(9, PipelineOptions().devices(4).cut(CutRequest::blocks({2, 2, 2}, 1, 2))); },
                 "cannot cut 3 blocks into 4 stages: every stage needs at least one block; use at most 3 stages");
  expect_invalid([] { gpipe::make_plan(3, PipelineOptions().devices(2).cut(CutRequest::blocks({}, 1, 2))); },
                 "has no blocks");
  expect_invalid([] { gpipe::make_plan(5, PipelineOptions().devices(2).cut(CutRequest::by_cost({1, 2, 3}))); },
                 "the cut by cost has 3 per-layer costs for a model of 5 layers; give one cost per layer");
  expect_invalid([] { gpipe::make_plan(3, PipelineOptions().devices(2).cut(CutRequest::by_cost({1, -2, 3}))); },
                 "the cost of layer 1 is -2");
  expect_invalid([] { gpipe::make_plan(3, PipelineOptions().cut(CutRequest::blocks({1, 1, 1}))); },
                 "the number of devices K is not given");
  expect_invalid([] { gpipe::make_plan(3, PipelineOptions().devices(4).cut(CutRequest::by_cost({1, 1, 1}))); },
                 "cannot cut 3 layers into 4 devices");
  expect_invalid([] { gpipe::make_plan(5, PipelineOptions().cut(CutRequest::given({2, 2}))); },
                 "sum of balance {2, 2}: 4");
  expect_invalid([] { CutRequest::given({2, 3}).resolve(5, 3); }, "the balance {2, 3} has 2 stages, not the 3 asked for");
}

// M is refused above kMostMicroBatches before the programs, which grow with M, are built: at once,
// however large (10^6 micro-batches of 2 devices took seconds and gigabytes to build).
TEST(PlanTest, MicroBatchesAboveTheCapAreRefusedBeforeTheProgramsAreBuilt) {
  const auto begin = std::chrono::steady_clock::now();
  expect_invalid([] { gpipe::make_plan(4, PipelineOptions().devices(2).micro_batches(1000000)); },
                 "M = 1000000 micro-batches (`micro_batches`) is more than gpipe plans (65536)");
  expect_invalid([] { gpipe::make_plan(4, PipelineOptions().devices(2).micro_batches(gpipe::kMostMicroBatches + 1)); },
                 "give M at most the rows of a batch");
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - begin).count(), 1.0);
  // A plan of fewer micro-batches runs a smaller batch in one micro-batch per row.
  const gpipe::PipelinePlan plan = gpipe::make_plan(4, PipelineOptions().devices(2).micro_batches(64));
  EXPECT_EQ(plan.training_program(8).micro_batches, 8);
}

// Stage times order a V schedule's program (and its programs for fewer micro-batches); one per stage.
TEST(PlanTest, StageTimesOrderTheVSchedulesOnePerStage) {
  using gpipe::ActionTimes;
  const std::vector<ActionTimes> times{{3, 3, 3}, {1, 1, 1}, {3, 3, 3}, {1.5, 1.5, 1.5}};
  const auto options = PipelineOptions().devices(2).micro_batches(8).schedule(gpipe::ScheduleKind::kZBV);
  const gpipe::PipelinePlan unit = gpipe::make_plan(10, options);
  const gpipe::PipelinePlan timed = gpipe::make_plan(10, PipelineOptions(options).stage_times(times));
  EXPECT_NE(gpipe::format_grid(timed.training), gpipe::format_grid(unit.training));
  EXPECT_EQ(gpipe::format_grid(timed.training),
            gpipe::format_grid(gpipe::lower(gpipe::zbv(2, 8, times), timed.checkpoint)));
  EXPECT_EQ(gpipe::format_grid(timed.training_program(6)),
            gpipe::format_grid(gpipe::lower(gpipe::zbv(2, 6, times), timed.checkpoint)));
  EXPECT_EQ(gpipe::format_grid(gpipe::with_stage_times(unit, times).training), gpipe::format_grid(timed.training));
  EXPECT_EQ(gpipe::format_grid(gpipe::with_stage_times(timed, {}).training), gpipe::format_grid(unit.training));
  // A schedule that does not order by times keeps its order.
  const auto one = PipelineOptions().devices(4).micro_batches(8).schedule(gpipe::ScheduleKind::k1F1B);
  EXPECT_EQ(gpipe::format_grid(gpipe::make_plan(10, PipelineOptions(one).stage_times(times)).training),
            gpipe::format_grid(gpipe::make_plan(10, one).training));
  expect_invalid([&] { gpipe::make_plan(10, PipelineOptions(options).stage_times({{1, 1, 1}})); },
                 "`stage_times` holds 1 entry for a pipeline of 4 stages; give one per stage (K·V), or none");
  expect_invalid([&] { gpipe::with_stage_times(unit, {{1, 1, 1}}); }, "`stage_times` holds 1 entry");
}

// PipelineConfig: a plan's shape, as the one serializer writes it and reads it back. Every field
// crosses text_of exactly (a stage time of 1/3 keeps its bits), a plan's config makes the same plan
// again, and what no pipeline could run is refused naming the field.
TEST(PipelineConfigTest, RoundTripsExactlyAndRefusesWhatCannotRun) {
  const std::vector<gpipe::ActionTimes> times{{0.1, 1.0 / 3, 2e-7}, {1, 1, 0}, {2.5, 2.5, 2.5}, {1e-4, 7, 0.25}};
  const gpipe::PipelinePlan plan = gpipe::make_plan(
      9, PipelineOptions().devices(2).micro_batches(3).schedule(ScheduleKind::kZBV).balance({1, 2, 2, 4})
             .checkpoint(gpipe::Checkpoint::kAlways).stage_times(times));
  const gpipe::PipelineConfig config = plan.config();
  EXPECT_EQ(config.virtual_stages, 2);
  EXPECT_EQ(gpipe::describe(config), "zbv (V=2), M=3, checkpoint always");
  const std::string text = gpipe::text_of(gpipe::fields_of(config));
  const gpipe::PipelineConfig back = gpipe::config_of(gpipe::fields_of_text(text, "the test's line"), "the line");
  EXPECT_TRUE(back == config) << text;
  EXPECT_EQ(back.stage_times[0].input_grad, 1.0 / 3) << text;
  const gpipe::PipelinePlan again = gpipe::make_plan(9, PipelineOptions().config(back));
  EXPECT_EQ(again.training.actions, plan.training.actions);
  EXPECT_TRUE(again.config() == config);
  // Another value differs.
  gpipe::PipelineConfig other = config;
  other.stage_times[3].weight_grad = 0.5;
  EXPECT_TRUE(other != config);

  auto refused = [&](gpipe::Fields fields, const std::string& expected) {
    try {
      gpipe::config_of(fields, "its pipeline");
      ADD_FAILURE() << "read: " << gpipe::text_of(fields);
    } catch (const std::runtime_error& e) {
      EXPECT_NE(std::string(e.what()).find(expected), std::string::npos) << e.what();
    }
  };
  auto with = [&](const std::string& name, const gpipe::FieldValue& value) {
    gpipe::Fields fields = gpipe::fields_of(config);
    for (auto& [key, v] : fields)
      if (key == name) v = value;
    return fields;
  };
  refused(with("devices", int64_t{0}), "its pipeline's devices is 0");
  refused(with("devices", std::string("two")), "its pipeline has no devices");
  refused(with("schedule", std::string("fast")), "its pipeline: ");
  refused(with("balance", std::vector<int64_t>{1, 2, 6}), "its pipeline's balance has 3 stages, not K·V");
  refused(with("balance", std::vector<double>{1, 2, 2, 4}), "its pipeline has no balance (a list of whole numbers)");
  refused(with("schedule", std::string("interleaved")), "its pipeline cannot have run: ");  // M = 3 on K = 2
  refused(with("stage_times", std::vector<double>{1, 2, 3}), "its pipeline's stage_times holds 3 times, not 3 for "
                                                             "each of its 4 stages");
  refused(with("stage_times", std::vector<double>(12, -1.0)), "its pipeline's stage_times holds -1");
  // A line text_of did not write.
  for (const std::string bad : {"devices=2", "devices:x=2", "devices:i=two", "balance:I=1,,2"}) {
    try {
      gpipe::fields_of_text(bad, "rank 0's pipeline");
      ADD_FAILURE() << "read: " << bad;
    } catch (const std::runtime_error& e) {
      EXPECT_NE(std::string(e.what()).find("rank 0's pipeline is not a pipeline's fields"), std::string::npos)
          << e.what();
    }
  }
}
