// tasks.h: the built-in tasks as library values. A task is a model with its data, its loss, the
// metric it is scored by and the references that metric is read against, its run's defaults, its
// cut and schedule, and its extras (a picture of denoised images, text sampled from a language
// model). `gpipe train --model`, `gpipe bench --workload` and `gpipe plan --model` look tasks up
// here (Python does not yet):
//
//   const gpipe::Task& task = gpipe::find_task("resnet");
//   const gpipe::TaskOptions options = gpipe::TaskOptions().seed(7);
//   gpipe::Trainer trainer(task.model(options), gpipe::PipelineOptions().devices(2).micro_batches(4),
//                          task.trainer_options(), task.data(options).train);
//
// A new built-in task is one file in src/tasks/ (a function that returns its Task) and, in the
// registry (src/tasks/registry.cc), its declaration and its entry.
#pragma once

#include "gpipe/choose.h"
#include "gpipe/data.h"
#include "gpipe/pipeline.h"
#include "gpipe/planner.h"
#include "gpipe/schedule.h"
#include "gpipe/train.h"

#include <torch/arg.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <set>
#include <string>
#include <vector>

namespace gpipe {

/// What a run may ask of a task's model and data.
struct TaskOptions {
  /// The model's weights (every layer range draws as the whole model does) and the data's random
  /// parts (the U-Net's noise, a workload's batch).
  TORCH_ARG(uint64_t, seed) = 0;
  /// Where the data is read from; empty: the task's own (Task::data_dir).
  TORCH_ARG(std::string, data_dir) = "";
  /// Only the first N training and test samples (0: all).
  TORCH_ARG(int64_t, train_samples) = 0;
  TORCH_ARG(int64_t, test_samples) = 0;
  /// The transformer workload: its output layer reads its embedding's weight.
  TORCH_ARG(bool, tie_embeddings) = false;
};

/// A task's data: what it trains on, what it is scored on, and the references of its metric.
struct TaskData {
  Dataset train;
  Dataset test;
  /// "test", or "training" for a task scored on its training data (a data file of one's own).
  std::string test_name = "test";
  /// Where the data came from, for a header: "Fashion-MNIST", "fortunes (DIR, ...)", a file.
  std::string source;
  /// Scored by PSNR: the PSNR of the noisy test images themselves (the score of doing nothing).
  double noisy_psnr_db = 0;
  /// Scored in bits per byte: the bytes of text, and a bigram model's and gzip -9's bits per byte on
  /// the bytes the model is scored on.
  int64_t train_bytes = 0;
  int64_t test_bytes = 0;
  double bigram_bits_per_byte = 0;
  double gzip_bits_per_byte = 0;
};

/// How a task is scored after every epoch: its last evaluation read in the task's metric, beside the
/// references of its data. Each task file sets its own (Task::scoring), most from the scorings the
/// built-in tasks share (src/tasks/scoring.cc: accuracy, PSNR, bits per byte, the loss itself); a new
/// metric is written in the task file that uses it.
struct Scoring {
  /// The score's name: Python's task "metric", and in gpipe train's JSON the figure's after
  /// "test_" ("accuracy", "psnr_db", "bits_per_byte"; "loss", the loss itself, adds no figure).
  std::string name;
  /// The evaluation counts the samples whose largest score is their class (the accuracy's:
  /// TrainerOptions::classification).
  bool classification = false;
  /// The evaluation, named by `data.test_name`, with its unit and the references it is read
  /// against, as gpipe train prints it after an epoch ("test accuracy 85.00%", "test PSNR 24.13 dB
  /// (noisy input 18.20 dB)", "test 1.234 bits per byte (bigram 3.100, gzip -9 2.900)", "test loss
  /// 0.1234") or, with `summary`, in a run's summary ("test accuracy  85.00%", "test PSNR      24.13 dB
  /// (noisy input 18.20 dB)", "test bits per byte  1.234 (bigram ...)", "test loss  0.123456").
  std::function<std::string(const Evaluation& evaluation, const TaskData& data, bool summary)> format;
  /// The score by name, as gpipe train's JSON has it: "test_accuracy", "test_psnr_db" or
  /// "test_bits_per_byte" (none for the loss itself: the loss is the score); with `references`, those
  /// it is read against too ("noisy_test_psnr_db"; "bigram_bits_per_byte", "gzip_bits_per_byte").
  std::function<std::vector<std::pair<std::string, double>>(const Evaluation& evaluation, const TaskData& data,
                                                            bool references)>
      figures;
};

/// The accuracy's scoring (scoring.cc): the share of test samples whose largest score is their class.
/// What a Task scores by unless it says otherwise.
Scoring accuracy_scoring();

/// The settings a task's default run uses (each ends within 15 minutes on 2 cores: README).
struct TaskDefaults {
  int epochs = 8;
  int64_t batch_size = 128;
  double lr = 1e-3;
  LrSchedule lr_schedule = LrSchedule::kConstant;
  /// Mirror the training images left to right in about half the epochs (mirrored, data.h).
  bool flip = false;
  /// Cut by measured time rather than evenly (a model whose layers differ in time by 10x).
  bool cut_by_time = false;
};

/// A built-in task: one entry of the registry.
struct Task {
  std::string name;     ///< what --model and find_task take, e.g. "resnet"
  std::string title;    ///< what a header calls the model, e.g. "ResNet"
  std::string summary;  ///< one line for a help text
  bool workload = false;  ///< a benchmark workload of docs/benchmarks.md (random data, one batch)
  int layers = 0;
  Scoring scoring = accuracy_scoring();  ///< its metric and references (each built-in task sets its own)
  LossFn loss;
  std::string loss_name;  ///< "cross_entropy" or "mse"
  /// The data folder read when TaskOptions::data_dir is empty ("" for a task that makes its data).
  std::string data_dir;
  TaskDefaults defaults;
  /// The model: every layer, or those a rank keeps, seeded by TaskOptions::seed.
  std::function<Model(const TaskOptions&)> model;
  /// Reads or makes the data. Throws std::runtime_error (or std::invalid_argument for options that
  /// cannot work) naming the folder or file and the fix.
  std::function<TaskData(const TaskOptions&)> data;
  /// One batch of the task's shape, drawn from TaskOptions::seed without reading any file: what
  /// gpipe bench times and gpipe plan profiles (a workload's batch is its data).
  std::function<Dataset(const TaskOptions&)> batch;
  /// The cut this task runs on K `devices` of V stages each under `schedule` when none is asked for
  /// (PipelineOptions::cut): a tuned cut, its blocks evenly, or the even cut. Unset: the even cut.
  std::function<CutRequest(int devices, ScheduleKind schedule, int virtual_stages)> cut;
  /// The schedule (and V, 0 for its own) this task runs on K `devices` with M micro-batches when
  /// none is asked for ("task"). Unset: fill-drain.
  std::function<std::pair<ScheduleKind, int>(int devices, int micro_batches)> schedule;
  /// A byte-level language model's: bytes a sample (a window of text) holds, the model's context,
  /// for generate_text; 0 for a model that reads no text.
  int64_t context = 0;
  /// A denoiser of images: its targets are its inputs without the noise (`samples` draws them:
  /// denoising_picture).
  bool denoises = false;

