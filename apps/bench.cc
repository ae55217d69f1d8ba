// bench.cc: `gpipe bench`: the workloads of docs/benchmarks.md through the pipeline, against one
// device and against the ideal; in one process, or one rank per device under mpirun (the same sweep).
#include "bench.h"
#include "commands.h"
#include "common.h"

#include <gpipe/gpipe.h>
#include <torch/torch.h>

#include <CLI/CLI.hpp>

#include <cmath>
#include <iomanip>
#include <iostream>

namespace gpipe::cli {

namespace {


// --virtual-stages applies to the schedules that take that V (takes_virtual_stages); the others run their own.
int virtual_stages(const std::string& schedule, const BenchOptions& o) {
  const bool takes = o.virtual_stages > 0 && takes_virtual_stages(parse_schedule(schedule), o.virtual_stages);
  RunRequest r;
  r.schedule = schedule;
  r.virtual_stages = takes ? o.virtual_stages : 0;
  return resolve_run(Task(), r).virtual_stages;
}

// Every contender's optimizer: plain SGD (no momentum), a small step.
const OptimizerOptions kBenchOptimizer = OptimizerOptions().kind(OptimizerKind::kSgd).lr(1e-4);

TaskOptions task_options(const BenchOptions& o) { return TaskOptions().tie_embeddings(o.tie_embeddings); }

// The cost model of task `name` at M micro-batches: its layers profiled on one micro-batch of its
// batch, on one device's threads, as the devices will run them. Three warm-up passes: a first
// profile runs on fresh pages.
CostModel profile_task(const std::string& name, int M, const BenchOptions& o) {
  const Task& task = find_task(name);
  const Dataset batch = task.batch(task_options(o));
  const int64_t rows = micro_batch_sizes(batch.size(), M).front();
  return profile_layers(task.model(task_options(o)).build(LayerRange{}), batch.input.narrow(0, 0, rows), o.threads,
                        state_per_parameter_byte(kBenchOptimizer), /*warmup=*/3, /*repetitions=*/5, task.loss,
                        batch.target.narrow(0, 0, rows));
}

// One configuration's request: an explicit cut (for K above 1), a workload's blocks evenly (--balance-by
// even, docs/benchmarks.md; never a task's tuned cut), or by cost (`costs`, with a cost method).
RunRequest request_of(int K, int M, const std::string& schedule, const std::string& balance_by, const BenchOptions& o) {
  RunRequest r;
  r.devices = K;
  r.micro_batches = M;
  r.schedule = schedule;
  r.virtual_stages = virtual_stages(schedule, o);
  if (!o.balance.empty() && K > 1) r.balance = o.balance;
  r.balance_by = balance_by == "given" ? "" : balance_by;
  return r;
}

// Every configuration is checked before any work, by the plan each will run.
void check_sweep(const BenchOptions& o) {
  GPIPE_CHECK(!job().distributed || o.balance_by == std::vector<std::string>{"even"},
              "--balance-by profiles the whole model in one process; under mpirun pass a cut with --balance");
  if (!o.balance.empty() && o.balance_by_given) {
    std::string methods;
    for (const std::string& m : o.balance_by) methods += (methods.empty() ? "" : " ") + m;
    GPIPE_CHECK(false, "--balance ", format_balance(o.balance), " is the cut, and --balance-by ", methods,
                " would choose it too (its rows would be one cut under ", o.balance_by.size() > 1 ? "several names" : "another name",
                "); give one of them");
}
  // --virtual-stages is for the schedules of several stages per device: each of them in the sweep takes it
  // (zbv and v-half only their 2), and one of them is swept.
  if (o.virtual_stages > 0) {
    const std::string flag = "--virtual-stages " + std::to_string(o.virtual_stages);
    bool taken = false;
    for (const std::string& schedule : o.schedules) {
      const ScheduleKind kind = parse_schedule(schedule);
      if (default_virtual_stages(kind) > 1) or_usage_error(flag, [&] { check_virtual_stages(kind, o.virtual_stages); });
      taken = taken || default_virtual_stages(kind) > 1;
    }
    if (!taken)
      usage_error(flag + ": V is the stages per device of the interleaved schedule, which this --schedule does not "
                  "sweep; add interleaved to --schedule, or leave out --virtual-stages");
  }
  for (const auto& name : o.workloads) {
    const Task& task = find_task(name);
    GPIPE_CHECK(!o.tie_embeddings || name == "transformer", "workload ", name, " has no embedding to tie; "
                "--tie-embeddings is for the transformer workload");
    const int64_t rows = task.batch(task_options(o)).size();
    for (int M : o.micro_batches)
      GPIPE_CHECK(M <= rows, "--micro-batches ", M, " is more than workload ", name, "'s batch of ", rows,
                  " rows; every micro-batch needs a row");
    for (int K : o.stages)
      for (const std::string& schedule : o.schedules) {
        const int V = virtual_stages(schedule, o);
        or_usage_error("--stages " + std::to_string(K), [&] { return replicas_of(K); });  // whole pipelines of ranks
        const bool given = !o.balance.empty() && K > 1;
        GPIPE_CHECK(given || !task.workload || cut_of(task, request_of(K, 1, schedule, "even", o)).kind == CutKind::kBlocks,
                    "workload ", name, " has too few blocks for --stages ", K,
                    V > 1 ? " x --virtual-stages " + std::to_string(V) : std::string(), "; use fewer stages");
        for (int M : o.micro_batches)
          or_usage_error("--stages " + std::to_string(K) + " --micro-batches " + std::to_string(M) + " --schedule " +
                             schedule + (given ? " --balance" : ""),
                         [&] {
            return make_plan(task.layers, pipeline_options_of(task, request_of(K, M, schedule, "even", o)));
          });
      }
  }
}

// The contenders of one comparison: the whole batch unsplit and one device running the M micro-batches
// (the baseline of the ideal K·M/(M+K-1)), in one process; then every K x schedule x cut asked for.
std::vector<Contender> contenders(const BenchOptions& o) {
  std::vector<Contender> out;
  if (!job().distributed) {
    out.resize(2);
    out[0].unsplit = true;
  }
  for (int K : o.stages)
    for (const std::string& schedule : o.schedules)
      // A cut given with --balance (for K above 1) is labelled as such: no method chose it.
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

void build(Contender& c, const std::string& name, int M, Checkpoint mode, const BenchOptions& o,
           const CostModel& costs) {
  c.task = name;
  const Task& task = find_task(name);
  const Model model = task.model(task_options(o));
  c.batch = task.batch(task_options(o));
  if (c.unsplit) {
    c.whole = model.build(LayerRange{});
    c.sgd = make_optimizer(kBenchOptimizer, unique_parameters(*c.whole));
    return;
  }
  RunRequest request = request_of(c.devices, M, c.schedule, c.balance_by, o);
  if (request.balance.empty() && request.balance_by != "even")  // by cost: the profiled costs of one micro-batch
    request.layer_costs = layer_costs_by(c.balance_by, model.build(LayerRange{}), costs,
                                         micro_batch_sizes(c.batch.size(), M).front());
  const PipelineOptions options = pipeline_options_of(task, request)
                                      .checkpoint(mode)
                                      .threads_per_device(o.threads)
                                      .tied_parameters(model.tied)
                                      .track_memory(!job().distributed);
  c.pipe = make_pipeline(model.build, task.layers, options);
  c.sgd = make_optimizer(kBenchOptimizer, c.pipe->parameters());
  // Replica 0's pipeline on its share of the rows (the replicas' gradient sum is not modelled).
  const int64_t share = micro_batch_sizes(c.batch.size(), replicas_of(c.devices)).front();
  if (job().prints()) c.predicted = predict(costs, c.pipe->plan(), micro_batch_sizes(share, M));
}

template <typename T>
void keep_largest(std::vector<T>& kept, size_t j, T value) {
  if (kept.size() <= j) kept.resize(j + 1, 0);
  kept[j] = std::max(kept[j], value);
}

// One training step (SGD step included) of `c`, on every rank; records it when `timed`.
void step(Contender& c, bool timed) {
  const Task& task = find_task(c.task);
  const int64_t sent_before = c.pipe ? c.pipe->bytes_sent() : 0;
  const int64_t begin = now_ns();
  if (c.unsplit) {
    clear_grads(unique_parameters(*c.whole));
    task.loss(c.whole->forward(c.batch.input), c.batch.target).backward();
  } else {
    clear_grads(c.pipe->parameters());
    c.pipe->train_step(c.batch.input, c.batch.target, task.loss);  // ends with a collective under MPI: all ranks in step
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

int run(const BenchOptions& o, const std::string& command) {
  if (job().prints()) check_results_path(o.results);
  if (o.transport) return run_transport(o.warmup, o.json, o.results, command);
  check_sweep(o);
  keep_freed_memory();  // before the first step, so every contender runs with the same allocator settings
  nlohmann::json rows = nlohmann::json::array();
  if (job().prints() && !o.json) print_header();
  for (const auto& name : o.workloads)
    for (int M : o.micro_batches) {
      // The cost model, on the rank that prints (the whole workload is small enough to hold there).
      const CostModel costs = job().prints() || !job().distributed ? profile_task(name, M, o) : CostModel{};
      for (const std::string& mode : o.checkpoints) {
        std::vector<Contender> all = contenders(o);
        for (Contender& c : all) build(c, name, M, parse_checkpoint(mode), o, costs);
        // Round-robin: warm-up rounds, then timed rounds, one step of every contender per round.
        for (int s = 0; s < o.warmup + o.steps; ++s)
          for (Contender& c : all) step(c, s >= o.warmup);
        const size_t baselines = job().distributed ? 0 : 2;
        for (size_t n = baselines; n < all.size(); ++n) {
          const Contender& c = all[n];
          const Contender* first = nullptr;  // the first schedule asked for at the same K and cut
          for (size_t m = baselines; m < n; ++m)
            if (all[m].devices == c.devices && all[m].balance_by == c.balance_by &&
                all[m].schedule == o.schedules.front() && c.schedule != all[m].schedule)
              first = &all[m];
          const nlohmann::json row = row_of(c, baselines ? &all[0] : nullptr, baselines ? &all[1] : nullptr, first,
                                            name, M, parse_checkpoint(mode), o);
          if (!job().prints()) continue;
          rows.push_back(row);
          if (o.json)
            std::cout << row.dump() << std::endl;
          else
            print_row(row);
        }
      }
    }
  if (job().prints()) write_results(o.results, rows, command);
  return 0;
}

}  // namespace

void add_bench_command(CLI::App& app, const std::string& command, int& status) {
  auto o = std::make_shared<BenchOptions>();
  CLI::App* sub = app.add_subcommand(
      "bench", "Time the workloads defined in docs/benchmarks.md through the pipeline against one device");
  sub->add_option("--workload", o->workloads,
                  "a benchmark workload (mlp, transformer, tiny, imbalanced) or any built-in task (cnn, resnet, unet, "
                  "gpt) on a random batch of its shape; several sweep: mlp,tiny")
      ->delimiter(',')->check(CLI::IsMember(task_names(/*workloads=*/true)))->capture_default_str();
  sub->add_option("--stages", o->stages, "numbers of devices K to sweep (1 2 or 1,2)")
      ->delimiter(',')->check(at_least(1))->capture_default_str();
  sub->add_option("--micro-batches", o->micro_batches, "numbers of micro-batches M to sweep")
      ->delimiter(',')->check(at_least(1))->capture_default_str();
  sub->add_option("--checkpoint", o->checkpoints, "always, except_last, never (several sweep)")
      ->delimiter(',')->check(CLI::IsMember(checkpoint_names()))->capture_default_str();
  sub->add_option("--schedule", o->schedules,
                  "schedules to sweep: gpipe (fill-drain), 1f1b, interleaved (with --virtual-stages), zb1p, zbv or v-half; "
                  "each later one is also compared with the first, step by step")
      ->delimiter(',')->check(CLI::IsMember(schedule_names()))->capture_default_str();
  sub->add_option("--virtual-stages", o->virtual_stages,
                  "V, stages per device of the interleaved schedule (default 2; zbv and v-half always run 2)")
      ->check(in_range(2, 64, /*whole=*/true));
  sub->add_option("--threads-per-stage", o->threads, "intra-op threads of each device (and of the one device)")
      ->check(at_least(1))->capture_default_str();
  sub->add_option("--steps", o->steps, "timed steps per configuration (the median is reported)")
      ->check(at_least(1))->capture_default_str();
  sub->add_option("--warmup", o->warmup,
                  "untimed steps of every configuration before its --steps timed ones (any number, also more "
                  "than --steps: they warm caches and allocators and are never timed)")->check(at_least(0))->capture_default_str();
  sub->add_option("--balance", o->balance, "an explicit cut, layers per stage: K x V entries (e.g. 3,5)")
      ->delimiter(',')->check(at_least(1));
  sub->add_option("--balance-by", o->balance_by,
                  "how stages are cut (several sweep): even (blocks evenly, as docs/benchmarks.md), params (parameter "
                  "counts), time (profiled forward+backward per layer) or memory (activations kept plus "
                  "parameters, gradients and momentum); the exact min-max cut of the stages, or of the devices "
                  "where a schedule puts several stages on one")
      ->delimiter(',')->check(CLI::IsMember({"even", "params", "time", "memory"}))->capture_default_str();
  sub->add_flag("--json", o->json, "one JSON object per configuration on standard output (JSON Lines)");
  sub->add_flag("--tie-embeddings", o->tie_embeddings,
                "the transformer's output layer reuses its embedding's weight (tied embeddings): one weight on the "
                "first and the last stage, one gradient, one update");
  sub->add_flag("--transport", o->transport,
                "under mpirun -np 2: latency and bandwidth of the MPI transport per message size (ping-pong)");
  sub->add_option("--results", o->results, "file the results are written to (empty: none)")
      ->capture_default_str();
  sub->callback([o, sub, command, &status] {
    o->balance_by_given = sub->count("--balance-by") > 0;
    status = run(*o, command);
  });
}

}  // namespace gpipe::cli
