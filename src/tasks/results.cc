// results.cc: the JSON rows of gpipe's commands and gpipe bench's result files (nlohmann-json,
// private to this file).
#include "gpipe/results.h"

#include "gpipe/cost_model.h"
#include "gpipe/device.h"
#include "gpipe/io.h"

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <cmath>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <stdexcept>
#include <thread>

namespace gpipe {

namespace {

// A pipeline's config as its JSON rows have it: its fields (fields_of), K named "stages" as in every
// row gpipe has written.
nlohmann::json config_json(const PipelineConfig& config) {
  nlohmann::json out;
  for (const auto& [name, value] : fields_of(config))
    std::visit([&out, &name = name](const auto& v) { out[name == "devices" ? "stages" : name] = v; }, value);
  return out;
}

}  // namespace

std::string json_of(const BenchRow& r) {
  const Prediction& p = r.predicted;
  nlohmann::json row = config_json(r.config);  // schedule, stages (K), micro_batches, V, balance, ...
  if (r.chosen) row["schedule"] = "auto:" + to_string(r.config.schedule);
  row.update(nlohmann::json{
      {"workload", r.workload}, {"tie_embeddings", r.tie_embeddings}, {"transport", r.transport},
      {"replicas", r.replicas}, {"threads_per_device", r.threads_per_device}, {"balance_by", r.balance_by},
      {"order", r.order},
      {"samples_per_s", r.samples_per_s}, {"samples_per_s_min", r.samples_per_s_min},
      {"samples_per_s_max", r.samples_per_s_max}, {"ideal", r.ideal}, {"bubble", r.bubble},
      {"overhead_us_per_step", r.overhead_us_per_step}, {"step_s", r.step_s}, {"predicted_step_s", p.step_s},
      {"predicted_bubble", p.bubble}, {"predicted_peak_bytes", p.peak_bytes}, {"predicted_static_bytes", p.static_bytes},
      {"peak_bytes", r.peak_bytes}, {"peak_held_bytes", r.peak_held_bytes}, {"parameter_bytes", r.parameter_bytes},
      {"bytes_sent_per_step", r.bytes_sent_per_step}, {"skip_bytes_per_step", r.skip_bytes_per_step},
      {"program_actions_per_device", r.program_actions_per_device}, {"steps", r.steps}, {"warmup", r.warmup},
      {"simulated_over_measured", r.simulated_over_measured}});
  auto ratio = [&row](const std::string& name, const BenchRatio& x) {
    row.update({{name, x.median}, {name + "_min", x.min}, {name + "_max", x.max}});
  };
  if (r.has_baselines) {
    row.update({{"one_device_samples_per_s", r.one_device_samples_per_s}, {"efficiency", r.efficiency},
                {"unsplit_samples_per_s", r.unsplit_samples_per_s}});
    ratio("speedup", r.speedup);
    ratio("speedup_vs_unsplit", r.speedup_vs_unsplit);
  }
  if (!r.vs_schedule.empty()) {
    row.update({{"vs_schedule", r.vs_schedule}, {"bubble_vs_schedule", r.bubble_vs_schedule},
                {"peak_bytes_vs_schedule", r.peak_bytes_vs_schedule},
                {"peak_held_bytes_vs_schedule", r.peak_held_bytes_vs_schedule}});
    ratio("speedup_vs_schedule", r.speedup_vs_schedule);
  }
  return row.dump();
}

std::string json_of(const LinkTiming& t) {
  return nlohmann::json{{"bytes", t.bytes},
                        {"repeats", t.repeats},
                        {"one_way_us", t.one_way_s * 1e6},
                        {"one_way_us_min", t.min_s * 1e6},
                        {"one_way_us_max", t.max_s * 1e6},
                        {"gb_per_s", t.gb_per_s()}}
      .dump();
}

std::string json_of(const PlanCandidate& c) {
  nlohmann::json out = config_json(c.config);
  out.update(nlohmann::json{{"replicas", c.replicas}, {"predicted_samples_per_s", c.samples_per_s},
                            {"predicted_step_s", c.step_s}, {"predicted_bubble", c.predicted.bubble},
                            {"predicted_peak_bytes", c.predicted.peak_bytes},
                            {"predicted_static_bytes", c.predicted.static_bytes},
                            {"predicted_total_bytes", c.predicted.total_bytes()}, {"fits", c.fits},
                            {"order", order_name(c.config.stage_times)}});
  return out.dump();
}

std::string json_of(const Schedule& program, const SimulatedRun& run, const std::string& name,
                    const std::string& checkpoint) {
  nlohmann::json rows = nlohmann::json::array();
  for (const auto& row : program.actions) {
    rows.push_back(nlohmann::json::array());
    for (const Action& a : row) rows.back().push_back(a.str());
  }
  return nlohmann::json{{"schedule", name},
                        {"devices", program.devices},
                        {"micro_batches", program.micro_batches},
                        {"virtual_stages", program.virtual_stages()},
                        {"checkpoint", checkpoint},
                        {"makespan_slots", run.makespan},
                        {"bubble", run.bubble},
                        {"peak_in_flight", run.peak_in_flight},
                        {"program", rows}}
      .dump();
}

namespace {

// This process's BLAS kernel (blas.h) and one thread's GFLOP/s, for machine_json.
nlohmann::json blas_kernel_json() {
  const BlasKernel kernel = blas_kernel();
  return {{"running", kernel.running}, {"best", kernel.best}, {"chosen_by", kernel.chosen_by},
          {"vector_isa", kernel.vector_isa}, {"gflops_one_thread", std::round(blas_gflops() * 10) / 10}};
}

}  // namespace

std::string machine_json() {
  std::string cpu = "unknown";
  std::ifstream info("/proc/cpuinfo");
  for (std::string line; std::getline(info, line);)
    if (line.rfind("model name", 0) == 0) {
      cpu = line.substr(line.find(':') + 2);
      break;
    }
  return nlohmann::json{
      {"cores", std::thread::hardware_concurrency()},
      {"cpu", cpu},
      {"blas", blas_info()},
      {"blas_kernel", blas_kernel_json()},
      {"malloc", freed_memory_kept() ? "glibc, freed memory kept (trim 256 MiB, mmap 32 MiB, top pad 64 MiB)"
                                     : "as the environment or the C library sets it"},
      {"libtorch", TORCH_VERSION},
      {"cuda", torch::cuda::is_available()}}
      .dump();
}

namespace {

// Makes the folder `path` goes into, or throws naming it and what to do.
void make_folder_of(const std::string& path) {
  const std::filesystem::path file(path);
  std::error_code error;
  if (file.has_parent_path() && !std::filesystem::create_directories(file.parent_path(), error) && error)
    throw std::runtime_error("cannot create the folder " + file.parent_path().string() + " (" + error.message() +
                             "); give a path in a folder you can write to");
}

}  // namespace

void check_results_path(const std::string& path) {
  if (path.empty()) return;
  make_folder_of(path);
  check_writable(path);
}

void write_results(const std::string& path, const std::vector<std::string>& rows, const std::string& command) {
  if (path.empty()) return;
  make_folder_of(path);
  const std::time_t now = std::time(nullptr);
  char date[32];
  std::strftime(date, sizeof date, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
  nlohmann::json results = nlohmann::json::array();
  for (const std::string& row : rows) results.push_back(nlohmann::json::parse(row));
  const nlohmann::json doc = {
      {"command", command}, {"date", date}, {"machine", nlohmann::json::parse(machine_json())}, {"results", results}};
  write_file_atomically(path, doc.dump(2) + "\n");
  std::cerr << "results written to " << path << "\n";
}

}  // namespace gpipe
