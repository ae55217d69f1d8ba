// bench_rows.cc: what `gpipe bench` reports of each configuration: its row, as JSON and in the table.
#include "bench.h"
#include "common.h"

#include <algorithm>
#include <cmath>
#include <iomanip>
#include <iostream>

namespace gpipe::cli {
namespace {

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

}  // namespace

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

}  // namespace gpipe::cli
