// trainer.cc: the Trainer made: its run's length and checks, the model against its data and its
// cut, the same settings and data on every rank, its optimizer and the test hook; and how a stop
// is agreed and reported. The step loop is in trainer_steps.cc, saving and resuming in
// trainer_files.cc.
#include "gpipe/train.h"

#include "gpipe/check.h"
#include "gpipe/digest.h"
#include "gpipe/io.h"
#include "gpipe/job.h"
#include "gpipe/transport.h"
#include "train/stage_updates.h"
#include "train/trainer_parts.h"

#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <string>
#include <vector>

namespace gpipe {

RandomStateGuard::RandomStateGuard() : state_(detail::generator_state(detail::default_generator())) {}

RandomStateGuard::~RandomStateGuard() {
  at::Generator generator = detail::default_generator();
  generator.set_state(state_);
}

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
              ": expected throw:STEP, exit:RANK:STEP, save:RANK:STEP or inf:RANK:STEP with whole numbers of at least 0 "
              "(a test hook; unset it)");
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
    GPIPE_CHECK(fault_.kind == "throw" || fault_.kind == "exit" || fault_.kind == "save" || fault_.kind == "inf",
                "GPIPE_TEST_FAULT=", hook,
                ": expected throw:STEP, exit:RANK:STEP, save:RANK:STEP or inf:RANK:STEP (a test hook; unset it)");
    if (fault_.kind != "throw") {
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
  // A layer that begins a stage and changes its input in place only with a graph would fail in step 1:
  // refused now. Under MPI a boundary passes at most kMostBoundaryTensors in one message: a cut past it
  // is refused too.
  detail::on_the_first_rows(train_.input, [&](const torch::Tensor& rows) {
    check_stage_inputs(model_, rows, pipeline_->plan().balance, job().distributed ? kMostBoundaryTensors : 0);
    return 0;
  });
  // Every rank trains alike, on the same rows: its settings and its training data are compared.
  std::vector<std::pair<std::string, std::string>> shared = settings_of(options_);
  shared.emplace_back("training data", std::to_string(tensors_digest({train_.input, train_.target})));
  check_same_on_every_rank(*pipeline_, shared);
  optimizer_ = make_optimizer(options_.optimizer(), pipeline_->parameters());
  if (scales_loss(options_.loss_scale(), pipeline_->plan().precision))
    scaler_.emplace(options_.loss_scale().value_or(LossScaleOptions()));
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
  detail::on_all_ranks<std::invalid_argument>(*pipeline_, check, "refused the run");
}

int Trainer::agreed_stop() { return static_cast<int>(pipeline_->max(static_cast<double>(stop_requested()))); }

Trainer::~Trainer() = default;
Trainer::Trainer(Trainer&&) noexcept = default;
Trainer& Trainer::operator=(Trainer&&) noexcept = default;

}  // namespace gpipe
