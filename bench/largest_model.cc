// largest_model.cc: the largest Transformer gpipe trains per K under a memory cap per stage, GPipe's Table 1.
//
// GPipe (Huang et al., 2018), Table 1: with re-materialization and K devices the
// largest model grows near-linearly with K (a Transformer from 282M parameters
// on one accelerator to 83.9B on 128). Here the device is a CPU stage thread
// whose tracked memory is capped: for each K, checkpoint mode and schedule, the
// model is the Transformer of docs/giant-models.md ("The largest model") with L
// encoder blocks at a fixed width, and the program finds the largest L whose
// training step fits the cap on every stage. What counts against the cap:
// parameters, gradients and Adam's two moments (4 x the parameter bytes, held
// from before the step) plus everything the stage's thread allocates during the
// step, charged by gpipe's tracking allocator; so each stage runs with a
// tracked cap of C minus its static bytes.
//
// The search starts where the cost model (cost_model.h, profiled here on one
// block) predicts the boundary, then walks by steps of --resolution (default 2%)
// of L: every "fits" is a real training step (pipeline step and Adam update)
// that ran; every "does not fit" is the out-of-memory error a stage raised,
// printed. The row reports the largest L that ran and the next L of the walk, which did not.
//
// Usage: largest_model [--cap 512MiB] [--stages 1,2,4,8] [--resolution 0.02] [--results FILE]
//        (default bench/results/largest-model.json)
#include <gpipe/gpipe.h>
#include <torch/torch.h>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <cmath>
#include <iomanip>
#include <iostream>
#include <sstream>

