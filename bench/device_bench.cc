// device_bench.cc: the measurements of the lent GPU machine (issue 31), one JSON object per line on
// standard output; bench/device.sh runs it and writes bench/results/device.json.
//
//   device_bench table2 [...]  GPipe's Table 2 on CPU cores: a Transformer of --layers encoder blocks cut
//                              into K stages, K devices of --threads cores each, M micro-batches;
//                              samples/s and the bubble per (K, M, threads, cut). --cuts even,time: the
//                              blocks evenly (the embedding with the first, the head with the last), and/or
//                              by the layers' profiled time (the min-max cut refined by the simulation, as
//                              `gpipe bench --balance-by time` cuts). Speedups are over K = 1 with the
//                              same M and threads (device.sh divides).
//   device_bench gpu [...]     a Transformer on one GPU: K stages on the GPU (each its own stream), samples/s
//                              with Adam; --trace FILE writes a Perfetto trace of the last step of the
//                              largest K. Plain PyTorch's figure comes from bench/device_pytorch.py.
//   device_bench table1 [...]  GPipe's Table 1 on one GPU: the most encoder blocks (fixed width and
//                              batch) that train --steps steps with Adam, with re-materialization
//                              (always, M micro-batches) and without (never, M = 1), doubling then
//                              bisecting; each with the caching allocator's peak and the cost model's
//                              prediction (gpipe plan's). --cap limits the GPU to that many bytes (the
//                              rest is held by one tensor, allocated first, so the figures are those of
//                              a device of that size).
//
// Common flags: --layers L --width D --heads H --ffn F --sequence S --batch N --vocab V --steps S --warmup W
// --budget SECONDS (stop starting new configurations after that long; what ran is printed); gpu and
// table1 take --precision fp32,bf16 (each precision in turn, PipelineOptions::precision; every row says
// its own).
#include <gpipe/gpipe.h>
#include <torch/torch.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <iostream>
#include <map>
#include <sstream>
#include <stdexcept>
#include <thread>
#include <string>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;
using nlohmann::json;

struct Args {
  std::map<std::string, std::string> values;

