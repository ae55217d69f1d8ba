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
  std::string model_file;
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
  std::string augment = "auto";  // resolved by check_flags: flip for --model resnet, none otherwise
  std::string schedule = "auto";  // resolved by choose_schedule before anything else
  int virtual_stages = 0;         // 0: 2 for the interleaved schedule, 1 for the others
  int64_t batch_size = 128;
  bool batch_size_given = false;
  bool drop_last = false;
  bool shuffle = true;
  int epochs = 0;  // 0: the model's own default (default_epochs); given as 0 with --resume: no training
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

// The built-in models: the CNN (no --model), and by name a residual network and a U-Net (models.h).
inline bool is_resnet(const TrainOptions& o) { return o.model_file == "resnet"; }
inline bool is_unet(const TrainOptions& o) { return o.model_file == "unet"; }
inline bool is_gpt(const TrainOptions& o) { return o.model_file == "gpt"; }
inline bool is_builtin(const TrainOptions& o) { return is_resnet(o) || is_unet(o) || is_gpt(o); }

// The built-in models' default runs: each ends within 15 minutes on 2 cores (README).
constexpr int kResnetEpochs = 14;
constexpr int kUnetEpochs = 2;
constexpr int kGptEpochs = 4;
inline int default_epochs(const TrainOptions& o) {
  return is_resnet(o) ? kResnetEpochs : is_unet(o) ? kUnetEpochs : is_gpt(o) ? kGptEpochs : 8;
}

// --model gpt: the language model's shape, and its run's defaults where they differ from the CNN's
// (chosen by measurement on 2 cores: docs/models.md).
inline GptOptions gpt_shape() {
  GptOptions shape;
  shape.context = 128;
  shape.width = 64;
  shape.heads = 4;
  shape.blocks = 4;
  shape.feed_forward = 256;
  return shape;
}
constexpr int64_t kGptBatch = 16;
// --generate's most bytes: each is one pass of the model over its context (about a millisecond),
// printed as it is sampled.
constexpr int64_t kMaxGeneratedBytes = 100000;
constexpr double kGptLr = 2e-3;

// The U-Net's task: Fashion-MNIST images with Gaussian noise of this standard deviation, in
// pixel values (0 black, 1 white), to be made clean again.
constexpr double kNoise = 0.3;

// The data to train and evaluate on, and the loss.
struct Split : Dataset {
  std::string name;  // "test" or "training"
};

struct Data {
  Split train;
  Split eval;
  bool classification = true;
  LossFn loss;
  double noisy_psnr = 0;  // --model unet: the PSNR of the noisy test images; 0 otherwise
  // --model gpt: bytes of text; the loss is cross-entropy per byte, reported in bits per byte
  // beside a bigram model's and gzip -9's on the same test bytes.
  bool language_model = false;
  int64_t train_bytes = 0, test_bytes = 0;
  double bigram_bits_per_byte = 0;
  double gzip_bits_per_byte = 0;
};

// Layers per stage: --balance, --balance-by's min-max cut of measured costs, or an even cut.
struct Cut {
  std::vector<int> balance;
  nlohmann::json plan;  // --balance-by's plan, for the summary
};

/// The pipeline the flags describe, without its cut (train.cc).
PipelineOptions pipeline_options(const TrainOptions& o);

/// The optimizer the flags describe (train.cc).
OptimizerOptions optimizer_options(const TrainOptions& o);

/// Checks the flags, loads the model and the data, chooses the cut, trains (train.cc).
int run_train(TrainOptions o);

/// Trains `model` on `data`, cut as `cut` says, with progress, the evaluation after every epoch,
/// checkpoints, the timeline and the summary; returns the exit status (train_run.cc).
int train_and_report(const TrainOptions& o, const Model& model, const Data& data, const Cut& cut);

}  // namespace gpipe::cli
