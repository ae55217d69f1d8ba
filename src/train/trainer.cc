// trainer.cc: the training loop: optimizer, learning rate, clipping, the non-finite guard, epochs,
// and the run saved and resumed through snapshots, in one process and under MPI.
#include "gpipe/train.h"

#include "gpipe/backend.h"
#include "gpipe/job.h"

#include "gpipe/digest.h"

#include "gpipe/check.h"
#include "gpipe/cost_model.h"
#include "gpipe/io.h"
#include "gpipe/microbatch.h"
#include "gpipe/planner.h"
#include "gpipe/transport.h"
#include "train/stage_updates.h"

#include <torch/torch.h>

#include <csignal>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <iomanip>
#include <limits>
#include <optional>
#include <sstream>
#include <string_view>

namespace gpipe {
namespace {

torch::Tensor generator_state(const at::Generator& generator) {
  at::Generator g = generator;
  return g.get_state();
}

at::Generator default_generator() { return at::globalContext().defaultGenerator(torch::kCPU); }

[[noreturn]] void refuse(const std::string& message) { throw std::invalid_argument("gpipe: " + message); }

// "gpipe: " + text, as every error of the library begins.
std::string prefixed(const std::string& text) { return text.rfind("gpipe: ", 0) == 0 ? text : "gpipe: " + text; }

// Runs `work` on this rank, then every rank learns whether every other's succeeded (a collective
// that all of them reach): this rank rethrows its own error as Error; the others throw Error
// naming the highest failed rank and `what_it_did` ("refused the run").
template <class Error>
void on_all_ranks(Pipeline& pipeline, const std::function<void()>& work, const std::string& what_it_did) {
  std::string error;
  try {
    work();
  } catch (const std::exception& e) {
    error = prefixed(what_of(e));
  }
  const double failed = pipeline.max(error.empty() ? -1.0 : static_cast<double>(pipeline.rank()));
  if (!error.empty()) throw Error(error);
  if (failed >= 0)
    throw Error("gpipe: rank " + std::to_string(static_cast<int>(failed)) + " " + what_it_did +
                " (its message says why)");
}

}  // namespace

RandomStateGuard::RandomStateGuard() : state_(generator_state(default_generator())) {}

RandomStateGuard::~RandomStateGuard() {
  at::Generator generator = default_generator();
  generator.set_state(state_);
}

// ---------------------------------------------------------------- optimizer and learning rate

std::string optimizer_name(OptimizerKind kind) {
  switch (kind) {
    case OptimizerKind::kSgd: return "sgd";
    case OptimizerKind::kAdam: return "adam";
    case OptimizerKind::kAdamW: return "adamw";
  }
  return "?";
}

OptimizerKind parse_optimizer(const std::string& name) {
  for (OptimizerKind kind : {OptimizerKind::kSgd, OptimizerKind::kAdam, OptimizerKind::kAdamW})
    if (optimizer_name(kind) == name) return kind;
  GPIPE_CHECK(false, "unknown optimizer '", name, "'; use sgd, adam or adamw");
  return OptimizerKind::kAdam;
}

std::string lr_schedule_name(LrSchedule kind) {
  switch (kind) {
    case LrSchedule::kConstant: return "constant";
    case LrSchedule::kCosine: return "cosine";
    case LrSchedule::kStep: return "step";
  }
  return "?";
}

LrSchedule parse_lr_schedule(const std::string& name) {
  for (LrSchedule kind : {LrSchedule::kConstant, LrSchedule::kCosine, LrSchedule::kStep})
    if (lr_schedule_name(kind) == name) return kind;
  GPIPE_CHECK(false, "unknown learning-rate schedule '", name, "'; use constant, cosine or step");
  return LrSchedule::kConstant;
}

double OptimizerOptions::decay() const {
  return weight_decay().value_or(kind() == OptimizerKind::kAdamW ? 0.01 : 0.0);  // torch.optim's defaults
}

void OptimizerOptions::check() const {
  const bool sgd = kind() == OptimizerKind::kSgd;
  GPIPE_CHECK(std::isfinite(lr()) && lr() > 0, "the learning rate must be a finite number above 0 (got ", lr(), ")");
  GPIPE_CHECK(sgd || (momentum() == 0 && !nesterov()), "`momentum` and `nesterov` are SGD's (`optimizer` sgd); ",
              optimizer_name(kind()), " has `betas`");
  GPIPE_CHECK(!sgd || !betas(), "`betas` are Adam's and AdamW's; SGD has `momentum`");
  GPIPE_CHECK(!nesterov() || momentum() > 0, "`nesterov` needs `momentum` above 0 (as torch.optim.SGD)");
  // The parameters are float: a factor beyond float's range cannot be applied to them.
  const double largest = std::numeric_limits<float>::max();
  GPIPE_CHECK(std::isfinite(decay()) && decay() >= 0 && decay() <= largest, "`weight_decay` must be a number from 0 "
              "to 3.4e38, float's largest (got ", decay(), ")");
  GPIPE_CHECK(std::isfinite(momentum()) && momentum() >= 0 && momentum() <= largest, "`momentum` must be a number "
              "from 0 to 3.4e38, float's largest (got ", momentum(), ")");
}

double state_per_parameter_byte(const OptimizerOptions& options) {
  if (options.kind() == OptimizerKind::kSgd) return options.momentum() > 0 ? 2.0 : 1.0;
  return 3.0;  // Adam, AdamW: two moments
}

std::unique_ptr<torch::optim::Optimizer> make_optimizer(const OptimizerOptions& o,
                                                        const std::vector<torch::Tensor>& params) {
  o.check();
  namespace optim = torch::optim;
  if (o.kind() == OptimizerKind::kSgd)
    return std::make_unique<optim::SGD>(
        params, optim::SGDOptions(o.lr()).momentum(o.momentum()).nesterov(o.nesterov()).weight_decay(o.decay()));
  const auto betas = o.betas().value_or(std::make_tuple(0.9, 0.999));
  if (o.kind() == OptimizerKind::kAdamW)
    return std::make_unique<optim::AdamW>(params, optim::AdamWOptions(o.lr()).betas(betas).weight_decay(o.decay()));
  return std::make_unique<optim::Adam>(params, optim::AdamOptions(o.lr()).betas(betas).weight_decay(o.decay()));
}

void LrScheduleOptions::check() const {
  GPIPE_CHECK(warmup_steps() >= 0, "the warm-up must be 0 steps or more (got ", warmup_steps(), ")");
  GPIPE_CHECK(step_size() >= 0, "the LR step size must be 0 (one epoch) or more steps (got ", step_size(), ")");
  GPIPE_CHECK(std::isfinite(gamma()) && gamma() > 0, "the LR decay factor gamma must be a finite number above 0 (got ",
              gamma(), ")");
}

double learning_rate(double lr, const LrScheduleOptions& schedule, int64_t step, int64_t total) {
  GPIPE_CHECK(schedule.kind() != LrSchedule::kStep || schedule.step_size() > 0,
              "the step schedule needs a step size above 0 (got ", schedule.step_size(), ")");
  const int64_t W = schedule.warmup_steps();
  if (step < W) return lr * static_cast<double>(step + 1) / static_cast<double>(W);
  const double t = static_cast<double>(step - W);
  if (schedule.kind() == LrSchedule::kCosine) {
    const double span = static_cast<double>(std::max<int64_t>(1, total - W));
    return lr * 0.5 * (1.0 + std::cos(M_PI * std::min(1.0, t / span)));
  }
  if (schedule.kind() == LrSchedule::kStep)
    return lr * std::pow(schedule.gamma(), std::floor(t / static_cast<double>(schedule.step_size())));
  return lr;
}

// ---------------------------------------------------------------- models

Model Model::of(std::string name, int layers, LayerBuilder build) {
  Model m;
  m.name = std::move(name);
  m.layers = layers;
  m.build = std::move(build);
  return m;
}

Model Model::of(std::string name, const ScriptModel& source) {
  Model m;
  m.name = std::move(name);
  m.layers = static_cast<int>(source.layers->size());
  m.script = source.script;
  const torch::nn::Sequential all = source.layers;
  // A module used at two places of the Sequential shares its tensors: under MPI its parameters are
  // tied across ranks; its buffers would drift apart, so that is refused (in a job of several
  // processes, whichever backend runs it).
  m.tied = shared_tensors(all);
  const auto shared_buffers = shared_tensors(all, /*buffers=*/true);
  GPIPE_CHECK(running_backend() == Runtime::kThreads || shared_buffers.empty(), shared_buffers.empty() ? "" : shared_buffers.front().front(),
              " and ", shared_buffers.empty() ? "" : shared_buffers.front().back(),
              " are one buffer (a module used twice in the Sequential); in a job of several processes each rank would keep a "
              "copy of its own: train this model in one process, or give each use its own module");
  m.build = [all](LayerRange keep) {  // the loaded layers themselves: they share the script module's tensors
    torch::nn::Sequential part;
    const auto names = all->named_children().keys();
    for (int n = 0; n < static_cast<int>(names.size()); ++n)
      if (keep.contains(n)) part->push_back(names[static_cast<size_t>(n)], *(all->begin() + n));
    return part;
  };
  return m;
}

// ---------------------------------------------------------------- checks and the cut

namespace {

// fn on the first two rows of `input`, or, where it fails on two, on up to 64: a layer may need more
// rows than two (a view by 4, a statistic over the batch), which its micro-batches will have. Where
// it fails on both, what it said on two.
template <typename Fn>
auto on_the_first_rows(const torch::Tensor& input, Fn&& fn) {
  try {
    return fn(input.narrow(0, 0, std::min<int64_t>(2, input.size(0))));
  } catch (const std::exception&) {
    if (input.size(0) <= 2) throw;
    const std::exception_ptr on_two = std::current_exception();
    try {
      return fn(input.narrow(0, 0, std::min<int64_t>(64, input.size(0))));
    } catch (const std::exception&) {
      std::rethrow_exception(on_two);
    }
  }
}

}  // namespace

torch::Tensor check_layers_train(torch::nn::Sequential whole, const torch::Tensor& sample) {
  // In eval mode, with gradients (on a few rows, the graph freed at once): an output that no
  // gradient reaches would train nothing.
  whole->eval();
  struct TrainModeAgain {  // the layers may be the training ones (a TorchScript model's)
    torch::nn::Sequential layers;
    ~TrainModeAgain() { layers->train(); }
  } train_mode_again{whole};
  const auto names = whole->named_children();
  auto layer = [&names](size_t i) {
    const std::string index = std::to_string(i);
    return "layer " + index + (names[i].key() == index ? "" : " ('" + names[i].key() + "')");
  };
  bool trains = false;
  for (const torch::Tensor& p : whole->parameters()) trains = trains || p.requires_grad();
  if (!trains)
    refuse(whole->parameters().empty()
               ? "the model has no parameters: training would change nothing; give a model with layers that learn"
               : "none of the model's parameters requires a gradient (all are frozen): training would change "
                 "nothing; unfreeze some (requires_grad=True) before saving the model");
  // The parameters, the optimizer's state and the checkpoint files are float32.
  for (const auto& p : whole->named_parameters()) {
    if (p.value().is_floating_point() && p.value().scalar_type() != torch::kFloat)
      refuse("the model's parameter " + p.key() + " is " + dtype_text(p.value()) + ", but gpipe trains float32 "
             "models: save the model as float32 (model.float() in Python before torch.jit.script)");
    if (p.value().is_floating_point() && !torch::isfinite(p.value()).all().item<bool>())
      refuse("the model's parameter " + p.key() + " holds NaN or infinite values, so every loss would be NaN; "
             "initialize it anew, or save the model before it diverged");
  }
  const int64_t rows = sample.size(0);
  int64_t stopped = -1;  // the layer whose output no gradient reaches, though its input's does
  std::optional<std::string> rows_changed;  // the first layer since which the rows are not the samples'
  Tensors out = sample;
  for (size_t i = 0; i < whole->size(); ++i) {
    const Tensors in = out;
    try {
      out = run_layer(*(whole->begin() + static_cast<std::ptrdiff_t>(i)), in, "it");
    } catch (const std::exception& e) {
      const bool dtype = i == 0 && sample.scalar_type() != torch::kFloat && sample.scalar_type() != torch::kLong;
      refuse(layer(i) + " fails on " +
             (i == 0 ? "the data's first samples, shape " : "the output of layer " + std::to_string(i - 1) + ", shape ") +
             in.shape() + ": " + what_of(e) +
             (dtype    ? "; the data's 'input' is " + dtype_text(sample) + ": save it as float32 (X.float() in Python)"
              : i == 0 ? "; give the model inputs of the shape its first layer takes"
                       : "; make each layer take the shape the one before it outputs"));
    }
    // Inside the model another layout may come and go (sequence first, say); the output's rows must
    // be the samples', and the first layer that changed them is the one to name.
    const torch::Tensor& lead = out.items.front();  // of a tuple, the first tensor
    const bool rows_kept = lead.dim() > 0 && lead.size(0) == rows;
    if (!rows_kept && !rows_changed)
      rows_changed = layer(i) + " turns " + std::to_string(rows) + " samples (shape " + in.shape() + ") into " +
                     (lead.dim() == 0 ? "a single number"
                                      : std::to_string(lead.size(0)) + (lead.size(0) == 1 ? " row" : " rows") +
                                            " (shape " + out.shape() + ")");
    if (rows_kept) rows_changed.reset();
    if (requires_grad(in) && !requires_grad(out)) stopped = static_cast<int64_t>(i);
    if (requires_grad(out)) stopped = -1;
  }
  if (out.tuple)
    refuse("the model's last layer returns a tuple (shape " + out.shape() + "), but the loss takes one tensor: end "
           "the model with a layer that returns one");
  if (rows_changed)
    refuse(*rows_changed + ", and the model's output keeps that: the outputs no longer pair with the samples; the "
           "model must end with one row per sample (slice, pool or reduce dimensions after the first)");
  if (!requires_grad(out))
    refuse("the model's output does not depend on any parameter through a gradient" +
           (stopped >= 0 ? ": " + layer(static_cast<size_t>(stopped)) +
                               " returns a tensor without one (argmax, a comparison, an integer result or .detach())"
                         : std::string()) +
           ", so training would change nothing; end the model with differentiable scores (argmax belongs after "
           "training, not in the model)");
  return out.only().detach();
}

void check_model_and_data(const Model& model, const Dataset& data, bool classification) {
  GPIPE_CHECK(data.size() > 0, "the training data has no samples");
  const torch::Tensor out = on_the_first_rows(data.input, [&model](const torch::Tensor& rows) {
    const RandomStateGuard guard;  // building the whole model draws random numbers
    return check_layers_train(model.build(LayerRange{}), rows);
  });
  const std::string samples = std::to_string(out.size(0)) + " samples";
  const torch::Tensor& target = data.target;
  if (!classification && target.is_floating_point() && target.scalar_type() != out.scalar_type())
    refuse("`loss` mse: the targets are " + dtype_text(target) + ", but the model outputs " + dtype_text(out) +
           ": save the targets as " + dtype_text(out) + " (Y.float() in Python)");
  const auto out_row = out.sizes().slice(1), target_row = target.sizes().slice(1);
  if (classification) {
    if (out.dim() < 2)
      refuse("`loss` cross_entropy needs the model to output a score per class (shape [N, classes]), but it "
                  "outputs " + shape_text(out) + " for " + samples);
    const int64_t classes = out.size(-1);
    if (target_row != out_row.slice(0, out_row.size() - 1))
      refuse("`loss` cross_entropy: the model outputs " + shape_text(out) + " for " + samples + ", so the targets "
                  "must be class indices of shape [N" + (out.dim() > 2 ? ", ..." : std::string()) + "], but they have "
                  "shape " + shape_text(target) + (target.dim() == 2 && target.size(1) == 1 ? "; squeeze the last "
                  "dimension (target.squeeze(1) in Python)" : ""));
    const int64_t low = target.min().item<int64_t>(), high = target.max().item<int64_t>();
    if (low < 0 || high >= classes)
      refuse("`loss` cross_entropy: the targets hold class " + std::to_string(low < 0 ? low : high) +
                  ", but the model outputs " + std::to_string(classes) + " classes (0 to " +
                  std::to_string(classes - 1) + ")");
  } else if (target_row != out_row) {
    refuse("`loss` mse: the model outputs rows of shape " + shape_text(out.narrow(0, 0, 1).squeeze(0)) +
                ", but the targets' rows have shape " + shape_text(target.narrow(0, 0, 1).squeeze(0)) +
                " (targets " + shape_text(target) + "); give targets of the output's shape");
  }
}

namespace {

// How a save at `path` is named on standard error when a signal ends the process (note_saved).
std::string saved_name(const std::string& path, bool per_device) {
  return per_device ? path + " (per-device files)" : path;
}

}  // namespace

namespace {
void refuse_per_device_set(const std::string& path);  // below, with the per-device files
}  // namespace

std::optional<SavedPipeline> check_snapshot_of(const std::string& path, const Model& model,
                                               const std::string& optimizer_name) {
  refuse_per_device_set(path);
  const RandomStateGuard guard;  // building the model draws random numbers
  const torch::nn::Sequential whole = model.build(LayerRange{});
  const Snapshot file = read_snapshot(path, whole, optimizer_name, model.script.has_value());
  GPIPE_CHECK(file.parameters_in_file == file.parameters_taken, path, " is a checkpoint file of another model: "
              "it holds ", file.parameters_in_file, " parameters, this model ", file.parameters_taken);
  return file.state.pipeline;
}

CostBalance balance_by(const std::string& method, const Model& model, const Tensors& sample, int devices,
                       int micro_batches, int threads, double optimizer_copies, ScheduleKind schedule,
                       int virtual_stages, const std::vector<int>& whole, Checkpoint checkpoint) {
  const std::string unit = cost_unit(method);  // throws for an unknown method, before any work
  const RandomStateGuard guard;  // building the whole model and running it draw random numbers
  const torch::nn::Sequential layers = model.build(LayerRange{});
  // Timing runs backward through the layers, whose parameters may be the caller's own (a TorchScript
  // model's are): their gradients are put back as they were, also when the profile fails.
  struct KeptGradients {
    std::vector<torch::Tensor> params, grads;
    ~KeptGradients() {
      for (size_t n = 0; n < params.size(); ++n) params[n].mutable_grad() = grads[n];
    }
  } kept;
  for (const torch::Tensor& p : layers->parameters()) {
    kept.params.push_back(p);
    kept.grads.push_back(p.grad().defined() ? p.grad().clone() : torch::Tensor());
  }
  const int64_t rows = batch_rows(sample, whole);
  const CostModel profile = method == "params" ? CostModel{}
                                               : profile_layers(layers, sample,
                                                                ProfileLayersOptions()
                                                                    .threads(threads)
                                                                    .state_per_parameter_byte(optimizer_copies)
                                                                    .whole(whole));
  const std::vector<double> costs = layer_costs_by(method, layers, profile, rows);
  const PipelineOptions options = PipelineOptions()
                                      .devices(devices)
                                      .virtual_stages(virtual_stages)
                                      .schedule(schedule)
                                      .micro_batches(micro_batches)
                                      .checkpoint(checkpoint)
                                      .cut(CutRequest::by_cost(costs));
  // By time, the min-max cut is then improved by the simulated step (what the sums of times leave out).
  const PipelinePlan plan =
      method == "time" ? refined_plan(profile, options, std::vector<int64_t>(static_cast<size_t>(micro_batches), rows))
                       : make_plan(static_cast<int>(costs.size()), options);
  CostBalance out;
  out.balance = plan.balance;
  out.plan = plan_partition(costs, out.balance,
                            make_schedule(plan.schedule, plan.devices, plan.micro_batches, plan.virtual_stages,
                                          plan.stage_times));
  out.unit = unit;
  out.stage_times = plan.stage_times;
  return out;
}

std::string format_run_figures(const RunFigures& f) {
  std::ostringstream out;
  out << std::fixed << std::setprecision(1) << "  training time  " << f.train_seconds << " s (" << f.steps
      << " steps)\n"
      << std::setprecision(0) << "  throughput     " << f.samples_per_s << " samples/s\n"
      << std::setprecision(1) << "  bubble         " << 100 * f.bubble << "% of device time idle (measured)\n"
      << "  partition      ";
  const bool name_devices = static_cast<int>(f.balance.size()) > f.devices;
  for (size_t j = 0; j < f.balance.size(); ++j)
    out << (j ? " | " : "") << "stage " << j
        << (name_devices && j < f.placement.size() ? " (device " + std::to_string(f.placement[j]) + ")" : "")
        << ": " << f.balance[j] << (f.balance[j] == 1 ? " layer" : " layers");
  out << "\n";
  return out.str();
}

// ---------------------------------------------------------------- the trainer

namespace {

// A whole number of the test hook GPIPE_TEST_FAULT (`text` in full), or an error naming the value.
int64_t fault_number(const std::string& part, const std::string& text) {
  size_t end = 0;
  int64_t value = -1;
  try {
    value = std::stoll(part, &end);
  } catch (const std::exception&) {
    end = std::string::npos;
  }
  GPIPE_CHECK(!part.empty() && end == part.size() && value >= 0, "GPIPE_TEST_FAULT=", text,
              ": expected throw:STEP, exit:RANK:STEP or save:RANK:STEP with whole numbers of at least 0 (a test hook; "
              "unset it)");
  return value;
}

}  // namespace

RunLength run_length(const TrainerOptions& options, int64_t samples) {
  RunLength out;
  GPIPE_CHECK(samples > 0, "the training data has no samples");
  GPIPE_CHECK(options.batch_size() >= 1, "the batch size must be at least 1 (got ", options.batch_size(), ")");
  GPIPE_CHECK(options.epochs() >= 1, "the run needs at least 1 epoch (got ", options.epochs(), ")");
  GPIPE_CHECK(options.steps() >= 0, "the step limit must be 0 (none) or more (got ", options.steps(), ")");
  GPIPE_CHECK(options.save_every() >= 0, "the steps between saves must be 0 (only after every epoch) or more (got ",
              options.save_every(), ")");
  GPIPE_CHECK(options.save_every() == 0 || !options.save().empty(),
              "saving every ", options.save_every(), " steps needs a file to save to (TrainerOptions::save)");
  GPIPE_CHECK(std::isfinite(options.stop_timeout()) && options.stop_timeout() >= 0,
              "the time a step may take after a stop request must be a finite number of seconds, 0 or more (got ",
              options.stop_timeout(), ")");
  GPIPE_CHECK(options.loss() != nullptr, "the trainer needs a loss function");
  options.optimizer().check();
  options.lr_schedule().check();
  GPIPE_CHECK(std::isfinite(options.clip_grad_norm()) && options.clip_grad_norm() >= 0,
              "the gradient norm to clip to must be 0 (never) or a finite number above 0 (got ",
              options.clip_grad_norm(), ")");
  // A last batch smaller than the batch size is kept (as PyTorch's DataLoader), unless drop_last.
  const int64_t B = options.batch_size();
  out.steps_per_epoch = options.drop_last() ? samples / B : (samples + B - 1) / B;
  GPIPE_CHECK(out.steps_per_epoch > 0, "`drop_last` with `batch_size` ", B, " and ", samples,
              " training samples leaves no step; use a smaller batch");
  const int64_t all = out.steps_per_epoch * options.epochs();
  out.total_steps = options.steps() > 0 ? std::min(options.steps(), all) : all;
  out.lr_schedule = options.lr_schedule();
  if (out.lr_schedule.step_size() == 0) out.lr_schedule.step_size(out.steps_per_epoch);
  // A warm-up longer than the run would end it below the learning rate asked for.
  const int64_t W = out.lr_schedule.warmup_steps();
  GPIPE_CHECK(W <= out.total_steps, "the warm-up of ", W, " steps (`warmup_steps`) is longer than the run's ",
              out.total_steps, out.total_steps == 1 ? " step" : " steps", " (", options.epochs(),
              options.epochs() == 1 ? " epoch of " : " epochs of ", out.steps_per_epoch,
              out.steps_per_epoch == 1 ? " step" : " steps",
              options.steps() > 0 && options.steps() < all ? ", limited by `steps` " + std::to_string(options.steps())
                                                            : std::string(),
              "): the learning rate would never reach its value (the last step would run at ", out.total_steps, "/", W,
              " of it); give at most ", out.total_steps, out.total_steps == 1 ? " warm-up step" : " warm-up steps",
              ", or a longer run");
  // The schedules rise only in the warm-up (to `lr`) and with a step factor above 1 (to the last step's):
  // a learning rate beyond float's range is refused now, not at the step that reaches it.
  const double last_lr = learning_rate(options.optimizer().lr(), out.lr_schedule, out.total_steps - 1, out.total_steps);
  GPIPE_CHECK(last_lr <= std::numeric_limits<float>::max(), "the learning rate of the last step, ", out.total_steps,
              ", would be ", last_lr, ", beyond float's range (3.4e38): the parameters could not take it; lower `lr`",
              out.lr_schedule.kind() == LrSchedule::kStep ? ", `lr_gamma` or the steps" : "");
  return out;
}


Trainer::Trainer(const Model& model, const PipelineOptions& pipeline, const TrainerOptions& options, Dataset train,
                 Runtime runtime)
    : Trainer(model, nullptr, pipeline, options, std::move(train), runtime) {}

Trainer::Trainer(const Model& model, const PipelinePlan& plan, const PipelineOptions& pipeline,
                 const TrainerOptions& options, Dataset train, Runtime runtime)
    : Trainer(model, &plan, pipeline, options, std::move(train), runtime) {}

Trainer::Trainer(const Model& model, const PipelinePlan* plan, const PipelineOptions& pipeline,
                 const TrainerOptions& options, Dataset train, Runtime runtime)
    : model_(model), options_(options), train_(std::move(train)), shuffle_(at::detail::createCPUGenerator(options.seed())) {
  const RunLength length = run_length(options_, train_.size());
  steps_per_epoch_ = length.steps_per_epoch;
  total_steps_ = length.total_steps;
  lr_schedule_ = length.lr_schedule;
  // The test hook (train.h).
  if (const char* text = std::getenv("GPIPE_TEST_FAULT"); text != nullptr && *text != '\0') {
    const std::string hook(text);
    const size_t colon = hook.find(':');
    fault_.kind = hook.substr(0, colon);
    const std::string rest = colon == std::string::npos ? "" : hook.substr(colon + 1);
    GPIPE_CHECK(fault_.kind == "throw" || fault_.kind == "exit" || fault_.kind == "save", "GPIPE_TEST_FAULT=", hook,
                ": expected throw:STEP, exit:RANK:STEP or save:RANK:STEP (a test hook; unset it)");
    if (fault_.kind == "exit" || fault_.kind == "save") {
      const size_t second = rest.find(':');
      fault_.rank = static_cast<int>(fault_number(rest.substr(0, second), hook));
      fault_.step = fault_number(second == std::string::npos ? "" : rest.substr(second + 1), hook);
    } else {
      fault_.step = fault_number(rest, hook);
    }
  }
  // The model's own ties join any the caller declared.
  PipelineOptions with_ties = pipeline;
  with_ties.tied_parameters().insert(with_ties.tied_parameters().end(), model_.tied.begin(), model_.tied.end());
  // The model against its data, before any stage is built: for the built-in losses only (a loss of
  // one's own, or cross-entropy over class probabilities, may take other shapes).
  using Loss = torch::Tensor (*)(const torch::Tensor&, const torch::Tensor&);
  const Loss* builtin = options_.loss().target<Loss>();
  const bool classes = builtin != nullptr && *builtin == &cross_entropy_loss && !train_.target.is_floating_point();
  if (classes || (builtin != nullptr && *builtin == &mse_loss)) check_model_and_data(model_, train_, classes);
  pipeline_ = plan != nullptr ? make_pipeline(model_.build, *plan, with_ties, runtime)
                              : make_pipeline(model_.build, model_.layers, with_ties, runtime);
  // A layer that begins a stage and changes its input in place would fail in step 1: refused now.
  // Under MPI a boundary passes at most kMostBoundaryTensors in one message: a cut past it is refused too.
  on_the_first_rows(train_.input, [&](const torch::Tensor& rows) {
    check_stage_inputs(model_, rows, pipeline_->plan().balance, job().distributed ? kMostBoundaryTensors : 0);
    return 0;
  });
  // Every rank trains alike, on the same rows: its settings and its training data are compared.
  std::vector<std::pair<std::string, std::string>> shared = settings_of(options_);
  shared.emplace_back("training data", std::to_string(tensors_digest({train_.input, train_.target})));
  check_same_on_every_rank(*pipeline_, shared);
  optimizer_ = make_optimizer(options_.optimizer(), pipeline_->parameters());
  if (options_.update_on_devices() && detail::StageUpdates::possible(*pipeline_)) {
    stage_updates_ = std::make_unique<detail::StageUpdates>(*pipeline_, options_.optimizer());
    pipeline_->set_before_stage([updates = stage_updates_.get()](int stage) { updates->apply(stage); });
  }
  // A step still running stop_timeout seconds after a stop request is abandoned (in one process).
  const double timeout = options_.stop_timeout();
  pipeline_->set_interrupt([timeout] { return stop_requested() != 0 && seconds_since_stop_request() >= timeout; });
#if defined(GPIPE_HAS_MPI) && GPIPE_HAS_MPI
  const char* const no_mpi = "";
#else
  const char* const no_mpi = " (and this gpipe was built without MPI: rebuild with -DGPIPE_MPI=ON to run under mpirun)";
#endif
  GPIPE_CHECK(!options_.per_device_files() || pipeline_->device() >= 0,
              "per-device files are for MPI runs, where each device writes its own; in one process the "
              "trainer saves the whole model to one file", no_mpi);
  // Per-device files are written by replica 0's ranks: checked there, before training.
  if (options_.per_device_files() && !options_.save().empty())
    on_every_rank([&] {
      if (pipeline_->replica() == 0) check_writable(snapshot_file(options_.save()));
    });
}

std::vector<std::string> Trainer::stop_report(const std::string& resume_flag) const {
  const int signal = stopped_by_;
  if (signal == 0) return {};
  const std::string name = signal_name(signal);
  const std::string& save = options_.save();
  const int64_t per_epoch = steps_per_epoch_;
  const std::string kept =
      save.empty()                  ? "nothing was saved (no save file was given)"
      : options_.per_device_files() ? "the run is saved in " + snapshot_file(save, 0) + " .. " +
                                          snapshot_file(save, pipeline_->devices() - 1) + " and " + manifest_file(save)
                                    : "the run is saved in " + save;
  std::vector<std::string> lines{"gpipe: stopped by " + name + " at step " + std::to_string(step_) + " of " +
                                 std::to_string(total_steps_) + " (epoch " + std::to_string(step_ / per_epoch + 1) +
                                 ", " + std::to_string(step_ % per_epoch) + " of its " + std::to_string(per_epoch) +
                                 " steps done); " + kept};
  if (!resume_flag.empty() && !save.empty())
    lines.push_back("gpipe: resume with: " + resume_command(save, resume_flag));
  return lines;
}

void Trainer::on_every_rank(const std::function<void()>& check) {
  on_all_ranks<std::invalid_argument>(*pipeline_, check, "refused the run");
}

int Trainer::agreed_stop() { return static_cast<int>(pipeline_->max(static_cast<double>(stop_requested()))); }

namespace {

// Per-device files: the manifest, written by the first rank once every device's file is whole,
// names their step; until then each device keeps its file of the step before as FILE.prev.
const char* kManifestFormat = "gpipe-per-device-snapshot-1";

std::string manifest_text(int64_t step, int devices) {
  return std::string(kManifestFormat) + "\nstep " + std::to_string(step) + "\ndevices " + std::to_string(devices) +
         "\n";
}

// The device counts K of the per-device files beside `path` (PATH.stage<j>-of-K, any device j:
// a set that lacks device 0's file is still a set of K), smallest first, each once.
std::vector<int> per_device_sets(const std::string& path) {
  namespace fs = std::filesystem;
  const fs::path file(path);
  const fs::path folder = file.parent_path().empty() ? fs::path(".") : file.parent_path();
  const std::string prefix = file.filename().string() + ".stage";
  auto digits = [](const std::string& s) {
    return !s.empty() && s.size() <= 6 && s.find_first_not_of("0123456789") == std::string::npos;
  };
  std::vector<int> sets;
  std::error_code ec;
  for (fs::directory_iterator it(folder, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (name.rfind(prefix, 0) != 0) continue;
    const std::string rest = name.substr(prefix.size());  // <j>-of-<K>
    const size_t of = rest.find("-of-");
    if (of == std::string::npos || !digits(rest.substr(0, of)) || !digits(rest.substr(of + 4))) continue;
    sets.push_back(std::stoi(rest.substr(of + 4)));
  }
  std::sort(sets.begin(), sets.end());
  sets.erase(std::unique(sets.begin(), sets.end()), sets.end());
  return sets;
}

// "2" or "2 and 4": the K of those sets.
std::string counts_text(const std::vector<int>& sets) {
  std::string out;
  for (size_t n = 0; n < sets.size(); ++n)
    out += (n == 0 ? "" : n + 1 == sets.size() ? " and " : ", ") + std::to_string(sets[n]);
  return out;
}

// A whole checkpoint file `path` that is not there, where a job saved per-device files under its
// name: refused, saying how to resume them.
void refuse_per_device_set(const std::string& path) {
  const std::vector<int> sets = per_device_sets(path);
  if (std::filesystem::exists(path) || sets.empty()) return;
  const std::string k = counts_text(sets);
  throw std::invalid_argument("no such file: " + path + "; there are per-device files " + path + ".stage0-of-" +
                              std::to_string(sets.front()) + " ..., one per rank of a job: resume them under "
                              "mpirun -np " + k + " or torchrun --nproc_per_node " + k + " with `devices` " + k +
                              " `per_device_files`");
}

// What per-device files hold: each device's layers of the cut that saved them.
const char* kPerDeviceCut =
    "; per-device files hold the layers each device had when they were saved: resume them with the same "
    "`devices`, `balance`, `schedule` and `virtual_stages` as that run, or save one whole file (without "
    "`per_device_files`), which resumes with any cut";

// The step a manifest names, or -1 when there is no manifest; throws for a file that is not one.
int64_t manifest_step(const std::string& manifest, int devices) {
  if (!std::filesystem::exists(manifest)) return -1;
  std::istringstream in(read_file(manifest));
  std::string format, step_word, devices_word;
  int64_t step = -1;
  int saved_devices = 0;
  if (!(in >> format >> step_word >> step >> devices_word >> saved_devices) || format != kManifestFormat ||
      step_word != "step" || devices_word != "devices" || step < 0)
    throw std::invalid_argument(manifest + " is not a manifest of per-device files written by gpipe train "
                                "`per_device_files`; resume from the files of a run that saved them");
  if (saved_devices != devices)
    throw std::invalid_argument(manifest + " is of a run with " + std::to_string(saved_devices) +
                                " devices; resume with the same number of devices (`devices` " +
                                std::to_string(saved_devices) + ")");
  return step;
}

}  // namespace

std::string Trainer::manifest_file(const std::string& path) const { return path + ".manifest"; }

std::string Trainer::snapshot_file(const std::string& path, int device) const {
  if (!options_.per_device_files()) return path;
  const int K = pipeline_->devices();
  return path + ".stage" + std::to_string(device < 0 ? pipeline_->device() : device) + "-of-" + std::to_string(K);
}

void Trainer::resume(const std::string& resume_path) {
  const std::string path = snapshot_file(resume_path);
  const std::string optimizer = optimizer_name(options_.optimizer().kind());
  // Every rank reads and checks the file: all of them refuse it, or none, before any restores it.
  Snapshot r;
  // Per-device files are plain snapshots, also of a TorchScript model.
  const bool script = model_.script.has_value() && !options_.per_device_files();
  on_every_rank([&] {
    const std::string previous = path + ".prev";
    const bool per_device = options_.per_device_files();
    // What a save killed by SIGKILL left (PATH.tmp.<pid>.*, its writer gone) goes, as a save's would.
    remove_stale_temporaries(path);
    if (per_device) remove_stale_temporaries(manifest_file(resume_path));
    if (!std::filesystem::is_regular_file(path) && !(per_device && std::filesystem::is_regular_file(previous))) {
      const std::vector<int> sets = per_device_sets(resume_path);
      const std::string k = counts_text(sets);
      if (!per_device) refuse_per_device_set(path);
      if (!per_device) check_input_file(path);  // a folder, a FIFO, a device: says which
      if (std::filesystem::is_regular_file(resume_path))
        throw std::invalid_argument(resume_path + " is one whole checkpoint file, not a set of per-device files: "
                                    "leave out `per_device_files` (a whole file resumes with any `devices`)");
      // A set of this K that lacks this device's file: the fix is a whole set, not another K.
      const bool same_k = std::find(sets.begin(), sets.end(), pipeline_->devices()) != sets.end();
      throw std::invalid_argument(
          "no such file: " + path +
          (sets.empty()  ? " (each device has its own file; resume with the K of the run that saved)"
           : same_k      ? " (the set of " + std::to_string(pipeline_->devices()) + " per-device files of " +
                           resume_path + " lacks this device's file: it is not whole, and no `devices` makes it "
                           "whole; resume from a whole set, or from a save of the run to another path)"
                         : " (the per-device files of " + resume_path + " are of " + k + " devices: resume with "
                           "`devices` " + k + ")"));
    }
    // Per-device files of another cut lack this device's layers: the fix is the cut, not the model.
    auto read = [&](const std::string& file) {
      try {
        return read_snapshot(file, pipeline_->layers(), optimizer, script);
      } catch (const std::runtime_error& e) {
        if (per_device && std::string(e.what()).find(" is a checkpoint file of another model") != std::string::npos)
          throw std::runtime_error(e.what() + std::string(kPerDeviceCut));
        throw;
      }
    };
    const int64_t step = per_device ? manifest_step(manifest_file(resume_path), pipeline_->devices()) : -1;
    if (step < 0) {  // one file, or per-device files of a gpipe without manifests
      r = read(path);
      return;
    }
    // The file of the manifest's step: the device's file, or the one it kept while a save that did
    // not end was writing the next.
    std::string steps;
    for (const std::string& file : {path, previous}) {
      if (!std::filesystem::is_regular_file(file)) continue;
      Snapshot candidate = read(file);
      if (candidate.state.step == step) {
        r = std::move(candidate);
        whole_in_previous_ = file == previous;
        return;
      }
      steps += (steps.empty() ? "" : " and ") + file + " is of step " + std::to_string(candidate.state.step);
    }
    throw std::invalid_argument(manifest_file(resume_path) + " names step " + std::to_string(step) + ", but " + steps +
                                ": the files are of different runs; resume from a whole set of per-device files");
  });
  // Every parameter of the file is taken by some stage: it is this model's, not a larger one's.
  const double taken = pipeline_->sum(pipeline_->replica() == 0 ? static_cast<double>(r.parameters_taken) : 0.0);
  const int64_t expected = options_.per_device_files() ? r.parameters_taken : static_cast<int64_t>(taken);
  GPIPE_CHECK(r.parameters_in_file == expected, path, " is a checkpoint file of another model: it holds ",
              r.parameters_in_file, " parameters, this model ", expected,
              options_.per_device_files() ? kPerDeviceCut : "");
  GPIPE_CHECK(pipeline_->same_everywhere(static_cast<double>(r.state.step)), "the per-device files of ", resume_path,
              " are from different steps (this rank's, ", path, ", from step ", r.state.step,
              "); a run stopped while saving: resume from another checkpoint file");
  if (options_.per_device_files()) {
    // Files of one run draw the data in one order; a file of another run (another --seed) would have
    // each rank draw other batches.
    const torch::Tensor order = r.state.shuffle_state.contiguous();
    const size_t hash = std::hash<std::string_view>{}(std::string_view(
        static_cast<const char*>(order.data_ptr()), static_cast<size_t>(order.numel() * order.element_size())));
    GPIPE_CHECK(pipeline_->same_everywhere(static_cast<double>(hash & ((uint64_t{1} << 52) - 1))),
                "the per-device files of ", resume_path, " are of different runs (they draw the data in different "
                "orders: another `seed`?); resume from the files of one run");
  }
  restore_snapshot(r, pipeline_->layers(), *optimizer_);
  shuffle_.set_state(r.state.shuffle_state);
  epoch_start_shuffle_ = r.state.shuffle_state;  // what a save before any step writes back
  at::Generator random = default_generator();
  random.set_state(r.state.random_state);
  step_ = start_step_ = r.state.step;
  if (options_.save() == resume_path) saved_at_ = step_;  // the save path holds this step already
  // What a process ended by a signal before its first save names as whole: the file it resumed from.
  note_saved(saved_name(resume_path, options_.per_device_files()), step_);
}

Trainer::~Trainer() = default;
Trainer::Trainer(Trainer&&) noexcept = default;
Trainer& Trainer::operator=(Trainer&&) noexcept = default;

double TrainStats::median_step_s() const {
  if (step_seconds.empty()) return 0.0;
  std::vector<float> sorted = step_seconds;
  const size_t half = sorted.size() / 2;
  std::nth_element(sorted.begin(), sorted.begin() + static_cast<std::ptrdiff_t>(half), sorted.end());
  const double upper = sorted[half];
  if (sorted.size() % 2 == 1) return upper;
  return (upper + *std::max_element(sorted.begin(), sorted.begin() + static_cast<std::ptrdiff_t>(half))) / 2;
}

void Trainer::finish_held_update() {
  if (!stage_updates_) return;
  const int64_t begin = now_ns();
  const bool held = stage_updates_->holding();
  stage_updates_->give_back(*optimizer_);
  if (held) stats_.train_seconds += static_cast<double>(now_ns() - begin) * 1e-9;
}

void Trainer::fit(const TrainerCallbacks& callbacks) {
  const int64_t N = train_.size(), B = options_.batch_size();
  stopped_by_ = 0;
  // Updates held for the devices are applied, and their state given back, however fit() ends.
  in_fit_ = true;
  struct Finish {
    Trainer& t;
    ~Finish() {
      t.in_fit_ = false;
      try {
        t.finish_held_update();
      } catch (...) {  // an exception already on its way is the one to report
      }
    }
  } finish{*this};
  // A stop request is honoured at a step boundary that every rank reaches: saved, then return.
  auto stop_here = [this] {
    stopped_by_ = agreed_stop();
    if (stopped_by_ != 0) save();
    return stopped_by_ != 0;
  };
  if (stop_here()) return;
  for (int epoch = static_cast<int>(step_ / steps_per_epoch_) + 1; step_ < total_steps_; ++epoch) {
    // A fit() after one that stopped draws the epoch it stopped in again, from its start.
    if (drawn_epoch_ == epoch - 1) shuffle_.set_state(epoch_start_shuffle_);
    epoch_start_shuffle_ = generator_state(shuffle_);
    const torch::Tensor order = options_.shuffle() ? torch::randperm(N, shuffle_, torch::kLong) : torch::arange(N);
    drawn_epoch_ = epoch - 1;
    for (int64_t b = step_ % steps_per_epoch_; b < steps_per_epoch_ && step_ < total_steps_; ++b) {
      if (callbacks.before_step) {
        finish_held_update();
        callbacks.before_step(step_);
      }
      try {
        train_step(order.narrow(0, b * B, std::min(B, N - b * B)), epoch);
      } catch (const Interrupted&) {  // abandoned after a stop request: the parameters are as they were
        if (stop_requested() == 0) throw;
        stopped_by_ = stop_requested();
        save();
        return;
      }
      if (callbacks.progress) callbacks.progress(epoch, b + 1);
      if (callbacks.after_step) {
        finish_held_update();
        callbacks.after_step(epoch, b + 1);
      }
      if (options_.save_every() > 0 && step_ % options_.save_every() == 0) save();
      if (stop_here()) {
        // A stop after an epoch's last step: the epoch is whole, so its evaluation follows the save,
        // as in an unbroken run (which a resumed one continues from the next epoch).
        finish_held_update();
        if (b + 1 == steps_per_epoch_ && callbacks.after_epoch) callbacks.after_epoch(epoch);
        return;
      }
    }
    finish_held_update();
    if (callbacks.after_epoch) callbacks.after_epoch(epoch);
    save();
  }
  save();
  finish_held_update();
}

double Trainer::train_step(const torch::Tensor& rows, int epoch) {
  torch::Tensor x = train_.input.index_select(0, rows);
  if (options_.augment()) x = options_.augment()(x, rows, epoch);
  const torch::Tensor y = train_.target.index_select(0, rows);
  const int64_t begin = now_ns();
  clear_grads(pipeline_->parameters());  // the step writes fresh ones
  if (fault_.kind == "exit" && fault_.rank == pipeline_->rank() && fault_.step == step_) std::_Exit(3);
  const LossFn injected = [](const torch::Tensor&, const torch::Tensor&) -> torch::Tensor {
    throw std::runtime_error("injected fault in the loss (GPIPE_TEST_FAULT)");
  };
  const bool inject = fault_.kind == "throw" && fault_.step == step_;
  double loss = 0;
  try {
    loss = pipeline_->train_step(x, y, inject ? injected : options_.loss()).item<double>();
  } catch (...) {
    // The update of the step before is applied whole: the parameters as they were before this step.
    if (stage_updates_) {
      try {
        stage_updates_->apply_remaining();
      } catch (...) {  // the step's own error is the one to report
      }
    }
    throw;
  }
  if (stage_updates_) stage_updates_->apply_remaining();  // a share no action of this step reached
  // The loss is the same on every rank: all stop together, before the update, the parameters as they were.
  if (!std::isfinite(loss))
    throw std::runtime_error("gpipe: the loss became " + std::string(std::isnan(loss) ? "NaN" : "infinite") +
                             " in step " + std::to_string(step_ + 1) + " (epoch " + std::to_string(epoch) +
                             "): training stops with the parameters of step " + std::to_string(step_) +
                             (saved_at_ >= 0 ? ", and the last checkpoint file (step " + std::to_string(saved_at_) +
                                                   ") is kept"
                                             : "") +
                             (step_ == 0 ? ": no update was applied yet, so the learning rate is not the cause: the "
                                           "model's outputs or the loss on this data overflow float; scale the data "
                                           "(inputs and targets) down"
                                         : "; lower `lr`, or add `clip_grad_norm`"));
  if (options_.clip_grad_norm() > 0) pipeline_->clip_gradients(options_.clip_grad_norm());
  const double lr =
      learning_rate(options_.optimizer().lr(), lr_schedule_, step_, total_steps_);
  if (!(lr <= std::numeric_limits<float>::max())) {  // the parameters are float: the update would overflow
    std::ostringstream text;
    text << "gpipe: the learning rate of step " << step_ + 1 << " is " << lr
         << ", beyond float's range (3.4e38); lower `lr`"
         << (options_.lr_schedule().kind() == LrSchedule::kStep ? " or `lr_gamma`" : "");
    throw std::runtime_error(text.str());
  }
  if (stage_updates_ && in_fit_) {
    stage_updates_->hold(lr, *optimizer_);  // applied on the devices during the next step
  } else {
    for (auto& group : optimizer_->param_groups()) group.options().set_lr(lr);
    optimizer_->step();
  }
  const double took = static_cast<double>(now_ns() - begin) * 1e-9;
  stats_.train_seconds += took;
  stats_.step_seconds.push_back(static_cast<float>(took));
  if (stats_.samples == 0) stats_.first_loss = loss;
  stats_.last_loss = loss;
  stats_.bubble_sum += pipeline_->bubble();
  stats_.samples += x.size(0);
  ++step_;
  return loss;
}

void Trainer::save() {
  const std::string& path = options_.save();
  if (path.empty() || saved_at_ == step_) return;
  finish_held_update();
  if (!pipeline_->all_finite())
    throw std::runtime_error("gpipe: the parameters hold NaN or infinite values at step " + std::to_string(step_) +
                             ": no checkpoint file is written for it" +
                             (saved_at_ >= 0 ? " (the one of step " + std::to_string(saved_at_) + " is kept)" : "") +
                             "; lower `lr`, or add `clip_grad_norm`");
  saved_at_ = step_;
  // The shuffling state from which the epoch of the next step is drawn: that epoch's start when
  // its order was drawn already, else the generator as it is.
  const bool drawn = drawn_epoch_ == step_ / steps_per_epoch_;
  TrainState now{step_, drawn ? epoch_start_shuffle_ : generator_state(shuffle_),
                 generator_state(default_generator()), std::nullopt};
  const PipelinePlan& plan = pipeline_->plan();
  now.pipeline = SavedPipeline{plan.schedule,       plan.devices,        std::min(options_.batch_size(), train_.size()),
                               plan.micro_batches, plan.virtual_stages, plan.balance,
                               plan.checkpoint,    plan.stage_times};
  const std::string optimizer = optimizer_name(options_.optimizer().kind());
  if (options_.per_device_files()) {
    save_per_device_files(path, now, optimizer);
    note_saved(saved_name(path, true), now.step);
    return;
  }
  try {
    save_whole_snapshot(*pipeline_, model_, *optimizer_, optimizer, now, path);
  } catch (const std::length_error& e) {  // too large to gather: every rank is here
    throw std::runtime_error(std::string(e.what()) + "; save one file per device (`per_device_files`)");
  }
  note_saved(saved_name(path, false), now.step);
}

void Trainer::save_per_device_files(const std::string& path, const TrainState& now, const std::string& optimizer) {
  // Every rank learns whether every other wrote its part.
  auto on_all = [this](const std::function<void()>& work) {
    on_all_ranks<std::runtime_error>(*pipeline_, work, "could not save its per-device file");
  };
  const bool holds = pipeline_->replica() == 0;  // replicas hold the same parameters
  const std::string file = snapshot_file(path), previous = file + ".prev";
  // 1. Each device's file, the one the manifest names kept aside until the manifest names this step
  //    (already aside when a save that did not end left it there: then PATH is not whole and goes).
  // All or nothing: when any device's file fails, every device puts its files back as they were, so
  // the set stays the one the manifest names (or, before a first save, no file is left without one).
  bool kept_aside = false, written = false;
  try {
    on_all([&] {
      if (!holds) return;
      std::error_code ec;
      if (!whole_in_previous_ && std::filesystem::is_regular_file(file)) {
        std::filesystem::rename(file, previous, ec);
        if (ec) throw std::runtime_error("gpipe: cannot keep " + file + " as " + previous + ": " + ec.message());
        kept_aside = true;
      }
      save_snapshot(file, {encode_snapshot_part(pipeline_->layers(), *optimizer_)}, pipeline_->layers(),
                    std::nullopt, optimizer, now);
      written = true;
      if (fault_.kind == "save" && fault_.rank == pipeline_->rank() && fault_.step == now.step)
        throw std::runtime_error("gpipe: GPIPE_TEST_FAULT=save:" + std::to_string(fault_.rank) + ":" +
                                 std::to_string(fault_.step) + " made this rank's save fail (a test hook)");
    });
  } catch (...) {
    std::error_code ignored;
    if (written) std::filesystem::remove(file, ignored);
    if (kept_aside) std::filesystem::rename(previous, file, ignored);
    throw;
  }
  // 2. The manifest, last: the files it names are all whole.
  on_all([&] {
    if (pipeline_->root()) write_file_atomically(manifest_file(path), manifest_text(now.step, pipeline_->devices()));
  });
  // 3. The files of the step before are no longer needed.
  whole_in_previous_ = false;
  if (holds) {
    std::error_code ignored;
    std::filesystem::remove(previous, ignored);
  }
}

void save_whole_snapshot(Pipeline& pipeline, const Model& model, torch::optim::Optimizer& optimizer,
                         const std::string& optimizer_name, const TrainState& state, const std::string& path) {
  // Replicas hold the same parameters: replica 0's are gathered.
  const std::vector<std::string> parts =
      pipeline.gather(pipeline.replica() == 0 ? encode_snapshot_part(pipeline.layers(), optimizer) : "");
  if (!pipeline.root()) return;
  // A TorchScript file is the script module with every stage's values: under MPI the first rank's
  // copy of the whole model (its layers share that module's tensors) takes them before it is written.
  torch::nn::Sequential whole = pipeline.layers();
  if (pipeline.device() >= 0 && model.script) {
    const RandomStateGuard guard;
    whole = model.build(LayerRange{});
  }
  save_snapshot(path, parts, whole, model.script, optimizer_name, state);
}

Evaluation Trainer::evaluate(const Dataset& data) {
  finish_held_update();
  return pipeline_->evaluate(data.input, data.target, options_.loss(), options_.classification());
}

}  // namespace gpipe
