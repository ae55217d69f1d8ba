// train.h: what the parts of `gpipe train` share: its flags' values, the data and the cut they chose.
#pragma once

#include <gpipe/gpipe.h>

#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>
#include <vector>

namespace gpipe::cli {

struct TrainOptions {
  std::string data_dir = kFashionMnistDir;
  bool data_dir_given = false;
  std::string model_file;  // a built-in task (tasks.h) by name, or a TorchScript file; empty: cnn
  std::string data_file;
  std::string loss = "cross_entropy";
  bool loss_given = false;
  int stages = 2;
  bool stages_given = false;  // --stages on the command line, not the default
  std::vector<int> balance;
  std::string balance_by;
  int micro_batches = 4;
  std::string checkpoint = "never";
  std::string batch_norm = "deferred";
  std::string augment = "auto";  // resolved by apply_task: the task's own (flip for resnet), none otherwise
  std::string schedule = "auto";  // resolved by choose_schedule before anything else
  int virtual_stages = 0;         // 0: 2 for the interleaved schedule, 1 for the others
  int64_t batch_size = 128;
  bool batch_size_given = false;
  bool drop_last = false;
  bool shuffle = true;
  int epochs = 0;  // 0: the task's own (TaskDefaults); given as 0 with --resume: no training
  bool epochs_given = false;
  int64_t steps = 0;
  std::string optimizer = "adam";
  double lr = 1e-3;
  bool lr_given = false;
  double momentum = 0;
  bool nesterov = false;
  double weight_decay = 0;
  bool weight_decay_given = false;
  std::vector<double> betas{0.9, 0.999};
  bool betas_given = false;
  bool step_flags_given = false;  // --lr-step-size or --lr-gamma
  std::string lr_schedule = "constant";
  bool lr_schedule_given = false;
  int64_t warmup_steps = 0;
  int64_t lr_step_size = 0;  // 0: one epoch
  double lr_gamma = 0.1;
  double clip_grad_norm = 0;  // 0: no clipping
  std::string seed_text = "0";
  uint64_t seed = 0;
  int threads = 1;
  int64_t train_samples = 0;
  int64_t test_samples = 0;
  std::string save;
  int64_t save_every = 0;  // 0: after every epoch and at the end only
  std::string resume;
  bool per_stage_files = false;  // --per-device-files (--per-stage-files, its old name)
  std::string trace;
  std::string samples;  // --model unet: a PNG of denoised test images
  int64_t generate = 0;     // --model gpt: bytes to sample after training
  std::string prompt;       // what the sample continues
  bool prompt_given = false;
  double temperature = 0.8;
  bool temperature_given = false;
  bool json = false;
};

// What the flags chose: the task (a built-in one, or a TorchScript model with its data), its data,
// and the pipeline with its plan, made once (the Trainer takes it as it is).
struct Choice {
  Task task;
  Model model;
  TaskData data;
  PipelineOptions options;
  PipelinePlan plan;
  nlohmann::json cost_plan;  // --balance-by's plan, for the summary
};

/// The optimizer the flags describe (train.cc).
OptimizerOptions optimizer_options(const TrainOptions& o);

/// Checks the flags, loads the model and the data, chooses the cut, trains (train.cc).
int run_train(TrainOptions o);

/// The summary on standard output: as text, or as JSON with --json (train_summary.cc).
void print_summary(const TrainOptions& o, const Choice& c, const RunSummary& s, const nlohmann::json& epochs,
                   const std::string& generated, const std::string& saved_to);

/// The built-in task --model names, or none (a TorchScript file).
bool is_builtin(const TrainOptions& o);

/// The options the task's model and data are made with.
TaskOptions task_options(const TrainOptions& o);

/// Trains the chosen task, with progress, the evaluation after every epoch, checkpoints, the
/// timeline and the summary; returns the exit status (train_run.cc).
int train_and_report(const TrainOptions& o, const Choice& choice);

}  // namespace gpipe::cli
