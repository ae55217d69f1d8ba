// tasks_test.cc: the built-in tasks as library values: every entry of the registry builds, cuts and
// trains a step through a pipeline exactly as on one device; the extras (text sampled from a language
// model, the picture of denoised images) and the errors a caller meets.
#include "helpers.h"

#include <gpipe/gpipe.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <numeric>

#include <zlib.h>

namespace gpipe {
namespace {

// sizeof(TrainerOptions) on x86-64 with libstdc++, when settings_of last covered every field.
constexpr size_t kTrainerOptionsSize = 328;

TEST(TasksTest, EveryNameFindsItsTaskAndAnUnknownOneNamesTheKnown) {
  const std::vector<std::string> training = task_names(), all = task_names(true);
  EXPECT_EQ(training, (std::vector<std::string>{"cnn", "resnet", "unet", "gpt"}));
  EXPECT_GT(all.size(), training.size());
  for (const std::string& name : all) EXPECT_EQ(find_task(name).name, name);
  try {
    find_task("resnet18");
    FAIL() << "an unknown task was found";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("cnn, resnet, unet, gpt, mlp"), std::string::npos) << e.what();
  }
}

// Every task's model takes its batch, its loss scores the output, and its own cut (where it has one)
// is a cut of its layers into K·V stages.
TEST(TasksTest, EveryTaskBuildsTakesItsBatchAndCutsItsLayers) {
  for (const std::string& name : task_names(true)) {
    SCOPED_TRACE(name);
    const Task& task = find_task(name);
    const TaskOptions options = TaskOptions().seed(3);
    const Model model = task.model(options);
    EXPECT_EQ(model.layers, task.layers);
    torch::nn::Sequential whole = model.build(LayerRange{});
    EXPECT_EQ(static_cast<int>(whole->size()), task.layers);
    const Dataset batch = task.batch(options);
    ASSERT_GE(batch.size(), 4);
    whole->eval();
    torch::NoGradGuard no_grad;
    const torch::Tensor out = whole->forward(batch.input.narrow(0, 0, 2));
    const double loss = task.loss(out, batch.target.narrow(0, 0, 2)).item<double>();
    EXPECT_TRUE(std::isfinite(loss));
    EXPECT_EQ(task.loss_name == "cross_entropy", batch.target.scalar_type() == torch::kLong);
    for (const auto& [kind, V] : {std::pair{ScheduleKind::kGPipe, 1}, {ScheduleKind::kInterleaved, 2}}) {
      if (!task.cut) continue;
      const std::vector<int> cut = task.cut(2, kind, V).resolve(task.layers, 2 * V);
      EXPECT_EQ(static_cast<int>(cut.size()), 2 * V);
      EXPECT_EQ(std::accumulate(cut.begin(), cut.end(), 0), task.layers);
    }
  }
}

// The tuned and block cuts, as docs/benchmarks.md and docs/models.md give them.
TEST(TasksTest, OwnCutsAndSchedules) {
  const Task& cnn = find_task("cnn");
  auto cut = [](const Task& task, int K, ScheduleKind kind, int V) { return task.cut(K, kind, V).resolve(task.layers, K * V); };
  EXPECT_EQ(cut(cnn, 2, ScheduleKind::kGPipe, 1), (std::vector<int>{3, 8}));
  EXPECT_EQ(cut(cnn, 2, ScheduleKind::kInterleaved, 2), (std::vector<int>{3, 1, 2, 5}));
  EXPECT_EQ(cnn.cut(2, ScheduleKind::kZBV, 2).kind, CutKind::kEven);
  EXPECT_EQ(cnn.cut(3, ScheduleKind::kGPipe, 1).kind, CutKind::kEven);
  EXPECT_EQ(cnn.schedule(2, 4), (std::pair{ScheduleKind::kInterleaved, 2}));
  EXPECT_EQ(cnn.schedule(2, 3), (std::pair{ScheduleKind::kGPipe, 1}));
  const Task& gpt = find_task("gpt");  // blocks evenly, the embedding first, LayerNorm and head last
  EXPECT_EQ(cut(gpt, 2, ScheduleKind::kGPipe, 1), (std::vector<int>{3, 4}));
  EXPECT_EQ(cut(gpt, 4, ScheduleKind::kGPipe, 1), (std::vector<int>{2, 1, 1, 3}));
  EXPECT_EQ(gpt.cut(5, ScheduleKind::kGPipe, 1).kind, CutKind::kEven);
  EXPECT_EQ(cut(find_task("transformer"), 2, ScheduleKind::kGPipe, 1), (std::vector<int>{5, 5}));
  EXPECT_FALSE(find_task("resnet").schedule);
  EXPECT_TRUE(find_task("resnet").defaults.cut_by_time);
}

// The one place a run's pipeline is chosen (gpipe train, bench and schedule call it): "auto" takes
// the task's own schedule and cut, a given cut leaves both to the flags, "even" is a workload's blocks
// or the layers evenly, a cost method needs its costs, and a task whose layers differ in time asks
// for the cut by time where it can be profiled.
TEST(TasksTest, PipelineOptionsOfAPipelineRequest) {
  const Task& cnn = find_task("cnn");
  auto balance = [](const Task& task, const PipelineRequest& r) {
    return make_plan(task.layers, pipeline_options_of(task.own(), r)).balance;
  };
  PipelineOptions own = pipeline_options_of(cnn.own(), {2, 4});
  EXPECT_EQ(own.schedule(), ScheduleKind::kInterleaved);
  EXPECT_EQ(own.virtual_stages(), 2);
  EXPECT_EQ(balance(cnn, {2, 4}), (std::vector<int>{3, 1, 2, 5}));
  EXPECT_EQ(pipeline_options_of(cnn.own(), {2, 3}).schedule(), ScheduleKind::kGPipe);  // M odd: fill-drain
  EXPECT_EQ(balance(cnn, {2, 3}), (std::vector<int>{3, 8}));
  PipelineRequest given{std::nullopt, 4};  // K: the balance's length
  given.balance = {5, 6};
  EXPECT_EQ(pipeline_options_of(cnn.own(), given).schedule(), ScheduleKind::kGPipe);
  EXPECT_EQ(balance(cnn, given), (std::vector<int>{5, 6}));
  PipelineRequest even{2, 4, "gpipe"};
  even.balance_by = "even";
  EXPECT_EQ(balance(cnn, even), (std::vector<int>{6, 5}));  // never the tuned {3, 8}
  EXPECT_EQ(balance(find_task("transformer"), even), (std::vector<int>{5, 5}));  // its blocks evenly
  PipelineRequest by_time = even;
  by_time.balance_by = "time";
  EXPECT_THROW(pipeline_options_of(cnn.own(), by_time), std::invalid_argument);  // no costs given
  by_time.layer_costs.assign(11, 1.0);
  by_time.layer_costs[0] = 10;
  EXPECT_EQ(balance(cnn, by_time), (std::vector<int>{1, 10}));
  EXPECT_EQ(resolve_run(find_task("resnet").own(), {2, 4}).balance_by, "time");
  EXPECT_EQ(resolve_run(find_task("resnet").own(), {1, 4}).balance_by, "");
  EXPECT_EQ(resolve_run(cnn.own(), {2, 4}).balance_by, "");
  const PipelineRequest interleaved = resolve_run(OwnPipeline(), {2, 4, "auto", 3});  // no task: V above 1 interleaves
  EXPECT_EQ(interleaved.schedule, "interleaved");
  EXPECT_EQ(interleaved.virtual_stages, 3);
  EXPECT_EQ(resolve_run(OwnPipeline(), {2, 4, "zbv"}).virtual_stages, 2);
}

// "auto" chooses by prediction: the first of search_plans at the run's K, batch and checkpoint mode,
// over what the request leaves open (the schedule and V; M unless given; the cut unless given). The
// same costs give the same choice; what is given stays; "auto" where nothing is predicted is the task's own.
TEST(TasksTest, AutoIsTheFastestPredictedConfigurationOfWhatIsLeftOpen) {
  const PlannedModel model = plan_model_of(find_task("tiny"));
  const int64_t batch = 32, memory = int64_t{1} << 40;
  PipelineRequest open{2, std::nullopt, "auto"};  // M left to auto
  open.checkpoint = Checkpoint::kNever;
  const ScheduleChoice choice = choose_schedule(model.costs, open, batch, memory);
  PlanSearch search;
  search.devices = 2;
  search.stages = {2};
  search.memory_per_device = memory;
  search.batch = batch;
  search.checkpoints = {Checkpoint::kNever};
  const std::vector<PlanCandidate> found = search_plans(model.costs, search);
  ASSERT_GT(found.size(), 6u);
  EXPECT_EQ(choice.config.schedule, found.front().config.schedule);
  EXPECT_EQ(choice.config.micro_batches, found.front().config.micro_batches);
  EXPECT_EQ(choice.config.virtual_stages, found.front().config.virtual_stages);
  EXPECT_EQ(choice.config.balance, found.front().config.balance);
  EXPECT_EQ(choice.predicted.step_s, found.front().predicted.step_s);
  EXPECT_EQ(choice.considered, static_cast<int>(found.size()));
  EXPECT_TRUE(choice.fits && choice.chose_micro_batches);
  for (const PlanCandidate& c : found) EXPECT_GE(c.step_s, found.front().step_s);
  const ScheduleChoice again = choose_schedule(model.costs, open, batch, memory);
  EXPECT_EQ(again.config.schedule, choice.config.schedule);
  EXPECT_EQ(again.config.micro_batches, choice.config.micro_batches);
  EXPECT_EQ(again.config.balance, choice.config.balance);
  // A given M, V or cut stays; the schedule is chosen among those that take them.
  PipelineRequest m = open;
  m.micro_batches = 8;
  EXPECT_EQ(choose_schedule(model.costs, m, batch, memory).config.micro_batches, 8);
  PipelineRequest v = open;
  v.virtual_stages = 2;
  const ScheduleChoice two = choose_schedule(model.costs, v, batch, memory);
  EXPECT_EQ(two.config.virtual_stages, 2);
  EXPECT_GT(default_virtual_stages(two.config.schedule), 1);
  PipelineRequest given = open;
  given.devices = 0;
  given.balance = {1, model.costs.layer_count() - 1};
  const ScheduleChoice cut = choose_schedule(model.costs, given, batch, memory);
  EXPECT_EQ(cut.config.balance, given.balance);
  EXPECT_EQ(cut.config.devices, 2);
  EXPECT_EQ(cut.config.virtual_stages, 1);
  // Re-materialization left open: none where the memory fits; where it does not, the fastest mode
  // that fits, recomputing activations to keep fewer of them.
  PipelineRequest recompute = open;
  recompute.checkpoint.reset();
  EXPECT_EQ(choose_schedule(model.costs, recompute, batch, memory).config.checkpoint,
            Checkpoint::kNever);
  EXPECT_EQ(choice.config.checkpoint, Checkpoint::kNever);  // given: the run's
  const std::vector<PlanCandidate> modes = schedule_candidates(model.costs, recompute, batch, memory);
  int64_t least_without = std::numeric_limits<int64_t>::max(), least_with = least_without;
  for (const PlanCandidate& c : modes)
    (c.config.checkpoint == Checkpoint::kNever ? least_without : least_with) =
        std::min(c.config.checkpoint == Checkpoint::kNever ? least_without : least_with, c.largest_total_bytes);
  ASSERT_LT(least_with, least_without);
  const ScheduleChoice tight = choose_schedule(model.costs, recompute, batch, least_with);
  EXPECT_TRUE(tight.fits);
  EXPECT_NE(tight.config.checkpoint, Checkpoint::kNever);
  EXPECT_NE(format_choice(tight).find(", checkpoint " + to_string(tight.config.checkpoint)), std::string::npos)
      << format_choice(tight);
  // The choice as a run takes it, and in words.
  const PipelineRequest chosen = with_choice(open, choice);
  const PipelineOptions options = pipeline_options_of(find_task("tiny").own(), chosen);
  EXPECT_EQ(options.schedule(), choice.config.schedule);
  EXPECT_EQ(options.micro_batches(), choice.config.micro_batches);
  EXPECT_EQ(make_plan(model.costs.layer_count(), options).balance, choice.config.balance);
  EXPECT_EQ(format_choice(choice).rfind("schedule auto: " + to_string(choice.config.schedule), 0), 0u) << format_choice(choice);
  // Where nothing profiles the model, "auto" is the task's own.
  EXPECT_EQ(pipeline_options_of(find_task("cnn").own(), {2, 4, "auto"}).schedule(), ScheduleKind::kInterleaved);
  EXPECT_EQ(resolve_run(find_task("cnn").own(), {2, 4, "task"}).schedule, "interleaved");
}

// "auto" predicts each M from the layers' costs at that M's rows, each size asked for once: a kernel on
// fewer rows does less per second, which one profile scaled per sample does not show.
TEST(TasksTest, AutoPredictsEachMicroBatchCountFromItsOwnRows) {
  PlannedModel model = plan_model_of(find_task("tiny"));
  model.costs.action_overhead_s = model.costs.step_overhead_s = 0;  // the layers' costs alone, which the rows scale
  const int64_t batch = 32, memory = int64_t{1} << 40;
  PipelineRequest open{2, std::nullopt, "auto"};  // M left to auto
  open.checkpoint = Checkpoint::kNever;
  std::map<int64_t, int> asked;
  // Micro-batches of fewer than 8 rows cost 10x per sample: M above 4 must not be chosen.
  const CostsAtRows costs_at = [&](int64_t rows) {
    ++asked[rows];
    return with_compute_scaled(model.costs, rows < 8 ? 10 : 1);
  };
  const std::vector<PlanCandidate> found = schedule_candidates(costs_at, open, batch, memory);
  EXPECT_EQ(asked, (std::map<int64_t, int>{{32, 1}, {16, 1}, {8, 1}, {4, 1}}));  // M = 1, 2, 4, 8
  EXPECT_LE(found.front().config.micro_batches, 4);
  for (const PlanCandidate& c : found)
    if (c.config.micro_batches == 8) EXPECT_GT(c.step_s, 5 * found.front().step_s) << to_string(c.config.schedule);
  // The devices of one process share its cores: a cut of 4 stages weighs K=4 and K=2 (V=2), and on 2
  // cores every K=4 configuration computes twice as long as on 4; K=2 is the same on both.
  PipelineRequest four{std::nullopt, 4, "auto"};
  four.checkpoint = Checkpoint::kNever;
  four.balance = {1, 1, 1, model.costs.layer_count() - 3};
  std::map<std::pair<std::string, int>, double> on_four;
  for (const PlanCandidate& c : schedule_candidates(model.costs, four, batch, memory, 1, 4))
    on_four[{to_string(c.config.schedule), c.config.devices}] = c.predicted.step_s;
  std::map<int, int> weighed;  // configurations per K
  for (const PlanCandidate& c : schedule_candidates(model.costs, four, batch, memory, 1, 2)) {
    const double alone = on_four.at({to_string(c.config.schedule), c.config.devices});
    if (c.config.devices == 4) EXPECT_GT(c.predicted.step_s, 1.5 * alone) << to_string(c.config.schedule);
    if (c.config.devices == 2) EXPECT_EQ(c.predicted.step_s, alone) << to_string(c.config.schedule);
    ++weighed[c.config.devices];
  }
  EXPECT_GT(weighed[4], 0);
  EXPECT_GT(weighed[2], 0);
}

// "auto" profiles every size it weighs in rounds, each layer's times the least of its rounds: a burst of
// other work on the machine during one size's profile does not choose the M, which one profile per size
// in turn let it do.
TEST(TasksTest, AutoWeighsEverySizeAlikeThroughABurstOfNoise) {
  PlannedModel model = plan_model_of(find_task("tiny"));
  model.costs.action_overhead_s = model.costs.step_overhead_s = 0;
  const int64_t batch = 32, memory = int64_t{1} << 40;
  PipelineRequest open{2, std::nullopt, "auto"};
  open.checkpoint = Checkpoint::kNever;
  const std::vector<int64_t> sizes = profiled_rows(open, batch);
  EXPECT_EQ(sizes, (std::vector<int64_t>{4, 8, 16, 32}));  // M = 8, 4, 2, 1
  const int quiet_M = choose_schedule(model.costs, open, batch, memory).config.micro_batches;
  ASSERT_GT(quiet_M, 1);
  // The machine is busy while the first profiles run (those of the smaller micro-batches, 3x as long),
  // quiet from the profile of the whole batch on.
  for (const int rounds : {1, kProfileRounds}) {
    SCOPED_TRACE(rounds);
    std::vector<int64_t> order;
    const CostsAtRows noisy = [&](int64_t rows) {
      order.push_back(rows);
      return with_compute_scaled(model.costs, order.size() <= 3 ? 3 : 1);
    };
    const CostsAtRows costs_at = profiled_together(noisy, sizes, rounds);
    const int chosen = choose_schedule(costs_at, open, batch, memory).config.micro_batches;
    if (rounds == 1) {
      EXPECT_EQ(chosen, 1);  // the one size profiled while quiet looks the fastest
      EXPECT_EQ(order, sizes);
    } else {
      EXPECT_EQ(chosen, quiet_M);
      EXPECT_EQ(order, (std::vector<int64_t>{4, 8, 16, 32, 32, 16, 8, 4}));  // ascending, then descending
    }
    costs_at(32);
    EXPECT_EQ(order.size(), sizes.size() * static_cast<size_t>(rounds));  // each size profiled once per round
  }
  EXPECT_THROW(profiled_together([&](int64_t) { return model.costs; }, sizes, 0), std::invalid_argument);
}

// A training run's "auto": prepare_training profiles the model once and its settings take the choice;
// M given stays, M left open is chosen; the plan is the choice's.
TEST(TasksTest, TrainingRunsTheScheduleAutoChose) {
  for (const bool m_given : {false, true}) {
    SCOPED_TRACE(m_given);
    TrainSettings s;
    s.model = "tiny";
    s.schedule = "auto";
    s.micro_batches = 2;
    if (!m_given) s.given.erase("micro_batches");
    s.batch_size = 32;
    s.given.insert("batch_size");
    const Task known = known_task(s);
    resolve_training(s, known);
    EXPECT_EQ(s.schedule, "auto");  // chosen once the model and data are read
    const TrainingRun run = prepare_training(s, known);
    ASSERT_TRUE(run.choice.has_value());
    EXPECT_EQ(s.schedule, to_string(run.choice->config.schedule));
    EXPECT_EQ(s.micro_batches, run.choice->config.micro_batches);
    EXPECT_EQ(s.virtual_stages, run.choice->config.virtual_stages);
    EXPECT_EQ(run.plan.schedule, run.choice->config.schedule);
    EXPECT_EQ(run.plan.balance, run.choice->config.balance);
    EXPECT_EQ(run.plan.devices, 2);
    if (m_given) EXPECT_EQ(s.micro_batches, 2);
    EXPECT_EQ(run.choice->chose_micro_batches, !m_given);
  }
  EXPECT_EQ(TrainSettings().schedule, "auto");  // gpipe train's default
  TrainSettings own;  // the task's own: no profile
  own.schedule = "task";
  own.train_samples = 256;
  own.test_samples = 10;
  const Task cnn = known_task(own);
  resolve_training(own, cnn);
  EXPECT_EQ(own.schedule, "interleaved");
  EXPECT_FALSE(prepare_training(own, cnn).choice.has_value());
  // Auto by default with nothing to train (`epochs` 0 on a file that does not say how it was trained)
  // runs the task's own at the settings' M (4 by default, M not given): the CNN's interleaved on 2
  // devices, as a named "task" does.
  const std::string path = (std::filesystem::temp_directory_path() / "gpipe_tasks_test_evaluate.pt").string();
  {
    const torch::nn::Sequential whole = cnn.model(TaskOptions()).build(LayerRange{});
    torch::optim::SGD sgd(whole->parameters(), 0.1);
    const torch::Tensor generator = at::detail::getDefaultCPUGenerator().get_state();
    save_snapshot(path, {encode_snapshot_part(whole, sgd)}, whole, std::nullopt, optimizer_name(OptimizerKind::kSgd),
                  TrainState{0, generator, generator, std::nullopt});
  }
  TrainSettings none;
  none.train_samples = 256;
  none.test_samples = 10;
  none.optimizer = "sgd";
  none.resume = path;
  none.epochs = 0;
  none.given.insert("epochs");
  none.given.erase("micro_batches");
  resolve_training(none, cnn);
  const TrainingRun evaluated = prepare_training(none, cnn);
  EXPECT_FALSE(evaluated.choice.has_value());
  EXPECT_EQ(none.schedule, "interleaved");
  EXPECT_EQ(evaluated.plan.schedule, ScheduleKind::kInterleaved);
  EXPECT_EQ(evaluated.plan.micro_batches, 4);
  std::remove(path.c_str());
}

// A task scores itself (Task::scoring): its score with its unit and its references, after an epoch and
// in the summary, and by name for the JSON.
TEST(TasksTest, ScoresWithTheirUnitsAndReferences) {
  TaskData data;
  data.noisy_psnr_db = 18.2;
  data.bigram_bits_per_byte = 3.1;
  data.gzip_bits_per_byte = 2.9;
  Evaluation e;
  e.loss = 0.25;
  e.accuracy = 0.85;
  const Scoring& accuracy = find_task("cnn").scoring;
  const Scoring& loss = find_task("mlp").scoring;
  const Scoring& bits = find_task("gpt").scoring;
  const Scoring& psnr = find_task("unet").scoring;
  EXPECT_EQ(accuracy.format(e, data, false), "test accuracy 85.00%");
  EXPECT_EQ(accuracy.format(e, data, true), "test accuracy  85.00%");
  EXPECT_EQ(accuracy.figures(e, data, false), (std::vector<std::pair<std::string, double>>{{"test_accuracy", 0.85}}));
  EXPECT_EQ(loss.format(e, data, false), "test loss 0.2500");
  EXPECT_EQ(loss.format(e, data, true), "test loss  0.250000");
  EXPECT_TRUE(loss.figures(e, data, true).empty());
  e.loss = std::log(2.0);
  EXPECT_EQ(bits.format(e, data, false), "test 1.000 bits per byte (bigram 3.100, gzip -9 2.900)");
  EXPECT_EQ(bits.format(e, data, true), "test bits per byte  1.000 (bigram 3.100, gzip -9 2.900)");
  ASSERT_EQ(bits.figures(e, data, false).size(), 1u);
  const auto read = bits.figures(e, data, /*references=*/true);
  ASSERT_EQ(read.size(), 3u);
  EXPECT_EQ(read[0].first, "test_bits_per_byte");
  EXPECT_NEAR(read[0].second, 1.0, 1e-12);
  EXPECT_EQ(read[1], (std::pair<std::string, double>{"bigram_bits_per_byte", 3.1}));
  EXPECT_EQ(read[2], (std::pair<std::string, double>{"gzip_bits_per_byte", 2.9}));
  e.loss = 0.01;
  char db[32];
  std::snprintf(db, sizeof db, "%.2f", psnr_db(e.loss));
  EXPECT_EQ(psnr.format(e, data, false), "test PSNR " + std::string(db) + " dB (noisy input 18.20 dB)");
  EXPECT_EQ(psnr.format(e, data, true), "test PSNR      " + std::string(db) + " dB (noisy input 18.20 dB)");
  ASSERT_EQ(psnr.figures(e, data, false).size(), 1u);
  const auto figures = psnr.figures(e, data, /*references=*/true);
  ASSERT_EQ(figures.size(), 2u);
  EXPECT_EQ(figures[0].first, "test_psnr_db");
  EXPECT_DOUBLE_EQ(figures[0].second, psnr_db(e.loss));
  EXPECT_EQ(figures[1].first, "noisy_test_psnr_db");
  // Named by the data's test_name: a task scored on its training data says so.
  data.test_name = "training";
  EXPECT_EQ(accuracy.format(e, data, false), "training accuracy 85.00%");
  EXPECT_EQ(psnr.figures(e, data, true)[1].first, "noisy_training_psnr_db");
  // The names Python's task "metric" gives; only the accuracy counts classes.
  EXPECT_EQ(accuracy.name, "accuracy");
  EXPECT_EQ(psnr.name, "psnr_db");
  EXPECT_EQ(bits.name, "bits_per_byte");
  EXPECT_EQ(loss.name, "loss");
  EXPECT_TRUE(accuracy.classification);
  EXPECT_FALSE(psnr.classification || bits.classification || loss.classification);
  EXPECT_TRUE(find_task("resnet").scoring.classification);
}

// A task of one's own data is scored by its loss: classes by accuracy, real-valued targets by the loss
// itself; a data file is neither text to sample nor images to denoise.
TEST(TasksTest, ADataFileOfOnesOwnIsScoredByItsLoss) {
  const Task classes = with_data_file(find_task("gpt"), "unread.pt", "cross_entropy");
  EXPECT_EQ(classes.scoring.name, "accuracy");
  EXPECT_TRUE(classes.trainer_options().classification());
  EXPECT_EQ(classes.context, 0);
  const Task values = with_data_file(find_task("unet"), "unread.pt", "mse");
  EXPECT_EQ(values.scoring.name, "loss");
  EXPECT_FALSE(values.trainer_options().classification());
  EXPECT_FALSE(values.denoises);
  EXPECT_TRUE(find_task("unet").denoises);
  EXPECT_EQ(find_task("gpt").context, 128);
}

TEST(TasksTest, TrainerOptionsCarryTheDefaults) {
  const Task& gpt = find_task("gpt");
  const TrainerOptions options = gpt.trainer_options();
  EXPECT_EQ(options.batch_size(), 16);
  EXPECT_EQ(options.epochs(), 4);
  EXPECT_DOUBLE_EQ(options.optimizer().lr(), 2e-3);
  EXPECT_EQ(options.lr_schedule().kind(), LrSchedule::kCosine);
  EXPECT_FALSE(options.classification());
  EXPECT_TRUE(find_task("cnn").trainer_options().classification());
}

// A training run as a front end asks for it: the task's defaults fill what was not given, and the
// settings that do not fit the task are refused in the library's words, before any file is read.
TEST(TasksTest, TrainSettingsTakeTheTasksDefaultsAndRefuseWhatDoesNotFit) {
  TrainSettings gpt;
  gpt.model = "gpt";
  gpt.lr = 0.5;
  gpt.given.insert("lr");
  const Task known = known_task(gpt);
  resolve_training(gpt, known);
  EXPECT_EQ(gpt.epochs, 4);
  EXPECT_EQ(gpt.batch_size, 16);
  EXPECT_DOUBLE_EQ(gpt.lr, 0.5);  // given: kept
  EXPECT_EQ(gpt.lr_schedule, "cosine");
  EXPECT_EQ(gpt.augment, "none");
  EXPECT_EQ(trainer_options_of(gpt, known).batch_size(), 16);
  TrainSettings cnn;
  cnn.generate = 10;
  testing::expect_invalid([&] { resolve_training(cnn, known_task(cnn)); },
                          "`bytes` samples bytes from a language model: it is for `model` gpt (the default model is "
                          "not one)");
  TrainSettings flip = gpt;
  flip.augment = "flip";
  testing::expect_invalid([&] { resolve_training(flip, known); }, "`augment` flip mirrors Fashion-MNIST's training "
                          "images for a classifier; it is not for `model` gpt, which reads text: use `augment` none");
  TrainSettings many;
  many.micro_batches = 64;
  many.batch_size = 32;
  many.given.insert("batch_size");
  testing::expect_invalid([&] { resolve_training(many, known_task(many)); },
                          "`micro_batches` 64 is larger than `batch_size` 32; every micro-batch needs a sample");
}

// A task's step through two stages is one device's step, parameter by parameter (the CNN's Dropout
// draws its masks per stage, so it is left out; the ResNet's BatchNorm normalizes per micro-batch, so
// it runs one).
TEST(TasksTest, AStepOfEveryTrainingTaskThroughTwoStagesEqualsOneDevice) {
  for (const std::string& name : {"resnet", "unet", "gpt", "transformer", "imbalanced"}) {
    SCOPED_TRACE(name);
    const Task& task = find_task(name);
    const TaskOptions options = TaskOptions().seed(1);
    const Model model = task.model(options);
    const Dataset batch = task.batch(options).first(8);
    torch::nn::Sequential reference = model.build(LayerRange{});
    task.loss(reference->forward(batch.input), batch.target).backward();
    PipelineOptions pipeline =
        PipelineOptions().devices(2).micro_batches(name == "resnet" ? 1 : 4).tied_parameters(model.tied);
    if (task.cut) pipeline.cut(task.cut(2, ScheduleKind::kGPipe, 1));
    auto pipe = make_pipeline(model.build, model.layers, pipeline);
    pipe->train_step(batch.input, batch.target, task.loss);
    const auto expected = reference->named_parameters(), got = pipe->layers()->named_parameters();
    ASSERT_EQ(expected.size(), got.size());
    for (size_t n = 0; n < expected.size(); ++n)
      EXPECT_TRUE(torch::allclose(expected[n].value().grad(), got[n].value().grad(), 1e-4, 1e-6))
          << expected[n].key();
  }
}

TEST(TasksTest, TheFortunesTaskReadsAFolderAndScoresAgainstItsReferences) {
  const std::filesystem::path dir = std::filesystem::temp_directory_path() / "gpipe_tasks_test_fortunes";
  std::filesystem::create_directories(dir);
  std::string text;
  for (int n = 0; n < 400; ++n) text += "Fortune number " + std::to_string(n) + " says: be kind.\n%\n";
  std::ofstream(dir / "kind") << text;
  const TaskData data = find_task("gpt").data(TaskOptions().data_dir(dir.string()).test_samples(2));
  EXPECT_EQ(data.test.size(), 2);
  EXPECT_EQ(data.train.input.size(1), 128);
  EXPECT_GT(data.bigram_bits_per_byte, 0);
  EXPECT_GT(data.gzip_bits_per_byte, 0);
  EXPECT_NE(data.source.find(dir.string()), std::string::npos);
  // Enough text for the reader, too little for a window of the model's context in the test part.
  std::ofstream(dir / "kind", std::ios::trunc) << text.substr(0, 1200);
  try {
    find_task("gpt").data(TaskOptions().data_dir(dir.string()));
    FAIL() << "a test part shorter than a window was taken";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("too little text"), std::string::npos) << e.what();
  }
  std::filesystem::remove_all(dir);
}

