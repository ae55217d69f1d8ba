// bench.cc: `gpipe bench`: the workloads of docs/benchmarks.md against one device and against the ideal.
#include "commands.h"
#include "common.h"
#include "world.h"

#include <gpipe/gpipe.h>
#include <torch/torch.h>

#include <CLI/CLI.hpp>

#include <chrono>
#include <ctime>
#include <filesystem>
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
  int virtual_stages = 2;  // for the interleaved schedule
  int threads = 1;
  int steps = 7;
  int warmup = 2;
  std::vector<std::string> balance_by{"even"};
  std::vector<int> balance;  // an explicit cut, for the one K it fits
  bool json = false;
  bool tie_embeddings = false;  // the transformer's output layer reads its embedding's weight
  bool transport = false;  // MPI: time the transport alone (ping-pong between ranks 0 and 1)
  std::string results = "bench/results/bench.json";
};

// V for `schedule`: --virtual-stages for the interleaved schedule, 1 for the others.
int virtual_stages(const std::string& schedule, const BenchOptions& o) {
  return schedule == "interleaved" ? o.virtual_stages : 1;
}

// One configuration of a comparison: the whole batch on one device (unsplit),
// or a pipeline. Every configuration of a comparison runs one step in turn, so
// each ratio compares steps taken moments apart on the same noisy machine.
struct Contender {
  std::string label;         // for messages
  int stages = 1;            // K
  std::string schedule = "gpipe";
  int virtual_stages = 1;
  std::string balance_by = "even";
  bool unsplit = false;      // the whole batch in one piece on the calling thread
  Workload workload;
  std::unique_ptr<Pipeline> pipe;
  std::unique_ptr<torch::optim::SGD> sgd;
  // Per timed step:
  std::vector<double> step_s;
  std::vector<double> bubbles;
  std::vector<double> overhead_s;        // the pipeline's own time (see overhead_seconds)
  std::vector<double> simulated_s;       // the program simulated with the step's measured action times
  std::vector<int64_t> peak_bytes;       // per device, largest over the timed steps
  std::vector<int64_t> held_bytes;       // per device, peak held between actions, largest over the timed steps
  std::vector<int64_t> parameter_bytes;  // per device, parameters and gradients
  Prediction predicted;                  // the cost model's figures for this configuration (cost_model.h)
};

// The cut of `w` into K·V stages: explicit, even (docs/benchmarks.md), or by measured cost.
std::vector<int> cut_for(const Workload& w, int K, int V, int M, const std::string& balance_by, const BenchOptions& o) {
  if (!o.balance.empty() && K > 1) return o.balance;
  if (balance_by == "even" || V > 1) return w.balance(K * V);
  if (balance_by == "params") return balance_by_cost(parameter_costs(w.model), K);
  // Profile one micro-batch, on one stage's threads for time, as the stages will run it.
  const torch::Tensor sample = w.input.narrow(0, 0, chunk_sizes(w.input.size(0), M).front());
  return balance_by_cost(balance_by == "time" ? time_costs(w.model, sample, o.threads) : memory_costs(w.model, sample), K);
}

// The cost model of workload `name` at M micro-batches: its layers profiled on one
// micro-batch, on one stage's threads, as the stages will run them.
CostModel profile_workload(const std::string& name, int M, const BenchOptions& o) {
  const Workload w = make_workload(name, 0, {}, o.tie_embeddings);
  const int64_t rows = chunk_sizes(w.input.size(0), M).front();
  // Three warm-up passes: the first profile of a process runs on pages not yet touched.
  return profile_layers(w.model, w.input.narrow(0, 0, rows), o.threads, /*state_per_parameter_byte=*/1,  // plain SGD
                        /*warmup=*/3, /*repetitions=*/5, w.loss, w.target.narrow(0, 0, rows));
}

