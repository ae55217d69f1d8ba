// train.h: the training loop as library API: the optimizer as torch.optim sets it up, the learning
// rate schedule, gradient clipping, the non-finite guard, steps and epochs, evaluation, and saving
// and resuming the run, the same in one process and under MPI.
//
//   gpipe::Trainer trainer(gpipe::Model::of("CNN", 11, build),
//                          gpipe::PipelineOptions().devices(2).micro_batches(4),
//                          gpipe::TrainerOptions().epochs(2).save("run.pt"), train_data);
//   trainer.resume("run.pt");   // optional: continue a run saved before
//   trainer.fit();              // trains, saving after every epoch and at the end
//                               // (and stopping, saved, on gpipe::request_stop: stop.h)
//   gpipe::Evaluation e = trainer.evaluate(test_data);
//
// Under MPI (one rank per device) every call is collective: every rank makes
// it, in the same order, with the same data.
#pragma once

#include "gpipe/choose.h"
#include "gpipe/data.h"
#include "gpipe/loss_scale.h"
#include "gpipe/partition.h"
#include "gpipe/pipeline.h"
#include "gpipe/script_model.h"
#include "gpipe/snapshot.h"
#include "gpipe/stage.h"
#include "gpipe/stop.h"
#include "gpipe/trace.h"

#include <torch/arg.h>
#include <torch/optim/optimizer.h>
#include <torch/script.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace gpipe {

/// torch.optim's SGD, Adam and AdamW.
enum class OptimizerKind { kSgd, kAdam, kAdamW };

/// "sgd", "adam", "adamw": the names the command line and snapshots use.
std::string optimizer_name(OptimizerKind kind);
/// The kind named by optimizer_name; throws std::invalid_argument for another name.
OptimizerKind parse_optimizer(const std::string& name);

/// An optimizer's settings with torch.optim's defaults.
struct OptimizerOptions {
  TORCH_ARG(OptimizerKind, kind) = OptimizerKind::kAdam;
  TORCH_ARG(double, lr) = 1e-3;
  /// SGD's momentum (0: none) and Nesterov's variant of it.
  TORCH_ARG(double, momentum) = 0;
  TORCH_ARG(bool, nesterov) = false;
  /// L2 penalty (SGD, Adam) or decoupled weight decay (AdamW); unset: 0, and 0.01 for AdamW.
  TORCH_ARG(std::optional<double>, weight_decay) = std::nullopt;
  /// Adam's and AdamW's betas.
  using Betas = std::tuple<double, double>;
  TORCH_ARG(std::optional<Betas>, betas) = std::nullopt;

 public:
  /// The weight decay in effect: the one given, or torch.optim's default for the kind.
  double decay() const;
  /// Throws std::invalid_argument for settings torch.optim would refuse or that
  /// belong to another optimizer (momentum for Adam, betas for SGD, ...).
  void check() const;
};

/// Bytes of gradient and optimizer state the optimizer `options` describe keep per parameter byte
/// (CostModel::state_per_parameter_byte): 1 for SGD without momentum (the gradient), 2 for SGD with
/// momentum (and its buffer), 3 for Adam and AdamW (their two moments).
double state_per_parameter_byte(const OptimizerOptions& options);

/// The optimizer `options` describe, over `parameters`.
std::unique_ptr<torch::optim::Optimizer> make_optimizer(const OptimizerOptions& options,
                                                        const std::vector<torch::Tensor>& parameters);

/// How the learning rate changes over a run.
enum class LrSchedule {
  kConstant,  ///< the optimizer's lr throughout
  kCosine,    ///< from lr down to 0 over the run, as CosineAnnealingLR
  kStep,      ///< times gamma every step_size steps, as StepLR
};

/// "constant", "cosine", "step": the names the command line uses.
std::string lr_schedule_name(LrSchedule kind);
/// The kind named by lr_schedule_name; throws std::invalid_argument for another name.
LrSchedule parse_lr_schedule(const std::string& name);

struct LrScheduleOptions {
  TORCH_ARG(LrSchedule, kind) = LrSchedule::kConstant;
  /// Steps of linear warm-up first: step t (0-based) runs at lr·(t+1)/W. A Trainer refuses a
  /// warm-up longer than its run (the learning rate would never reach its value).
  TORCH_ARG(int64_t, warmup_steps) = 0;
  /// kStep: steps between decays; 0: one epoch.
  TORCH_ARG(int64_t, step_size) = 0;
  /// kStep: the factor of each decay.
  TORCH_ARG(double, gamma) = 0.1;

