// plan.cc: `gpipe plan`: the configurations that fit a model on a cluster, fastest first, predicted by
// the cost model (cost_model.h) and the schedule simulator, before anything runs.
#include "commands.h"
#include "flags.h"

#include <gpipe/gpipe.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <iomanip>
#include <iostream>
#include <memory>
#include <set>
#include <sstream>

namespace gpipe::cli {
namespace {

struct PlanOptions {
  // The model: a workload, a TorchScript file, or a Transformer by its shape.
  std::string workload;
  std::string model;
  std::vector<int64_t> input_shape;  // one sample's shape, for --model
  int64_t input_tokens = 0;          // with --model: samples of token ids below it (0: random floats)
  TransformerShape transformer;      // a Transformer by its shape (shape_fields); its precision set by run
  // The cluster.
  int devices = 0;
  std::string memory = "16GiB";
  double flops = 100e12;  // per device, for a Transformer given by shape
  double speed = 1.0;     // for a profiled model: the device's speed relative to this machine's core
  double latency_us = 5.0;
  double bandwidth_gb_s = 25.0;
  std::string optimizer = "adam";
  std::string precision = "fp32";  // of the stages' forwards: the bytes a value takes, the profile's arithmetic
  int64_t batch = 0;
  std::vector<std::string> schedules = schedule_names();
  std::vector<std::string> checkpoints{"never", "except_last", "always"};
  std::vector<int> stages;         // K to consider (empty: every divisor of the devices)
  std::vector<int> micro_batches;  // M to consider (empty: powers of two up to max(8, 4·K) and the rows)
  int top = 10;
  bool all = false;
  bool json = false;
  std::set<std::string> given;  // the flags on the command line
};

// A Transformer by its shape: gpipe plan's flags of it.
std::vector<Field<TransformerShape>> make_shape_fields() {
  using T = TransformerShape;
  std::vector<Field<T>> rows{
      {"layers", "--layers", "a Transformer's encoder blocks", &T::layers, whole_number(1)},
      {"width", "--width", "its model width", &T::width, whole_number(1)},
      {"heads", "--heads", "its attention heads", &T::heads, whole_number(1)},
      {"ffn", "--ffn", "its feed-forward width", &T::ffn, whole_number(1)},
      {"vocab", "--vocab", "its vocabulary", &T::vocab, whole_number(1)},
      {"sequence", "--seq", "its sequence length", &T::sequence, whole_number(1)},
      {"bytes_per_value", "--bytes-per-value",
       "a Transformer by shape: 4 (float32) or 2 (the whole model in half precision: parameters, optimizer state "
       "and activations)",
       &T::bytes_per_value, one_of({"4", "2"}, "bytes per value: float32 or half precision")},
  };
  rows.back().shows_default = true;
  return rows;
}

// gpipe plan's other flags: the model, the cluster and the configurations searched; where plan searches
// a setting of gpipe train, its row is train's.
std::vector<Field<PlanOptions>> make_plan_fields() {
  using P = PlanOptions;
  std::string tasks;
  for (const std::string& n : task_names(true)) tasks += (tasks.empty() ? "" : ", ") + n;
  std::vector<Field<P>> rows{
      {"workload", "--workload",
       "a built-in task or benchmark workload (tasks.h: " + tasks + "), profiled here on a random batch of its "
       "shape; `model` NAME says the same",
       &P::workload, one_of(task_names(true))},
      {"model", "--model",
       "a built-in task by name (as `workload`), or a TorchScript nn.Sequential, profiled here (with `input_shape`)",
       &P::model, {}},
      {"input_shape", "--input-shape", "one sample's shape for `model`, e.g. 1,28,28", &P::input_shape, whole_number(1)},
      {"input_tokens", "--input-tokens",
       "with `model`: samples of token ids 0..N-1 (a model that starts with an Embedding of N entries) rather than "
       "random floats",
       &P::input_tokens, whole_number(1)},
      train_field<P>("precision", &P::precision,
                      "the stages' arithmetic (as gpipe train's `precision`): fp32, or bf16 and fp16 (autocast), "
                      "whose activations take 2 bytes a value (parameters keep `bytes_per_value`); a profiled model "
                      "is profiled under it"),
      {"cluster_devices", "--devices", "devices in the cluster", &P::devices, number_in(1, 1 << 16, /*whole=*/true)},
      {"memory_per_device", "--memory-per-device", "memory of each device, e.g. 16GiB", &P::memory, {}},
      {"flops", "--flops", "FLOP/s of a device on a Transformer given by shape (1e3 to 1e21)", &P::flops,
       number_in(1e3, 1e21)},
      {"speed", "--speed", "a device's speed relative to this machine's core, for a profiled model", &P::speed,
       number_in(1e-6, 1e9)},
      {"latency_us", "--latency-us", "latency of a link between devices, microseconds", &P::latency_us,
       number_in(0, 1e9)},
      {"bandwidth_gb_s", "--bandwidth-gb-s", "bandwidth of a link, GB/s", &P::bandwidth_gb_s, number_in(1e-6, 1e9)},
      {"optimizer", "--optimizer",
       "the state kept per parameter: sgd (none), momentum (one value), adam or adamw (two)", &P::optimizer,
       one_of(plan_optimizer_names())},
      {"batch", "--batch", "the global batch, rows per step", &P::batch, whole_number(1, kMostInt64)},
      train_field<P>("schedule", &P::schedules, "schedules to consider (auto: every one)",
                     one_of(schedule_choices({"auto"}))),
      train_field<P>("checkpoint", &P::checkpoints, "checkpoint modes to consider"),
      train_field<P>("devices", &P::stages, "pipeline depths K to consider (default: every divisor of `cluster_devices`)"),
      train_field<P>("micro_batches", &P::micro_batches,
                      "micro-batch counts M to consider (default: 1, 2, 4, ... up to max(8, 4·K) and the rows per "
                      "replica)"),
      {"top", "--top", "configurations shown", &P::top, whole_number(1)},
      {"all", "--all", "show every configuration that fits", &P::all, {}},
  };
  for (Field<P>& row : rows)
    for (const char* shown : {"precision", "memory_per_device", "flops", "speed", "latency_us",
                              "bandwidth_gb_s", "optimizer", "top"})
      if (row.name == shown) row.shows_default = true;
  return rows;
}

const std::vector<Field<PlanOptions>>& plan_fields() {
  static const std::vector<Field<PlanOptions>> rows = make_plan_fields();
  return rows;
}

const std::vector<Field<TransformerShape>>& shape_fields() {
  static const std::vector<Field<TransformerShape>> rows = make_shape_fields();
  return rows;
}

// A table figure that leaves its column at least one space: `digits` decimals where they fit in
// `width` - 1 characters and show the value, else 4 significant digits (1.955e+14, 2.5e-07).
std::string figure(double value, int width, int digits) {
  std::ostringstream fixed_text, short_text;
  fixed_text << std::fixed << std::setprecision(digits) << value;
  const bool shows = value == 0 || std::abs(value) >= std::pow(10.0, -digits);
  if (shows && static_cast<int>(fixed_text.str().size()) < width) return fixed_text.str();
  short_text << std::setprecision(4) << value;
  return short_text.str();
}

// The model of --workload or --model, profiled here, its errors named by the flags that gave it.
PlannedModel profiled_model(const PlanOptions& o) {
  const PlanProfileOptions profile = PlanProfileOptions()
                                        .optimizer(o.optimizer)
                                        .speed(o.speed)
                                        .name("model " + o.model)
                                        .layers(ProfileLayersOptions().precision(o.transformer.precision));
  if (!o.workload.empty())
    return or_usage_error("--workload", [&] { return plan_model_of(find_task(o.workload), TaskOptions(), profile); });
  return plan_model_of(o.model, o.input_shape, profile, o.input_tokens);
}

// "{3, 3, 2}" for short cuts, "{5, 4, ..., 5} (16 stages)" for long ones.
std::string cut_text(const std::vector<int>& balance) {
  if (balance.size() <= 8) return format_balance(balance);
  return "{" + std::to_string(balance.front()) + ", " + std::to_string(balance[1]) + ", ..., " +
         std::to_string(balance.back()) + "} (" + std::to_string(balance.size()) + " stages)";
}

int run(PlanOptions o) {  // a copy: --precision is set into its Transformer
  const auto begin = std::chrono::steady_clock::now();
  const int64_t memory = or_usage_error("--memory-per-device", [&] { return parse_bytes(o.memory); });
  if (memory < 1) usage_error("--memory-per-device: " + o.memory + " is less than one byte");
  const std::vector<std::string> shape_flags{"--layers", "--width", "--heads", "--ffn", "--vocab", "--seq"};
  const bool by_shape = std::any_of(shape_flags.begin(), shape_flags.end(), [&](auto& f) { return o.given.count(f) > 0; });
  const int sources = (by_shape ? 1 : 0) + (o.workload.empty() ? 0 : 1) + (o.model.empty() ? 0 : 1);
  if (sources != 1)
    usage_error(std::string(sources == 0 ? "no model given" : "more than one model given") +
                ": give one of --workload NAME, --model FILE.pt --input-shape ..., or a Transformer by --layers, "
                "--width, --heads, --ffn, --vocab and --seq");
  // Flags that belong to the other kind of model would be silently ignored: refuse them.
  for (const std::string& f : by_shape ? std::vector<std::string>{"--speed", "--input-shape", "--input-tokens"}
                                       : std::vector<std::string>{"--flops", "--bytes-per-value"})
    if (o.given.count(f))
      usage_error(f + " applies to " +
                  (!by_shape                ? "a Transformer given by shape"
                   : f == "--speed"        ? "a profiled model (--workload or --model)"
                                           : "--model, a TorchScript file") +
                  "; leave it out");
  o.transformer.precision = parse_precision(o.precision);
  if (!by_shape)  // profiled here: the stages' CPU autocast
    check_precision_runs(o.transformer.precision, c10::DeviceType::CPU);
  for (const std::string f : {"--input-shape", "--input-tokens"})
    if (!o.workload.empty() && o.given.count(f)) usage_error(f + " applies to --model; a workload has its own input");
  if (by_shape) {
    for (const std::string& f : shape_flags)
      if (!o.given.count(f)) usage_error("a Transformer given by shape needs " + f + " too");
    if (o.transformer.layers > kMostPlannedBlocks)
      usage_error("--layers " + std::to_string(o.transformer.layers) + " is more than gpipe plan takes (" +
                  std::to_string(kMostPlannedBlocks) + ")");
  }
  PlanSearch search = plan_search_of(o.devices, memory, o.batch, o.schedules, o.checkpoints, o.stages, o.micro_batches);
  search.check();
  PlannedModel m = by_shape ? or_usage_error("the Transformer", [&] {
    return plan_model_of(o.transformer, DeviceSpec{o.flops}, o.optimizer);
  }) : profiled_model(o);
  m.costs.link_latency_s = o.latency_us * 1e-6;
  m.costs.link_bytes_per_s = o.bandwidth_gb_s * 1e9;
  // A search of more than 2 s (the profile's time not counted) says how far it is every 2 s on standard
  // error (one line rewritten on a terminal); one that said so ends with its 100% line.
  ProgressLine progress;
  search.progress = [&](int64_t done, int64_t total) {
    if (done == total ? !progress.shown() : !progress.due(2.0)) return;
    const double percent =
        done == total ? 100 : std::min(99.0, 100.0 * static_cast<double>(done) / static_cast<double>(total));
    progress.show("gpipe plan: " + fixed(percent, 0) + "% of " + std::to_string(total) +
                  " stage x micro-batch pairs simulated in " + fixed(progress.seconds(), 0) + " s");
  };
  std::vector<PlanCandidate> found = search_plans(m, search);
  progress.end();
  for (PlanCandidate& c : found) c.config.precision = o.transformer.precision;  // what each would run in
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - begin).count();
  const size_t feasible = static_cast<size_t>(std::count_if(found.begin(), found.end(), [](const PlanCandidate& c) { return c.fits; }));
  if (feasible == 0) {
    for (size_t n = 0; o.json && n < std::min<size_t>(found.size(), static_cast<size_t>(o.top)); ++n)
      std::cout << json_of(found[n]) << "\n";
    std::cerr << "gpipe: "
              << no_fit_message(found, m, search, o.optimizer, by_shape && o.transformer.bytes_per_value == 4,
                                {"--checkpoint always", "--devices", "--bytes-per-value 2", "--optimizer"})
              << "\n";
    return 1;
  }
  const size_t shown = o.all ? feasible : std::min(feasible, static_cast<size_t>(o.top));
  if (o.json) {
    for (size_t n = 0; n < shown; ++n) std::cout << json_of(found[n]) << "\n";
    return 0;
  }
  std::cout << m.description << "\n"
            << "cluster: " << o.devices << " devices of " << format_bytes(static_cast<double>(memory)) << ", links "
            << o.latency_us << " us and " << o.bandwidth_gb_s << " GB/s; optimizer " << o.optimizer
            << (o.precision == "fp32" ? "" : "; precision " + o.precision) << "; batch "
            << o.batch << "\n"
            << feasible << " of " << found.size() << " configurations fit (planned in " << std::fixed
            << std::setprecision(2) << seconds << " s); the " << shown << " fastest:\n"
            << std::setw(4) << "K" << std::setw(5) << "D" << std::setw(5) << "M" << std::setw(14) << "schedule"
            << std::setw(13) << "checkpoint" << std::setw(12) << "samples/s" << std::setw(11) << "step s"
            << std::setw(8) << "bubble" << std::setw(13) << "peak/device" << "  cut\n";
  for (size_t n = 0; n < shown; ++n) {
    const PlanCandidate& c = found[n];
    const std::string schedule = to_string(c.config.schedule);
    std::cout << std::setw(4) << c.config.devices << std::setw(5) << c.replicas << std::setw(5)
              << c.config.micro_batches
              << std::setw(14)
              << (c.config.virtual_stages > 1 ? schedule + "/" + std::to_string(c.config.virtual_stages) : schedule)
              << std::setw(13) << to_string(c.config.checkpoint)
              << std::setw(12) << figure(c.samples_per_s, 12, 1) << std::setw(11) << figure(c.step_s, 11, 4)
              << std::setw(8) << std::setprecision(3) << c.predicted.bubble << std::setw(13)
              << format_bytes(static_cast<double>(c.largest_total_bytes)) << "  " << cut_text(c.config.balance) << "\n";
  }
  return 0;
}

}  // namespace

