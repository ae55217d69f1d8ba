// bench.cc: `gpipe bench`: its flags, and the rows of the library's sweep (run_benchmark, tasks.h) as a
// table or JSON; in one process, or one rank per device under mpirun (the same sweep).
#include "commands.h"
#include "flags.h"

#include <gpipe/gpipe.h>

#include <CLI/CLI.hpp>

#include <algorithm>
#include <iomanip>
#include <iostream>

namespace gpipe::cli {
namespace {

struct BenchOptions {
  BenchSweep sweep;
  bool json = false;
  bool transport = false;  // MPI: time the transport alone (run_transport)
  std::string results = "bench/results/bench.json";
};

std::string mebibytes(const std::vector<int64_t>& bytes) {
  std::string out;
  for (size_t j = 0; j < bytes.size(); ++j) out += (j ? " " : "") + fixed(static_cast<double>(bytes[j]) / (1 << 20), 1);
  return out.empty() ? "-" : out;
}

void print_header() {
  std::cout << std::left << std::setw(12) << "workload" << std::right << std::setw(3) << "K" << std::setw(3) << "D"
            << std::setw(5) << "M" << std::setw(13) << "checkpoint" << std::setw(20) << "schedule" << std::setw(11)
            << "samples/s" << std::setw(9) << "speedup" << std::setw(17) << "(min .. max)" << std::setw(7) << "ideal"
            << std::setw(6) << "eff" << std::setw(8) << "bubble" << std::setw(9) << "vs unspl" << std::setw(9)
            << "sim/meas" << std::setw(8) << "pred t" << std::setw(9) << "pred mem" << std::setw(9) << "sent MiB"
            << std::setw(10) << "skip MiB" << "  peak MiB per device  balance\n";
}

void print_row(const BenchRow& r) {
  auto baseline = [&r](double value, int digits) { return r.has_baselines ? fixed(value, digits) : "-"; };
  const std::string range = r.has_baselines ? "(" + fixed(r.speedup.min, 2) + " .. " + fixed(r.speedup.max, 2) + ")" : "-";
  const PipelineConfig& c = r.config;
  const std::string schedule = (r.chosen ? "auto:" : "") + to_string(c.schedule);
  std::cout << std::left << std::setw(12) << r.workload << std::right << std::setw(3) << c.devices << std::setw(3)
            << r.replicas << std::setw(5) << c.micro_batches << std::setw(13) << to_string(c.checkpoint) << std::setw(20)
            << schedule + (c.virtual_stages > 1 ? "/" + std::to_string(c.virtual_stages) : "") << std::setw(11) << fixed(r.samples_per_s, 1)
            << std::setw(9) << baseline(r.speedup.median, 3) << std::setw(17) << range << std::setw(7)
            << fixed(r.ideal, 3) << std::setw(6) << baseline(r.efficiency, 2) << std::setw(8) << fixed(r.bubble, 3)
            << std::setw(9) << baseline(r.speedup_vs_unsplit.median, 3) << std::setw(9)
            << fixed(r.simulated_over_measured, 3) << std::setw(8) << fixed(r.predicted.step_s / r.step_s, 3)
            << std::setw(9) << (r.peak_bytes.empty() ? "-" : fixed(r.predicted_over_measured_peak, 3))
            << std::setw(9) << fixed(r.bytes_sent_per_step / (1 << 20), 1) << std::setw(10)
            << fixed(r.skip_bytes_per_step / (1 << 20), 2) << "  " << std::left << std::setw(19)
            << mebibytes(r.peak_bytes) << std::right << "  " << r.balance_by << " "
            << nlohmann::json(c.balance).dump() << std::endl;
}

// `gpipe bench --transport`: latency and bandwidth of the MPI transport between two ranks, by ping-pong
// per message size (header and data messages, as a pipeline sends them).
int run_transport(int warmup, bool json, const std::string& results, const std::string& command) {
  const std::vector<LinkTiming> timings = or_usage_error("--transport", [&] { return time_link(warmup); });
  if (!job().prints()) return 0;
  if (!json)
    std::cout << std::setw(12) << "bytes" << std::setw(10) << "repeats" << std::setw(16) << "one-way us"
              << std::setw(22) << "(min .. max)" << std::setw(12) << "GB/s" << "\n";
  std::vector<std::string> rows;
  for (const LinkTiming& t : timings) {
    rows.push_back(json_of(t));
    if (json) {
      std::cout << rows.back() << std::endl;
      continue;
    }
    std::cout << std::setw(12) << t.bytes << std::setw(10) << t.repeats << std::fixed << std::setprecision(1)
              << std::setw(16) << t.one_way_s * 1e6 << std::setw(22)
              << "(" + fixed(t.min_s * 1e6, 1) + " .. " + fixed(t.max_s * 1e6, 1) + ")" << std::setprecision(3)
              << std::setw(12) << t.gb_per_s() << std::endl;
  }
  write_results(results, rows, command);
  return 0;
}

int run(const BenchOptions& o, const std::string& command) {
  if (job().prints()) or_usage_error("--results", [&] { check_results_path(o.results); });
  if (o.transport) return run_transport(o.sweep.warmup, o.json, o.results, command);
  check_bench(o.sweep);
  std::vector<std::string> rows;
  if (job().prints() && !o.json) print_header();
  run_benchmark(o.sweep, [&](const BenchRow& row) {
    rows.push_back(json_of(row));
    if (o.json)
      std::cout << rows.back() << std::endl;
    else
      print_row(row);
  });
  if (job().prints()) write_results(o.results, rows, command);
  return 0;
}

}  // namespace

void add_bench_command(CLI::App& app, const std::string& command, int& status) {
  auto o = std::make_shared<BenchOptions>();
  BenchSweep& w = o->sweep;
  CLI::App* sub = app.add_subcommand(
      "bench", "Time the workloads defined in docs/benchmarks.md through the pipeline against one device");
  const TakeFlags take = add_fields(sub, w, bench_fields(), "bench");
  sub->add_flag("--json", o->json, "one JSON object per configuration on standard output (JSON Lines)");
  CLI::Option* transport = sub->add_flag(
      "--transport", o->transport,
      "under mpirun -np 2 or torchrun --nproc_per_node 2: latency and bandwidth of the job's transport (MPI or c10d) per message size (ping-pong; of the "
      "other flags only --warmup, --json and --results apply)");
  for (const Field<BenchSweep>& row : bench_fields())  // all but --warmup are the sweep's
    if (row.name != "warmup") transport->excludes(sub->get_option(row.flag));
  sub->add_option("--results", o->results, "file the results are written to (empty: none)")
      ->capture_default_str();
  sub->callback([o, take, command, &status] {
    const std::vector<std::string> given = take();
    o->sweep.balance_by_given = std::find(given.begin(), given.end(), "balance_by") != given.end();
    status = run(*o, command);
  });
}

}  // namespace gpipe::cli