 public:
  /// Throws std::invalid_argument for negative warm-up or step size, or a
  /// gamma that is not a finite number above 0.
  void check() const;
};

/// The learning rate of optimizer step `step` (0-based) of `total`, for a base
/// rate `lr`: the warm-up, then the schedule's factor, as LambdaLR applies it.
/// kStep needs a step_size above 0 here (the Trainer turns 0 into one epoch).
double learning_rate(double lr, const LrScheduleOptions& schedule, int64_t step, int64_t total);

/// A transformation of a training batch: the rows' input, which rows of the
/// data set they are, and the epoch (1-based); a function of those alone, so
/// a resumed run sees the batches an unbroken one would.
using Augment = std::function<torch::Tensor(const torch::Tensor& input, const torch::Tensor& rows, int epoch)>;

/// How a Trainer trains.
struct TrainerOptions {
  TORCH_ARG(OptimizerOptions, optimizer) = {};
  TORCH_ARG(LrScheduleOptions, lr_schedule) = {};
  /// Scale the whole model's gradient down to this L2 norm when it is larger
  /// (over every stage and rank, as torch.nn.utils.clip_grad_norm_); 0: never.
  TORCH_ARG(double, clip_grad_norm) = 0;
  /// Samples per optimizer step; a last smaller batch is kept unless drop_last (as DataLoader).
  TORCH_ARG(int64_t, batch_size) = 128;
  TORCH_ARG(bool, drop_last) = false;
  /// Draw a new order of the samples every epoch (from `seed`), or keep theirs.
  TORCH_ARG(bool, shuffle) = true;
  TORCH_ARG(uint64_t, seed) = 0;
  /// Passes over the training data, and a limit on the optimizer steps of the
  /// whole run, resumed ones included (0: none).
  TORCH_ARG(int, epochs) = 1;
  TORCH_ARG(int64_t, steps) = 0;
  /// The loss, and whether evaluate() also counts correct classes (argmax).
  TORCH_ARG(LossFn, loss) = cross_entropy_loss;
  TORCH_ARG(bool, classification) = true;
  TORCH_ARG(Augment, augment) = nullptr;
  /// Where fit() saves the run after every epoch and at the end (empty: nowhere).
  TORCH_ARG(std::string, save) = "";
  /// Also save every this many steps (counted from step 0 of the run, resumed ones included;
  /// 0: only after every epoch and at the end).
  TORCH_ARG(int64_t, save_every) = 0;
  /// After a stop request (request_stop, stop.h), a step still running this many seconds later is
  /// abandoned, its parameters as they were, and the run saved at the step before it. In one
  /// process; under MPI the ranks cannot abandon a step singly, and it runs to its end.
  TORCH_ARG(double, stop_timeout) = 10;
  /// Under MPI: each device saves and resumes its own file, PATH.stage<j>-of-<K>
  /// (for models above the 2 GiB one MPI gather carries); resume with the same K.
  /// A manifest, PATH.manifest, written last, names their step; while a save
  /// runs each device keeps its file of the step before (PATH.stage<j>-of-<K>.prev),
  /// so a run killed while saving resumes from the last whole set.
  TORCH_ARG(bool, per_device_files) = false;
  /// fit() applies each step's optimizer update on the devices during the next step: each stage's
  /// share on its device, before the stage's first action, in time the device would otherwise wait
  /// for its input (on the main job the whole update on the calling thread, while both devices
  /// waited, was 3.4 ms of a 47 ms step). The same update to the bit: the optimizer's arithmetic is
  /// per parameter. The step's gradients are held until the next step has run: one more copy of
  /// them in memory. false: after each step, on the calling thread. In one process a weight tied
  /// across stages is always updated on the calling thread.
  TORCH_ARG(bool, update_on_devices) = true;
  /// Dynamic loss scaling (loss_scale.h): one scale for every stage and rank, and a step whose gradients
  /// are not all finite skipped on all of them. None: GradScaler's defaults where the pipeline runs in
  /// float16 (PipelineOptions::precision), no scaling otherwise.
  TORCH_ARG(std::optional<LossScaleOptions>, loss_scale) = std::nullopt;
};

