// train.h: what the parts of `gpipe train` share: its flags' values, the data and the cut they chose.
#pragma once

#include <gpipe/gpipe.h>

#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>
#include <vector>

namespace gpipe::cli {

struct TrainOptions {
  // What was given on the command line rather than left to its default (sub->count).
  bool data_dir_given = false, loss_given = false, stages_given = false, batch_size_given = false,
       epochs_given = false, lr_given = false, weight_decay_given = false, betas_given = false,
       step_flags_given = false /* --lr-step-size or --lr-gamma */, lr_schedule_given = false,
       prompt_given = false, temperature_given = false;
  std::string data_dir = kFashionMnistDir;
  std::string model_file;  // a built-in task (tasks.h) by name, or a TorchScript file; empty: cnn
  std::string data_file;
  std::string loss = "cross_entropy";
  int stages = 2;
  std::vector<int> balance;
  std::string balance_by;
  int micro_batches = 4;
  std::string checkpoint = "never", batch_norm = "deferred";
  std::string augment = "auto";   // resolved by apply_task: the task's own (flip for resnet), none otherwise
  std::string schedule = "auto";  // resolved by choose_schedule before anything else
  int virtual_stages = 0;         // 0: 2 for the interleaved schedule, 1 for the others
  int64_t batch_size = 128;
  bool drop_last = false, shuffle = true;
  int epochs = 0;  // 0: the task's own (TaskDefaults); given as 0 with --resume: no training
  int64_t steps = 0;
  std::string optimizer = "adam";
  double lr = 1e-3, momentum = 0;
  bool nesterov = false;
  double weight_decay = 0;
  std::vector<double> betas{0.9, 0.999};
  std::string lr_schedule = "constant";
  int64_t warmup_steps = 0, lr_step_size = 0;  // lr_step_size 0: one epoch
  double lr_gamma = 0.1, clip_grad_norm = 0;   // clip_grad_norm 0: no clipping
  std::string seed_text = "0";
  uint64_t seed = 0;
  int threads = 1;
  int64_t train_samples = 0, test_samples = 0, save_every = 0;  // save_every 0: every epoch and the end only
  std::string save, resume, trace;
  bool per_stage_files = false;  // --per-device-files (--per-stage-files, its old name)
  std::string samples;           // --model unet: a PNG of denoised test images
  int64_t generate = 0;          // --model gpt: bytes to sample after training, continuing the prompt
  std::string prompt;
  double temperature = 0.8;
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