// Generation: one seed, one text; another temperature or seed, another; a temperature whose inverse
// is not finite is refused before any work.
TEST(TasksTest, GeneratedTextFollowsTheSeedAndRefusesATinyTemperature) {
  const Task& gpt = find_task("gpt");
  const Model model = gpt.model(TaskOptions());
  auto pipe = make_pipeline(model.build, model.layers, PipelineOptions().devices(2).tied_parameters(model.tied));
  std::string seen;
  const GenerateOptions options = GenerateOptions().bytes(12).prompt("Q: ").seed(5);
  const std::string a = generate_text(*pipe, gpt.context, options, [&](char c) { seen += c; });
  EXPECT_EQ(a.size(), 3u + 12u);
  EXPECT_EQ(a.substr(0, 3), "Q: ");
  EXPECT_EQ(seen, a.substr(3));
  EXPECT_EQ(generate_text(*pipe, gpt.context, options), a);
  EXPECT_NE(generate_text(*pipe, gpt.context, GenerateOptions().bytes(12).prompt("Q: ").seed(6)), a);
  EXPECT_THROW(GenerateOptions().temperature(1e-320).check(), std::invalid_argument);
  EXPECT_THROW(GenerateOptions().bytes(kMostGeneratedBytes + 1).check(), std::invalid_argument);
  EXPECT_EQ(shown_text(std::string("a\\\x01\n", 4)), "a\\\\\\x01\n");
}

