// bench.cc: `gpipe bench`: the workloads of BENCHMARKS.md against one device and against the ideal.
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
  std::string schedule = "gpipe";
  int threads = 1;
  int steps = 5;
  int warmup = 2;
  std::vector<std::string> balance_by{"even"};
  std::vector<int> balance;  // an explicit cut, for the one K it fits
  bool json = false;
  bool transport = false;  // MPI: time the transport alone (ping-pong between ranks 0 and 1)
  std::string results = "bench/results/bench.json";
};

struct Timing {
  std::vector<double> step_s;
  std::vector<double> bubbles;
  std::vector<double> overhead_s;        // the pipeline's own time per step (see overhead_seconds)
  std::vector<int64_t> peak_bytes;       // per stage, largest over the timed steps
  std::vector<int64_t> parameter_bytes;  // per stage, parameters and gradients
};

// Seconds per training step (SGD step included) of the whole model and batch on one device.
Timing time_single_device(const std::string& name, const BenchOptions& o) {
  Workload w = make_workload(name, 0);
  at::set_num_threads(o.threads);
  set_blas_threads(o.threads);
  torch::optim::SGD sgd(w.model->parameters(), 1e-4);
  Timing t;
  for (int s = 0; s < o.warmup + o.steps; ++s) {
    const int64_t begin = now_ns();
    clear_grads(w.model->parameters());
    w.loss(w.model->forward(w.input), w.target).backward();
    sgd.step();
    if (s >= o.warmup) t.step_s.push_back(static_cast<double>(now_ns() - begin) * 1e-9);
  }
  return t;
}

Timing time_pipeline(const std::string& name, int K, int M, Checkpoint mode, const std::string& balance_by,
                     const BenchOptions& o, std::vector<int>* balance) {
  Workload w = make_workload(name, 0);
  std::vector<int> cut = w.balance(K);
  if (!o.balance.empty() && K > 1) {
    cut = o.balance;
  } else if (balance_by == "params") {
    cut = balance_by_cost(parameter_costs(w.model), K);
  } else if (balance_by != "even") {
    // Profile one micro-batch, on one stage's threads for time, as the stages will run it.
    const torch::Tensor sample = w.input.narrow(0, 0, chunk_sizes(w.input.size(0), M).front());
    cut = balance_by_cost(balance_by == "time" ? time_costs(w.model, sample, o.threads) : memory_costs(w.model, sample), K);
  }
  Pipeline pipe(w.model, PipelineOptions()
                             .balance(cut)
                             .chunks(M)
                             .checkpoint(mode)
                             .schedule(parse_schedule(o.schedule))
                             .threads_per_stage(o.threads)
                             .track_memory(true));
  *balance = pipe.balance();
  torch::optim::SGD sgd(pipe.parameters(), 1e-4);
  Timing t;
  for (int s = 0; s < o.warmup + o.steps; ++s) {
    const int64_t begin = now_ns();
    clear_grads(pipe.parameters());
    pipe.train_step(w.input, w.target, w.loss);
    sgd.step();
    if (s >= o.warmup) {
      t.step_s.push_back(static_cast<double>(now_ns() - begin) * 1e-9);
      t.bubbles.push_back(pipe.last_trace().bubble());
      t.overhead_s.push_back(overhead_seconds(pipe.last_trace(), pipe.schedule()));
      const auto memory = pipe.memory();
      t.peak_bytes.resize(memory.size(), 0);
      t.parameter_bytes.resize(memory.size(), 0);
      for (size_t j = 0; j < memory.size(); ++j) {
        t.peak_bytes[j] = std::max(t.peak_bytes[j], memory[j].peak_bytes);
        t.parameter_bytes[j] = memory[j].parameter_bytes;
      }
    }
  }
  return t;
}

// Keeps `row` for the results file; with --json prints it as a line and
// returns false, otherwise returns true: the caller prints its table line.
bool add_row(const BenchOptions& o, nlohmann::json& rows, const nlohmann::json& row) {
  rows.push_back(row);
  if (o.json) std::cout << row.dump() << std::endl;
  return !o.json;
}