  /// The options a Trainer runs this task with: its defaults, its loss and metric.
  TrainerOptions trainer_options() const;
  /// Its own pipeline, where none is asked for (choose.h): its schedule, its cut, and whether it is
  /// cut by measured time.
  OwnPipeline own() const { return {schedule, cut, defaults.cut_by_time}; }
};

/// The names find_task knows: the training tasks (cnn, resnet, unet, gpt) and, with
/// `workloads`, the benchmark workloads after them (mlp, transformer, tiny, imbalanced, ...).
std::vector<std::string> task_names(bool workloads = false);

/// The task named `name`. Throws std::invalid_argument naming the known tasks.
const Task& find_task(const std::string& name);

/// A task of one's own: a TorchScript nn.Sequential saved in Python (`model_file`, see
/// script_model.h), trained with `loss` ("cross_entropy" or "mse") on a dataset saved with
/// torch.save({'input': X, 'target': Y}, `data_file`) and scored on the same data, or, with no data
/// file, on Fashion-MNIST. Throws std::invalid_argument naming the file and the problem.
Task script_task(const std::string& model_file, const std::string& data_file, const std::string& loss);

/// `task` trained with `loss` ("cross_entropy" or "mse") on a dataset of one's own, saved with
/// torch.save({'input': X, 'target': Y}, `data_file`), and scored on the same data (read when the
/// task's data is asked for). Throws std::invalid_argument for another loss.
Task with_data_file(Task task, const std::string& data_file, const std::string& loss);

/// The task's model (built from `options`) as the planner takes it (planner.h): profiled here on the
/// first kPlanProfileRows rows of its batch (Task::batch), with its loss, as plan_model_of profiles a
/// Sequential; described as "task NAME" or "workload NAME".
PlannedModel plan_model_of(const Task& task, const TaskOptions& options = TaskOptions(),
                           const PlanProfileOptions& profile = PlanProfileOptions());

/// The TorchScript nn.Sequential saved in `model_file` as the planner takes it: checked as a Trainer
/// checks a model (check_layers_train), then profiled here on kPlanProfileRows random samples of
/// `input_shape` (one sample's shape, without the batch): floats from a normal distribution, or with
/// `input_tokens` N > 0, token ids 0..N-1 (int64, for a model that starts with an Embedding of N
/// entries). Throws std::invalid_argument naming `model`, `input_shape` or `input_tokens` and the
/// problem: no shape, a file that is no such model, samples of more than a quarter of this machine's
/// memory, a negative N, a model that cannot train on them.
PlannedModel plan_model_of(const std::string& model_file, const std::vector<int64_t>& input_shape,
                           const PlanProfileOptions& profile = PlanProfileOptions(), int64_t input_tokens = 0);

// ---------------------------------------------------------------- a run of a task (run.cc)
//
// A run's pipeline is made of its request and the task's own (Task::own) in choose/ (choose.h:
// resolve_run, cut_of, pipeline_options_of).

/// What a finished training run reports (gpipe train prints it as text or JSON), from its trainer.
struct RunSummary {
  std::string evaluated_on;  ///< TaskData::test_name
  Evaluation evaluation;     ///< the last evaluation
  bool no_step_ran = false;  ///< this run took no step (resumed at its end, or `epochs` 0)
  double first_loss = 0;     ///< the loss of this run's first step, and of its last (when a step ran)
  double final_loss = 0;
  RunFigures figures;        ///< this run's time, steps, throughput, measured bubble, cut and placement
  int64_t steps = 0;         ///< steps in all, resumed ones included
  int64_t total_steps = 0;   ///< the step the run ends at (Trainer::total_steps)
  int64_t steps_per_epoch = 0;
  int replicas = 1;          ///< pipeline replicas (ranks / K under mpirun)
  std::string transport;     ///< Pipeline::describe(): threads, MPI, or c10d and whether over shared memory
  double checksum = 0;       ///< of the parameters, over every rank (Pipeline::checksum)
  struct Stage {
    int stage = 0, device = 0, layers = 0;
    std::vector<std::string> modules;  ///< the stage's layers' names (in one process; empty under MPI)
  };
  std::vector<Stage> partition;
  std::vector<std::pair<std::string, double>> scores;  ///< Scoring::figures with its references
};

/// The summary of `trainer`'s run of `task` on `data`, last evaluated as `evaluation`; `checksum` is
/// Pipeline::checksum, a collective every rank calls first. Calls no collective itself.
RunSummary summarize_run(Trainer& trainer, const Task& task, const TaskData& data, const Evaluation& evaluation,
                         double checksum);

/// Checks `task`'s training data against a run's micro-batches and batch before any work: it has
/// samples (windows of text for a language model), at least one per micro-batch, and, for a
/// `batch_size` given (0: the task's own, which may be all of a small data set), no more rows per
/// batch than it holds (a batch takes each at most once). Throws std::invalid_argument naming
/// `micro_batches` or `batch_size` and the fix.
void check_run_data(const Task& task, const TaskData& data, int micro_batches, int64_t batch_size = 0);

/// What ends a run whose last evaluation's loss is NaN or infinite (empty when it is finite): after
/// epoch `epoch` of `trainer`'s run, a model that diverged (lower `lr`, or add `clip_grad_norm`), whose
/// epoch is not saved; at epoch 0, the model of the snapshot file `resume`, which holds a diverged one.
/// Named by `data.test_name`.
std::string divergence_error(const Trainer& trainer, const Evaluation& evaluation, const TaskData& data, int epoch,
                             const std::string& resume);

// ---------------------------------------------------------------- a training run as asked for (run.cc)

/// A training run of a task as a front end asks for it (gpipe train's flags), each setting by the
/// name its errors give in backquotes (`devices`, `batch_size`, ...): the rows of train_settings()
/// (settings.h), which also check them. `given` names the settings asked for rather than left to
/// their default: resolve_training fills the rest with the task's own.
struct TrainSettings {
  /// The settings asked for, by name (find_setting's); `micro_batches` unless a caller leaves M to
  /// `schedule` auto by taking it out.
  std::set<std::string> given{"micro_batches"};
  /// Whether the setting `name` was asked for. Throws std::logic_error for a name no setting has.
  bool was_given(const std::string& name) const;
  std::string data_dir = kFashionMnistDir;
  std::string model;  ///< a built-in task (task_names(true)) by name, or a TorchScript file; empty: cnn
  std::string data;   ///< a dataset file of one's own (with_data_file); empty: the task's
  std::string loss = "cross_entropy";
  int devices = 2;
  std::vector<int> balance;
  std::string balance_by;
  int micro_batches = 4;  ///< not `given`: with `schedule` auto, M is chosen too
  std::string checkpoint = "never", batch_norm = "deferred";
  std::string precision = "fp32";  ///< of each stage's forward: fp32, bf16 or fp16 (PipelineOptions::precision)
  std::string loss_scale = "auto";  ///< auto (under fp16), dynamic or off (TrainerOptions::loss_scale)
  std::string augment = "auto";   ///< "auto": the task's own (flip for resnet), none otherwise
  /// "auto": chosen by prediction (prepare_training), or on `resume` the pipeline the file was
  /// trained with; under MPI and torchrun rank 0's choice, taken by every rank (with per-device files
  /// the task's own). "task": the task's own (resolve_run).
  std::string schedule = "auto";  ///< `given`: auto then fails where the model cannot be profiled
  int virtual_stages = 0;         ///< 0: 2 for the interleaved schedule, 1 for the others
  int64_t batch_size = 128;
  bool drop_last = false, shuffle = true;
  int epochs = 0;  ///< 0: the task's own; given as 0 with `resume`: no training, only the evaluation
  int64_t steps = 0;
  std::string optimizer = "adam";
  double lr = 1e-3, momentum = 0;
  bool nesterov = false;
  double weight_decay = 0;
  std::vector<double> betas{0.9, 0.999};
  std::string lr_schedule = "constant";
  int64_t warmup_steps = 0, lr_step_size = 0;  ///< lr_step_size 0: one epoch
  double lr_gamma = 0.1, clip_grad_norm = 0;   ///< clip_grad_norm 0: no clipping
  uint64_t seed = 0;
  int threads_per_device = 1;
  int64_t train_samples = 0, test_samples = 0, save_every = 0;  ///< save_every 0: every epoch and the end only
  std::string save, resume, trace;  ///< `trace`: the file of the last step's timeline
  bool per_device_files = false;
  bool update_after_step = false;  ///< TrainerOptions::update_on_devices false
  std::string samples;  ///< a denoiser's: a PNG of denoised test images (denoising_picture)
  /// A language model's: bytes to sample after training (generate_text), continuing `prompt`; errors name it
  /// `bytes`, as GenerateOptions does
  int64_t generate = 0;
  std::string prompt;
  double temperature = 0.8;
};

/// Whether `model` names a built-in task (or is empty: cnn) rather than a TorchScript file.
bool is_builtin_task(const std::string& model);

/// The task `settings` train before any file is read: the built-in task, or for a model file the
/// CNN's run (its data and defaults, not its cut or schedule); with `data`, trained and scored on
/// that file. Throws std::invalid_argument naming `loss`.
Task known_task(const TrainSettings& settings);

/// `settings` checked and completed for `task` (known_task) before any work: the schedule, V and the
/// cut by time left to the task (resolve_run); every setting that can be judged without reading a
/// file, outputs that could not be written or would replace an input; then the task's defaults for
/// what was not given (epochs, batch size, lr, its schedule, augment) and the settings that do not
/// fit the task (another loss, flip for other than an image classifier, `generate` for other than a
/// language model, `samples` for other than a denoiser, more micro-batches than samples per batch).
/// Throws std::invalid_argument naming the setting in backquotes and the fix.
void resolve_training(TrainSettings& settings, const Task& task);

/// The options of the task's model and data; of the optimizer; of the Trainer (the task's loss and
/// metric, the settings' optimizer, LR schedule, batches, epochs, at least 1, saves and augment).
TaskOptions task_options_of(const TrainSettings& settings);
OptimizerOptions optimizer_options_of(const TrainSettings& settings);
TrainerOptions trainer_options_of(const TrainSettings& settings, const Task& task);

/// After `trainer` resumed `settings`' `resume` file: where the run asks for no `precision` and the file
/// was trained in another one than the trainer's pipeline runs (under MPI and with per-device files,
/// where the file is read only by the resume; in one process prepare_training takes the file's),
/// throws std::invalid_argument naming the file's precision and the flag that continues it.
void check_resumed_precision(const TrainSettings& settings, const Trainer& trainer);

/// A run of a task made ready: the task (`known`, or a TorchScript model's), its model and data, the
/// pipeline and its plan, made once (a Trainer takes them as they are).
struct TrainingRun {
  Task task;
  Model model;
  TaskData data;
  PipelineOptions options;
  PipelinePlan plan;
  std::optional<CostBalance> cost;  ///< with `balance_by`: the min-max cut of the measured costs
  std::optional<ScheduleChoice> choice;  ///< with `schedule` auto: what was chosen (under MPI, by rank 0)
  /// With `schedule` auto by default (not given) where the model could not be profiled: why, and that
  /// the task's own schedule runs instead. Empty otherwise.
  std::string auto_fallback;
};

/// The run `settings` (resolved by resolve_training) ask of `known`: its model and data read and
/// checked (check_run_data; under MPI, the same bytes on every rank: check_same_bytes), the `resume`
/// file checked against the model before a profile, and the cut: given, the task's own, or with
/// `balance_by` the min-max cut of each layer's cost on one micro-batch (in one process). Throws
/// std::invalid_argument naming the setting (`model`, `data`, `data_dir`, `resume`, the plan's) and
/// the problem. With `schedule` auto the layers are profiled (under MPI by rank 0 alone, on a replica's
/// share of the batch; every rank takes its choice) on micro-batches of each M weighed and choose_schedule
/// picks the schedule, V, the cut (unless given) and M (unless given):
/// `settings` then hold the choice, TrainingRun::choice its prediction; `balance_by` cuts from the
/// profile at the M given (or the default's). `profiling`, if given, is called just before the
/// profile (a few seconds), once the settings are found to leave auto a configuration.
TrainingRun prepare_training(TrainSettings& settings, const Task& known,
                             const std::function<void()>& profiling = nullptr);

/// --generate: `bytes` bytes sampled one at a time from a byte-level language model: each from the
/// model's scores for the byte after the last `context` ones, divided by `temperature`, drawn
/// from a generator seeded by `seed`; the text starts as a fortune does ("%\n"), then `prompt`.
/// `on_byte` sees each byte as it is drawn. Returns the prompt and the sample.
struct GenerateOptions {
  TORCH_ARG(int64_t, bytes) = 200;
  TORCH_ARG(std::string, prompt) = "";
  TORCH_ARG(double, temperature) = 0.8;
  TORCH_ARG(uint64_t, seed) = 0;