/// The settings of `options` that every rank of a job must share, by name (TrainerOptions' own names),
/// as text: what a Trainer compares across ranks (check_same_on_every_rank). The loss is a function
/// and is not compared; the augmentation only by whether there is one. tasks_test checks that a new
/// field of TrainerOptions is not forgotten here.
std::vector<std::pair<std::string, std::string>> settings_of(const TrainerOptions& options);

class Pipeline;
/// Every rank of `pipeline`'s job compares `settings` (name, value), collectively: unless all agree,
/// every rank throws std::invalid_argument naming the first setting that differs and the lowest rank
/// whose value is not the first rank's. In one process there is nothing to compare.
void check_same_on_every_rank(Pipeline& pipeline, const std::vector<std::pair<std::string, std::string>>& settings);

/// Puts the default generator back as it was when the guard was made: building
/// a whole model for a look at it (a check, a profile) leaves the run's random
/// numbers as they were.
class RandomStateGuard {
 public:
  RandomStateGuard();
  ~RandomStateGuard();
  RandomStateGuard(const RandomStateGuard&) = delete;
  RandomStateGuard& operator=(const RandomStateGuard&) = delete;

 private:
  torch::Tensor state_;
};

/// A model to train: how to build its layers (all of them, or those a rank
/// keeps), and the TorchScript module they come from, if any.
struct Model {
  std::string name;
  int layers = 0;
  LayerBuilder build;
  /// A TorchScript model: what a snapshot writes (torch.jit.load reads it).
  std::optional<torch::jit::Module> script;
  /// Parameters two layers share (a module used twice): tied across MPI ranks.
  std::vector<std::vector<std::string>> tied;

  /// A model that `build` makes, `layers` layers in all (see LayerBuilder).
  static Model of(std::string name, int layers, LayerBuilder build);
  /// A TorchScript nn.Sequential's layers. Under MPI, a buffer that two layers
  /// share (a module used twice) is refused: each rank would keep its own copy.
  static Model of(std::string name, const ScriptModel& source);
};

/// Runs the whole model (in eval mode) on the first two samples of `data` and
/// checks its output against the targets and the loss, so that a model that
/// does not fit the data, or targets that do not fit the loss, are refused
/// before any training. Also refused: a model without parameters that train, a
/// layer that changes the number of rows, and an output no gradient reaches
/// (an argmax). Throws std::invalid_argument naming the layer that fails and
/// both shapes, or the targets' problem. The run's random numbers are left as
/// they were.
void check_model_and_data(const Model& model, const Dataset& data, bool classification);

/// Reads the snapshot file `path` against the whole of `model` (built here; the random numbers left as
/// they were) for an optimizer named `optimizer_name`, before work that a refused file would waste (a
/// profile of the model). Throws std::runtime_error for a file read_snapshot refuses, and
/// std::invalid_argument naming both counts for a file of another model, or naming the per-device
/// files saved under `path` where there is no whole file. Returns how the pipeline that saved it
/// ran, where the file says (SavedPipeline).
std::optional<SavedPipeline> check_snapshot_of(const std::string& path, const Model& model, const std::string& optimizer_name);

/// The layer checks of check_model_and_data, for a model without data: runs `whole` layer by layer
/// in eval mode on `sample` (a few rows) and returns its output; throws std::invalid_argument naming
/// the layer that fails, that changes the number of rows, or whose output no gradient reaches, or
/// saying that the model has no parameters that train. The layers are left in training mode.
torch::Tensor check_layers_train(torch::nn::Sequential whole, const torch::Tensor& sample);

/// A stage keeps its input for its backward pass; a layer that begins a stage and changes its input in
/// place runs on a copy of it where it does so without a graph (layers_changing_their_input). One that
/// does so only where its input takes a gradient would fail in step 1: runs the whole model in eval
/// mode on `sample` (a row or two) and throws std::invalid_argument naming the layer, the stage, the
/// cut and the fix. The run's random numbers are left as they were. With `most_boundary_tensors`
/// above 0 (kMostBoundaryTensors under MPI, transport.h), a boundary of the cut that passes more
/// tensors than that is refused too, naming the layer and the fix.
void check_stage_inputs(const Model& model, const Tensors& sample, const std::vector<int>& balance,
                        int most_boundary_tensors = 0);