  std::string text(const std::string& key, const std::string& otherwise) const {
    auto it = values.find(key);
    return it == values.end() ? otherwise : it->second;
  }
  int64_t integer(const std::string& key, int64_t otherwise) const {
    const std::string t = text(key, "");
    if (t.empty()) return otherwise;
    size_t used = 0;
    int64_t v = 0;
    try {
      v = std::stoll(t, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used != t.size() || v < 1)
      throw std::invalid_argument("--" + key + " takes a whole number of at least 1 (got " + t + ")");
    return v;
  }
  double number(const std::string& key, double otherwise) const {
    const std::string t = text(key, "");
    if (t.empty()) return otherwise;
    size_t used = 0;
    double v = 0;
    try {
      v = std::stod(t, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used != t.size() || !(v > 0)) throw std::invalid_argument("--" + key + " takes a positive number (got " + t + ")");
    return v;
  }
  std::vector<std::string> words(const std::string& key, const std::vector<std::string>& known,
                                 const std::vector<std::string>& otherwise) const {
    const std::string t = text(key, "");
    if (t.empty()) return otherwise;
    std::vector<std::string> out;
    std::stringstream in(t);
    std::string item;
    while (std::getline(in, item, ',')) {
      if (std::find(known.begin(), known.end(), item) == known.end()) {
        std::string names;
        for (const std::string& k : known) names += (names.empty() ? "" : ", ") + k;
        throw std::invalid_argument("--" + key + " takes a comma-separated list of " + names + " (got " + t + ")");
      }
      out.push_back(item);
    }
    return out;
  }
  std::vector<int> list(const std::string& key, const std::vector<int>& otherwise) const {
    const std::string t = text(key, "");
    if (t.empty()) return otherwise;
    std::vector<int> out;
    std::stringstream in(t);
    std::string item;
    while (std::getline(in, item, ',')) {
      Args one;
      one.values[key] = item;
      out.push_back(static_cast<int>(one.integer(key, 1)));
    }
    return out;
  }
};

struct Shape {
  int64_t layers = 32, width = 128, heads = 4, ffn = 512, sequence = 32, batch = 256, vocab = 1000;
};

Shape shape_of(const Args& a, const Shape& d) {
  Shape s;
  s.layers = a.integer("layers", d.layers);
  s.width = a.integer("width", d.width);
  s.heads = a.integer("heads", d.heads);
  s.ffn = a.integer("ffn", d.ffn);
  s.sequence = a.integer("sequence", d.sequence);
  s.batch = a.integer("batch", d.batch);
  s.vocab = a.integer("vocab", d.vocab);
  if (s.width % s.heads != 0)
    throw std::invalid_argument("--width " + std::to_string(s.width) + " is not a multiple of --heads " +
                                std::to_string(s.heads) + "; give a width that the heads divide");
  return s;
}

json shape_json(const Shape& s) {
  return {{"layers", s.layers}, {"width", s.width}, {"heads", s.heads}, {"ffn", s.ffn},
          {"sequence", s.sequence}, {"batch", s.batch}, {"vocab", s.vocab}};
}

// An embedding, `layers` encoder blocks, a projection to the vocabulary; each layer moved to
// `device` as it is made (a model larger than the host's memory never sits there whole).
gpipe::Workload transformer(const Shape& s, const torch::Device& device, uint64_t seed = 0) {
  torch::manual_seed(seed);
  gpipe::Workload w;
  w.name = "transformer";
  torch::nn::Embedding embedding(s.vocab, s.width);
  embedding->to(device);
  w.model->push_back(embedding);
  for (int64_t b = 0; b < s.layers; ++b) {
    gpipe::EncoderBlock block(s.width, s.heads, s.ffn, 0.0);
    block->to(device);
    w.model->push_back(block);
    w.block_layers.push_back(1);
  }
  torch::nn::Linear head(s.width, s.vocab);
  head->to(device);
  w.model->push_back(head);
  w.layers = static_cast<int>(s.layers) + 2;
  w.lead_layers = w.tail_layers = 1;
  w.input = torch::randint(s.vocab, {s.batch, s.sequence}, torch::kLong).to(device);
  w.target = torch::randint(s.vocab, {s.batch, s.sequence}, torch::kLong).to(device);
  w.loss = gpipe::cross_entropy_loss;
  return w;
}

int64_t parameters_of(const gpipe::Workload& w) {
  int64_t n = 0;
  for (const auto& p : w.model->parameters()) n += p.numel();
  return n;
}

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

void emit(const json& row) { std::cout << row.dump() << std::endl; }

// `row` with the fields of `more` added.
json with(json row, const json& more) {
  row.update(more);
  return row;
}

// Steps of `pipe` with `optimizer` (or none): the median seconds of the timed ones.
template <typename Optimizer>
double time_steps(gpipe::Pipeline& pipe, const gpipe::Workload& w, Optimizer* optimizer, int warmup, int steps) {
  std::vector<double> times;
  for (int s = 0; s < warmup + steps; ++s) {
    const auto begin = Clock::now();
    if (optimizer) optimizer->zero_grad();
    pipe.train_step(w.input, w.target, w.loss);
    if (optimizer) optimizer->step();
    if (optimizer && w.input.is_cuda()) pipe.parameters().front().sum().item<double>();  // the update done
    if (s >= warmup) times.push_back(seconds_since(begin));
  }
  return median(times);
}

int table2(const Args& a) {
  const Shape s = shape_of(a, Shape{});
  const std::vector<int> stages = a.list("stages", {1, 2, 4, 8}), micro = a.list("micro-batches", {1, 4, 32});
  const std::vector<int> threads = a.list("threads", {1});
  const std::vector<std::string> cuts = a.words("cuts", {"even", "time"}, {"even"});
  const std::vector<int> wide = a.list("wide-stages", {8});  // K also run with --wide-threads per device
  const int wide_threads = static_cast<int>(a.integer("wide-threads", 2));
  const int steps = static_cast<int>(a.integer("steps", 2)), warmup = static_cast<int>(a.integer("warmup", 1));
  const double budget = a.number("budget", 1e9);
  const auto begin = Clock::now();
  gpipe::set_blas_threads(1);
  const gpipe::Workload w = transformer(s, torch::kCPU);
  emit({{"kind", "table2_model"}, {"shape", shape_json(s)}, {"parameters", parameters_of(w)},
        {"blas", gpipe::blas_info()}, {"cores", std::thread::hardware_concurrency()}});
  struct Run {
    int K, t;
  };
  std::vector<Run> runs;
  for (int t : threads)
    for (int K : stages) runs.push_back({K, t});
  for (int K : wide) {  // and K = 1 with as many threads, the speedup's base
    if (std::find(threads.begin(), threads.end(), wide_threads) != threads.end()) break;
    runs.push_back({1, wide_threads});
    runs.push_back({K, wide_threads});
  }
  // The layers profiled on one micro-batch at M, on `threads` cores, once per (M, threads) a time cut needs.
  std::map<std::pair<int, int>, gpipe::CostModel> profiles;
  const auto profile = [&](int M, int threads) -> const gpipe::CostModel& {
    auto it = profiles.find({M, threads});
    if (it != profiles.end()) return it->second;
    const int64_t rows = gpipe::micro_batch_sizes(s.batch, M).front();
    return profiles[{M, threads}] =
               gpipe::profile_layers(w.model, w.input.narrow(0, 0, rows),
                                     gpipe::ProfileLayersOptions()
                                         .threads(threads)
                                         .state_per_parameter_byte(0)
                                         .warmup(2)
                                         .loss(w.loss)
                                         .target(w.target.narrow(0, 0, rows))
                                         .in_flight(std::min(M, 8)));
  };
  for (int M : micro)
    for (const Run& r : runs)
      for (const std::string& cut : cuts) {
        if (cut == "time" && r.K == 1) continue;  // one stage: the even cut's run is the base
        const json row = {{"K", r.K}, {"M", M}, {"threads_per_device", r.t}, {"cut", cut}};
        if (seconds_since(begin) > budget) {
          emit(with(row, {{"kind", "table2_skipped"},
                          {"why", "the phase's budget of " + std::to_string(budget) + " s was spent"}}));
          continue;
        }
        if (r.K * r.t > static_cast<int>(std::thread::hardware_concurrency())) {
          emit(with(row, {{"kind", "table2_skipped"}, {"why", "more cores asked than the machine has"}}));
          continue;
        }
        const gpipe::Workload mine = transformer(s, torch::kCPU);
        gpipe::PipelineOptions options = gpipe::PipelineOptions()
                                             .balance(mine.balance(r.K))
                                             .threads_per_device(r.t)
                                             .micro_batches(M)
                                             .checkpoint(gpipe::Checkpoint::kExceptLast);
        if (cut == "time") {
          const gpipe::CostModel& costs = profile(M, r.t);
          const std::vector<int64_t> rows = gpipe::micro_batch_sizes(s.batch, M);
          options.balance(gpipe::balance_by_cost(gpipe::layer_times(costs, rows.front()), r.K));
          options.balance(gpipe::refined_plan(costs, options, rows).balance);
        }
        gpipe::Pipeline pipe(mine.model, options);
        const double seconds = time_steps<torch::optim::SGD>(pipe, mine, nullptr, warmup, steps);
        emit(with(row, {{"kind", "table2"}, {"balance", options.balance()}, {"step_s", seconds},
                        {"samples_per_s", static_cast<double>(s.batch) / seconds}, {"bubble", pipe.bubble()}}));
      }
  return 0;
}

// --device cpu (bench/device.sh's smoke mode): the same logic on CPU devices, so that it is proven
// where no GPU is.
bool on_cpu(const Args& a) {
  const std::string d = a.text("device", "cuda");
  if (d != "cuda" && d != "cpu") throw std::invalid_argument("--device takes cuda or cpu (got " + d + ")");
  return d == "cpu";
}

// --precision: the precisions measured in turn (default float32 alone).
std::vector<gpipe::Precision> precisions(const Args& a) {
  std::vector<gpipe::Precision> out;
  for (const std::string& name : a.words("precision", {"fp32", "bf16"}, {"fp32"})) out.push_back(gpipe::parse_precision(name));
  return out;
}

int gpu(const Args& a) {
  const bool cpu = on_cpu(a);
  if (!cpu && !torch::cuda::is_available()) {
    emit({{"kind", "gpu_skipped"}, {"why", "no CUDA device visible"}});
    return 0;
  }
  const Shape s = shape_of(a, Shape{24, 1024, 16, 4096, 512, 32, 32000});
  const std::vector<int> stages = a.list("stages", {1, 2, 4});
  const int micro = static_cast<int>(a.integer("micro-batches", 4));
  const int steps = static_cast<int>(a.integer("steps", 5)), warmup = static_cast<int>(a.integer("warmup", 2));
  const double budget = a.number("budget", 1e9);
  const std::string trace = a.text("trace", "");
  const auto begin = Clock::now();
  const torch::Device device = cpu ? torch::Device(torch::kCPU) : torch::Device(torch::kCUDA, 0);
  const gpipe::Device one = cpu ? gpipe::Device::cpu(1) : gpipe::Device::cuda(0);
  for (const gpipe::Precision precision : precisions(a))
  for (int K : stages)
    for (int M : {1, micro}) {
      if (K == 1 && M != 1) continue;  // K = 1: one micro-batch, as plain PyTorch runs it
      if (K > 1 && M == 1) continue;
      if (seconds_since(begin) > budget) {
        emit({{"kind", "gpu_skipped"}, {"K", K}, {"M", M}, {"precision", gpipe::to_string(precision)},
              {"why", "the phase's budget was spent"}});
        continue;
      }
      gpipe::Workload w = transformer(s, device);
      gpipe::Pipeline pipe(w.model, gpipe::PipelineOptions()
                                        .balance(w.balance(K))
                                        .device_list(std::vector<gpipe::Device>(static_cast<size_t>(K), one))
                                        .micro_batches(M)
                                        .checkpoint(K == 1 ? gpipe::Checkpoint::kNever : gpipe::Checkpoint::kExceptLast)
                                        .precision(precision));
      torch::optim::Adam adam(pipe.parameters(), torch::optim::AdamOptions(1e-4));
      const double seconds = time_steps(pipe, w, &adam, warmup, steps);
      emit({{"kind", "gpu"}, {"device", device.str()}, {"precision", gpipe::to_string(precision)}, {"K", K}, {"M", M},
            {"shape", shape_json(s)}, {"parameters", parameters_of(w)},
            {"step_s", seconds}, {"samples_per_s", static_cast<double>(s.batch) / seconds},
            {"bubble_host_timestamps", pipe.bubble()}});
      if (!trace.empty() && K == stages.back() && precision == gpipe::Precision::kFloat32)
        gpipe::write_trace(pipe.trace(), trace);
    }
  return 0;
}

// Holds all but `cap` bytes of the GPU's free memory (`free_bytes`, as the caller measured it).
torch::Tensor hold_all_but(int64_t cap, int64_t free_bytes) {
  if (cap <= 0 || free_bytes <= cap) return {};
  return torch::empty({free_bytes - cap}, torch::dtype(torch::kUInt8).device(torch::kCUDA, 0));
}

struct Trial {
  bool fits = false;
  std::string error;
  int64_t parameters = 0, peak_bytes = 0, static_bytes = 0, predicted_bytes = 0;
  double seconds = 0;
};

Trial try_blocks(const Shape& base, int64_t blocks, gpipe::Checkpoint mode, int M, int steps, bool cpu, int64_t cap,
                 gpipe::Precision precision) {
  Shape s = base;
  s.layers = blocks;
  Trial t;
  const auto begin = Clock::now();
  // What gpipe plan predicts: the cost model of this Transformer (bytes per sample measured on
  // libtorch's encoder layer in float32; an activation in 2 bytes under bf16, as gpipe plan
  // --precision bf16 counts it), parameters with their gradient and Adam's two moments.
  gpipe::TransformerShape ts;
  ts.layers = s.layers;
  ts.width = s.width;
  ts.heads = s.heads;
  ts.ffn = s.ffn;
  ts.vocab = s.vocab;
  ts.sequence = s.sequence;
  ts.precision = precision;
  const gpipe::PipelinePlan plan = gpipe::make_plan(static_cast<int>(blocks) + 2,
                                                    gpipe::PipelineOptions().devices(1).micro_batches(M).checkpoint(mode));
  t.predicted_bytes = gpipe::predict(gpipe::transformer_costs(ts, gpipe::DeviceSpec{1e14}, 3.0), plan,
                                     gpipe::micro_batch_sizes(s.batch, M))
                          .largest_total_bytes();
  try {
    gpipe::Workload w = transformer(s, cpu ? torch::Device(torch::kCPU) : torch::Device(torch::kCUDA, 0));
    t.parameters = parameters_of(w);
    // On CPU (the smoke test) gpipe's tracking allocator caps what the step allocates.
    const gpipe::Device device = cpu ? gpipe::Device::cpu(1).with_memory_cap(cap) : gpipe::Device::cuda(0);
    gpipe::Pipeline pipe(w.model, gpipe::PipelineOptions().devices(1).device_list({device}).micro_batches(M)
                                      .checkpoint(mode).track_memory(true).precision(precision));
    torch::optim::Adam adam(pipe.parameters(), torch::optim::AdamOptions(1e-4));
    for (int step = 0; step < steps; ++step) {
      adam.zero_grad();
      pipe.train_step(w.input, w.target, w.loss);
      adam.step();
      const auto memory = pipe.memory();
      if (!memory.empty()) t.peak_bytes = std::max(t.peak_bytes, memory.front().peak_bytes);
    }
    t.static_bytes = t.parameters * 4 * 4;  // parameters, gradients, Adam's two moments, float32
    t.fits = true;
  } catch (const std::exception& e) {
    const std::string what = e.what();
    if (what.find("out of memory") == std::string::npos) throw;  // only running out of memory means "too large"
    t.error = what.substr(0, std::min(what.find('\n'), size_t{300}));
  }
  t.seconds = seconds_since(begin);
  return t;
}

int table1(const Args& a) {
  const bool cpu = on_cpu(a);
  if (!cpu && !torch::cuda::is_available()) {
    emit({{"kind", "table1_skipped"}, {"why", "no CUDA device visible"}});
    return 0;
  }
  const Shape s = shape_of(a, Shape{0, 512, 8, 2048, 512, 32, 1000});
  const int M = static_cast<int>(a.integer("micro-batches", 8)), steps = static_cast<int>(a.integer("steps", 3));
  const double budget = a.number("budget", 1e9);
  const int64_t cap = a.text("cap", "").empty() ? 0 : gpipe::parse_bytes(a.text("cap", ""));
  const int64_t free_bytes = a.text("free", "").empty() ? 0 : gpipe::parse_bytes(a.text("free", ""));
  const torch::Tensor held = cpu ? torch::Tensor() : hold_all_but(cap, free_bytes);
  emit({{"kind", "table1_setup"}, {"device", cpu ? "cpu" : "cuda:0"}, {"shape", shape_json(s)}, {"cap_bytes", cap}, {"held_bytes", held.defined() ? held.numel() : 0},
        {"micro_batches", M}, {"steps", steps}});
  const auto begin = Clock::now();
  for (const gpipe::Precision precision : precisions(a))
  for (const auto& [mode_, m_] : {std::pair<gpipe::Checkpoint, int>{gpipe::Checkpoint::kNever, 1},
                                  std::pair<gpipe::Checkpoint, int>{gpipe::Checkpoint::kAlways, M}}) {
    const gpipe::Checkpoint mode = mode_;  // structured bindings cannot be captured before C++20
    const int m = m_;
    const std::string name = gpipe::to_string(mode), arithmetic = gpipe::to_string(precision);
    auto run = [&](int64_t blocks) {
      const Trial t = try_blocks(s, blocks, mode, m, steps, cpu, cap, precision);
      emit({{"kind", "table1_trial"}, {"checkpoint", name}, {"precision", arithmetic}, {"M", m}, {"layers", blocks},
            {"fits", t.fits},
            {"parameters", t.parameters}, {"peak_bytes", t.peak_bytes}, {"static_bytes", t.static_bytes},
            {"measured_bytes", t.static_bytes + t.peak_bytes}, {"predicted_bytes", t.predicted_bytes},
            {"seconds", t.seconds}, {"error", t.error}});
      return t;
    };
    // Doubling, then bisecting to within 1/32 of the answer (or 1 block).
    int64_t lo = 0, hi = 0;
    Trial best;
    bool out_of_time = false;
    for (int64_t blocks = 1;; blocks *= 2) {
      if (seconds_since(begin) > budget) {
        out_of_time = true;
        break;
      }
      const Trial t = run(blocks);
      if (!t.fits) {
        hi = blocks;
        break;
      }
      lo = blocks;
      best = t;
      if (blocks >= (int64_t{1} << 20)) break;
    }
    while (!out_of_time && hi > 0 && hi - lo > std::max<int64_t>(1, lo / 32)) {
      if (seconds_since(begin) > budget) {
        out_of_time = true;
        break;
      }
      const int64_t mid = lo + (hi - lo) / 2;
      const Trial t = run(mid);
      if (t.fits) {
        lo = mid;
        best = t;
      } else {
        hi = mid;
      }
    }
    emit({{"kind", "table1"}, {"checkpoint", name}, {"precision", arithmetic}, {"M", m}, {"layers", lo}, {"first_failing_layers", hi},
          {"complete", !out_of_time && hi > 0}, {"parameters", best.parameters},
          {"measured_bytes", best.static_bytes + best.peak_bytes}, {"peak_bytes", best.peak_bytes},
          {"predicted_bytes", best.predicted_bytes}});
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    if (argc < 2) throw std::invalid_argument("give a measurement: device_bench table2|gpu|table1 [--flag value ...]");
    const std::string what = argv[1];
    Args a;
    for (int i = 2; i < argc; i += 2) {
      const std::string key = argv[i];
      if (key.rfind("--", 0) != 0 || i + 1 >= argc)
        throw std::invalid_argument("flags come as --name value pairs (got " + key + ")");
      a.values[key.substr(2)] = argv[i + 1];
    }
    static const std::vector<std::string> known{"layers", "width", "heads", "ffn", "sequence", "batch", "vocab",
                                                "stages", "micro-batches", "threads", "wide-stages", "wide-threads",
                                                "steps", "warmup", "budget", "trace", "cap", "free", "device", "cuts",
                                                "precision"};
    for (const auto& [key, value] : a.values)
      if (std::find(known.begin(), known.end(), key) == known.end())
        throw std::invalid_argument("unknown flag --" + key + "; see the usage at the top of bench/device_bench.cc");
    if (what == "table2") return table2(a);
    if (what == "gpu") return gpu(a);
    if (what == "table1") return table1(a);
    throw std::invalid_argument("unknown measurement " + what + "; give table2, gpu or table1");
  } catch (const std::exception& e) {
    std::cerr << "device_bench: " << e.what() << std::endl;
    return 2;
  }
}
