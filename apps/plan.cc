// plan.cc: `gpipe plan`: the configurations that fit a model on a cluster, fastest first, predicted by
// the cost model (cost_model.h) and the schedule simulator, before anything runs.
#include "commands.h"
#include "common.h"

#include <gpipe/gpipe.h>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <iomanip>
#include <iostream>
#include <memory>
#include <set>

namespace gpipe::cli {
namespace {

struct PlanOptions {
  // The model: a workload, a TorchScript file, or a Transformer by its shape.
  std::string workload;
  std::string model;
  std::vector<int64_t> input_shape;  // one sample's shape, for --model
  TransformerShape transformer;
  // The cluster.
  int devices = 0;
  std::string memory = "16GiB";
  double flops = 100e12;  // per device, for a Transformer given by shape
  double speed = 1.0;     // for a profiled model: the device's speed relative to this machine's core
  double latency_us = 5.0;
  double bandwidth_gb_s = 25.0;
  std::string optimizer = "adam";
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

// Most layers (blocks) gpipe plan takes, and most stage x micro-batch pairs it simulates per
// configuration unless --micro-batches asks for more: what keeps an answer within seconds.
constexpr int64_t kMostLayers = 1000000;
constexpr int64_t kMostPairs = int64_t{1} << 17;

double state_per_parameter_byte(const std::string& optimizer) {
  return optimizer == "sgd" ? 1.0 : optimizer == "momentum" ? 2.0 : 3.0;
}

// The model's costs, layer by layer, and the cut rule: blocks split evenly (lead layers with the
// first stage, tail layers with the last), or, for a profiled model, the min-max cut of layer times.
struct Model {
  std::string description;
  CostModel costs;
  int lead = 0, blocks = 0, tail = 0;  // for a Transformer; blocks 0: cut by time
  int64_t parameters = 0;
};

Model transformer_model(const PlanOptions& o) {
  Model m;
  const TransformerShape& t = o.transformer;
  m.costs = transformer_costs(t, DeviceSpec{o.flops}, state_per_parameter_byte(o.optimizer));
  m.lead = 1;
  m.blocks = static_cast<int>(t.layers);
  m.tail = 1;
  m.parameters = t.parameters();
  std::ostringstream d;
  d << "Transformer: " << t.layers << " layers, width " << t.width << ", " << t.heads << " heads, feed-forward "
    << t.ffn << ", vocabulary " << t.vocab << ", sequence " << t.sequence << "; " << std::fixed
    << std::setprecision(2) << static_cast<double>(m.parameters) / 1e9 << "B parameters; device " << o.flops / 1e12
    << " TFLOP/s";
  m.description = d.str();
  return m;
}

constexpr int64_t kProfileRows = 8;

Model profiled_model(const PlanOptions& o) {
  Model m;
  torch::nn::Sequential layers;
  torch::Tensor sample;
  LossFn loss;
  torch::Tensor target;
  if (!o.workload.empty()) {
    const Workload w = make_workload(o.workload, 0);
    layers = w.model;
    const int64_t rows = std::min<int64_t>(kProfileRows, w.input.size(0));
    sample = w.input.narrow(0, 0, rows);
    loss = w.loss;
    target = w.target.narrow(0, 0, rows);
    m.description = "workload " + o.workload;
  } else {
    if (o.input_shape.empty())
      usage_error("--model needs --input-shape, one sample's shape without the batch (e.g. 1,28,28); the sample is "
                  "random floats, so a model that starts with an Embedding is planned with --workload or by shape");
    layers = or_usage_error("--model", [&] { return load_script_model(o.model).layers; });
    std::vector<int64_t> shape{kProfileRows};
    shape.insert(shape.end(), o.input_shape.begin(), o.input_shape.end());
    sample = torch::randn(shape);
    m.description = "model " + o.model;
  }
  // Profiled here on a micro-batch of kProfileRows rows (and the loss, for a workload); the figures
  // are per sample, divided by the device's speed.
  m.costs = or_usage_error(o.model.empty() ? "--workload" : "--input-shape", [&] {
    return profile_layers(layers, sample, 1, state_per_parameter_byte(o.optimizer), 1, 3, loss, target);
  });
  for (LayerCost& c : m.costs.layers) {
    c.forward_s /= o.speed;
    c.backward_s /= o.speed;
    c.input_grad_s /= o.speed;
    c.weight_grad_s /= o.speed;
  }
  for (const auto& p : layers->parameters()) m.parameters += p.numel();
  std::ostringstream d;
  d << m.description << ": " << layers->size() << " layers, " << m.parameters << " parameters (profiled here, device "
    << o.speed << "x this machine's core)";
  m.description = d.str();
  return m;
}

// The cut of the model into S stages.
std::vector<int> cut_of(const Model& m, int S) {
  if (m.blocks > 0) {
    std::vector<int> out = even_balance(m.blocks, S);
    out.front() += m.lead;
    out.back() += m.tail;
    return out;
  }
  std::vector<double> time;
  for (const LayerCost& c : m.costs.layers) time.push_back(c.forward_s + c.backward_s);
  return balance_by_cost(time, S);
}

struct Candidate {
  int K = 1, D = 1, M = 1, V = 1;
  std::string schedule, checkpoint;
  std::vector<int> balance;
  Prediction predicted;
  double step_s = 0, samples_per_s = 0;
  int64_t largest_total_bytes = 0;  // of the device needing most: static bytes and the step's peak
  bool fits = false;
};

// "{3, 3, 2}" for short cuts, "{5, 4, ..., 5} (16 stages)" for long ones.
std::string cut_text(const std::vector<int>& balance) {
  if (balance.size() <= 8) return format_balance(balance);
  return "{" + std::to_string(balance.front()) + ", " + std::to_string(balance[1]) + ", ..., " +
         std::to_string(balance.back()) + "} (" + std::to_string(balance.size()) + " stages)";
}

int run(const PlanOptions& o) {
  const auto begin = std::chrono::steady_clock::now();
  const int64_t memory = or_usage_error("--memory-per-device", [&] { return parse_bytes(o.memory); });
  if (memory < 1) usage_error("--memory-per-device: " + o.memory + " is less than one byte");
  const std::vector<std::string> shape_flags{"--layers", "--width", "--heads", "--ffn", "--vocab", "--seq"};
  const bool by_shape = std::any_of(shape_flags.begin(), shape_flags.end(), [&](const std::string& f) {
    return o.given.count(f) > 0;
  });
  const int sources = (by_shape ? 1 : 0) + (o.workload.empty() ? 0 : 1) + (o.model.empty() ? 0 : 1);
  if (sources != 1)
    usage_error(std::string(sources == 0 ? "no model given" : "more than one model given") +
                ": give one of --workload NAME, --model FILE.pt --input-shape ..., or a Transformer by --layers, "
                "--width, --heads, --ffn, --vocab and --seq");
  // Flags that belong to the other kind of model would be silently ignored: refuse them.
  for (const std::string& f : by_shape ? std::vector<std::string>{"--speed", "--input-shape"}
                                       : std::vector<std::string>{"--flops", "--bytes-per-value"})
    if (o.given.count(f))
      usage_error(f + " applies to " + (by_shape ? "a profiled model (--workload or --model)" : "a Transformer given by shape") +
                  "; leave it out");
  if (!o.workload.empty() && o.given.count("--input-shape"))
    usage_error("--input-shape applies to --model; a workload has its own input");
  if (by_shape) {
    for (const std::string& f : shape_flags)
      if (!o.given.count(f)) usage_error("a Transformer given by shape needs " + f + " too");
    if (o.transformer.layers > kMostLayers)
      usage_error("--layers " + std::to_string(o.transformer.layers) + " is more than gpipe plan takes (" +
                  std::to_string(kMostLayers) + ")");
  }
  for (int K : o.stages)
    if (o.devices % K != 0)
      usage_error("--stages " + std::to_string(K) + " does not divide --devices " + std::to_string(o.devices) +
                  "; K pipelines' worth of devices must make up the cluster");
  const Model m = by_shape ? or_usage_error("the Transformer", [&] { return transformer_model(o); })
                           : profiled_model(o);
  const int L = m.costs.layer_count();
  const int stage_units = m.blocks > 0 ? m.blocks : L;  // what a stage must have at least one of

  CostModel costs = m.costs;
  costs.link_latency_s = o.latency_us * 1e-6;
  costs.link_bytes_per_s = o.bandwidth_gb_s * 1e9;
  costs.update_s_per_parameter_byte = 0;

  std::vector<Candidate> found;
  auto wanted = [](const std::vector<int>& list, int value) {
    return list.empty() || std::find(list.begin(), list.end(), value) != list.end();
  };
  for (int K = 1; K <= o.devices; ++K) {
    if (o.devices % K != 0 || K > stage_units || !wanted(o.stages, K)) continue;
    const int D = o.devices / K;
    if (o.batch < D) continue;  // every replica needs a row
    const int64_t rows = micro_batch_sizes(o.batch, D).front();
    std::vector<int> micro;
    if (o.micro_batches.empty()) {
      for (int64_t M = 1; M <= rows && M <= std::max(8, 4 * K) && 2 * K * M <= kMostPairs; M *= 2)
        micro.push_back(static_cast<int>(M));
    } else {
      for (int M : o.micro_batches) {
        if (M > rows)
          usage_error("--micro-batches " + std::to_string(M) + " is more than the " + std::to_string(rows) +
                      " rows a replica gets at K=" + std::to_string(K) + " (" + std::to_string(D) + " replicas)");
        micro.push_back(M);
      }
    }
    for (const std::string& schedule : o.schedules)
      for (int M : micro) {
        const ScheduleKind kind = parse_schedule(schedule);
        const int V = default_virtual_stages(kind);
        if (K * V > stage_units) continue;
        if (K == 1 && (kind == ScheduleKind::kZB1P || V > 1)) continue;  // one device: nothing to fill
        for (const std::string& checkpoint : o.checkpoints) {
          PipelinePlan plan;
          try {
            plan = make_plan(L, PipelineOptions().balance(cut_of(m, K * V)).micro_batches(M).schedule(kind)
                                    .checkpoint(parse_checkpoint(checkpoint)));
          } catch (const std::invalid_argument&) {
            break;  // a shape this schedule does not take (interleaved with M not a multiple of K, say)
          }
          Candidate c;
          c.K = K;
          c.D = D;
          c.M = M;
          c.V = V;
          c.schedule = schedule;
          c.checkpoint = checkpoint;
          c.balance = plan.balance;
          c.predicted = predict(costs, plan, micro_batch_sizes(rows, M));
          // Replicas sum their gradients: a ring all-reduce of the largest stage's gradients.
          int64_t largest_static = 0;
          for (int64_t s : c.predicted.static_bytes) largest_static = std::max(largest_static, s);
          const double gradient_bytes = static_cast<double>(largest_static) / (1 + costs.state_per_parameter_byte);
          const double all_reduce =
              D > 1 ? 2.0 * (D - 1) * (costs.link_latency_s + gradient_bytes / D / costs.link_bytes_per_s) : 0.0;
          c.step_s = c.predicted.step_s + all_reduce;
          c.samples_per_s = static_cast<double>(o.batch) / c.step_s;
          c.largest_total_bytes = c.predicted.largest_total_bytes();
          c.fits = c.largest_total_bytes <= memory;
          found.push_back(std::move(c));
        }
      }
  }
  GPIPE_CHECK(!found.empty(), "no configuration of ", o.devices, " devices takes a batch of ", o.batch, " rows",
              o.stages.empty() ? "" : " with the --stages given", o.micro_batches.empty() ? "" : " and --micro-batches",
              "; every stage needs a layer (a block) and every replica and micro-batch a row, zb1p, interleaved and zbv "
              "need K >= 2, interleaved M a multiple of K, and a schedule at most 2^21 stage x micro-batch pairs");
  std::stable_sort(found.begin(), found.end(), [](const Candidate& a, const Candidate& b) {
    if (a.fits != b.fits) return a.fits;
    return a.fits ? a.samples_per_s > b.samples_per_s : a.largest_total_bytes < b.largest_total_bytes;
  });
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - begin).count();
  const size_t feasible = static_cast<size_t>(std::count_if(found.begin(), found.end(), [](const Candidate& c) { return c.fits; }));