/// What a run did, as the end of `gpipe train`'s summary reports it (Python's
/// gpipe.Summary prints the same lines).
struct RunFigures {
  double train_seconds = 0;
  int64_t steps = 0;
  double samples_per_s = 0;
  double bubble = 0;            ///< the measured share of device time idle, 0 to 1
  std::vector<int> balance;     ///< layers per stage
  std::vector<int> placement;   ///< the device of each stage
  int devices = 1;              ///< K: with more stages than devices each stage names its device
  double median_step_s = 0;     ///< the median of the steps' wall times (0: not measured)
  double loss_scale = 0;        ///< the loss scale at the end (0: the run scales no loss)
  int64_t skipped_steps = 0;    ///< steps the loss scale skipped (gradients not finite)
};

/// The lines "  training time ...", "  throughput ...", "  bubble ...", "  loss scale ..." (where
/// there is one) and "  partition ...", each ending in a newline.
std::string format_run_figures(const RunFigures& figures);

/// Cuts `model` into contiguous stages, `options`' V for each of its devices, by per-layer cost on
/// one micro-batch `sample` (BalanceByOptions::method): its layers profiled here (profile_layers,
/// with `options`' threads, optimizer_copies and whole; not for "params"), then the cut
/// choose_cut_by_cost (choose.h) chooses from that profile. The plan predicts the step of the schedule
/// over the micro-batches. The run's random numbers, and the gradients of the model's parameters, are
/// left as they were.
CostBalance balance_by(const Model& model, const Tensors& sample, const BalanceByOptions& options);

/// Writes the snapshot of a whole run to `path` in one file: every process's part (its layers and
/// `optimizer`'s state of them, named `optimizer_name`) gathered on the root, which writes it
/// whole or not at all, as TorchScript when the model is a TorchScript model (torch.jit.load reads
/// it; under MPI the root's copy of the model takes every rank's values first). Collective. Throws
/// std::length_error when the parts are more than one MPI gather carries.
void save_whole_snapshot(Pipeline& pipeline, const Model& model, torch::optim::Optimizer& optimizer,
                         const std::string& optimizer_name, const TrainState& state, const std::string& path);

/// Where a run stands and what it measured.
struct TrainStats {
  int64_t samples = 0;        ///< samples trained on in this process's run (not resumed ones)
  double train_seconds = 0;   ///< wall time inside training steps
  double bubble_sum = 0;      ///< the measured bubble, summed over steps
  double first_loss = 0;      ///< the first step's mean loss in this run
  double last_loss = 0;       ///< the last step's
  std::vector<float> step_seconds;  ///< each step's wall time in this run, in order
  int64_t skipped_steps = 0;  ///< steps of this run skipped by the loss scale (gradients not finite)

  /// Samples per second of training-step time; 0 before any step.
  double samples_per_s() const { return train_seconds > 0 ? static_cast<double>(samples) / train_seconds : 0.0; }
  /// The median of step_seconds (the mean of the middle two of an even count); 0 before any step.
  /// Beside train_seconds' mean, what a typical step took: a machine's stalls lengthen the mean.
  double median_step_s() const;
};

/// How long a run of `options` over `samples` training samples is: its steps per epoch, its steps in
/// all, and its learning-rate schedule with the step size resolved (one epoch where not given).
struct RunLength {
  int64_t steps_per_epoch = 0;
  int64_t total_steps = 0;
  LrScheduleOptions lr_schedule;
};
/// `options` over `samples` training samples, checked as the Trainer checks them (the batch, epochs,
/// steps, saves, optimizer, schedule, warm-up against the run's steps, the last step's learning rate):
/// throws std::invalid_argument naming the problem, so that a front end refuses them before any work
/// (a profile, say).
RunLength run_length(const TrainerOptions& options, int64_t samples);

/// What fit() tells its caller as it goes.
struct TrainerCallbacks {
  /// Before each step; `step` counts the steps taken so far.
  std::function<void(int64_t step)> before_step;
  /// After each step: the epoch (1-based) and the batch in it (1-based).
  std::function<void(int epoch, int64_t batch)> after_step;
  /// After each epoch, before it is saved.
  std::function<void(int epoch)> after_epoch;
  /// After each step, as after_step, for reporting what the trainer measured (stats(), step(), the
  /// pipeline's trace): with TrainerOptions::update_on_devices the step's update is still held for
  /// the devices, so the parameters are not yet updated. before_step and after_step see them whole:
  /// fit() applies a held update on the calling thread before calling them, while the devices wait.
  std::function<void(int epoch, int64_t batch)> progress;
};