void add_plan_command(CLI::App& app, const std::string&, int& status) {
  auto o = std::make_shared<PlanOptions>();
  CLI::App* sub = app.add_subcommand(
      "plan", "Predict the configurations (K, replicas, M, schedule, checkpoint, cut) that fit a model on a cluster, "
              "fastest first; nothing runs (docs/giant-models.md)");
  for (const auto& row : shape_fields()) remember_flag(row.name, row.flag);  // plan's help names them
  const TakeFlags take_plan = add_fields(sub, *o, plan_fields(), "plan");
  const TakeFlags take_shape = add_fields(sub, o->transformer, shape_fields(), "plan");
  for (const char* needed : {"--devices", "--batch"}) sub->get_option(needed)->required();
  sub->add_flag("--json", o->json, "one JSON object per configuration (JSON Lines)");
  sub->callback([o, take_plan, take_shape, sub, &status] {
    take_plan();
    take_shape();
    for (const CLI::Option* option : sub->get_options())
      if (option->count() > 0) o->given.insert(option->get_name());
    const std::vector<std::string> tasks = task_names(true);
    if (o->workload.empty() && std::find(tasks.begin(), tasks.end(), o->model) != tasks.end()) {
      o->workload = o->model;  // a built-in task by name
      o->model.clear();
      o->given.erase("--model");
      o->given.insert("--workload");
    }
    status = run(*o);
  });
}

}  // namespace gpipe::cli