  auto row_json = [&](const Candidate& c) {
    return nlohmann::json{{"stages", c.K},
                          {"replicas", c.D},
                          {"micro_batches", c.M},
                          {"schedule", c.schedule},
                          {"virtual_stages", c.V},
                          {"checkpoint", c.checkpoint},
                          {"balance", c.balance},
                          {"predicted_samples_per_s", c.samples_per_s},
                          {"predicted_step_s", c.step_s},
                          {"predicted_bubble", c.predicted.bubble},
                          {"predicted_peak_bytes", c.predicted.peak_bytes},
                          {"predicted_static_bytes", c.predicted.static_bytes},
                          {"predicted_total_bytes", c.predicted.total_bytes()},
                          {"fits", c.fits}};
  };
  if (feasible == 0) {
    const Candidate& least = found.front();  // the smallest need
    const int device = least.predicted.largest_device();
    // Static bytes scale as 1/K: the K at which the largest device would fit, all else equal.
    const double over = static_cast<double>(least.largest_total_bytes) / static_cast<double>(memory);
    const int wanted_k = static_cast<int>(std::ceil(over * least.K));
    const bool always_tried = std::find(o.checkpoints.begin(), o.checkpoints.end(), "always") != o.checkpoints.end();
    std::ostringstream hint;
    hint << "no configuration fits: the least memory is needed by K=" << least.K << ", M=" << least.M << ", "
         << least.schedule << ", checkpoint " << least.checkpoint << ", whose device " << device << " needs "
         << format_bytes(static_cast<double>(least.largest_total_bytes)) << "; the device has "
         << format_bytes(static_cast<double>(memory)) << "; try " << (always_tried ? "" : "--checkpoint always, ");
    if (wanted_k <= stage_units)
      hint << "about " << wanted_k << " or more devices per pipeline (--devices a multiple of it), ";
    else
      hint << "fewer or smaller layers (a stage needs at least one of the " << stage_units << "), "
           << (by_shape && o.transformer.bytes_per_value == 4 ? "--bytes-per-value 2, " : "")
           << (o.optimizer != "sgd" ? "a lighter --optimizer, " : "");
    hint << "or devices with more memory";
    if (o.json) {
      for (size_t n = 0; n < std::min<size_t>(found.size(), static_cast<size_t>(o.top)); ++n)
        std::cout << row_json(found[n]).dump() << "\n";
    }
    std::cerr << "gpipe: " << hint.str() << "\n";
    return 1;
  }
  const size_t shown = o.all ? feasible : std::min(feasible, static_cast<size_t>(o.top));
  if (o.json) {
    for (size_t n = 0; n < shown; ++n) std::cout << row_json(found[n]).dump() << "\n";
    return 0;
  }
  std::cout << m.description << "\n"
            << "cluster: " << o.devices << " devices of " << format_bytes(static_cast<double>(memory)) << ", links "
            << o.latency_us << " us and " << o.bandwidth_gb_s << " GB/s; optimizer " << o.optimizer << "; batch "
            << o.batch << "\n"
            << feasible << " of " << found.size() << " configurations fit (planned in " << std::fixed
            << std::setprecision(2) << seconds << " s); the " << shown << " fastest:\n"
            << std::setw(4) << "K" << std::setw(5) << "D" << std::setw(5) << "M" << std::setw(14) << "schedule"
            << std::setw(13) << "checkpoint" << std::setw(12) << "samples/s" << std::setw(11) << "step s"
            << std::setw(8) << "bubble" << std::setw(13) << "peak/device" << "  cut\n";
  for (size_t n = 0; n < shown; ++n) {
    const Candidate& c = found[n];
    std::cout << std::setw(4) << c.K << std::setw(5) << c.D << std::setw(5) << c.M << std::setw(14)
              << (c.V > 1 ? c.schedule + "/" + std::to_string(c.V) : c.schedule) << std::setw(13) << c.checkpoint
              << std::setw(12) << std::setprecision(1) << c.samples_per_s << std::setw(11) << std::setprecision(4)
              << c.step_s << std::setw(8) << std::setprecision(3) << c.predicted.bubble << std::setw(13)
              << format_bytes(static_cast<double>(c.largest_total_bytes)) << "  " << cut_text(c.balance) << "\n";
  }
  return 0;
}

}  // namespace

void add_plan_command(CLI::App& app, const std::string&, int& status) {
  auto o = std::make_shared<PlanOptions>();
  CLI::App* sub = app.add_subcommand(
      "plan", "Predict the configurations (K, replicas, M, schedule, checkpoint, cut) that fit a model on a cluster, "
              "fastest first; nothing runs (docs/giant-models.md)");
  sub->add_option("--workload", o->workload, "a workload of docs/benchmarks.md, profiled here");
  sub->add_option("--model", o->model, "a TorchScript nn.Sequential, profiled here (with --input-shape)");
  sub->add_option("--input-shape", o->input_shape, "one sample's shape for --model, e.g. 1,28,28")
      ->delimiter(',')->check(at_least(1));
  sub->add_option("--layers", o->transformer.layers, "a Transformer's encoder blocks")->check(at_least(1));
  sub->add_option("--width", o->transformer.width, "its model width")->check(at_least(1));
  sub->add_option("--heads", o->transformer.heads, "its attention heads")->check(at_least(1));
  sub->add_option("--ffn", o->transformer.ffn, "its feed-forward width")->check(at_least(1));
  sub->add_option("--vocab", o->transformer.vocab, "its vocabulary")->check(at_least(1));
  sub->add_option("--seq", o->transformer.sequence, "its sequence length")->check(at_least(1));
  sub->add_option("--bytes-per-value", o->transformer.bytes_per_value, "4 (float32) or 2 (half precision)")
      ->check(CLI::IsMember({2, 4}))->capture_default_str();
  sub->add_option("--devices", o->devices, "devices in the cluster")->required()->check(CLI::Range(1, 1 << 16));
  sub->add_option("--memory-per-device", o->memory, "memory of each device, e.g. 16GiB")->capture_default_str();
  sub->add_option("--flops", o->flops, "FLOP/s of a device on a Transformer given by shape (1e3 to 1e21)")
      ->check(CLI::Range(1e3, 1e21))->capture_default_str();
  sub->add_option("--speed", o->speed, "a device's speed relative to this machine's core, for a profiled model")
      ->check(CLI::Range(1e-6, 1e9))->capture_default_str();
  sub->add_option("--latency-us", o->latency_us, "latency of a link between devices, microseconds")
      ->check(CLI::Range(0.0, 1e9))->capture_default_str();
  sub->add_option("--bandwidth-gb-s", o->bandwidth_gb_s, "bandwidth of a link, GB/s")
      ->check(CLI::Range(1e-6, 1e9))->capture_default_str();
  sub->add_option("--optimizer", o->optimizer, "sgd, momentum or adam: the state kept per parameter")
      ->check(CLI::IsMember({"sgd", "momentum", "adam"}))->capture_default_str();
  sub->add_option("--batch", o->batch, "the global batch, rows per step")->required()->check(at_least(1));
  sub->add_option("--schedule", o->schedules, "schedules to consider")
      ->delimiter(',')->check(CLI::IsMember(schedule_names()))->capture_default_str();
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
    status = run(*o);
  });
}

}  // namespace gpipe::cli