TEST(TasksTest, TheDenoisingPictureHasThreeRowsOfFramedImages) {
  const Task& unet = find_task("unet");
  const Model model = unet.model(TaskOptions());
  auto pipe = make_pipeline(model.build, model.layers, PipelineOptions().devices(2));
  const Dataset test = unet.batch(TaskOptions());
  const torch::Tensor picture = denoising_picture(*pipe, test, 3);
  EXPECT_EQ(picture.scalar_type(), torch::kUInt8);
  EXPECT_EQ(picture.sizes(), (std::vector<int64_t>{3 * 58, 3 * 58}));
  EXPECT_EQ(picture.select(0, 0).min().item<int>(), 255);  // the white frame
}

TEST(TasksTest, AScriptTaskRefusesALossItCannotScore) {
  EXPECT_THROW(script_task("model.pt", "", "hinge"), std::invalid_argument);
  EXPECT_THROW(script_task("model.pt", "", "mse"), std::invalid_argument);  // Fashion-MNIST has classes
}

}  // namespace
}  // namespace gpipe

namespace gpipe {
namespace {

// A request by cost takes one cost per layer of the model; one that is even or given is left as it is.
TEST(TasksTest, ARequestByCostTakesTheLayersCosts) {
  const Task& task = find_task("tiny");
  const torch::nn::Sequential model = task.model(TaskOptions()).build(LayerRange{});
  PipelineRequest request;
  request.devices = 2;
  request.balance_by = "params";
  const PipelineRequest filled = with_layer_costs(request, model, CostModel{}, 4);
  EXPECT_EQ(filled.layer_costs, parameter_costs(model));
  EXPECT_EQ(pipeline_options_of(task.own(), filled).cut().kind, CutKind::kByCost);
  request.balance_by = "even";
  EXPECT_TRUE(with_layer_costs(request, model, CostModel{}, 4).layer_costs.empty());
  request.balance_by = "params";
  request.balance = {1, task.layers - 1};
  EXPECT_TRUE(with_layer_costs(request, model, CostModel{}, 4).layer_costs.empty());
}

// gpipe bench's sweep is checked before any work, each refusal naming its options.
TEST(BenchTest, TheSweepIsCheckedNamingItsOptions) {
  BenchSweep sweep;
  sweep.workloads = {"tiny"};
  sweep.micro_batches = {4};
  EXPECT_NO_THROW(check_bench(sweep));
  BenchSweep given = sweep;
  given.balance = {15, 1};
  given.balance_by = {"time", "params"};
  given.balance_by_given = true;
  testing::expect_invalid([&] { check_bench(given); }, "`balance` {15, 1} is the cut, and `balance_by` time params");
  BenchSweep many = sweep;
  many.micro_batches = {100000};
  testing::expect_invalid([&] { check_bench(many); }, "`micro_batches` 100000 is more than workload tiny's batch");
  BenchSweep v = sweep;
  v.virtual_stages = 3;
  testing::expect_invalid([&] { check_bench(v); }, "add interleaved to `schedule`");
  BenchSweep tied = sweep;
  tied.tie_embeddings = true;
  testing::expect_invalid([&] { check_bench(tied); }, "`tie_embeddings` is for the transformer workload");
}

// A sweep gives a row per K x schedule x cut, each against one device and the first schedule.
TEST(BenchTest, ARowPerConfigurationAgainstItsBaselines) {
  BenchSweep sweep;
  sweep.workloads = {"tiny"};
  sweep.stages = {1, 2};
  sweep.micro_batches = {4};
  sweep.schedules = {"gpipe", "1f1b"};
  sweep.balance_by = {"even", "params"};
  sweep.steps = 2;
  sweep.warmup = 0;
  std::vector<BenchRow> rows;
  run_benchmark(sweep, [&](const BenchRow& row) { rows.push_back(row); });
  ASSERT_EQ(rows.size(), 8u);
  for (const BenchRow& r : rows) {
    const std::string schedule = to_string(r.config.schedule);
    const std::vector<int>& balance = r.config.balance;
    SCOPED_TRACE(schedule + " K=" + std::to_string(r.config.devices) + " " + r.balance_by);
    EXPECT_EQ(r.transport, "threads");
    EXPECT_TRUE(r.has_baselines);
    EXPECT_GT(r.samples_per_s, 0);
    EXPECT_GT(r.speedup.median, 0);
    EXPECT_LE(r.samples_per_s_min, r.samples_per_s_max);
    EXPECT_EQ(std::accumulate(balance.begin(), balance.end(), 0), find_task("tiny").layers);
    EXPECT_EQ(static_cast<int>(balance.size()), r.config.devices);
    EXPECT_EQ(r.vs_schedule, schedule == "1f1b" ? "gpipe" : "");
    EXPECT_EQ(r.peak_bytes.size(), static_cast<size_t>(r.config.devices));
  }
  EXPECT_DOUBLE_EQ(rows.front().ideal, 1.0);  // K = 1
}

// The model of a file, as the planner takes it: refused before any work, naming the option.
TEST(TasksTest, APlannedModelFileNamesItsOptions) {
  testing::expect_invalid([] { plan_model_of(std::string("model.pt"), std::vector<int64_t>{}); },
                          "`model` needs `input_shape`");
  testing::expect_invalid([] { plan_model_of(::testing::TempDir() + "gpipe_no_such_model.pt", {6}); }, "gpipe: `model`: ");
}

// A run's data is checked against its micro-batches and a batch given, naming the option and the fix.
TEST(TasksTest, ARunsDataHoldsAtLeastAMicroBatchAndABatch) {
  const Task& task = find_task("cnn");
  TaskData data;
  data.train = {torch::zeros({5, 1, 28, 28}), torch::zeros({5}, torch::kLong)};
  EXPECT_NO_THROW(check_run_data(task, data, 5, 5));
  EXPECT_NO_THROW(check_run_data(task, data, 4));  // the task's own batch: all of a small data set
  testing::expect_invalid([&] { check_run_data(task, data, 6); },
                          "`micro_batches` 6 is more than the 5 training samples; every micro-batch needs a sample");
  testing::expect_invalid([&] { check_run_data(task, data, 2, 6); },
                          "`batch_size` 6 is more than the 5 training samples the data holds; a batch takes each at "
                          "most once: give `batch_size` 5 or less");
  testing::expect_invalid([&] { check_run_data(find_task("gpt"), TaskData(), 1); }, "the training data has no samples");
}

// A test loss that is not finite ends a run: after an epoch, the learning rate and the fix; at
// epoch 0, the snapshot that holds a diverged model.
TEST(TasksTest, ANonFiniteLossIsAnErrorThatNamesTheFix) {
  const Task& task = find_task("tiny");
  const std::string path = ::testing::TempDir() + "gpipe_tasks_test_diverged.pt";
  Trainer trainer(task.model(TaskOptions()), PipelineOptions().devices(1),
                  task.trainer_options().optimizer(OptimizerOptions().lr(0.25)).save(path), task.batch(TaskOptions()));
  TaskData data;
  Evaluation evaluation;
  evaluation.loss = 1.5;
  EXPECT_EQ(divergence_error(trainer, evaluation, data, 1, ""), "");
  evaluation.loss = std::nan("");
  const std::string after = divergence_error(trainer, evaluation, data, 2, "");
  EXPECT_NE(after.find("gpipe: the test loss is NaN after epoch 2"), std::string::npos) << after;
  EXPECT_NE(after.find("(`lr` 0.25) is too high; lower `lr`, or add `clip_grad_norm`; this epoch is not saved: "
                       "nothing was saved"), std::string::npos) << after;
  evaluation.loss = INFINITY;
  EXPECT_EQ(divergence_error(trainer, evaluation, data, 0, "run.pt"),
            "gpipe: the test loss is infinite for the model of run.pt: the checkpoint holds a diverged model; "
            "resume from another");
}

// A picture is a PNG file, written whole; a tensor that is not one is refused, and nothing is written.
TEST(TasksTest, APictureIsWrittenAsAPngFile) {
  const std::string path = ::testing::TempDir() + "gpipe_tasks_test.png", refused = path + ".refused.png";
  std::remove(refused.c_str());
  const torch::Tensor image = torch::arange(15, torch::kUInt8).reshape({3, 5}) * 17;
  write_png(path, image);
  std::ifstream file(path, std::ios::binary);
  const std::string bytes((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
  ASSERT_GT(bytes.size(), 8u);
  EXPECT_EQ(bytes.substr(0, 8), std::string("\x89PNG\r\n\x1a\n", 8));
  // Read back as a decoder would: each chunk's CRC, the header's size and kind, the rows of IDAT.
  auto u32 = [&](size_t at) {
    return (uint32_t{static_cast<uint8_t>(bytes[at])} << 24) | (uint32_t{static_cast<uint8_t>(bytes[at + 1])} << 16) |
           (uint32_t{static_cast<uint8_t>(bytes[at + 2])} << 8) | uint32_t{static_cast<uint8_t>(bytes[at + 3])};
  };
  std::vector<std::string> types;
  std::string header, packed;
  for (size_t at = 8; at + 12 <= bytes.size();) {
    const uint32_t length = u32(at);
    const std::string type = bytes.substr(at + 4, 4), data = bytes.substr(at + 8, length);
    const std::string body = type + data;
    EXPECT_EQ(u32(at + 8 + length), ::crc32(0, reinterpret_cast<const Bytef*>(body.data()), static_cast<uInt>(body.size())))
        << type;
    types.push_back(type);
    if (type == "IHDR") header = data;
    if (type == "IDAT") packed += data;
    at += 12 + length;
  }
  EXPECT_EQ(types, (std::vector<std::string>{"IHDR", "IDAT", "IEND"}));
  ASSERT_EQ(header.size(), 13u);
  EXPECT_EQ(header.substr(0, 8), std::string("\0\0\0\x05\0\0\0\x03", 8));  // width 5, height 3
  EXPECT_EQ(header[8], 8);  // 8 bits a pixel
  EXPECT_EQ(header[9], 0);  // grayscale
  std::string rows(3 * 6, '\x7f');
  uLongf size = static_cast<uLongf>(rows.size());
  ASSERT_EQ(::uncompress(reinterpret_cast<Bytef*>(rows.data()), &size, reinterpret_cast<const Bytef*>(packed.data()),
                         static_cast<uLong>(packed.size())),
            Z_OK);
  ASSERT_EQ(size, 18u);
  for (int y = 0; y < 3; ++y) {
    EXPECT_EQ(rows[static_cast<size_t>(y) * 6], 0) << "row " << y << "'s filter";
    for (int x = 0; x < 5; ++x)
      EXPECT_EQ(static_cast<uint8_t>(rows[static_cast<size_t>(y) * 6 + 1 + x]), image[y][x].item<uint8_t>());
  }
  testing::expect_invalid([&] { write_png(refused, torch::zeros({3, 5})); }, "uint8");
  EXPECT_FALSE(std::filesystem::exists(refused));
}

// What every rank of a job must share is compared from the option values (agreement.cc): every
// field of TrainerOptions has a setting, and a changed field changes its setting.
TEST(AgreementTest, EveryTrainerOptionIsASetting) {
#if defined(__x86_64__) && defined(__GLIBCXX__)
  // A new field of TrainerOptions changes its size: give it a setting in settings_of (agreement.cc),
  // and a line below, then the size here.
  EXPECT_EQ(sizeof(TrainerOptions), kTrainerOptionsSize);
#endif
  const auto base = settings_of(TrainerOptions());
  const std::vector<TrainerOptions> changed = {
      TrainerOptions().optimizer(OptimizerOptions().kind(OptimizerKind::kSgd)),
      TrainerOptions().optimizer(OptimizerOptions().lr(0.5)),
      TrainerOptions().optimizer(OptimizerOptions().kind(OptimizerKind::kSgd).momentum(0.9)),
      TrainerOptions().optimizer(OptimizerOptions().kind(OptimizerKind::kSgd).momentum(0.9).nesterov(true)),
      TrainerOptions().optimizer(OptimizerOptions().weight_decay(0.1)),
      TrainerOptions().optimizer(OptimizerOptions().betas(std::make_tuple(0.8, 0.9))),
      TrainerOptions().lr_schedule(LrScheduleOptions().kind(LrSchedule::kCosine)),
      TrainerOptions().lr_schedule(LrScheduleOptions().warmup_steps(3)),
      TrainerOptions().lr_schedule(LrScheduleOptions().step_size(3)),
      TrainerOptions().lr_schedule(LrScheduleOptions().gamma(0.5)),
      TrainerOptions().clip_grad_norm(1),
      TrainerOptions().batch_size(7),
      TrainerOptions().drop_last(true),
      TrainerOptions().shuffle(false),
      TrainerOptions().seed(9),
      TrainerOptions().epochs(3),
      TrainerOptions().steps(3),
      TrainerOptions().classification(false),
      TrainerOptions().augment([](const torch::Tensor& x, const torch::Tensor&, int) { return x; }),
      TrainerOptions().save("elsewhere.pt"),
      TrainerOptions().save_every(5),
      TrainerOptions().stop_timeout(1),
      TrainerOptions().per_device_files(true),
      TrainerOptions().update_on_devices(false),
      TrainerOptions().loss_scale(LossScaleOptions().enabled(false))};
  for (size_t n = 0; n < changed.size(); ++n) EXPECT_NE(settings_of(changed[n]), base) << "option " << n;
}

// In one process there is no other rank: the settings agree with themselves.
TEST(AgreementTest, OneProcessAgrees) {
  Pipeline pipe(testing::small_mlp(0), PipelineOptions().devices(2));
  EXPECT_NO_THROW(check_same_on_every_rank(pipe, settings_of(TrainerOptions())));
}

}  // namespace
}  // namespace gpipe