namespace detail {
class StageUpdates;
}

/// A training run of a pipeline: the pipeline, its optimizer, the data order,
/// and where the run stands.
///
/// Errors: bad options throw std::invalid_argument before any work; a failed
/// step (an error in a stage, a NaN or infinite loss) throws with the
/// parameters as they were before it, and no snapshot holding NaN or infinite
/// values is ever written.
///
/// Test hook: the environment variable GPIPE_TEST_FAULT, read when the trainer
/// is made, injects a fault into a run, so that a program's (gpipe train's, or
/// any library user's) handling of failures can be tested: "throw:STEP" makes
/// the loss throw in step STEP (0-based, counting resumed steps; the stage
/// holding the loss fails, under MPI on the last rank of a pipeline);
/// "exit:RANK:STEP" ends MPI rank RANK (0 in one process) abruptly with
/// status 3 before step STEP, as a crash would; "save:RANK:STEP" makes rank RANK's
/// per-device file of step STEP fail once written (every device's file is then put
/// back as it was); "inf:RANK:STEP" makes the last gradient rank RANK holds infinite after step
/// STEP's backward (a float16 overflow in one stage, which the loss scale skips everywhere; a run
/// without one checks no gradient). Unset or empty: no fault;
/// another value: std::invalid_argument.
class Trainer {
 public:
  /// Checks the model against its data before any work (check_model_and_data, for the built-in
  /// losses: mse_loss, and cross_entropy_loss over class indices), then the inputs of its stages'
  /// first layers (check_stage_inputs).
  Trainer(const Model& model, const PipelineOptions& pipeline, const TrainerOptions& options, Dataset train,
          Runtime runtime = Runtime::kAuto);
  /// The same with the plan make_plan made for `pipeline` (as a front end makes it once to check its
  /// flags): the pipeline takes it as it is (make_pipeline), K, V, M and the cut are not resolved again.
  Trainer(const Model& model, const PipelinePlan& plan, const PipelineOptions& pipeline, const TrainerOptions& options,
          Dataset train, Runtime runtime = Runtime::kAuto);
  ~Trainer();
  Trainer(Trainer&&) noexcept;
  Trainer& operator=(Trainer&&) noexcept;

  /// Restores a run saved by save() (any K, in one process or under MPI):
  /// parameters, buffers, optimizer state, step, the shuffling and the
  /// default generator. Throws std::invalid_argument, on every rank, for a
  /// missing, corrupt or other model's file, before anything changes.
  void resume(const std::string& path);

  /// Trains until options.epochs are done (or options.steps in all), saving
  /// to options.save after every epoch, every options.save_every steps and at
  /// the end. After a stop request (request_stop, stop.h; under MPI on any
  /// rank) it stops at the next step boundary, saves, and returns early with
  /// stopped_by() set: the run resumed from that file ends as an unbroken one.
  /// With update_on_devices, a step's update is applied during the next step: the progress
  /// callback sees the parameters before it; the other callbacks, saves, evaluate() and fit()'s
  /// return see them whole.
  void fit(const TrainerCallbacks& callbacks = {});

  /// One optimizer step on the training rows `rows` in `epoch`: gradients,
  /// clipping, the learning rate of this step, the update. Returns the mean loss.
  double train_step(const torch::Tensor& rows, int epoch);

  /// Writes the run to options.save unless it was saved (or resumed from
  /// there) at this step: one file gathered from every stage (the first rank
  /// writes it), or one per device with per_device_files. Refuses (throws
  /// std::runtime_error) to write parameters that are NaN or infinite.
  void save();

  /// Mean loss (and accuracy when classifying) on `data`, by pipelined inference.
  Evaluation evaluate(const Dataset& data);

