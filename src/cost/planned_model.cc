// planned_model.cc: a model as the planner takes it (PlannedModel): profiled here from a Sequential
// and a sample (its layers alone; calibrate.h adds the pipeline's own overhead), left as it was, or
// derived from a Transformer's shape; and the search over it.
#include "gpipe/planner.h"

#include "gpipe/check.h"
#include "gpipe/tensors.h"

#include <ATen/Context.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <iomanip>
#include <memory>
#include <sstream>
#include <utility>

namespace gpipe {
namespace {

// What running a model in training mode may change, saved when made and put back when destroyed:
// the parameters' gradients, the buffers (BatchNorm's running statistics, num_batches_tracked),
// every module's training mode, and the default generator's state.
class ModelStateGuard {
 public:
  explicit ModelStateGuard(const torch::nn::Sequential& model) {
    for (const torch::Tensor& p : model->parameters(/*recurse=*/true))
      gradients_.emplace_back(p, p.grad().defined() ? p.grad().clone() : torch::Tensor());
    for (const torch::Tensor& b : model->buffers(/*recurse=*/true)) buffers_.emplace_back(b, b.clone());
    modes_.emplace_back(model.ptr(), model->is_training());
    for (const auto& m : model->modules(/*include_self=*/false)) modes_.emplace_back(m, m->is_training());
    at::Generator generator = at::globalContext().defaultGenerator(torch::kCPU);
    generator_ = generator.get_state();
  }
  ~ModelStateGuard() {
    const torch::NoGradGuard no_grad;
    for (auto& [p, grad] : gradients_) p.mutable_grad() = grad;
    for (auto& [b, saved] : buffers_) b.copy_(saved);
    // Outermost first (modules() lists a module before its children): a module's train() sets its
    // children's mode, which they then get back.
    for (auto& [module, training] : modes_) module->train(training);
    at::Generator generator = at::globalContext().defaultGenerator(torch::kCPU);
    generator.set_state(generator_);
  }
  ModelStateGuard(const ModelStateGuard&) = delete;
  ModelStateGuard& operator=(const ModelStateGuard&) = delete;