 public:
  /// Throws std::invalid_argument for a temperature whose scaled scores are not finite, or more
  /// bytes than kMostGeneratedBytes.
  void check() const;
};
/// The most bytes generate_text samples in one call (each is one pass of the model).
constexpr int64_t kMostGeneratedBytes = 100000;
std::string generate_text(Pipeline& pipeline, int64_t context, const GenerateOptions& options,
                          const std::function<void(char)>& on_byte = nullptr);

/// --samples: the first `shown` test images noisy, denoised by `pipeline` and clean, one row each,
/// as an 8-bit grayscale picture [3 · 58, shown · 58] (each image doubled in size, framed in
/// white). Under MPI each of the pipeline's `replicas` runs its share of the rows; the picture is
/// made by the process that holds the first replica's output, and undefined elsewhere.
torch::Tensor denoising_picture(Pipeline& pipeline, const Dataset& test, int64_t shown, int replicas = 1);

/// Writes `image`, uint8 [height, width] (0 black, 255 white), to `path` as a grayscale PNG (zlib),
/// whole or not at all: the picture of denoising_picture. Throws std::invalid_argument for another
/// tensor, std::runtime_error naming the path and the problem.
void write_png(const std::string& path, const torch::Tensor& image);

/// `bytes` as text every terminal and JSON show: printable ASCII, newlines and tabs as they are,
/// every other byte as \xNN and a backslash as \\.
std::string shown_text(const std::string& bytes);

// ---------------------------------------------------------------- a benchmark of tasks (bench.cc)

/// A sweep of gpipe bench (docs/benchmarks.md): every workload x M x checkpoint, and in each every
/// K x schedule x cut, timed step by step against one device and the ideal.
struct BenchSweep {
  std::vector<std::string> workloads{"mlp"};  ///< tasks by name (task_names(true))
  std::vector<int> stages{2};                 ///< the K swept
  std::vector<int> micro_batches{32};         ///< the M swept
  std::vector<std::string> checkpoints{"except_last"};
  std::vector<std::string> schedules{"gpipe"};  ///< each later one is compared with the first
  int virtual_stages = 0;  ///< 0: each schedule's own (2 for interleaved, zbv and v-half)
  int threads = 1;         ///< intra-op threads of each device
  int steps = 7;           ///< timed steps per configuration
  int warmup = 2;          ///< untimed steps before them
  /// The cut methods swept: "even" (a workload's blocks evenly), "params", "time", "memory".
  std::vector<std::string> balance_by{"even"};
  bool balance_by_given = false;  ///< `balance_by` was asked for (not its default)
  std::vector<int> balance;       ///< an explicit cut, for the K above 1 it fits
  bool tie_embeddings = false;    ///< the transformer workload's tied embedding
  /// Every contender's arithmetic (PipelineOptions::precision; the unsplit one's forward under the same
  /// autocast), and the profile's.
  std::string precision = "fp32";
};

/// The median, smallest and largest of per-step ratios.
struct BenchRatio {
  double median = 0, min = 0, max = 0;
};

/// What gpipe bench reports of one configuration (its JSON row has these names).
struct BenchRow {
  /// What ran: its schedule, K, M, V, cut, checkpoint, precision and order (its JSON row has the
  /// config's fields, K as "stages").
  PipelineConfig config;
  bool chosen = false;  ///< the schedule was auto's choice: "auto:zbv" in the row
  std::string workload, transport, balance_by;
  /// "stage_times": a V schedule ordered by its stages' profiled times (in one process, whatever the
  /// cut); "unit": the unit order, as a schedule named in gpipe train runs on a cut given or even.
  std::string order = "unit";
  bool tie_embeddings = false;
  int replicas = 1, threads_per_device = 1, steps = 0, warmup = 0;
  double samples_per_s = 0, samples_per_s_min = 0, samples_per_s_max = 0, ideal = 0, bubble = 0;
  double overhead_us_per_step = 0, step_s = 0, simulated_over_measured = 0;
  double bytes_sent_per_step = 0, skip_bytes_per_step = 0;
  int64_t program_actions_per_device = 0;
  Prediction predicted;  ///< the cost model's (on the rank that prints)
  std::vector<int64_t> peak_bytes, peak_held_bytes, parameter_bytes;  ///< per device held here
  /// Of the per-device ratios predicted.peak_bytes / peak_bytes, the one farthest from 1 (1 when
  /// no peak was measured here; not in the JSON row).
  double predicted_over_measured_peak = 1;
  /// Against the whole batch unsplit and one device running the M micro-batches (one process only).
  bool has_baselines = false;
  double one_device_samples_per_s = 0, unsplit_samples_per_s = 0, efficiency = 0;
  BenchRatio speedup, speedup_vs_unsplit;
  /// Against the first schedule asked for at the same K and cut: `vs_schedule` empty when none.
  std::string vs_schedule;
  BenchRatio speedup_vs_schedule;
  double bubble_vs_schedule = 0;
  std::vector<double> peak_bytes_vs_schedule, peak_held_bytes_vs_schedule;
};

/// Checks every configuration of `sweep` by the plan each will run, before any work. Throws
/// std::invalid_argument naming the options (`devices`, `micro_batches`, ...) and the fix.
void check_bench(const BenchSweep& sweep);

/// Runs `sweep` (check_bench first): per workload x M x checkpoint, every configuration built, then
/// `warmup` and `steps` rounds of one training step (SGD) of each in turn, so that each ratio compares
/// steps taken moments apart; `on_row` sees each configuration's row on the process that prints
/// (job().prints()). Under MPI every rank calls it, with no baselines and no cut by cost.
void run_benchmark(const BenchSweep& sweep, const std::function<void(const BenchRow&)>& on_row);

}  // namespace gpipe
