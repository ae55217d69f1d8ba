// bench.cc: `gpipe bench`: the workloads of docs/benchmarks.md through the pipeline, against one
// device and against the ideal; in one process, or one rank per device under mpirun (the same sweep).
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

struct BenchOptions {
  std::vector<std::string> workloads{"mlp"};
  std::vector<int> stages{2};
  std::vector<int> micro_batches{32};
  std::vector<std::string> checkpoints{"except_last"};
  std::vector<std::string> schedules{"gpipe"};
  int virtual_stages = 0;  // 0: each schedule's own (2 for interleaved, zbv and v-half)
  int threads = 1;
  int steps = 7;
  int warmup = 2;
  std::vector<std::string> balance_by{"even"};
  std::vector<int> balance;  // an explicit cut, for the one K it fits
  bool balance_by_given = false;
  bool json = false;
  bool tie_embeddings = false;  // the transformer's output layer reads its embedding's weight
  bool transport = false;       // MPI: time the transport alone (bench_transport.cc)
  std::string results = "bench/results/bench.json";
};

// --virtual-stages applies to the schedules that take that V (takes_virtual_stages); the others run their own.
int virtual_stages(const std::string& schedule, const BenchOptions& o) {
  const ScheduleKind kind = parse_schedule(schedule);
  return o.virtual_stages > 0 && takes_virtual_stages(kind, o.virtual_stages) ? o.virtual_stages
                                                                              : default_virtual_stages(kind);
}


// One configuration of a comparison: the whole batch on one device (unsplit), or a pipeline. Every
// configuration of a comparison runs one step in turn, so each ratio compares steps taken moments
// apart on the same noisy machine.
struct Contender {
  int devices = 1;  // K
  std::string task;  // its name
  std::string schedule = "gpipe";
  int virtual_stages = 1;
  std::string balance_by = "even";
  bool unsplit = false;  // the whole batch in one piece on the calling thread
  Dataset batch;         // the task's batch
  torch::nn::Sequential whole;  // unsplit: the whole model
  std::unique_ptr<Pipeline> pipe;
  std::unique_ptr<torch::optim::Optimizer> sgd;
  Prediction predicted;  // the cost model's figures (cost_model.h)
  // Per timed step:
  std::vector<double> step_s, bubbles, overhead_s, simulated_s, sent_bytes;
  std::vector<int64_t> peak_bytes, held_bytes, parameter_bytes;  // per device held here, largest over the steps
};

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

