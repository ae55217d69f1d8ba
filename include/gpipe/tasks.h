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

#include "gpipe/data.h"
#include "gpipe/pipeline.h"
#include "gpipe/planner.h"
#include "gpipe/schedule.h"
#include "gpipe/train.h"

#include <torch/arg.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace gpipe {

/// What a task is scored by after every epoch.
enum class Metric {
  kAccuracy,     ///< the share of test samples whose largest score is their class
  kPsnr,         ///< peak signal-to-noise ratio of the output images, in dB (psnr_db)
  kBitsPerByte,  ///< the cross-entropy per byte of held-out text, in bits
  kLoss,         ///< the loss itself
};

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
  /// kPsnr: the PSNR of the noisy test images themselves (the score of doing nothing).
  double noisy_psnr_db = 0;
  /// kBitsPerByte: the bytes of text, and a bigram model's and gzip -9's bits per byte on the
  /// bytes the model is scored on.
  int64_t train_bytes = 0;
  int64_t test_bytes = 0;
  double bigram_bits_per_byte = 0;
  double gzip_bits_per_byte = 0;
};

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
  Metric metric = Metric::kAccuracy;
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
  /// none is asked for ("auto"). Unset: fill-drain.
  std::function<std::pair<ScheduleKind, int>(int devices, int micro_batches)> schedule;
  /// kBitsPerByte: bytes a sample holds (the model's context), for generate_text.
  int64_t context = 0;

  /// The options a Trainer runs this task with: its defaults, its loss and metric.
  TrainerOptions trainer_options() const;
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

/// The score of `loss` (the mean test loss) in the task's metric: bits per byte for kBitsPerByte,
/// dB for kPsnr, the loss otherwise (accuracy comes from Evaluation::accuracy).
double metric_of_loss(Metric metric, double loss);

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

/// `bytes` as text every terminal and JSON show: printable ASCII, newlines and tabs as they are,
/// every other byte as \xNN and a backslash as \\.
std::string shown_text(const std::string& bytes);

}  // namespace gpipe