  Pipeline& pipeline() { return *pipeline_; }
  const Pipeline& pipeline() const { return *pipeline_; }
  const Model& model() const { return model_; }
  /// The optimizer over pipeline().parameters(); during fit() with update_on_devices its state
  /// lives in each stage's own optimizer, and returns here by fit()'s return (and every save).
  torch::optim::Optimizer& optimizer() { return *optimizer_; }
  const TrainerOptions& options() const { return options_; }
  const TrainStats& stats() const { return stats_; }
  /// The pipeline the file resume() read was trained with, where it says (none before a resume).
  const std::optional<SavedPipeline>& resumed_pipeline() const { return resumed_pipeline_; }
  /// The loss scale (TrainerOptions::loss_scale), or nullptr where the run scales no loss.
  const LossScaler* loss_scaler() const { return scaler_ ? &*scaler_ : nullptr; }
  /// Optimizer steps taken, resumed ones included; the step this run started at; where it ends.
  int64_t step() const { return step_; }
  int64_t start_step() const { return start_step_; }
  int64_t total_steps() const { return total_steps_; }
  int64_t steps_per_epoch() const { return steps_per_epoch_; }
  /// Training samples.
  int64_t samples() const { return train_.size(); }
  /// The step of the last snapshot written to (or read from) options.save (-1: none).
  int64_t saved_at() const { return saved_at_; }
  /// The signal whose stop request ended fit() early (0: it ran to its end).
  int stopped_by() const { return stopped_by_; }
  /// After fit() stopped on a signal (stopped_by()), lines for standard error: where the run stopped
  /// and what holds it ("gpipe: stopped by SIGINT at step 3 of 16 (epoch 1, 3 of its 16 steps done);
  /// the run is saved in FILE", or that nothing was saved), and, for a program whose option
  /// `resume_flag` resumes from a file, the command that resumes it ("gpipe: resume with: ...",
  /// resume_command). None when fit() was not stopped.
  std::vector<std::string> stop_report(const std::string& resume_flag = "") const;
  /// The file save() writes for `path`: itself, or with per_device_files
  /// device `device`'s (this process's when -1).
  std::string snapshot_file(const std::string& path, int device = -1) const;
  /// With per_device_files: the manifest the first rank writes once every device's file of a
  /// step is whole, PATH.manifest; resume() takes the files of its step (or refuses them).
  std::string manifest_file(const std::string& path) const;

 private:
  Trainer(const Model& model, const PipelinePlan* plan, const PipelineOptions& pipeline, const TrainerOptions& options,
          Dataset train, Runtime runtime);
  void on_every_rank(const std::function<void()>& check);
  // Whether step step_+1's update may be applied (finite_step's rule, in trainer_steps.cc); throws the
  // non-finite loss's error where the run stops.
  bool finite_step(double loss, int epoch);
  void inject_infinite_gradient();  // GPIPE_TEST_FAULT=inf
  void update();  // the step's clipping, learning rate and optimizer update (on the devices, or here)
  // The stop request of any rank (its signal), agreed on by every rank; 0: none.
  int agreed_stop();
  void save_per_device_files(const std::string& path, const TrainState& now, const std::string& optimizer);
  // Applies what is left of an update held for the devices, on this thread, and gives its optimizer
  // state back to optimizer_ (timed as training).
  void finish_held_update();

  Model model_;
  TrainerOptions options_;
  Dataset train_;
  std::unique_ptr<Pipeline> pipeline_;
  std::unique_ptr<torch::optim::Optimizer> optimizer_;
  std::unique_ptr<detail::StageUpdates> stage_updates_;  // with update_on_devices, where possible
  std::optional<LossScaler> scaler_;                     // with loss scaling
  std::optional<SavedPipeline> resumed_pipeline_;
  bool in_fit_ = false;                                  // train_step may leave its update to the devices
  torch::Generator shuffle_;
  torch::Tensor epoch_start_shuffle_;
  int64_t steps_per_epoch_ = 1;
  int64_t total_steps_ = 0;
  LrScheduleOptions lr_schedule_;  // the options' schedule, its step size resolved
  int64_t start_step_ = 0;
  int64_t step_ = 0;
  int64_t saved_at_ = -1;
  // Per-device files: the whole set the manifest names is this device's PATH.prev (resumed from
  // the file a save that did not end had kept aside), not PATH; the next save keeps it there.
  bool whole_in_previous_ = false;
  int64_t drawn_epoch_ = -1;  // the epoch (0-based) whose order of samples fit() has drawn
  int stopped_by_ = 0;
  TrainStats stats_;
  struct TestFault {  // GPIPE_TEST_FAULT, as the class comment describes it
    std::string kind;  // "", "throw", "exit" or "save"
    int rank = -1;
    int64_t step = -1;
  };
  TestFault fault_;
};

}  // namespace gpipe