// The cut into K·V stages: explicit, the task's own (a workload's blocks evenly), or by cost.
std::vector<int> cut_for(const Task& task, const Contender& c, int M, const CostModel& costs, const BenchOptions& o) {
  const int K = c.devices, V = c.virtual_stages;
  if (!o.balance.empty() && K > 1) return o.balance;
  if (c.balance_by == "even") return task.cut ? task.cut(K, parse_schedule(c.schedule), V) : std::vector<int>{};
  const int64_t rows = micro_batch_sizes(c.batch.size(), M).front();
  return balance_by_cost(layer_costs_by(c.balance_by, task.model(task_options(o)).build(LayerRange{}), costs, rows),
                         K * V);
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
        for (int M : o.micro_batches)
          or_usage_error("--stages " + std::to_string(K) + " --micro-batches " + std::to_string(M) + " --schedule " +
                             schedule + (given ? " --balance" : ""),
                         [&] {
            return make_plan(task.layers, PipelineOptions().devices(K).balance(given ? o.balance : std::vector<int>{})
                                           .schedule(parse_schedule(schedule)).virtual_stages(V).micro_batches(M));
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
  const PipelineOptions options = PipelineOptions()
                                      .devices(c.devices)
                                      .balance(cut_for(task, c, M, costs, o))
                                      .micro_batches(M)
                                      .checkpoint(mode)
                                      .schedule(parse_schedule(c.schedule))
                                      .virtual_stages(c.virtual_stages)
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

// The median, smallest and largest of the per-step ratios a[s] / b[s].
struct Ratio {
  double median = 0, min = 0, max = 0;
};
Ratio ratio(const std::vector<double>& a, const std::vector<double>& b) {
  std::vector<double> r;
  for (size_t s = 0; s < std::min(a.size(), b.size()); ++s) r.push_back(a[s] / b[s]);
  if (r.empty()) return {};
  return {median(r), *std::min_element(r.begin(), r.end()), *std::max_element(r.begin(), r.end())};
}

// Of the per-device ratios predicted / measured, the one farthest from 1.
double worst_ratio(const std::vector<int64_t>& predicted, const std::vector<int64_t>& measured) {
  double worst = 1;
  for (size_t j = 0; j < predicted.size() && j < measured.size(); ++j) {
    const double r = static_cast<double>(predicted[j]) / static_cast<double>(std::max<int64_t>(measured[j], 1));
    if (std::abs(std::log(r)) > std::abs(std::log(worst))) worst = r;
  }
  return worst;
}

std::string mebibytes(const std::vector<int64_t>& bytes) {
  std::string out;
  for (size_t j = 0; j < bytes.size(); ++j) out += (j ? " " : "") + fixed(static_cast<double>(bytes[j]) / (1 << 20), 1);
  return out.empty() ? "-" : out;
}

// The row of contender `c` against the baselines (none under MPI) and the first schedule asked for at
// the same K and cut (`first`, or null).
nlohmann::json row_of(const Contender& c, const Contender* unsplit, const Contender* one, const Contender* first,
                      const std::string& name, int M, Checkpoint mode, const BenchOptions& o) {
  const double batch = static_cast<double>(c.batch.size());
  const double ideal = ideal_speedup(c.pipe->schedule());
  nlohmann::json row = {
      {"workload", name}, {"tie_embeddings", o.tie_embeddings}, {"transport", job().distributed ? "mpi" : "threads"},
      {"stages", c.devices}, {"replicas", replicas_of(c.devices)}, {"micro_batches", M},
      {"checkpoint", to_string(mode)}, {"schedule", c.schedule}, {"virtual_stages", c.virtual_stages},
      {"threads_per_device", o.threads}, {"balance", c.pipe->balance()}, {"balance_by", c.balance_by},
      {"samples_per_s", batch / median(c.step_s)},
      {"samples_per_s_min", batch / *std::max_element(c.step_s.begin(), c.step_s.end())},
      {"samples_per_s_max", batch / *std::min_element(c.step_s.begin(), c.step_s.end())},
      {"ideal", ideal}, {"bubble", median(c.bubbles)}, {"overhead_us_per_step", median(c.overhead_s) * 1e6},
      {"step_s", median(c.step_s)}, {"predicted_step_s", c.predicted.step_s},
      {"predicted_bubble", c.predicted.bubble}, {"predicted_peak_bytes", c.predicted.peak_bytes},
      {"predicted_static_bytes", c.predicted.static_bytes}, {"peak_bytes", c.peak_bytes},
      {"peak_held_bytes", c.held_bytes}, {"parameter_bytes", c.parameter_bytes},
      {"bytes_sent_per_step", median(c.sent_bytes)}, {"skip_bytes_per_step", c.pipe->sum(c.pipe->replica() == 0 ? static_cast<double>(c.pipe->skip_bytes()) : 0.0)},
      {"program_actions_per_device", c.pipe->schedule().actions.front().size()}, {"steps", o.steps},
      {"warmup", o.warmup}};
  std::vector<double> measured_s;
  for (size_t s = 0; s < c.simulated_s.size(); ++s) measured_s.push_back(c.simulated_s[s] + c.overhead_s[s]);
  row["simulated_over_measured"] = ratio(c.simulated_s, measured_s).median;
  if (one != nullptr) {
    const Ratio speedup = ratio(one->step_s, c.step_s), vs_unsplit = ratio(unsplit->step_s, c.step_s);
    row.update({{"one_device_samples_per_s", batch / median(one->step_s)}, {"speedup", speedup.median},
                {"speedup_min", speedup.min}, {"speedup_max", speedup.max}, {"efficiency", speedup.median / ideal},
                {"unsplit_samples_per_s", batch / median(unsplit->step_s)}, {"speedup_vs_unsplit", vs_unsplit.median},
                {"speedup_vs_unsplit_min", vs_unsplit.min}, {"speedup_vs_unsplit_max", vs_unsplit.max}});
  }
  if (first != nullptr) {
    const Ratio r = ratio(first->step_s, c.step_s);
    std::vector<double> peak_ratio, held_ratio;
    for (size_t j = 0; j < c.peak_bytes.size() && j < first->peak_bytes.size(); ++j) {
      peak_ratio.push_back(static_cast<double>(c.peak_bytes[j]) / static_cast<double>(first->peak_bytes[j]));
      held_ratio.push_back(static_cast<double>(c.held_bytes[j]) / static_cast<double>(first->held_bytes[j]));
    }
    row.update({{"vs_schedule", first->schedule}, {"speedup_vs_schedule", r.median}, {"speedup_vs_schedule_min", r.min},
                {"speedup_vs_schedule_max", r.max}, {"bubble_vs_schedule", median(c.bubbles) / median(first->bubbles)},
                {"peak_bytes_vs_schedule", peak_ratio}, {"peak_held_bytes_vs_schedule", held_ratio}});
  }
  return row;
}

void print_header() {
  std::cout << std::left << std::setw(12) << "workload" << std::right << std::setw(3) << "K" << std::setw(3) << "D"
            << std::setw(5) << "M" << std::setw(13) << "checkpoint" << std::setw(16) << "schedule" << std::setw(11)
            << "samples/s" << std::setw(9) << "speedup" << std::setw(17) << "(min .. max)" << std::setw(7) << "ideal"
            << std::setw(6) << "eff" << std::setw(8) << "bubble" << std::setw(9) << "vs unspl" << std::setw(9)
            << "sim/meas" << std::setw(8) << "pred t" << std::setw(9) << "pred mem" << std::setw(9) << "sent MiB"
            << std::setw(10) << "skip MiB" << "  peak MiB per device  balance\n";
}

void print_row(const nlohmann::json& r) {
  auto number = [&r](const char* key, int digits) { return r.contains(key) ? fixed(r[key].get<double>(), digits) : "-"; };
  const std::string range = r.contains("speedup") ? "(" + number("speedup_min", 2) + " .. " + number("speedup_max", 2) + ")" : "-";
  const int V = r["virtual_stages"];
  std::cout << std::left << std::setw(12) << r["workload"].get<std::string>() << std::right << std::setw(3)
            << r["stages"].get<int>() << std::setw(3) << r["replicas"].get<int>() << std::setw(5)
            << r["micro_batches"].get<int>() << std::setw(13) << r["checkpoint"].get<std::string>() << std::setw(16)
            << r["schedule"].get<std::string>() + (V > 1 ? "/" + std::to_string(V) : "") << std::setw(11)
            << number("samples_per_s", 1) << std::setw(9) << number("speedup", 3) << std::setw(17) << range
            << std::setw(7) << number("ideal", 3) << std::setw(6) << number("efficiency", 2) << std::setw(8)
            << number("bubble", 3) << std::setw(9) << number("speedup_vs_unsplit", 3) << std::setw(9)
            << number("simulated_over_measured", 3) << std::setw(8)
            << fixed(r["predicted_step_s"].get<double>() / r["step_s"].get<double>(), 3) << std::setw(9)
            << (r["peak_bytes"].empty() ? "-" : fixed(worst_ratio(r["predicted_peak_bytes"], r["peak_bytes"]), 3))
            << std::setw(9) << fixed(r["bytes_sent_per_step"].get<double>() / (1 << 20), 1) << std::setw(10)
            << fixed(r["skip_bytes_per_step"].get<double>() / (1 << 20), 2) << "  " << std::left << std::setw(19)
            << mebibytes(r["peak_bytes"]) << std::right << "  " << r["balance_by"].get<std::string>() << " "
            << r["balance"].dump() << std::endl;
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
  sub->add_option("--warmup", o->warmup, "untimed steps first")->check(at_least(0))->capture_default_str();
  sub->add_option("--balance", o->balance, "an explicit cut, layers per stage: K x V entries (e.g. 3,5)")
      ->delimiter(',')->check(at_least(1));
  sub->add_option("--balance-by", o->balance_by,
                  "how stages are cut (several sweep): even (blocks evenly, as docs/benchmarks.md), params (parameter "
                  "counts), time (profiled forward+backward per layer) or memory (activations kept plus "
                  "parameters, gradients and momentum); exact min-max partition")
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
