// calibrate.cc: what gpipe's own pipeline adds to the times its layers take alone, measured on a
// pipeline of small layers whose steps are timed against the prediction from their profile; and a
// model's profile with it. Here, where a pipeline is chosen, rather than in cost/, which predicts from
// profiles and runs no pipeline.
#include "gpipe/calibrate.h"

#include "gpipe/check.h"
#include "gpipe/device.h"
#include "gpipe/microbatch.h"
#include "gpipe/pipeline.h"
#include "gpipe/stage.h"

#include <ATen/Context.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <map>
#include <mutex>

namespace gpipe {
namespace {

// 8 x [Linear(64, 64), ReLU] on 256 rows: each action takes tens of microseconds, so what the step
// takes beyond the prediction is the pipeline's own.
constexpr int kLayers = 16;
constexpr int64_t kRows = 256, kWidth = 64;
constexpr int kWarmupSteps = 3, kTimedSteps = 21;

torch::nn::Sequential small_layers(LayerRange keep) {
  torch::nn::Sequential out;
  for (int l = 0; l < kLayers; ++l) {
    if (!keep.contains(l)) continue;
    if (l % 2 == 0)
      out->push_back(torch::nn::Linear(kWidth, kWidth));
    else
      out->push_back(torch::nn::ReLU());
  }
  return out;
}

// Fill-drain on 2 devices at M micro-batches: its pipeline and its timed steps.
struct Probe {
  int micro_batches = 1;
  std::unique_ptr<Pipeline> pipe;
  std::vector<double> steps;
};

std::unique_ptr<Pipeline> small_pipeline(int M, int threads) {
  const PipelineOptions options = PipelineOptions()
                                      .devices(2)
                                      .micro_batches(M)
                                      .schedule(ScheduleKind::kGPipe)
                                      .checkpoint(Checkpoint::kNever)
                                      .threads_per_device(threads);
  return make_pipeline(small_layers, kLayers, options, Runtime::kThreads);
}

// The measured step less the one predicted from the profiled layers, and the actions on the
// predicted critical path, of each probe.
std::vector<std::pair<double, double>> residuals(int threads) {
  const torch::Tensor input = torch::randn({kRows, kWidth}), target = torch::randn({kRows, kWidth});
  std::vector<Probe> probes;
  for (int M : {1, 4, 16}) probes.push_back({M, small_pipeline(M, threads), {}});
  // Step by step in turn, so that the machine's moods fall on every probe alike.
  for (int n = 0; n < kWarmupSteps + kTimedSteps; ++n)
    for (Probe& p : probes) {
      const auto begin = std::chrono::steady_clock::now();
      p.pipe->train_step(input, target, mse_loss);
      const std::chrono::duration<double> took = std::chrono::steady_clock::now() - begin;
      if (n >= kWarmupSteps) p.steps.push_back(took.count());
    }
  std::vector<std::pair<double, double>> out;
  for (Probe& p : probes) {
    std::nth_element(p.steps.begin(), p.steps.begin() + kTimedSteps / 2, p.steps.end());
    const std::vector<int64_t> rows = micro_batch_sizes(kRows, p.micro_batches);
    CostModel costs = profile_layers(small_layers(LayerRange{}), input.narrow(0, 0, rows.front()),
                                     ProfileLayersOptions()
                                         .threads(threads)
                                         .warmup(5)
                                         .repetitions(9)
                                         .loss(mse_loss)
                                         .target(target.narrow(0, 0, rows.front())));
    costs.update_s_per_parameter_byte = 0;  // the steps above do not update
    CostModel unit = with_compute_scaled(costs, 0.0);
    unit.action_overhead_s = 1.0;  // its step is the count of actions one after the other
    out.emplace_back(p.steps[kTimedSteps / 2] - predict(costs, p.pipe->plan(), rows).step_s,
                     predict(unit, p.pipe->plan(), rows).step_s);
  }
  return out;
}

PipelineOverhead measure(int threads) {
  // Trained whatever the caller's mode (torch.no_grad, inference mode): the modes are the thread's.
  const c10::InferenceMode not_inference(false);
  const torch::AutoGradMode grad(true);
  // Each of the 2 devices has at most half the machine's cores: a plan for more is measured at those.
  threads = std::clamp(threads, 1, std::max(1, machine_cores() / 2));
  // The layers are built from the default generator's numbers, which are put back.
  at::Generator generator = at::globalContext().defaultGenerator(torch::kCPU);
  const torch::Tensor state = generator.get_state();
  std::vector<std::pair<double, double>> found;
  try {
    found = residuals(threads);
  } catch (...) {
    generator.set_state(state);
    throw;
  }
  generator.set_state(state);
  return fit_pipeline_overhead(found);
}

}  // namespace

PipelineOverhead pipeline_overhead(int threads) {
  GPIPE_CHECK(threads >= 1, "pipeline_overhead needs at least 1 thread per device (got ", threads, ")");
  static std::mutex mutex;
  static std::map<int, PipelineOverhead> measured;
  const std::lock_guard<std::mutex> lock(mutex);
  if (const auto it = measured.find(threads); it != measured.end()) return it->second;
  return measured[threads] = measure(threads);
}

PipelineOverhead fit_pipeline_overhead(const std::vector<std::pair<double, double>>& residuals) {
  // residual = step + action x actions, by least squares.
  double n = 0, sx = 0, sy = 0, sxx = 0, sxy = 0;
  for (const auto& [measured, actions] : residuals) {
    const double y = std::isfinite(measured) ? measured : 0.0;
    n += 1, sx += actions, sy += y, sxx += actions * actions, sxy += actions * y;
  }
  PipelineOverhead o;
  if (n == 0) return o;
  const double spread = n * sxx - sx * sx;
  o.action_s = spread > 0 ? (n * sxy - sx * sy) / spread : 0.0;
  o.step_s = (sy - o.action_s * sx) / n;
  if (o.action_s < 0) {  // the step's alone
    o.action_s = 0;
    o.step_s = sy / n;
  } else if (o.step_s < 0) {  // the actions' alone
    o.step_s = 0;
    o.action_s = sxx > 0 ? sxy / sxx : 0.0;
  }
  o.action_s = std::max(0.0, o.action_s);
  o.step_s = std::max(0.0, o.step_s);
  return o;
}

CostModel with_pipeline_overhead(CostModel costs, int threads) {
  const PipelineOverhead own = pipeline_overhead(threads);
  costs.action_overhead_s = own.action_s;
  costs.step_overhead_s = own.step_s;
  return costs;
}

CostModel profile_model(const torch::nn::Sequential& model, const Tensors& sample, const PlanProfileOptions& options) {
  CostModel costs = profile_model_alone(model, sample, options);
  // Not scaled by `speed`: the overhead is this machine's threads', whatever device is planned.
  return options.count_pipeline_overhead() ? with_pipeline_overhead(std::move(costs), options.layers().threads()) : costs;
}

PlannedModel plan_model_of(const torch::nn::Sequential& model, const Tensors& sample, const PlanProfileOptions& options) {
  return plan_model_from(profile_model(model, sample, options), model, sample, options);
}

}  // namespace gpipe
