// plan.cc: `gpipe plan`: the configurations that fit a model on a cluster, fastest first, predicted by
// the cost model (cost_model.h) and the schedule simulator, before anything runs.
#include "commands.h"
#include "common.h"

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
  TransformerShape transformer;
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
    or_usage_error("--precision", [&] { check_precision_runs(o.transformer.precision, c10::DeviceType::CPU); });
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
  sub->add_option("--workload", o->workload,
                  "a built-in task or benchmark workload (tasks.h: " + [] {
                    std::string names;
                    for (const std::string& n : task_names(true)) names += (names.empty() ? "" : ", ") + n;
                    return names;
                  }() + "), profiled here on a random batch of its shape; --model NAME says the same")
      ->check(CLI::IsMember(task_names(true)));
  sub->add_option("--model", o->model,
                  "a built-in task by name (as --workload), or a TorchScript nn.Sequential, profiled here (with "
                  "--input-shape)");
  sub->add_option("--input-shape", o->input_shape, "one sample's shape for --model, e.g. 1,28,28")
      ->delimiter(',')->check(at_least(1));
  sub->add_option("--input-tokens", o->input_tokens,
                  "with --model: samples of token ids 0..N-1 (a model that starts with an Embedding of N entries) "
                  "rather than random floats")
      ->check(at_least(1));
  sub->add_option("--layers", o->transformer.layers, "a Transformer's encoder blocks")->check(at_least(1));
  sub->add_option("--width", o->transformer.width, "its model width")->check(at_least(1));
  sub->add_option("--heads", o->transformer.heads, "its attention heads")->check(at_least(1));
  sub->add_option("--ffn", o->transformer.ffn, "its feed-forward width")->check(at_least(1));
  sub->add_option("--vocab", o->transformer.vocab, "its vocabulary")->check(at_least(1));
  sub->add_option("--seq", o->transformer.sequence, "its sequence length")->check(at_least(1));
  sub->add_option("--precision", o->precision,
                  "the stages' arithmetic (as gpipe train --precision): fp32, or bf16 and fp16 (autocast), whose "
                  "activations take 2 bytes a value (parameters keep --bytes-per-value); a profiled model is profiled under it")
      ->check(one_of(precision_names()))->capture_default_str();
  sub->add_option("--bytes-per-value", o->transformer.bytes_per_value,
                  "a Transformer by shape: 4 (float32) or 2 (the whole model in half precision: parameters, "
                  "optimizer state and activations)")
      ->check(one_of({"4", "2"}, "bytes per value: float32 or half precision"))->capture_default_str();
  sub->add_option("--devices", o->devices, "devices in the cluster")->required()->check(in_range(1, 1 << 16, /*whole=*/true));
  sub->add_option("--memory-per-device", o->memory, "memory of each device, e.g. 16GiB")->capture_default_str();
  sub->add_option("--flops", o->flops, "FLOP/s of a device on a Transformer given by shape (1e3 to 1e21)")
      ->check(in_range(1e3, 1e21))->capture_default_str();
  sub->add_option("--speed", o->speed, "a device's speed relative to this machine's core, for a profiled model")
      ->check(in_range(1e-6, 1e9))->capture_default_str();
  sub->add_option("--latency-us", o->latency_us, "latency of a link between devices, microseconds")
      ->check(in_range(0.0, 1e9))->capture_default_str();
  sub->add_option("--bandwidth-gb-s", o->bandwidth_gb_s, "bandwidth of a link, GB/s")
      ->check(in_range(1e-6, 1e9))->capture_default_str();
  sub->add_option("--optimizer", o->optimizer, "sgd, momentum or adam: the state kept per parameter")
      ->check(CLI::IsMember({"sgd", "momentum", "adam"}))->capture_default_str();
  sub->add_option("--batch", o->batch, "the global batch, rows per step")->required()->check(at_least(1, kMostInt64));
  sub->add_option("--schedule", o->schedules, "schedules to consider (auto: every one)")
      ->delimiter(',')->check(CLI::IsMember([] {
        std::vector<std::string> names = schedule_names();
        names.push_back("auto");
        return names;
      }()))->capture_default_str();
  sub->add_option("--checkpoint", o->checkpoints, "checkpoint modes to consider")
      ->delimiter(',')->check(CLI::IsMember(checkpoint_names()))->capture_default_str();
  sub->add_option("--stages", o->stages, "pipeline depths K to consider (default: every divisor of --devices)")
      ->delimiter(',')->check(at_least(1));
  sub->add_option("--micro-batches", o->micro_batches, "micro-batch counts M to consider (default: 1, 2, 4, ... up to max(8, 4·K) "
                  "and the rows per replica)")->delimiter(',')->check(at_least(1));
  sub->add_option("--top", o->top, "configurations shown")->check(at_least(1))->capture_default_str();
  sub->add_flag("--all", o->all, "show every configuration that fits");
  sub->add_flag("--json", o->json, "one JSON object per configuration (JSON Lines)");
  sub->callback([o, sub, &status] {
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