void build(Contender& c, const std::string& name, int M, Checkpoint mode, const BenchOptions& o,
           const CostModel& costs) {
  c.workload = make_workload(name, 0, {}, o.tie_embeddings);
  if (c.unsplit) {
    c.sgd = std::make_unique<torch::optim::SGD>(unique_parameters(*c.workload.model), 1e-4);
    return;
  }
  const std::vector<int> cut = cut_for(c.workload, c.stages, c.virtual_stages, M, c.balance_by, o);
  c.pipe = std::make_unique<Pipeline>(c.workload.model, PipelineOptions()
                                                            .balance(cut)
                                                            .chunks(M)
                                                            .checkpoint(mode)
                                                            .schedule(parse_schedule(c.schedule))
                                                            .virtual_stages(c.virtual_stages)
                                                            .threads_per_stage(o.threads)
                                                            .tied_parameters(c.workload.tied)
                                                            .track_memory(true));
  c.sgd = std::make_unique<torch::optim::SGD>(c.pipe->parameters(), 1e-4);
  c.predicted = predict(costs, c.pipe->balance(), c.pipe->schedule(), chunk_sizes(c.workload.input.size(0), M));
}

// One training step (SGD step included) of `c`; records it when `timed`.
void step(Contender& c, bool timed) {
  Workload& w = c.workload;
  const int64_t begin = now_ns();
  if (c.unsplit) {
    clear_grads(unique_parameters(*w.model));
    w.loss(w.model->forward(w.input), w.target).backward();
  } else {
    clear_grads(c.pipe->parameters());
    c.pipe->train_step(w.input, w.target, w.loss);
  }
  c.sgd->step();
  const double seconds = static_cast<double>(now_ns() - begin) * 1e-9;
  if (!timed) return;
  c.step_s.push_back(seconds);
  if (c.unsplit) return;
  const StepTrace& trace = c.pipe->last_trace();
  c.bubbles.push_back(trace.bubble());
  const double overhead = overhead_seconds(trace, c.pipe->schedule());
  c.overhead_s.push_back(overhead);
  c.simulated_s.push_back(trace.seconds() - overhead);
  const auto memory = c.pipe->memory();
  c.peak_bytes.resize(memory.size(), 0);
  c.held_bytes.resize(memory.size(), 0);
  c.parameter_bytes.resize(memory.size(), 0);
  for (size_t j = 0; j < memory.size(); ++j) {
    c.peak_bytes[j] = std::max(c.peak_bytes[j], memory[j].peak_bytes);
    c.held_bytes[j] = std::max(c.held_bytes[j], memory[j].held_peak_bytes);
    c.parameter_bytes[j] = memory[j].parameter_bytes;
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

// Every configuration is checked before any work: the names, the cuts, and each schedule against K and M.
void check_sweep(const BenchOptions& o) {
  for (const auto& n : o.workloads) {
    const Workload w = make_workload(n, 0, LayerRange{0, 0}, o.tie_embeddings);  // sizes and cut, no layers
    const int64_t batch = w.input.size(0);
    for (int M : o.micro_batches)
      GPIPE_CHECK(M <= batch, "--micro-batches ", M, " is more than workload ", n, "'s batch of ", batch,
                  " rows; every micro-batch needs a row");
    for (int K : o.stages)
      for (const std::string& schedule : o.schedules) {
        const int V = virtual_stages(schedule, o);
        if (!o.balance.empty() && K > 1) {
          check_balance(o.balance, w.layers);
          GPIPE_CHECK(K * V == static_cast<int>(o.balance.size()), "--balance has ", o.balance.size(),
                      " stages but --stages ", K, V > 1 ? " x --virtual-stages " + std::to_string(V) : std::string(),
                      " asks for ", K * V, "; give K x V entries");
        } else {
          // The even cut splits the workload's blocks, not its layers.
          GPIPE_CHECK(K * V <= static_cast<int>(w.block_layers.size()), "workload ", n, " has ",
                      w.block_layers.size(), " blocks, too few for --stages ", K,
                      V > 1 ? " x --virtual-stages " + std::to_string(V) : std::string(), "; use fewer stages");
        }
        GPIPE_CHECK(V == 1 || o.balance_by == std::vector<std::string>{"even"},
                    "--balance-by cuts one contiguous stage per device; the interleaved schedule uses the even cut "
                    "(or --balance): leave --balance-by out");
        for (int M : o.micro_batches) make_schedule(parse_schedule(schedule), K, M, V);
      }
  }
}

// Keeps `row` for the results file; with --json prints it as a line and
// returns false, otherwise returns true: the caller prints its table line.
bool add_row(const BenchOptions& o, nlohmann::json& rows, const nlohmann::json& row) {
  rows.push_back(row);
  if (o.json) std::cout << row.dump() << std::endl;
  return !o.json;
}

// "(lo .. hi)" with `digits` decimals.
std::string range_text(double lo, double hi, int digits = 1) {
  std::ostringstream out;
  out << std::fixed << std::setprecision(digits) << "(" << lo << " .. " << hi << ")";
  return out.str();
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
  std::ostringstream out;
  out << std::fixed << std::setprecision(1);
  for (size_t j = 0; j < bytes.size(); ++j) out << (j ? " " : "") << static_cast<double>(bytes[j]) / (1 << 20);
  return out.str();
}

void write_results(const BenchOptions& o, const nlohmann::json& rows, const std::string& command) {
  if (o.results.empty()) return;
  const std::filesystem::path path(o.results);
  if (path.has_parent_path()) std::filesystem::create_directories(path.parent_path());
  const std::time_t now = std::time(nullptr);
  char date[32];
  std::strftime(date, sizeof date, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
  nlohmann::json doc = {{"command", command}, {"date", date}, {"machine", machine()}, {"results", rows}};
  write_file_atomically(path.string(), doc.dump(2) + "\n");
  std::cerr << "results written to " << path.string() << "\n";
}

#if defined(GPIPE_HAS_MPI) && GPIPE_HAS_MPI
// Latency and bandwidth of MpiTransport (header and data messages, as the
// pipeline sends them) between ranks 0 and 1, by ping-pong per message size.
int run_transport(const BenchOptions& o, const std::string& command) {
  const World& w = world();
  GPIPE_CHECK(w.size == 2, "--transport measures the link between two ranks; start it with mpirun -np 2 (got ", w.size,
              " ranks)");
  mpi::ErrorChannel errors(MPI_COMM_WORLD);
  mpi::MpiTransport transport(MPI_COMM_WORLD, &errors, {0, 1}, 1);  // stage r on rank r
  const int peer = 1 - w.rank;
  nlohmann::json rows = nlohmann::json::array();
  if (w.prints() && !o.json)
    std::cout << std::setw(12) << "bytes" << std::setw(10) << "repeats" << std::setw(16) << "one-way us"
              << std::setw(22) << "(min .. max)" << std::setw(12) << "GB/s" << "\n";
  for (int64_t bytes = 8; bytes <= (int64_t{64} << 20); bytes *= 8) {
    const torch::Tensor message = torch::ones({bytes / 4});
    const int repeats = static_cast<int>(std::clamp<int64_t>((int64_t{256} << 20) / bytes, 10, 2000));
    std::vector<double> one_way_s;
    for (int r = 0; r < o.warmup + repeats; ++r) {
      const int64_t begin = now_ns();
      if (w.rank == 0) {
        transport.send(0, peer, Channel::kActivation, 0, message);
        transport.recv(peer, 0, Channel::kGradient, 0);
      } else {
        transport.recv(peer, 1, Channel::kActivation, 0);
        transport.send(1, peer, Channel::kGradient, 0, message);
      }
      transport.finish_sends();
      if (r >= o.warmup) one_way_s.push_back(static_cast<double>(now_ns() - begin) * 0.5e-9);
    }
    if (!w.prints()) continue;
    const double t = median(one_way_s);
    const auto [lo, hi] = std::minmax_element(one_way_s.begin(), one_way_s.end());
    nlohmann::json row = {{"bytes", bytes},           {"repeats", repeats},
                          {"one_way_us", t * 1e6},    {"one_way_us_min", *lo * 1e6},
                          {"one_way_us_max", *hi * 1e6}, {"gb_per_s", static_cast<double>(bytes) / t * 1e-9}};
    if (add_row(o, rows, row))
      std::cout << std::setw(12) << bytes << std::setw(10) << repeats << std::fixed << std::setprecision(1)
                << std::setw(16) << t * 1e6 << std::setw(22) << range_text(*lo * 1e6, *hi * 1e6) << std::setprecision(3)
                << std::setw(12) << static_cast<double>(bytes) / t * 1e-9 << std::endl;
  }
  if (w.prints()) write_results(o, rows, command);
  return 0;
}

// The workloads with one stage per rank: np = K·D ranks for each K swept.
int run_mpi(const BenchOptions& o, const std::string& command) {
  const World& w = world();
  check_same_settings({{"command", command}});
  for (int K : o.stages)
    GPIPE_CHECK(w.size % K == 0, "--stages ", K, " does not divide the ", w.size,
                " ranks; start K·D ranks (mpirun -np ", K, " for one pipeline)");
  GPIPE_CHECK(o.balance_by.size() == 1 && o.balance_by.front() == "even",
              "--balance-by profiles the whole model in one process; under mpirun pass a cut with --balance");
  check_sweep(o);
  nlohmann::json rows = nlohmann::json::array();
  if (w.prints() && !o.json)
    std::cout << std::left << std::setw(12) << "workload" << std::right << std::setw(3) << "K" << std::setw(3) << "D"
              << std::setw(5) << "M" << std::setw(13) << "checkpoint" << std::setw(16) << "schedule" << std::setw(13) << "samples/s" << std::setw(25)
              << "(min .. max)" << std::setw(8) << "bubble" << std::setw(7) << "ideal" << std::setw(16)
              << "MiB sent/step" << std::setw(10) << "skip MiB" << "  balance\n";
  for (const auto& name : o.workloads) {
    const Workload whole = make_workload(name, 0, LayerRange{0, 0}, o.tie_embeddings);  // sizes and cut, no layers
    for (int M : o.micro_batches) {
      // The cost model, on the rank that prints (the whole workload is small enough to hold there).
      const CostModel costs = w.prints() ? profile_workload(name, M, o) : CostModel{};
      for (const auto& mode_name : o.checkpoints)
        for (int K : o.stages)
          for (const std::string& schedule : o.schedules) {
          const int V = virtual_stages(schedule, o);
          const std::vector<int> cut = !o.balance.empty() ? o.balance : whole.balance(K * V);
          const mpi::Placement place = mpi::place(w.rank, w.size, K);
          const Workload mine = make_workload(name, 0, LayerRange{0, 0}, o.tie_embeddings);  // the batch and loss
          const torch::nn::Sequential layers = mpi::device_layers(
              [&name, &o](LayerRange keep) { return make_workload(name, 0, keep, o.tie_embeddings).model; }, cut, K,
              place.stage);
          mpi::MpiPipeline pipe(layers, mpi::MpiPipelineOptions()
                                            .balance(cut)
                                            .chunks(M)
                                            .checkpoint(parse_checkpoint(mode_name))
                                            .schedule(parse_schedule(schedule))
                                            .virtual_stages(V)
                                            .tied_parameters(mine.tied)
                                            .device(Device::cpu(o.threads)));
          torch::optim::SGD sgd(pipe.parameters(), 1e-4);
          std::vector<double> step_s, bubbles;
          const int64_t sent_before = pipe.transport().bytes_sent();
          for (int s = 0; s < o.warmup + o.steps; ++s) {
            const int64_t begin = now_ns();
            clear_grads(pipe.parameters());
            pipe.train_step(mine.input, mine.target, mine.loss);  // ends with a collective: all ranks in step
            sgd.step();
            const double seconds = static_cast<double>(now_ns() - begin) * 1e-9;
            const double bubble = pipe.bubble();
            if (s >= o.warmup) {
              step_s.push_back(seconds);
              bubbles.push_back(bubble);
            }
          }
          const double sent_per_step =
              pipe.sum(static_cast<double>(pipe.transport().bytes_sent() - sent_before)) / (o.warmup + o.steps);
          const double skip_per_step = pipe.sum(place.replica == 0 ? static_cast<double>(pipe.skip_bytes()) : 0.0);
          if (!w.prints()) continue;
          const double batch = static_cast<double>(mine.input.size(0));
          const double rate = batch / median(step_s);
          // Replica 0's pipeline, on its share of the rows (the replicas' gradient sum is not modelled).
          const int64_t share = chunk_sizes(mine.input.size(0), place.replicas).front();
          const Prediction predicted = predict(costs, cut, pipe.schedule(), chunk_sizes(share, M));
          const double rmin = batch / *std::max_element(step_s.begin(), step_s.end());
          const double rmax = batch / *std::min_element(step_s.begin(), step_s.end());
          nlohmann::json row = {{"workload", name}, {"tie_embeddings", o.tie_embeddings},
                                {"transport", "mpi"},
                                {"stages", K},
                                {"replicas", place.replicas},
                                {"micro_batches", M},
                                {"checkpoint", mode_name},
                                {"schedule", schedule},
                                {"virtual_stages", V},
                                {"threads_per_stage", o.threads},
                                {"balance", cut},
                                {"samples_per_s", rate},
                                {"samples_per_s_min", rmin},
                                {"samples_per_s_max", rmax},
                                {"bubble", median(bubbles)},
                                {"step_s", median(step_s)},
                                {"predicted_step_s", predicted.step_s},
                                {"predicted_bubble", predicted.bubble},
                                {"predicted_peak_bytes", predicted.peak_bytes},
                                {"predicted_static_bytes", predicted.static_bytes},
                                {"ideal", ideal_speedup(pipe.schedule())},
                                {"bytes_sent_per_step", sent_per_step},
                                {"skip_bytes_per_step", skip_per_step},
                                {"steps", o.steps},
                                {"warmup", o.warmup}};
          if (add_row(o, rows, row)) {
            std::cout << std::left << std::setw(12) << name << std::right << std::setw(3) << K << std::setw(3)
                      << place.replicas << std::setw(5) << M << std::setw(13) << mode_name << std::setw(16)
                      << (V > 1 ? schedule + "/" + std::to_string(V) : schedule) << std::fixed
                      << std::setprecision(1) << std::setw(13) << rate << std::setw(25) << range_text(rmin, rmax)
                      << std::setprecision(3) << std::setw(8) << median(bubbles) << std::setw(7)
                      << ideal_speedup(pipe.schedule()) << std::setprecision(1) << std::setw(16) << sent_per_step / (1 << 20)
                      << std::setprecision(2) << std::setw(10) << skip_per_step / (1 << 20) << "  "
                      << nlohmann::json(cut).dump() << std::endl;
          }
        }
    }
  }
  if (w.prints()) write_results(o, rows, command);
  return 0;
}
#endif

// The contenders of one comparison (a workload, M and checkpoint mode): the
// whole batch unsplit, one device running the M micro-batches (the baseline
// of the ideal K·M/(M+K-1)), and every K × schedule × cost source asked for.
std::vector<Contender> contenders(const BenchOptions& o) {
  std::vector<Contender> out(2);
  out[0].label = "unsplit";
  out[0].unsplit = true;
  out[1].label = "K=1";
  for (int K : o.stages)
    for (const std::string& schedule : o.schedules)
      for (const std::string& balance_by : o.balance_by) {
        Contender c;
        c.stages = K;
        c.schedule = schedule;
        c.virtual_stages = virtual_stages(schedule, o);
        c.balance_by = balance_by;
        c.label = "K=" + std::to_string(K) + " " + schedule + " " + balance_by;
        out.push_back(std::move(c));
      }
  return out;
}

int run(const BenchOptions& o, const std::string& command) {
#if defined(GPIPE_HAS_MPI) && GPIPE_HAS_MPI
  if (o.transport) return run_transport(o, command);
  if (world().mpi) return run_mpi(o, command);
#endif
  GPIPE_CHECK(!o.transport, "--transport times MPI messages: build with MPI and start it with mpirun -np 2");
  check_sweep(o);
  keep_freed_memory();  // before the first step, so every contender runs with the same allocator settings
  std::vector<Checkpoint> modes;
  for (const auto& c : o.checkpoints) modes.push_back(parse_checkpoint(c));

  nlohmann::json rows = nlohmann::json::array();
  if (!o.json)
    std::cout << std::left << std::setw(12) << "workload" << std::right << std::setw(3) << "K" << std::setw(5) << "M"
              << std::setw(13) << "checkpoint" << std::setw(16) << "schedule" << std::setw(11) << "samples/s"
              << std::setw(9) << "speedup" << std::setw(17) << "(min .. max)" << std::setw(7) << "ideal"
              << std::setw(6) << "eff" << std::setw(8) << "bubble" << std::setw(9) << "vs unspl" << std::setw(9)
              << "sim/meas" << std::setw(8) << "pred t" << std::setw(9) << "pred mem" << std::setw(10) << "skip MiB"
              << "  peak MiB per device  balance\n";
  for (const auto& name : o.workloads)
    for (int M : o.micro_batches) {
      const CostModel costs = profile_workload(name, M, o);
      for (Checkpoint mode : modes) {
        std::vector<Contender> all = contenders(o);
        for (Contender& c : all) build(c, name, M, mode, o, costs);
        // Round-robin: warm-up rounds, then timed rounds, one step of every contender per round.
        for (int s = 0; s < o.warmup + o.steps; ++s)
          for (Contender& c : all) step(c, s >= o.warmup);
        const Contender& unsplit = all[0];
        const Contender& one = all[1];
        const double batch = static_cast<double>(unsplit.workload.input.size(0));
        for (size_t n = 2; n < all.size(); ++n) {
          const Contender& c = all[n];
          const double rate = batch / median(c.step_s);
          const double rmin = batch / *std::max_element(c.step_s.begin(), c.step_s.end());
          const double rmax = batch / *std::min_element(c.step_s.begin(), c.step_s.end());
          const Ratio speedup = ratio(one.step_s, c.step_s);      // per step: one device's time / this one's
          const Ratio vs_unsplit = ratio(unsplit.step_s, c.step_s);
          std::vector<double> measured_s;
          for (size_t s = 0; s < c.simulated_s.size(); ++s) measured_s.push_back(c.simulated_s[s] + c.overhead_s[s]);
          const Ratio simulated = ratio(c.simulated_s, measured_s);
          const double ideal = ideal_speedup(c.pipe->schedule());
          const int actions = static_cast<int>(c.pipe->schedule().actions.front().size());
          nlohmann::json row = {{"workload", name}, {"tie_embeddings", o.tie_embeddings},
                                {"stages", c.stages},
                                {"micro_batches", M},
                                {"checkpoint", to_string(mode)},
                                {"schedule", c.schedule},
                                {"virtual_stages", c.virtual_stages},
                                {"threads_per_stage", o.threads},
                                {"balance", c.pipe->balance()},
                                {"balance_by", c.balance_by},
                                {"samples_per_s", rate},
                                {"samples_per_s_min", rmin},
                                {"samples_per_s_max", rmax},
                                {"one_device_samples_per_s", batch / median(one.step_s)},
                                {"speedup", speedup.median},
                                {"speedup_min", speedup.min},
                                {"speedup_max", speedup.max},
                                {"ideal", ideal},
                                {"efficiency", speedup.median / ideal},
                                {"bubble", median(c.bubbles)},
                                {"overhead_us_per_step", median(c.overhead_s) * 1e6},
                                {"simulated_over_measured", simulated.median},
                                {"simulated_over_measured_min", simulated.min},
                                {"simulated_over_measured_max", simulated.max},
                                {"step_s", median(c.step_s)},
                                {"predicted_step_s", c.predicted.step_s},
                                {"predicted_bubble", c.predicted.bubble},
                                {"peak_bytes", c.peak_bytes},
                                {"predicted_peak_bytes", c.predicted.peak_bytes},
                                {"predicted_static_bytes", c.predicted.static_bytes},
                                {"peak_held_bytes", c.held_bytes},
                                {"parameter_bytes", c.parameter_bytes},
                                {"unsplit_samples_per_s", batch / median(unsplit.step_s)},
                                {"speedup_vs_unsplit", vs_unsplit.median},
                                {"speedup_vs_unsplit_min", vs_unsplit.min},
                                {"speedup_vs_unsplit_max", vs_unsplit.max},
                                {"program_actions_per_device", actions},
                                {"skip_bytes_per_step", c.pipe->skip_bytes()},
                                {"steps", o.steps},
                                {"warmup", o.warmup}};
          // Against the first schedule asked for, at the same K and cut: per-step ratios too.
          for (size_t m = 2; m < n; ++m)
            if (all[m].stages == c.stages && all[m].balance_by == c.balance_by && all[m].schedule == o.schedules.front() &&
                c.schedule != all[m].schedule) {
              const Ratio r = ratio(all[m].step_s, c.step_s);
              row["vs_schedule"] = all[m].schedule;
              row["speedup_vs_schedule"] = r.median;
              row["speedup_vs_schedule_min"] = r.min;
              row["speedup_vs_schedule_max"] = r.max;
              row["bubble_vs_schedule"] = median(c.bubbles) / median(all[m].bubbles);
              std::vector<double> peak_ratio, held_ratio;
              for (size_t j = 0; j < c.peak_bytes.size() && j < all[m].peak_bytes.size(); ++j) {
                peak_ratio.push_back(static_cast<double>(c.peak_bytes[j]) / static_cast<double>(all[m].peak_bytes[j]));
                held_ratio.push_back(static_cast<double>(c.held_bytes[j]) / static_cast<double>(all[m].held_bytes[j]));
              }
              row["peak_bytes_vs_schedule"] = peak_ratio;
              row["peak_held_bytes_vs_schedule"] = held_ratio;
            }
          if (add_row(o, rows, row))
            std::cout << std::left << std::setw(12) << name << std::right << std::setw(3) << c.stages << std::setw(5) << M
                      << std::setw(13) << to_string(mode) << std::setw(16)
                      << (c.virtual_stages > 1 ? c.schedule + "/" + std::to_string(c.virtual_stages) : c.schedule)
                      << std::fixed << std::setprecision(1) << std::setw(11) << rate << std::setprecision(3)
                      << std::setw(9) << speedup.median << std::setw(17) << range_text(speedup.min, speedup.max, 2)
                      << std::setw(7) << ideal << std::setprecision(2) << std::setw(6) << speedup.median / ideal
                      << std::setprecision(3) << std::setw(8) << median(c.bubbles) << std::setw(9) << vs_unsplit.median
                      << std::setw(9) << simulated.median << std::setw(8) << c.predicted.step_s / median(c.step_s)
                      << std::setw(9) << worst_ratio(c.predicted.peak_bytes, c.peak_bytes) << std::setprecision(2)
                      << std::setw(10) << static_cast<double>(c.pipe->skip_bytes()) / (1 << 20) << "  " << std::setw(19)
                      << std::left
                      << mebibytes(c.peak_bytes) << std::right << "  " << c.balance_by << " "
                      << nlohmann::json(c.pipe->balance()).dump() << std::endl;
        }
      }
    }
  write_results(o, rows, command);
  return 0;
}

}  // namespace

void add_bench_command(CLI::App& app, const std::string& command, int& status) {
  auto o = std::make_shared<BenchOptions>();
  CLI::App* sub = app.add_subcommand(
      "bench", "Time the workloads defined in docs/benchmarks.md through the pipeline against one device");
  sub->add_option("--workload", o->workloads,
                  "mlp, transformer, tiny, imbalanced, resnet, unet (several sweep: mlp,tiny)")
      ->delimiter(',')->capture_default_str();
  sub->add_option("--stages", o->stages, "numbers of stages K to sweep (1 2 or 1,2)")
      ->delimiter(',')->check(at_least(1))->capture_default_str();
  sub->add_option("--micro-batches", o->micro_batches, "numbers of micro-batches M to sweep")
      ->delimiter(',')->check(at_least(1))->capture_default_str();
  sub->add_option("--checkpoint", o->checkpoints, "always, except_last, never (several sweep)")
      ->delimiter(',')->check(CLI::IsMember({"always", "except_last", "never"}))->capture_default_str();
  sub->add_option("--schedule", o->schedules,
                  "schedules to sweep: gpipe (fill-drain), 1f1b, interleaved (with --virtual-stages) or zb1p; "
                  "each later one is also compared with the first, step by step")
      ->delimiter(',')->check(CLI::IsMember({"gpipe", "1f1b", "interleaved", "zb1p"}))->capture_default_str();
  sub->add_option("--virtual-stages", o->virtual_stages, "V, stages per device of the interleaved schedule")
      ->check(CLI::Range(2, 64))->capture_default_str();
  sub->add_option("--threads-per-stage", o->threads, "intra-op threads of each stage (and of the one device)")
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
  sub->callback([o, command, &status] { status = run(*o, command); });
}

}  // namespace gpipe::cli