namespace {

// The model: an embedding, L encoder blocks, a projection to the vocabulary (docs/giant-models.md).
struct Shape {
  int64_t width = 128, heads = 4, ffn = 512, vocab = 1000, sequence = 16, batch = 96;
  int micro_batches = 12;
};

gpipe::Workload make_model(const Shape& shape, int blocks, uint64_t seed) {
  torch::manual_seed(seed);
  gpipe::Workload w;
  w.name = "transformer-" + std::to_string(blocks);
  w.model->push_back(torch::nn::Embedding(shape.vocab, shape.width));
  for (int b = 0; b < blocks; ++b) {
    w.model->push_back(gpipe::EncoderBlock(shape.width, shape.heads, shape.ffn, 0.0));
    w.block_layers.push_back(1);
  }
  w.model->push_back(torch::nn::Linear(shape.width, shape.vocab));
  w.layers = blocks + 2;
  w.lead_layers = w.tail_layers = 1;
  w.input = torch::randint(shape.vocab, {shape.batch, shape.sequence}, torch::kLong);
  w.target = torch::randint(shape.vocab, {shape.batch, shape.sequence}, torch::kLong);
  w.loss = gpipe::cross_entropy_loss;
  return w;
}

// The cut of docs/benchmarks.md: blocks evenly, the embedding with the first stage, the head with the last.
std::vector<int> cut(int blocks, int K) {
  gpipe::Workload w;
  w.block_layers.assign(static_cast<size_t>(blocks), 1);
  w.lead_layers = w.tail_layers = 1;
  return w.balance(K);
}

constexpr double kAdamState = 3.0;  // gradient and two moments per parameter byte

struct Config {
  int K = 1;
  gpipe::Checkpoint mode = gpipe::Checkpoint::kNever;
  gpipe::ScheduleKind schedule = gpipe::ScheduleKind::kGPipe;
};

// The cost model of `blocks` blocks, from the profile of a model with two: layer 1 is a block
// followed by a block, layer 2 a block followed by the projection.
gpipe::CostModel costs_for(const gpipe::CostModel& profile, int blocks) {
  gpipe::CostModel c = profile;
  c.layers = {profile.layers.front()};
  for (int b = 0; b < blocks; ++b) c.layers.push_back(profile.layers[b + 1 < blocks ? 1 : 2]);
  c.layers.push_back(profile.layers.back());
  return c;
}

gpipe::Prediction predicted(const gpipe::CostModel& profile, const Shape& shape, int blocks, const Config& c) {
  const gpipe::PipelinePlan plan = gpipe::make_plan(blocks + 2, gpipe::PipelineOptions()
                                                                    .balance(cut(blocks, c.K))
                                                                    .micro_batches(shape.micro_batches)
                                                                    .checkpoint(c.mode)
                                                                    .schedule(c.schedule));
  return gpipe::predict(costs_for(profile, blocks), plan, gpipe::micro_batch_sizes(shape.batch, shape.micro_batches));
}

// The largest L the cost model says fits `cap` on every stage.
int predicted_blocks(const gpipe::CostModel& profile, const Shape& shape, const Config& c, int64_t cap) {
  auto fits = [&](int blocks) { return predicted(profile, shape, blocks, c).largest_total_bytes() <= cap; };
  constexpr int kMost = 1 << 20;  // blocks: far beyond any cap this machine can hold
  int lo = c.K, hi = c.K;  // every stage needs a block
  if (!fits(lo)) return lo;
  while (fits(hi)) {
    lo = hi;
    if (hi >= kMost) return hi;
    hi = std::min(2 * hi, kMost);
  }
  while (hi - lo > 1) {
    const int mid = lo + (hi - lo) / 2;
    (fits(mid) ? lo : hi) = mid;
  }
  return lo;
}

struct Trial {
  bool fits = false;
  std::string error;               // the out-of-memory error when it does not fit
  int64_t parameters = 0;
  std::vector<int64_t> peak_bytes;  // per stage: static bytes + the step's tracked peak
  double seconds = 0;
};

// One real training step of the L-block model under the cap.
Trial run_step(const Shape& shape, int blocks, const Config& c, int64_t cap) {
  Trial t;
  const auto begin = std::chrono::steady_clock::now();
  gpipe::Workload w = make_model(shape, blocks, 0);
  for (const auto& p : w.model->parameters()) t.parameters += p.numel();
  const std::vector<int> balance = cut(blocks, c.K);
  const std::vector<int> offsets = gpipe::stage_offsets(balance);
  std::vector<gpipe::Device> devices;
  std::vector<int64_t> static_bytes;
  for (int j = 0; j < c.K; ++j) {
    int64_t bytes = 0;
    for (int l = offsets[static_cast<size_t>(j)]; l < offsets[static_cast<size_t>(j) + 1]; ++l)
      for (const auto& p : (*(w.model->begin() + l)).ptr()->parameters()) bytes += static_cast<int64_t>(p.nbytes());
    static_bytes.push_back(static_cast<int64_t>(static_cast<double>(bytes) * (1 + kAdamState)));
    if (static_bytes.back() >= cap) {
      t.error = "stage " + std::to_string(j) + "'s parameters, gradients and Adam state need " +
                gpipe::format_bytes(static_cast<double>(static_bytes.back())) + ", the cap is " +
                gpipe::format_bytes(static_cast<double>(cap));
      return t;
    }
    devices.push_back(gpipe::Device::cpu(1).with_memory_cap(cap - static_bytes.back()));
  }
  gpipe::Pipeline pipe(w.model, gpipe::PipelineOptions()
                                    .balance(balance)
                                    .device_list(devices)
                                    .micro_batches(shape.micro_batches)
                                    .checkpoint(c.mode)
                                    .schedule(c.schedule));
  torch::optim::Adam adam(pipe.parameters(), torch::optim::AdamOptions(1e-4));
  try {
    pipe.train_step(w.input, w.target, w.loss);
    adam.step();
    t.fits = true;
    const auto memory = pipe.memory();
    for (int j = 0; j < c.K; ++j)
      t.peak_bytes.push_back(static_bytes[static_cast<size_t>(j)] + memory[static_cast<size_t>(j)].peak_bytes);
  } catch (const std::exception& e) {
    const std::string what = e.what();
    if (what.find("out of memory") == std::string::npos) throw;  // only running out of memory means "too large"
    t.error = what.substr(0, what.find('\n'));
  }
  t.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - begin).count();
  return t;
}

}  // namespace

int run(const std::string& cap_text, const std::vector<int>& stages, double resolution, const std::string& results);