 private:
  std::vector<std::pair<torch::Tensor, torch::Tensor>> gradients_, buffers_;
  std::vector<std::pair<std::shared_ptr<torch::nn::Module>, bool>> modes_;
  torch::Tensor generator_;
};

int64_t least_rows_unguarded(torch::nn::Sequential model, const Tensors& sample) {
  const torch::NoGradGuard no_grad;
  model->train();
  Tensors x = sample;
  for (auto& t : x.items)
    if (t.dim() >= 1 && t.size(0) > 1) t = t.narrow(0, 0, 1);
  x = copy_of(x);  // a first layer may change its input in place: not the caller's data
  const std::vector<std::string> names = layer_names(model);
  try {
    size_t i = 0;
    for (auto it = model->begin(); it != model->end(); ++it, ++i) x = run_layer(*it, x, names[i]);
  } catch (const std::exception& e) {
    if (std::string(e.what()).find("Expected more than 1 value per channel when training") != std::string::npos) return 2;
  }
  return 1;
}

}  // namespace

std::vector<std::string> plan_optimizer_names() { return {"sgd", "momentum", "adam", "adamw"}; }

double state_per_parameter_byte_of(const std::string& optimizer) {
  const std::vector<std::string> names = plan_optimizer_names();
  const double state[] = {1, 2, 3, 3};  // sgd: the gradient; momentum: and its velocity; adam(w): two moments
  for (size_t n = 0; n < names.size(); ++n)
    if (optimizer == names[n]) return state[n];
  GPIPE_CHECK(false, "`optimizer` must be \"sgd\", \"momentum\", \"adam\" or \"adamw\" (got \"", optimizer, "\")");
  return 0;
}

int64_t least_micro_batch_rows(const torch::nn::Sequential& model, const Tensors& sample) {
  const ModelStateGuard guard(model);
  return least_rows_unguarded(model, sample);
}

CostModel profile_model_alone(const torch::nn::Sequential& model, const Tensors& sample,
                              const PlanProfileOptions& options) {
  GPIPE_CHECK(options.speed() > 0 && std::isfinite(options.speed()),
              "`speed` must be a positive number, the device's speed relative to this machine's core (got ",
              options.speed(), ")");
  const double state = state_per_parameter_byte_of(options.optimizer());
  CostModel costs;
  {
    const ModelStateGuard guard(model);
    torch::nn::Sequential layers = model;  // a handle to the same modules, to set their mode
    layers->train();
    costs = profile_layers(model, sample, ProfileLayersOptions(options.layers()).state_per_parameter_byte(state));
  }
  return with_compute_scaled(std::move(costs), 1.0 / options.speed());
}

PlannedModel plan_model_from(const CostModel& costs, const torch::nn::Sequential& model, const Tensors& sample,
                             const PlanProfileOptions& options) {
  PlannedModel m;
  m.costs = costs;
  m.least_micro_batch_rows = least_micro_batch_rows(model, sample);
  for (const auto& p : model->parameters()) m.parameters += p.numel();
  std::ostringstream d;
  d << options.name() << ": " << model->size() << " layers, " << m.parameters << " parameters (profiled here, device "
    << options.speed() << "x this machine's core)"
    << (m.least_micro_batch_rows > 1 ? "; its BatchNorm trains on micro-batches of 2 rows or more" : "");
  if (options.count_pipeline_overhead())
    d << "; the pipeline's own overhead here " << std::fixed << std::setprecision(0) << m.costs.action_overhead_s * 1e6
      << " us per action and " << m.costs.step_overhead_s * 1e6 << " us per step";
  m.description = d.str();
  return m;
}

PlannedModel plan_model_of(const TransformerShape& t, const DeviceSpec& device, const std::string& optimizer) {
  GPIPE_CHECK(t.layers <= kMostPlannedBlocks, "a Transformer of ", t.layers, " `layers` is more than the planner takes (",
              kMostPlannedBlocks, ")");
  GPIPE_CHECK(t.bytes_per_value == 4 || t.bytes_per_value == 2,
              "`bytes_per_value` must be 4 (float32) or 2 (half precision) (got ", t.bytes_per_value, ")");
  PlannedModel m;
  m.costs = transformer_costs(t, device, state_per_parameter_byte_of(optimizer));
  m.lead = 1;
  m.blocks = static_cast<int>(t.layers);
  m.tail = 1;
  m.parameters = t.parameters();
  std::ostringstream d;
  d << "Transformer: " << t.layers << " layers, width " << t.width << ", " << t.heads << " heads, feed-forward "
    << t.ffn << ", vocabulary " << t.vocab << ", sequence " << t.sequence << "; " << std::fixed << std::setprecision(2)
    << static_cast<double>(m.parameters) / (m.parameters >= 1000000000 ? 1e9 : 1e6)
    << (m.parameters >= 1000000000 ? "B" : "M") << " parameters; device " << std::defaultfloat << std::setprecision(4)
    << device.flops_per_s / 1e12 << " TFLOP/s";
  m.description = d.str();
  return m;
}

std::vector<PlanCandidate> search_plans(const PlannedModel& model, PlanSearch search) {
  search.lead = model.lead;
  search.blocks = model.blocks;
  search.tail = model.tail;
  search.least_micro_batch_rows = model.least_micro_batch_rows;
  CostModel costs = model.costs;
  costs.update_s_per_parameter_byte = 0;
  return search_plans(costs, search);
}

PlanSearch plan_search_of(int devices, int64_t memory_per_device, int64_t batch,
                          const std::vector<std::string>& schedules, const std::vector<std::string>& checkpoints,
                          const std::vector<int>& stages, const std::vector<int>& micro_batches) {
  PlanSearch search;
  search.devices = devices;
  search.memory_per_device = memory_per_device;
  search.batch = batch;
  check_listed_once(schedules, "schedule");  // "auto" beside a schedule names that one once more, which is fine
  search.schedules.clear();
  for (const std::string& name : schedules)  // "auto": every schedule
    for (ScheduleKind kind : name == "auto" ? all_schedules() : std::vector<ScheduleKind>{parse_schedule(name)})
      if (std::find(search.schedules.begin(), search.schedules.end(), kind) == search.schedules.end())
        search.schedules.push_back(kind);
  search.checkpoints.clear();
  for (const std::string& name : checkpoints) search.checkpoints.push_back(parse_checkpoint(name));
  search.stages = stages;
  search.micro_batches = micro_batches;
  return search;
}

PlanShortfall shortfall_of(const std::vector<PlanCandidate>& found, int64_t memory_per_device, int stage_units) {
  GPIPE_CHECK(!found.empty(), "no configuration was planned");
  GPIPE_CHECK(memory_per_device >= 1, "a device needs at least 1 byte of memory (got ", memory_per_device, ")");
  PlanShortfall s;
  s.least = found.front();
  s.device = s.least.predicted.largest_device();
  const double over = static_cast<double>(s.least.largest_total_bytes) / static_cast<double>(memory_per_device);
  const double wanted = std::ceil(over * s.least.config.devices);
  s.devices_needed = wanted <= stage_units ? static_cast<int>(wanted) : 0;
  return s;
}

std::string no_fit_message(const std::vector<PlanCandidate>& found, const PlannedModel& model, const PlanSearch& search,
                           const std::string& optimizer, bool half_precision_helps, const PlanSettingNames& names) {
  const PlanShortfall short_of = shortfall_of(found, search.memory_per_device, model.stage_units());
  const PlanCandidate& least = short_of.least;
  const bool always_tried =
      std::find(search.checkpoints.begin(), search.checkpoints.end(), Checkpoint::kAlways) != search.checkpoints.end();
  std::ostringstream out;
  const PipelineConfig& config = least.config;
  out << "no configuration fits: the least memory is needed by K=" << config.devices << ", M=" << config.micro_batches
      << ", " << to_string(config.schedule) << ", checkpoint " << to_string(config.checkpoint) << ", whose device "
      << short_of.device << " needs " << format_bytes(static_cast<double>(least.largest_total_bytes))
      << "; the device has " << format_bytes(static_cast<double>(search.memory_per_device)) << "; try "
      << (always_tried ? "" : names.checkpoint_always + ", ");
  if (short_of.devices_needed > 0)
    out << "about " << short_of.devices_needed << " or more devices per pipeline (" << names.devices
        << " a multiple of it), ";
  else
    out << "fewer or smaller layers (a stage needs at least one of the " << model.stage_units() << "), "
        << (half_precision_helps ? names.half_precision + ", " : "")
        << (optimizer != "sgd" ? "a lighter " + names.optimizer + ", " : "");
  out << "or devices with more memory";
  return out.str();
}

}  // namespace gpipe