// "(lo .. hi)" with one decimal.
std::string range_text(double lo, double hi) {
  std::ostringstream out;
  out << std::fixed << std::setprecision(1) << "(" << lo << " .. " << hi << ")";
  return out.str();
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
  nlohmann::json rows = nlohmann::json::array();
  if (w.prints() && !o.json)
    std::cout << std::left << std::setw(12) << "workload" << std::right << std::setw(3) << "K" << std::setw(3) << "D"
              << std::setw(5) << "M" << std::setw(13) << "checkpoint" << std::setw(13) << "samples/s" << std::setw(25)
              << "(min .. max)" << std::setw(8) << "bubble" << std::setw(7) << "ideal" << std::setw(16)
              << "MiB sent/step" << "  balance\n";
  for (const auto& name : o.workloads) {
    const Workload whole = make_workload(name, 0, LayerRange{0, 0});  // sizes and cut, no layers
    for (int M : o.micro_batches)
      for (const auto& mode_name : o.checkpoints)
        for (int K : o.stages) {
          const std::vector<int> cut = !o.balance.empty() ? o.balance : whole.balance(K);
          const mpi::Placement place = mpi::place(w.rank, w.size, K);
          const auto [first, last] = mpi::stage_layers(cut, place.stage);
          Workload mine = make_workload(name, 0, LayerRange{first, last});
          mpi::MpiPipeline pipe(mine.model, mpi::MpiPipelineOptions()
                                                .balance(cut)
                                                .chunks(M)
                                                .checkpoint(parse_checkpoint(mode_name))
                                                .schedule(parse_schedule(o.schedule))
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
          if (!w.prints()) continue;
          const double batch = static_cast<double>(mine.input.size(0));
          const double rate = batch / median(step_s);
          const double rmin = batch / *std::max_element(step_s.begin(), step_s.end());
          const double rmax = batch / *std::min_element(step_s.begin(), step_s.end());
          nlohmann::json row = {{"workload", name},
                                {"transport", "mpi"},
                                {"stages", K},
                                {"replicas", place.replicas},
                                {"micro_batches", M},
                                {"checkpoint", mode_name},
                                {"schedule", o.schedule},
                                {"threads_per_stage", o.threads},
                                {"balance", cut},
                                {"samples_per_s", rate},
                                {"samples_per_s_min", rmin},
                                {"samples_per_s_max", rmax},
                                {"bubble", median(bubbles)},
                                {"ideal", ideal_speedup(K, M)},
                                {"bytes_sent_per_step", sent_per_step},
                                {"steps", o.steps},
                                {"warmup", o.warmup}};
          if (add_row(o, rows, row)) {
            std::cout << std::left << std::setw(12) << name << std::right << std::setw(3) << K << std::setw(3)
                      << place.replicas << std::setw(5) << M << std::setw(13) << mode_name << std::fixed
                      << std::setprecision(1) << std::setw(13) << rate << std::setw(25) << range_text(rmin, rmax)
                      << std::setprecision(3) << std::setw(8) << median(bubbles) << std::setw(7)
                      << ideal_speedup(K, M) << std::setprecision(1) << std::setw(16) << sent_per_step / (1 << 20)
                      << "  " << nlohmann::json(cut).dump() << std::endl;
          }
        }
  }
  if (w.prints()) write_results(o, rows, command);
  return 0;
}
#endif

int run(const BenchOptions& o, const std::string& command) {
#if defined(GPIPE_HAS_MPI) && GPIPE_HAS_MPI
  if (o.transport) return run_transport(o, command);
  if (world().mpi) return run_mpi(o, command);
#endif
  GPIPE_CHECK(!o.transport, "--transport times MPI messages: build with MPI and start it with mpirun -np 2");
  for (const auto& n : o.workloads) {  // unknown names and bad cuts fail before any work
    const Workload w = make_workload(n, 0);
    if (!o.balance.empty()) {
      check_balance(o.balance, static_cast<int>(w.model->size()));
      for (int K : o.stages)
        GPIPE_CHECK(K == static_cast<int>(o.balance.size()), "--balance has ", o.balance.size(),
                    " stages but --stages asks for ", K, "; give --stages ", o.balance.size());
    }
  }
  std::vector<Checkpoint> modes;
  for (const auto& c : o.checkpoints) modes.push_back(parse_checkpoint(c));

  nlohmann::json rows = nlohmann::json::array();
  if (!o.json)
    std::cout << std::left << std::setw(12) << "workload" << std::right << std::setw(3) << "K"
              << std::setw(5) << "M" << std::setw(13) << "checkpoint" << std::setw(13) << "samples/s"
              << std::setw(25) << "(min .. max)" << std::setw(9) << "speedup" << std::setw(7)
              << "ideal" << std::setw(11) << "efficiency" << std::setw(8) << "bubble" << std::setw(11)
              << "vs unsplit" << std::setw(11) << "us/action" << "  peak MiB per stage  balance\n";
  for (const auto& name : o.workloads) {
    const int64_t batch = make_workload(name, 0).input.size(0);
    auto rate_of = [batch](const std::vector<double>& step_s) {
      return static_cast<double>(batch) / median(step_s);
    };
    // The whole batch in one piece on one device: what micro-batching itself costs.
    const double unsplit_rate = rate_of(time_single_device(name, o).step_s);
    for (int M : o.micro_batches)
      for (Checkpoint mode : modes) {
        // The ideal K·M/(M+K-1) compares with one device running the same M micro-batches.
        std::vector<int> balance;
        const double one_device_rate = rate_of(time_pipeline(name, 1, M, mode, "even", o, &balance).step_s);
        for (int K : o.stages)
        for (const std::string& balance_by : o.balance_by) {
          const Timing t = time_pipeline(name, K, M, mode, balance_by, o, &balance);
          const double rate = rate_of(t.step_s);
          const double rmin = static_cast<double>(batch) / *std::max_element(t.step_s.begin(), t.step_s.end());
          const double rmax = static_cast<double>(batch) / *std::min_element(t.step_s.begin(), t.step_s.end());
          const double speedup = rate / one_device_rate;
          const double ideal = ideal_speedup(K, M);
          nlohmann::json row = {{"workload", name},
                                {"stages", K},
                                {"micro_batches", M},
                                {"checkpoint", to_string(mode)},
                                {"schedule", o.schedule},
                                {"threads_per_stage", o.threads},
                                {"balance", balance},
                                {"balance_by", balance_by},
                                {"samples_per_s", rate},
                                {"samples_per_s_min", rmin},
                                {"samples_per_s_max", rmax},
                                {"one_device_samples_per_s", one_device_rate},
                                {"speedup", speedup},
                                {"ideal", ideal},
                                {"efficiency", speedup / ideal},
                                {"bubble", median(t.bubbles)},
                                // over the 2(M+K-1) actions on the critical path of fill-drain
                                {"overhead_us_per_action", median(t.overhead_s) * 1e6 / (2.0 * (M + K - 1))},
                                {"peak_bytes", t.peak_bytes},
                                {"parameter_bytes", t.parameter_bytes},
                                {"unsplit_samples_per_s", unsplit_rate},
                                {"speedup_vs_unsplit", rate / unsplit_rate},
                                {"steps", o.steps},
                                {"warmup", o.warmup}};
          if (add_row(o, rows, row)) {
            std::cout << std::left << std::setw(12) << name << std::right << std::setw(3) << K
                      << std::setw(5) << M << std::setw(13) << to_string(mode) << std::fixed
                      << std::setprecision(1) << std::setw(13) << rate << std::setw(25) << range_text(rmin, rmax)
                      << std::setprecision(3) << std::setw(9) << speedup << std::setw(7) << ideal
                      << std::setw(11) << speedup / ideal << std::setw(8) << median(t.bubbles)
                      << std::setw(11) << rate / unsplit_rate << std::setprecision(1) << std::setw(11)
                      << median(t.overhead_s) * 1e6 / (2.0 * (M + K - 1)) << "  " << std::setw(18) << std::left
                      << mebibytes(t.peak_bytes) << std::right << "  " << balance_by << " "
                      << nlohmann::json(balance).dump() << std::endl;
          }
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
      "bench", "Time the workloads of BENCHMARKS.md through the pipeline against one device");
  sub->add_option("--workload", o->workloads, "mlp, transformer, tiny, imbalanced (several sweep)")
      ->capture_default_str();
  sub->add_option("--stages", o->stages, "numbers of stages K to sweep")
      ->check(CLI::PositiveNumber)->capture_default_str();
  sub->add_option("--micro-batches", o->micro_batches, "numbers of micro-batches M to sweep")
      ->check(CLI::PositiveNumber)->capture_default_str();
  sub->add_option("--checkpoint", o->checkpoints, "always, except_last, never (several sweep)")
      ->check(CLI::IsMember({"always", "except_last", "never"}))->capture_default_str();
  sub->add_option("--schedule", o->schedule, "gpipe (fill-drain), 1f1b or zb1p, for every configuration")
      ->check(CLI::IsMember({"gpipe", "1f1b", "zb1p"}))->capture_default_str();
  sub->add_option("--threads-per-stage", o->threads, "intra-op threads of each stage (and of the one device)")
      ->check(CLI::PositiveNumber)->capture_default_str();
  sub->add_option("--steps", o->steps, "timed steps per configuration (the median is reported)")
      ->check(CLI::PositiveNumber)->capture_default_str();
  sub->add_option("--warmup", o->warmup, "untimed steps first")->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  sub->add_option("--balance", o->balance, "an explicit cut, layers per stage (then --stages is its length)");
  sub->add_option("--balance-by", o->balance_by,
                  "how stages are cut (several sweep): even (blocks evenly, as BENCHMARKS.md), params (parameter "
                  "counts), time (profiled forward+backward per layer) or memory (activations kept plus "
                  "parameters, gradients and momentum); exact min-max partition")
      ->check(CLI::IsMember({"even", "params", "time", "memory"}))->capture_default_str();
  sub->add_flag("--json", o->json, "one JSON object per configuration on standard output (JSON Lines)");
  sub->add_flag("--transport", o->transport,
                "under mpirun -np 2: latency and bandwidth of the MPI transport per message size (ping-pong)");
  sub->add_option("--results", o->results, "file the results are written to (empty: none)")
      ->capture_default_str();
  sub->callback([o, command, &status] { status = run(*o, command); });
}

}  // namespace gpipe::cli
