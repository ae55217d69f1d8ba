// bench.cc: gpipe bench's sweep: its checks, its contenders, their steps in turn, and each one's row.
#include "gpipe/tasks.h"

#include "tasks/builtin.h"

#include "gpipe/check.h"
#include "gpipe/choose.h"
#include "gpipe/cost_model.h"
#include "gpipe/device.h"
#include "gpipe/job.h"
#include "gpipe/microbatch.h"
#include "gpipe/partition.h"
#include "gpipe/stage.h"
#include "gpipe/trace.h"
#include "runtime/autocast.h"  // the unsplit contender's forward in the sweep's precision, as a stage's

#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <memory>

namespace gpipe {

using tasks::said_about;
namespace {

// Every contender's optimizer: plain SGD (no momentum), a small step.
const OptimizerOptions kBenchOptimizer = OptimizerOptions().kind(OptimizerKind::kSgd).lr(1e-4);

TaskOptions task_options(const BenchSweep& o) { return TaskOptions().tie_embeddings(o.tie_embeddings); }

double median(std::vector<double> values) {
  if (values.empty()) return 0;
  std::sort(values.begin(), values.end());
  const size_t n = values.size();
  return n % 2 ? values[n / 2] : 0.5 * (values[n / 2 - 1] + values[n / 2]);
}

// The per-step ratios a[s] / b[s].
BenchRatio ratio(const std::vector<double>& a, const std::vector<double>& b) {
  std::vector<double> r;
  for (size_t s = 0; s < std::min(a.size(), b.size()); ++s) r.push_back(a[s] / b[s]);
  if (r.empty()) return {};
  return {median(r), *std::min_element(r.begin(), r.end()), *std::max_element(r.begin(), r.end())};
}

// The V of `schedule`: `virtual_stages` for the schedules that take it, the others their own.
int virtual_stages(const std::string& schedule, const BenchSweep& o) {
  if (schedule == "auto") return o.virtual_stages;  // chosen with the schedule, once profiled (build)
  const bool takes = o.virtual_stages > 0 && takes_virtual_stages(parse_schedule(schedule), o.virtual_stages);
  PipelineRequest r;
  r.schedule = schedule;
  if (takes) r.virtual_stages = o.virtual_stages;
  return resolve_run(OwnPipeline(), r).virtual_stages.value_or(0);
}

// One configuration's request: an explicit cut (for K above 1), a workload's blocks evenly ("even",
// docs/benchmarks.md; never a task's tuned cut), or by cost.
PipelineRequest request_of(int K, int M, const std::string& schedule, const std::string& balance_by,
                           const BenchSweep& o) {
  PipelineRequest r;
  r.devices = K;
  r.micro_batches = M;
  r.schedule = schedule;
  if (const int V = virtual_stages(schedule, o); V > 0) r.virtual_stages = V;
  if (!o.balance.empty() && K > 1) r.balance = o.balance;
  // Auto with a cut of several stages per device and no V given: the V the cut holds (as gpipe train's).
  const size_t stages = r.balance.size();
  if (schedule == "auto" && !r.virtual_stages && stages > 0 && stages % static_cast<size_t>(K) == 0)
    r.virtual_stages = static_cast<int>(r.balance.size()) / K;
  r.balance_by = balance_by == "given" ? "" : balance_by;
  r.precision = parse_precision(o.precision);
  return r;
}


// The cost model of `task` at M micro-batches: its layers profiled on one micro-batch of its batch, on
// one device's threads, as the devices run them. Three warm-up passes: a first profile runs on fresh pages.
CostModel profile_task(const Task& task, int M, const BenchSweep& o) {
  const Dataset batch = task.batch(task_options(o));
  const int64_t rows = micro_batch_sizes(batch.size(), M).front();
  return with_pipeline_overhead(
      profile_layers(task.model(task_options(o)).build(LayerRange{}), batch.input.narrow(0, 0, rows),
                     ProfileLayersOptions()
                         .threads(o.threads)
                         .state_per_parameter_byte(state_per_parameter_byte(kBenchOptimizer))
                         .warmup(3)
                         .repetitions(5)
                         .loss(task.loss)
                         .target(batch.target.narrow(0, 0, rows))
                         .precision(parse_precision(o.precision))),
      o.threads);
}

// One configuration: the whole batch on one device (unsplit), or a pipeline, and what its timed steps measured.
struct Contender {
  int devices = 1;
  std::string schedule = "gpipe";
  std::string chosen;  // "auto": the schedule chosen by prediction
  int virtual_stages = 1;
  std::string balance_by = "even";
  bool unsplit = false;  // the whole batch in one piece on the calling thread
  Precision precision = Precision::kFloat32;  // unsplit: of its forward and loss (a pipeline's: its options)
  Dataset batch;
  torch::nn::Sequential whole;  // unsplit: the whole model
  std::unique_ptr<Pipeline> pipe;
  std::unique_ptr<torch::optim::Optimizer> sgd;
  Prediction predicted;
  std::vector<double> step_s, bubbles, overhead_s, simulated_s, sent_bytes;
  std::vector<int64_t> peak_bytes, held_bytes, parameter_bytes;  // per device held here, largest over the steps
};

// The contenders of one comparison: the whole batch unsplit and one device running the M micro-batches
// (the baseline of the ideal K·M/(M+K-1)), in one process; then every K x schedule x cut asked for.
std::vector<Contender> contenders(const BenchSweep& o) {
  std::vector<Contender> out(job().distributed ? 0 : 2);
  if (!out.empty()) {
    out[0].unsplit = true;
    out[0].precision = parse_precision(o.precision);
  }
  for (int K : o.stages)
    for (const std::string& schedule : o.schedules)
      // A cut given with `balance` (for K above 1) is labelled as such: no method chose it.
      for (const std::string& balance_by :
           !o.balance.empty() && K > 1 ? std::vector<std::string>{"given"} : o.balance_by) {
        Contender c;
        c.devices = K;
        c.schedule = schedule;
        c.virtual_stages = virtual_stages(schedule, o);
        c.balance_by = balance_by;
        out.push_back(std::move(c));
      }
  return out;
}

void build(Contender& c, const Task& task, int M, Checkpoint mode, const BenchSweep& o, const CostModel& costs) {
  const Model model = task.model(task_options(o));
  c.batch = task.batch(task_options(o));
  if (c.unsplit) {
    c.whole = model.build(LayerRange{});
    c.sgd = make_optimizer(kBenchOptimizer, unique_parameters(*c.whole));
    return;
  }
  PipelineRequest request = request_of(c.devices, M, c.schedule, c.balance_by, o);
  if (request.balance.empty() && request.balance_by != "even")  // by cost: the profiled costs of one micro-batch
    request = with_layer_costs(request, model.build(LayerRange{}), costs, micro_batch_sizes(c.batch.size(), M).front());
  const int64_t share = micro_batch_sizes(c.batch.size(), replicas_of(c.devices)).front();  // replica 0's rows
  // The order of a V schedule: by the profiled times, where at hand (PipelineRequest::stage_times).
  if (request.balance_by == "time" && c.schedule != "auto") {  // the min-max cut improved by the simulation
    const PipelinePlan refined =
        refined_plan(costs, pipeline_options_of(task.own(), request).checkpoint(mode), micro_batch_sizes(share, M));
    request.balance = refined.balance;
    request.stage_times = refined.stage_times;
  }
  if (c.schedule == "auto") {  // the schedule and V predicted fastest at this K, M and cut (on the rank that profiled)
    request.checkpoint = mode;
    const ScheduleChoice choice =
        *chosen_on_first_rank([&] { return choose_schedule(costs, request, share); }, "`schedule` auto");
    request = with_choice(request, choice);
    c.chosen = to_string(choice.config.schedule);
    c.virtual_stages = choice.config.virtual_stages;
  }
  PipelineOptions options = pipeline_options_of(task.own(), request)
                                .checkpoint(mode)
                                .threads_per_device(o.threads)
                                .tied_parameters(model.tied)
                                .track_memory(!job().distributed);
  // In one process only: the ranks of a job would each need the same times (only one profiles).
  if (job().distributed) options.stage_times({});
  else if (options.stage_times().empty() && !costs.layers.empty() &&
           schedule_traits(options.schedule()).orders_by_times)  // any other cut: even, given, params, memory
    options.stage_times(stage_action_times(costs, make_plan(task.layers, options).balance,
                                           micro_batch_sizes(share, M).front(), mode));
  c.pipe = make_pipeline(model.build, task.layers, options);
  c.sgd = make_optimizer(kBenchOptimizer, c.pipe->parameters());
  // Replica 0's pipeline on its share of the rows (the replicas' gradient sum is not modelled).
  if (job().prints()) c.predicted = predict(costs, c.pipe->plan(), micro_batch_sizes(share, M));
}

template <typename T>
void keep_largest(std::vector<T>& kept, size_t j, T value) {
  if (kept.size() <= j) kept.resize(j + 1, 0);
  kept[j] = std::max(kept[j], value);
}

// One training step (SGD step included) of `c`, on every rank; recorded when `timed`.
void step(Contender& c, const Task& task, bool timed) {
  const int64_t sent_before = c.pipe ? c.pipe->bytes_sent() : 0;
  const int64_t begin = now_ns();
  if (c.unsplit) {
    clear_grads(unique_parameters(*c.whole));
    torch::Tensor loss;
    {
      const AutocastScope autocast(c.precision, c10::DeviceType::CPU);
      loss = task.loss(c.whole->forward(c.batch.input), c.batch.target);
    }
    loss.backward();
  } else {
    clear_grads(c.pipe->parameters());
    c.pipe->train_step(c.batch.input, c.batch.target, task.loss);  // ends with a collective under MPI
  }
  c.sgd->step();
  const double seconds = static_cast<double>(now_ns() - begin) * 1e-9;
  if (!timed) return;
  c.step_s.push_back(seconds);
  if (c.unsplit) return;
  c.bubbles.push_back(c.pipe->bubble());
  c.sent_bytes.push_back(c.pipe->sum(static_cast<double>(c.pipe->bytes_sent() - sent_before)));
  const StepTrace trace = c.pipe->trace();  // every device's, on the rank that prints
  if (job().prints()) {
    const double overhead = overhead_seconds(trace, c.pipe->schedule());
    c.overhead_s.push_back(overhead);
    c.simulated_s.push_back(trace.seconds() - overhead);
  }
  const auto memory = c.pipe->memory();
  for (size_t j = 0; j < memory.size(); ++j) {
    keep_largest(c.peak_bytes, j, memory[j].peak_bytes);
    keep_largest(c.held_bytes, j, memory[j].held_peak_bytes);
    keep_largest(c.parameter_bytes, j, memory[j].parameter_bytes);
  }
}

// The row of `c` against the baselines (none under MPI) and the first schedule asked for at the same K
// and cut (`first`, or null). Every rank calls it (the skip bytes are summed over the ranks).
BenchRow row_of(const Contender& c, const Contender* unsplit, const Contender* one, const Contender* first,
                const std::string& name, const BenchSweep& o) {
  const double batch = static_cast<double>(c.batch.size());
  BenchRow r;
  r.workload = name;
  r.tie_embeddings = o.tie_embeddings;
  r.transport = job().distributed ? "mpi" : "threads";
  r.config = c.pipe->plan().config();
  r.chosen = !c.chosen.empty();
  r.replicas = replicas_of(c.devices);
  r.threads_per_device = o.threads;
  r.balance_by = c.balance_by;
  r.order = order_name(c.pipe->plan().stage_times);
  r.samples_per_s = batch / median(c.step_s);
  r.samples_per_s_min = batch / *std::max_element(c.step_s.begin(), c.step_s.end());
  r.samples_per_s_max = batch / *std::min_element(c.step_s.begin(), c.step_s.end());
  r.ideal = ideal_speedup(c.pipe->schedule());
  r.bubble = median(c.bubbles);
  r.overhead_us_per_step = median(c.overhead_s) * 1e6;
  r.step_s = median(c.step_s);
  r.predicted = c.predicted;
  r.peak_bytes = c.peak_bytes;
  r.peak_held_bytes = c.held_bytes;
  r.parameter_bytes = c.parameter_bytes;
  for (size_t j = 0; j < r.predicted.peak_bytes.size() && j < r.peak_bytes.size(); ++j) {
    const double x = static_cast<double>(r.predicted.peak_bytes[j]) / static_cast<double>(std::max<int64_t>(r.peak_bytes[j], 1));
    if (std::abs(std::log(x)) > std::abs(std::log(r.predicted_over_measured_peak))) r.predicted_over_measured_peak = x;
  }
  r.bytes_sent_per_step = median(c.sent_bytes);
  r.skip_bytes_per_step = c.pipe->sum(c.pipe->replica() == 0 ? static_cast<double>(c.pipe->skip_bytes()) : 0.0);
  r.program_actions_per_device = static_cast<int64_t>(c.pipe->schedule().actions.front().size());
  r.steps = o.steps;
  r.warmup = o.warmup;
  std::vector<double> measured_s;
  for (size_t s = 0; s < c.simulated_s.size(); ++s) measured_s.push_back(c.simulated_s[s] + c.overhead_s[s]);
  r.simulated_over_measured = ratio(c.simulated_s, measured_s).median;
  if (one != nullptr) {
    r.has_baselines = true;
    r.speedup = ratio(one->step_s, c.step_s);
    r.speedup_vs_unsplit = ratio(unsplit->step_s, c.step_s);
    r.one_device_samples_per_s = batch / median(one->step_s);
    r.unsplit_samples_per_s = batch / median(unsplit->step_s);
    r.efficiency = r.speedup.median / r.ideal;
  }
  if (first != nullptr) {
    r.vs_schedule = first->schedule;
    r.speedup_vs_schedule = ratio(first->step_s, c.step_s);
    r.bubble_vs_schedule = median(c.bubbles) / median(first->bubbles);
    for (size_t j = 0; j < c.peak_bytes.size() && j < first->peak_bytes.size(); ++j) {
      r.peak_bytes_vs_schedule.push_back(static_cast<double>(c.peak_bytes[j]) / static_cast<double>(first->peak_bytes[j]));
      r.peak_held_bytes_vs_schedule.push_back(static_cast<double>(c.held_bytes[j]) /
                                              static_cast<double>(first->held_bytes[j]));
    }
  }
  return r;
}

}  // namespace

void check_bench(const BenchSweep& o) {
  check_listed_once(o.workloads, "workload");
  check_listed_once(o.stages, "devices");
  check_listed_once(o.micro_batches, "micro_batches");
  check_listed_once(o.checkpoints, "checkpoint");
  check_listed_once(o.schedules, "schedule");
  check_listed_once(o.balance_by, "balance_by");
  check_threads_per_device(o.threads);
  // The devices are CPU threads.
  check_precision_runs(parse_precision(o.precision), c10::DeviceType::CPU);
  GPIPE_CHECK(!job().distributed || o.balance_by == std::vector<std::string>{"even"},
              "`balance_by` profiles the whole model in one process; under ", job().launcher, " pass a cut with `balance`");
  if (!o.balance.empty() && o.balance_by_given) {
    std::string methods;
    for (const std::string& m : o.balance_by) methods += (methods.empty() ? "" : " ") + m;
    GPIPE_CHECK(false, "`balance` ", format_balance(o.balance), " is the cut, and `balance_by` ", methods,
                " would choose it too (its rows would be one cut under ",
                o.balance_by.size() > 1 ? "several names" : "another name", "); give one of them");
  }
  // `virtual_stages` is for the schedules of several stages per device: each of them in the sweep takes
  // it (zbv and v-half only their 2), and one of them is swept.
  if (o.virtual_stages > 0) {
    const std::string context = "`virtual_stages` " + std::to_string(o.virtual_stages);
    bool taken = false;
    for (const std::string& schedule : o.schedules) {
      if (schedule == "auto") {  // the schedules that take V
        taken = true;
        continue;
      }
      const ScheduleKind kind = parse_schedule(schedule);
      if (default_virtual_stages(kind) > 1) said_about(context, [&] { check_virtual_stages(kind, o.virtual_stages); });
      taken = taken || default_virtual_stages(kind) > 1;
    }
    GPIPE_CHECK(taken, context, ": V is the stages per device of the interleaved schedule, which this `schedule` "
                "does not sweep; add interleaved to `schedule`, or leave out `virtual_stages`");
  }
  for (const auto& name : o.workloads) {
    const Task& task = find_task(name);
    GPIPE_CHECK(!o.tie_embeddings || name == "transformer", "workload ", name, " has no embedding to tie; "
                "`tie_embeddings` is for the transformer workload");
    const int64_t rows = task.batch(task_options(o)).size();
    for (int M : o.micro_batches)
      GPIPE_CHECK(M <= rows, "`micro_batches` ", M, " is more than workload ", name, "'s batch of ", rows,
                  " rows; every micro-batch needs a row");
    for (int K : o.stages)
      for (const std::string& schedule : o.schedules) {
        const int V = virtual_stages(schedule, o);
        said_about("`devices` " + std::to_string(K), [&] { replicas_of(K); });  // whole pipelines of ranks
        const bool given = !o.balance.empty() && K > 1;
        GPIPE_CHECK(given || !task.workload || schedule == "auto" || cut_of(task.own(), request_of(K, 1, schedule, "even", o)).kind == CutKind::kBlocks,
                    "workload ", name, " has too few blocks for `devices` ", K,
                    V > 1 ? " x `virtual_stages` " + std::to_string(V) : std::string(), "; use fewer stages");
        for (int M : o.micro_batches)
          said_about("`devices` " + std::to_string(K) + " `micro_batches` " + std::to_string(M) + " `schedule` " + schedule +
                    (given ? " `balance`" : ""),
                [&] { make_plan(task.layers, pipeline_options_of(task.own(), request_of(K, M, schedule, "even", o))); });
      }
  }
}

void run_benchmark(const BenchSweep& o, const std::function<void(const BenchRow&)>& on_row) {
  check_bench(o);
  keep_freed_memory();  // before the first step, so every contender runs with the same allocator settings
  for (const auto& name : o.workloads) {
    const Task& task = find_task(name);
    for (int M : o.micro_batches) {
      // The cost model, on the rank that prints (the whole workload is small enough to hold there).
      const CostModel costs = job().prints() || !job().distributed ? profile_task(task, M, o) : CostModel{};
      for (const std::string& mode : o.checkpoints) {
        std::vector<Contender> all = contenders(o);
        for (Contender& c : all) build(c, task, M, parse_checkpoint(mode), o, costs);
        // Round-robin: warm-up rounds, then timed rounds, one step of every contender per round.
        for (int s = 0; s < o.warmup + o.steps; ++s)
          for (Contender& c : all) step(c, task, s >= o.warmup);
        const size_t baselines = job().distributed ? 0 : 2;
        for (size_t n = baselines; n < all.size(); ++n) {
          const Contender& c = all[n];
          const Contender* first = nullptr;  // the first schedule asked for at the same K and cut
          for (size_t m = baselines; m < n; ++m)
            if (all[m].devices == c.devices && all[m].balance_by == c.balance_by &&
                all[m].schedule == o.schedules.front() && c.schedule != all[m].schedule)
              first = &all[m];
          const BenchRow row = row_of(c, baselines ? &all[0] : nullptr, baselines ? &all[1] : nullptr, first, name, o);
          if (job().prints()) on_row(row);
        }
      }
    }
  }
}

}  // namespace gpipe