int main(int argc, char** argv) {
  CLI::App app{"The largest Transformer that trains per K under a memory cap per stage (GPipe's Table 1)"};
  std::string cap_text = "512MiB", results = "bench/results/largest-model.json";
  std::vector<int> stages{1, 2, 4, 8};
  double resolution = 0.02;
  app.add_option("--cap", cap_text, "memory per stage: parameters, gradients, Adam state and activations")
      ->capture_default_str();
  // Each rule says itself and the value given ("must be a whole number from 1 to 64 (got 0)").
  auto between = [](double least, double most, bool whole) {
    std::ostringstream rule;
    rule << "must be " << (whole ? "a whole number" : "a number") << " from " << least << " to " << most;
    return CLI::Validator(
        [rule = rule.str(), least, most, whole](std::string& text) {
          double value = 0;
          int64_t integer = 0;
          const bool read = whole ? CLI::detail::lexical_cast(text, integer) : CLI::detail::lexical_cast(text, value);
          if (whole) value = static_cast<double>(integer);
          return read && std::isfinite(value) && value >= least && value <= most ? std::string()
                                                                                 : rule + " (got " + text + ")";
        },
        whole ? "INT" : "NUMBER");
  };
  app.add_option("--stages", stages, "values of K")->delimiter(',')->check(between(1, 64, true))->capture_default_str();
  app.add_option("--resolution", resolution, "step of the search, as a share of L")
      ->check(between(0.001, 0.5, false))
      ->capture_default_str();
  app.add_option("--results", results, "JSON file of the table")->capture_default_str();
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {  // --help is one too (exit code 0); the others name the flag, status 2
    if (e.get_exit_code() == 0) return app.exit(e);
    std::cerr << "largest_model: " << e.what() << "; see largest_model --help\n";
    return 2;
  }
  try {
    return run(cap_text, stages, resolution, results);
  } catch (const std::invalid_argument& e) {
    std::cerr << e.what() << "\n";  // "gpipe: --cap ...": names the flag and the fix
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "largest_model: error: " << e.what() << "\n";
    return 1;
  }
}

int run(const std::string& cap_text, const std::vector<int>& stages, double resolution, const std::string& results) {
  const int64_t cap = gpipe::parse_bytes(cap_text);
  GPIPE_CHECK(std::isfinite(resolution), "--resolution must be a number between 0.001 and 0.5");
  // Every stage may really allocate up to the cap: refuse what this machine cannot hold.
  const double physical = static_cast<double>(sysconf(_SC_PHYS_PAGES)) * static_cast<double>(sysconf(_SC_PAGESIZE));
  const int most_stages = *std::max_element(stages.begin(), stages.end());
  GPIPE_CHECK(static_cast<double>(cap) * most_stages * 1.5 < physical, "--cap ", cap_text, " x ", most_stages,
              " stages (and the model's copy being built) is more than this machine's ",
              gpipe::format_bytes(physical), " of memory; use a smaller --cap or fewer --stages");
  // The results file is checked before the minutes of work, not after.
  {
    const std::filesystem::path path(results);
    const std::filesystem::path folder = path.has_parent_path() ? path.parent_path() : ".";
    GPIPE_CHECK(!results.empty() && std::filesystem::is_directory(folder) && access(folder.c_str(), W_OK) == 0 &&
                    !std::filesystem::is_directory(path),
                "--results ", results, ": cannot write there (the folder must exist and be writable); pick another file");
  }
  at::set_num_threads(1);
  gpipe::enable_memory_tracking();
  gpipe::keep_freed_memory();
  const Shape shape;

  // The cost model: the two-block model profiled on one micro-batch.
  const gpipe::Workload probe = make_model(shape, 2, 0);
  const int64_t probe_rows = gpipe::micro_batch_sizes(shape.batch, shape.micro_batches).front();
  const gpipe::CostModel profile = gpipe::profile_layers(probe.model, probe.input.narrow(0, 0, probe_rows),
                                                         gpipe::ProfileLayersOptions()
                                                             .state_per_parameter_byte(kAdamState)
                                                             .loss(probe.loss)
                                                             .target(probe.target.narrow(0, 0, probe_rows)));
  const int64_t block_parameters = gpipe::TransformerShape{1, shape.width, shape.heads, shape.ffn, shape.vocab,
                                                           shape.sequence}.block_parameters();

  std::cout << "largest_model: Transformer, width " << shape.width << ", " << shape.heads << " heads, feed-forward "
            << shape.ffn << ", vocabulary " << shape.vocab << ", sequence " << shape.sequence << "; batch "
            << shape.batch << " in " << shape.micro_batches << " micro-batches; Adam; cap "
            << gpipe::format_bytes(static_cast<double>(cap)) << " per stage; " << block_parameters
            << " parameters per block\n"
            << std::setw(3) << "K" << std::setw(8) << "mode" << std::setw(7) << "sched" << std::setw(8) << "layers"
            << std::setw(12) << "parameters" << std::setw(8) << "vs K=1" << std::setw(8) << "never" << std::setw(11) << "predicted"
            << std::setw(14) << "fails at" << "  peak MiB per stage (cap " << static_cast<double>(cap) / (1 << 20)
            << ")\n";
  nlohmann::json rows = nlohmann::json::array();
  // Parameters of the largest model at K=1, per mode and schedule.
  std::map<std::pair<gpipe::Checkpoint, gpipe::ScheduleKind>, double> one_device;
  for (int K : stages)
    for (gpipe::Checkpoint mode : {gpipe::Checkpoint::kNever, gpipe::Checkpoint::kAlways})
      for (gpipe::ScheduleKind schedule : {gpipe::ScheduleKind::kGPipe, gpipe::ScheduleKind::k1F1B}) {
        const Config c{K, mode, schedule};
        const int guess = predicted_blocks(profile, shape, c, cap);
        // Walk from the prediction to the boundary: fit → grow by the resolution until a step fails;
        // no fit → shrink until one runs.
        auto next = [&](int blocks, int direction) {
          const int step = std::max(1, static_cast<int>(std::lround(blocks * resolution)));
          return std::max(K, blocks + direction * step);
        };
        int blocks = guess;
        Trial t = run_step(shape, blocks, c, cap);
        Trial fit, fail;
        int fit_blocks = 0, fail_blocks = 0;
        if (t.fits) {
          while (t.fits) {
            fit = t;
            fit_blocks = blocks;
            blocks = next(blocks, +1);
            t = run_step(shape, blocks, c, cap);
          }
          fail = t;
          fail_blocks = blocks;
        } else {
          while (!t.fits && blocks > K) {
            fail = t;
            fail_blocks = blocks;
            blocks = next(blocks, -1);
            t = run_step(shape, blocks, c, cap);
          }
          if (t.fits) {
            fit = t;
            fit_blocks = blocks;
          }
        }
        if (!fit.fits) {
          std::cout << std::setw(3) << K << std::setw(8) << gpipe::to_string(mode) << std::setw(7)
                    << gpipe::to_string(schedule) << "  nothing fits: " << t.error << std::endl;
          continue;
        }
        const double parameters = static_cast<double>(fit.parameters);
        if (K == 1) one_device[{mode, schedule}] = parameters;
        auto ratio_to = [&](gpipe::Checkpoint at_one) {  // NaN (JSON null) without a K=1 row before it
          const auto it = one_device.find({at_one, schedule});
          return it == one_device.end() ? std::nan("") : parameters / it->second;
        };
        const double ratio = ratio_to(gpipe::Checkpoint::kNever);
        std::ostringstream peaks;
        peaks << std::fixed << std::setprecision(0);
        for (size_t j = 0; j < fit.peak_bytes.size(); ++j)
          peaks << (j ? " " : "") << static_cast<double>(fit.peak_bytes[j]) / (1 << 20);
        std::cout << std::setw(3) << K << std::setw(8) << gpipe::to_string(mode) << std::setw(7)
                  << gpipe::to_string(schedule) << std::setw(8) << fit_blocks << std::setw(11) << std::fixed
                  << std::setprecision(1) << parameters / 1e6 << "M" << std::setw(8) << std::setprecision(2) << ratio_to(mode) << std::setw(8) << ratio
                  << std::setw(11) << guess << std::setw(14) << fail_blocks << "  " << peaks.str() << std::endl;
        std::cout << "      L=" << fail_blocks << ": " << fail.error << std::endl;
        rows.push_back({{"stages", K},
                        {"checkpoint", gpipe::to_string(mode)},
                        {"schedule", gpipe::to_string(schedule)},
                        {"layers", fit_blocks},
                        {"parameters", fit.parameters},
                        {"ratio_to_one_device_never", ratio},
                        {"ratio_to_one_device_same_mode", ratio_to(mode)},
                        {"peak_bytes", fit.peak_bytes},
                        {"step_seconds", fit.seconds},
                        {"predicted_layers", guess},
                        {"fails_at_layers", fail_blocks},
                        {"fails_with", fail.error}});
      }
  const nlohmann::json doc = {
      {"command", "largest_model"},
      {"model", {{"width", shape.width}, {"heads", shape.heads}, {"ffn", shape.ffn}, {"vocab", shape.vocab},
                 {"sequence", shape.sequence}, {"block_parameters", block_parameters}}},
      {"batch", shape.batch},
      {"micro_batches", shape.micro_batches},
      {"optimizer", "adam"},
      {"cap_bytes", cap},
      {"resolution", resolution},
      {"blas", gpipe::blas_info()},
      {"libtorch", TORCH_VERSION},
      {"results", rows}};
  gpipe::write_file_atomically(results, doc.dump(2) + "\n");
  std::cerr << "results written to " << results << "\n";
  if (rows.empty()) {
    std::cerr << "largest_model: no model fits a cap of " << cap_text << " on any K; raise --cap\n";
    return 1;
  }
  return 0;
}
