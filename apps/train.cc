// train.cc: `gpipe train`: pipelined training (a CNN on Fashion-MNIST by default, or a model and data
// saved from Python), with progress, evaluation, a summary, checkpoints and a timeline.
#include "commands.h"
#include "common.h"
#include "png_image.h"
#include "world.h"

#include <gpipe/gpipe.h>
#include <torch/torch.h>

#include <CLI/CLI.hpp>

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <iomanip>
#include <iostream>
#include <limits>
#include <sstream>
#include <thread>
#include <unistd.h>

namespace gpipe::cli {
namespace {

struct TrainOptions {
  std::string data_dir = kFashionMnistDir;
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
  bool drop_last = false;
  bool shuffle = true;
  int epochs = 0;  // 0: the model's own default (default_epochs)
  int64_t steps = 0;
  std::string optimizer = "adam";
  double lr = 1e-3;
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
  std::string resume;
  bool per_stage_files = false;
  std::string trace;
  std::string samples;  // --model unet: a PNG of denoised test images
  bool json = false;
};

// The built-in models: the CNN (no --model), and by name a residual network and a U-Net (models.h).
bool is_resnet(const TrainOptions& o) { return o.model_file == "resnet"; }
bool is_unet(const TrainOptions& o) { return o.model_file == "unet"; }

// The built-in models' default runs: each ends within 15 minutes on 2 cores (README).
constexpr int kResnetEpochs = 14;
constexpr int kUnetEpochs = 2;
int default_epochs(const TrainOptions& o) { return is_resnet(o) ? kResnetEpochs : is_unet(o) ? kUnetEpochs : 8; }

// The U-Net's task: Fashion-MNIST images with Gaussian noise of this standard deviation, in
// pixel values (0 black, 1 white), to be made clean again.
constexpr double kNoise = 0.3;

// ---------------------------------------------------------------- the model

// The cuts measured best for 2 stages on one core each (docs/benchmarks.md): {3, 8} is the
// contiguous min-max cut, but its stages differ by 1.5x in time; interleaving the model as
// 4 stages, {conv1 block, conv2, relu+pool, classifier} on devices 0, 1, 0, 1, evens them out.
const std::vector<int> kFashionBalance{3, 8};
const std::vector<int> kFashionInterleavedBalance{3, 1, 2, 5};

// --schedule auto: the built-in CNN on 2 stages runs interleaved, 2 stages per device, with the
// cut above (measured fastest: bench/train_vs_pytorch.sh); every other model fill-drain.
void choose_schedule(TrainOptions& o) {
  if (o.schedule == "auto") {
    const bool tuned = o.model_file.empty() && o.stages == 2 && o.balance.empty() && o.balance_by.empty() &&
                       (o.virtual_stages == 0 || o.virtual_stages == 2) && o.micro_batches % 2 == 0;
    o.schedule = tuned || o.virtual_stages > 1 ? "interleaved" : "gpipe";
  }
  if (o.virtual_stages == 0) o.virtual_stages = o.schedule == "interleaved" ? 2 : 1;
}

// What is trained: the built-in CNN, ResNet or U-Net, or a TorchScript model from Python.
Model choose_model(const TrainOptions& o) {
  if (o.model_file.empty() || is_resnet(o) || is_unet(o)) {
    const uint64_t seed = o.seed;
    const bool resnet = is_resnet(o), unet = is_unet(o);
    return Model::of(resnet ? "ResNet" : unet ? "U-Net" : "CNN",
                     resnet ? kFashionResnetLayers : unet ? kFashionUnetLayers : kFashionCnnLayers,
                     [seed, resnet, unet](LayerRange keep) {
                       torch::manual_seed(seed);  // every range starts from the same draws: a rank's layers equal one process's
                       return resnet ? fashion_resnet(keep) : unet ? fashion_unet(keep) : fashion_cnn(keep);
                     });
  }
  return or_usage_error("--model", [&] {
    const ScriptModel source = load_script_model(o.model_file);
    torch::manual_seed(o.seed);  // the stream each step's Dropout seed is drawn from, as the built-in model's
    return Model::of(o.model_file, source);
  });
}

// ---------------------------------------------------------------- the data

// --augment flip: training image r is mirrored left to right in epoch e about half the time, as
// bit 13 of r·2654435761 + e·40503 + (seed mod 1000003) says: a function of (r, e, seed) alone, so a
// resumed run mirrors the same images as an unbroken one.
torch::Tensor mirrored(const torch::Tensor& images, const torch::Tensor& rows, int epoch, uint64_t seed) {
  const torch::Tensor hash = rows * int64_t{2654435761} + int64_t{epoch} * int64_t{40503} +
                             static_cast<int64_t>(seed % 1000003);
  const torch::Tensor flip = hash.div(8192, "floor").remainder(2).to(torch::kBool).view({-1, 1, 1, 1});
  return torch::where(flip, images.flip({3}), images);
}

struct Split : Dataset {
  std::string name;  // "test" or "training"
};

struct Data {
  Split train;
  Split eval;
  bool classification = true;
  LossFn loss;
  double noisy_psnr = 0;  // --model unet: the PSNR of the noisy test images; 0 otherwise
};

// Peak signal-to-noise ratio, in dB, of images with mean squared error `mse` in Fashion-MNIST's
// normalized units (fashion_mnist.h), pixel values 0..1.
double psnr(double mse) {
  const double pixel_mse = mse * kFashionStd * kFashionStd;
  return 10.0 * std::log10(1.0 / pixel_mse);
}

// The U-Net's inputs: `clean` images with Gaussian noise of kNoise (in pixel values) drawn from `seed`.
torch::Tensor add_noise(const torch::Tensor& clean, uint64_t seed) {
  torch::Generator generator = at::detail::createCPUGenerator(seed);
  return clean + torch::randn(clean.sizes(), generator, torch::kFloat) * static_cast<float>(kNoise / kFashionStd);
}

Data load_data(const TrainOptions& o) {
  Data d;
  if (!o.data_file.empty()) {
    d.train = {or_usage_error("--data", [&] { return load_tensor_data(o.data_file); }).first(o.train_samples),
               "training"};
    d.eval = d.train;
  } else {
    const Dataset fashion = load_fashion_mnist(o.data_dir, true, o.train_samples);
    const Dataset test = load_fashion_mnist(o.data_dir, false, o.test_samples);
    d.train = {fashion, "training"};
    d.eval = {test, "test"};
    if (is_unet(o)) {  // noisy images in, the clean ones out; the noise fixed by --seed
      d.train = {{add_noise(fashion.input, o.seed ^ 0x6e6f697365ull), fashion.input}, "training"};
      d.eval = {{add_noise(test.input, o.seed ^ 0x74657374ull), test.input}, "test"};
      d.noisy_psnr = psnr(torch::mse_loss(d.eval.input, d.eval.target).item<double>());
    }
  }
  d.classification = o.loss == "cross_entropy";
  if (d.classification) {
    if (d.train.target.is_floating_point())
      usage_error("--loss cross_entropy needs integer class targets, but the targets are " +
                  std::string(c10::toString(d.train.target.scalar_type())) + "; use --loss mse");
    d.train.target = d.train.target.to(torch::kLong);
    d.eval.target = d.eval.target.to(torch::kLong);
  } else if (!d.train.target.is_floating_point()) {
    usage_error("--loss mse needs real-valued targets, but the targets are " +
                std::string(c10::toString(d.train.target.scalar_type())) +
                "; use --loss cross_entropy for class indices, or save the targets as floats");
  }
  d.loss = d.classification ? LossFn(cross_entropy_loss) : LossFn(mse_loss);
  const int64_t N = d.train.input.size(0);
  if (N == 0) usage_error("the training data has no samples");
  if (o.micro_batches > N)
    usage_error("--micro-batches " + std::to_string(o.micro_batches) + " is more than the " + std::to_string(N) +
                " training samples; every micro-batch needs a sample");
  return d;
}

// The model's output for the first two samples, computed up front, so that a
// target that does not fit the loss (or a model that does not fit the data)
// is refused before any training, naming both shapes.
void check_targets(const Model& model, const Data& data) {
  const torch::Tensor sample = data.train.input.narrow(0, 0, std::min<int64_t>(2, data.train.input.size(0)));
  torch::Tensor out;
  {
    const RandomStateGuard guard;  // building the whole model draws random numbers
    torch::NoGradGuard no_grad;
    torch::nn::Sequential whole = model.build(LayerRange{});
    whole->eval();
    const auto names = whole->named_children();
    out = sample;
    for (size_t i = 0; i < whole->size(); ++i) {
      const torch::Tensor in = out;
      try {
        out = (whole->begin() + static_cast<std::ptrdiff_t>(i))->forward(in);
      } catch (const std::exception& e) {
        whole->train();
        const std::string index = std::to_string(i);
        usage_error("layer " + index + (names[i].key() == index ? "" : " ('" + names[i].key() + "')") + " fails on " +
                    (i == 0 ? "the data's first samples, shape " : "the output of layer " + std::to_string(i - 1) +
                                                                      ", shape ") +
                    shape_text(in) + ": " + what_of(e) +
                    (i == 0 ? "; give the model inputs of the shape its first layer takes"
                            : "; make each layer take the shape the one before it outputs"));
      }
    }
    whole->train();  // the layers may be the training ones (a TorchScript model's)
  }
  const torch::Tensor& target = data.train.target;
  const auto out_row = out.sizes().slice(1), target_row = target.sizes().slice(1);
  if (data.classification) {
    if (out.dim() < 2)
      usage_error("--loss cross_entropy needs the model to output a score per class (shape [N, classes]), but it "
                  "outputs " + shape_text(out) + " for 2 samples");
    const int64_t classes = out.size(-1);
    if (target_row != out_row.slice(0, out_row.size() - 1))
      usage_error("--loss cross_entropy: the model outputs " + shape_text(out) + " for 2 samples, so the targets "
                  "must be class indices of shape [N" + (out.dim() > 2 ? ", ..." : std::string()) + "], but they have "
                  "shape " + shape_text(target) + (target.dim() == 2 && target.size(1) == 1 ? "; squeeze the last "
                  "dimension (target.squeeze(1) in Python)" : ""));
    const int64_t low = target.min().item<int64_t>(), high = target.max().item<int64_t>();
    if (low < 0 || high >= classes)
      usage_error("--loss cross_entropy: the targets hold class " + std::to_string(low < 0 ? low : high) +
                  ", but the model outputs " + std::to_string(classes) + " classes (0 to " +
                  std::to_string(classes - 1) + ")");
  } else if (target_row != out_row) {
    usage_error("--loss mse: the model outputs rows of shape " + shape_text(out.narrow(0, 0, 1).squeeze(0)) +
                ", but the targets' rows have shape " + shape_text(target.narrow(0, 0, 1).squeeze(0)) +
                " (targets " + shape_text(target) + "); give targets of the output's shape");
  }
}

// ---------------------------------------------------------------- checks and the cut

// The optimizer the flags describe.
OptimizerOptions optimizer_options(const TrainOptions& o) {
  OptimizerOptions options;
  options.kind(parse_optimizer(o.optimizer)).lr(o.lr).momentum(o.momentum).nesterov(o.nesterov);
  if (o.weight_decay_given) options.weight_decay(o.weight_decay);
  if (o.betas_given) options.betas(std::make_tuple(o.betas[0], o.betas[1]));
  return options;
}

// Every flag that can be judged without reading a file, before any work.
void check_flags(TrainOptions& o) {
  o.seed = parse_seed(o.seed_text);
  if (world().mpi && !o.balance_by.empty())
    usage_error("--balance-by profiles the whole model in one process; run it once without mpirun and pass "
                "the cut it prints with --balance");
  if (o.micro_batches > o.batch_size)
    usage_error("--micro-batches " + std::to_string(o.micro_batches) + " is larger than --batch-size " +
                std::to_string(o.batch_size) + "; every micro-batch needs a sample");
  if ((is_resnet(o) || is_unet(o)) && std::filesystem::exists(o.model_file))
    usage_error("--model " + o.model_file + " names a built-in model, and there is also a file " + o.model_file +
                " here; for the file, say --model ./" + o.model_file);
  if ((is_resnet(o) || is_unet(o)) && !o.data_file.empty())
    usage_error("--model " + o.model_file + " is built to train on Fashion-MNIST; leave out --data (or give a "
                "TorchScript model file of your own to --model)");
  if (is_unet(o) && o.loss_given && o.loss != "mse")
    usage_error("--model unet denoises images: its loss is mse; leave out --loss");
  if (is_unet(o)) o.loss = "mse";
  if (o.data_file.empty() && o.loss != "cross_entropy" && !is_unet(o))
    usage_error("--loss " + o.loss + " needs --data with real-valued targets; Fashion-MNIST has class labels");
  if (!o.samples.empty() && !is_unet(o))
    usage_error("--samples writes a picture of denoised test images: it is for --model unet");
  if (!o.samples.empty() && (o.samples.size() < 5 || o.samples.compare(o.samples.size() - 4, 4, ".png") != 0))
    usage_error("--samples " + o.samples + ": the picture is a PNG file; give a path that ends in .png");
  if (o.epochs == 0) o.epochs = default_epochs(o);
  if (o.augment == "auto") o.augment = is_resnet(o) ? "flip" : "none";
  if (is_resnet(o) && !o.lr_schedule_given) o.lr_schedule = "cosine";
  if (o.augment == "flip" && (is_unet(o) || !o.data_file.empty()))
    usage_error("--augment flip mirrors Fashion-MNIST's training images for a classifier; it is not for " +
                std::string(is_unet(o) ? "--model unet, whose targets are the images themselves" : "--data") +
                ": use --augment none");
  // The residual network's blocks differ in time per layer by 10x: cut it by measured time
  // unless told otherwise (under MPI each rank would profile alone: an even cut there).
  if (is_resnet(o) && o.balance.empty() && o.balance_by.empty() && o.virtual_stages == 1 && o.stages > 1 &&
      !world().mpi)
    o.balance_by = "time";
  const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  if (o.threads > static_cast<int>(cores))
    usage_error("--threads-per-stage " + std::to_string(o.threads) + " is more than this machine's " +
                std::to_string(cores) + " cores; use 1 to " + std::to_string(cores));
  if (!o.balance.empty() && !o.balance_by.empty())
    usage_error("--balance and --balance-by " + o.balance_by + " both choose the cut; give one of them");
  const int V = o.virtual_stages;
  if (V > 1 && o.schedule != "interleaved")
    usage_error("--virtual-stages " + std::to_string(V) + " needs --schedule interleaved; the " + o.schedule +
                " schedule runs one stage per device");
  if (V > 1 && !o.balance_by.empty())
    usage_error("--balance-by cuts the model into contiguous stages, one per device; with --virtual-stages give "
                "the cut (--stages x V entries) with --balance, or leave it out for an even cut");
  // The optimizer's flags, as torch.optim takes them.
  optimizer_options(o).check();
  o.weight_decay = optimizer_options(o).decay();
  if (o.lr_schedule != "step" && o.step_flags_given)
    usage_error("--lr-step-size and --lr-gamma belong to --lr-schedule step");
  // Outputs: found unwritable now, not after training.
  if (o.per_stage_files && !world().mpi)
    usage_error("--per-stage-files is for mpirun, where each stage writes its own file; in one process --save "
                "writes the whole model");
  // No output may replace an input or the other output (--save may replace --resume's file).
  auto same_file = [](const std::string& a, const std::string& b) {
    std::error_code error;
    return !a.empty() && !b.empty() &&
           std::filesystem::weakly_canonical(a, error) == std::filesystem::weakly_canonical(b, error);
  };
  for (const auto& [output, path] : {std::pair<const char*, std::string>{"--save", o.save}, {"--trace", o.trace},
                                     {"--samples", o.samples}})
    for (const auto& [input, other] : {std::pair<const char*, std::string>{"--data", o.data_file},
                                       {"--model", o.model_file}, {"--trace", o.trace},
                                       {"--samples", o.samples}})
      if (std::string(output) != input && same_file(path, other))
        usage_error(std::string(output) + " " + path + " is the file of " + input + "; writing it would replace " +
                    (std::string(input) == "--trace" || std::string(input) == "--samples" ? "that output"
                                                                                           : "your input") +
                    ": give another path");
  // The single checkpoint and the trace are written by the first rank; per-device files are checked
  // where they are written, once the devices are placed.
  if (world().rank == 0 && !o.save.empty() && !o.per_stage_files)
    or_usage_error("--save", [&] { check_writable(o.save); return 0; });
  if (world().rank == 0 && !o.trace.empty()) or_usage_error("--trace", [&] { check_writable(o.trace); return 0; });
  if (world().rank == 0 && !o.samples.empty())
    or_usage_error("--samples", [&] { check_writable(o.samples); return 0; });
}

// Layers per stage: --balance, --balance-by's min-max cut of measured costs, or an even cut.
struct Cut {
  std::vector<int> balance;
  nlohmann::json plan;  // --balance-by's plan, for the summary
};

Cut choose_cut(const TrainOptions& o, const Model& model, const Data& data) {
  const int layers = model.layers, V = o.virtual_stages;
  Cut cut;
  if (!o.balance.empty()) {
    or_usage_error("--balance", [&] { check_balance(o.balance, layers); return 0; });
    const int entries = static_cast<int>(o.balance.size());
    if (entries % V != 0)
      usage_error("--balance has " + std::to_string(entries) + " stages, not a multiple of --virtual-stages " +
                  std::to_string(V) + "; give K x V entries (stage s runs on device s mod K)");
    if (o.stages_given && int64_t{o.stages} * V != entries)
      usage_error("--stages " + std::to_string(o.stages) + (V > 1 ? " x --virtual-stages " + std::to_string(V) : "") +
                  " and --balance (" + std::to_string(entries) + " stages) disagree; give one of them");
    cut.balance = o.balance;
    return cut;
  }
  if (int64_t{o.stages} * V > layers)
    usage_error("--stages " + std::to_string(o.stages) + (V > 1 ? " x --virtual-stages " + std::to_string(V) : "") +
                " is more than the model's " + std::to_string(layers) + " layers; use at most " +
                std::to_string(layers / V) + " stages");
  if (o.balance_by.empty()) {
    const bool cnn_on_two = o.model_file.empty() && o.stages == 2;
    cut.balance = cnn_on_two && V == 1   ? kFashionBalance
                  : cnn_on_two && V == 2 ? kFashionInterleavedBalance
                                         : even_balance(layers, o.stages * V);
    return cut;
  }
  // --balance-by: per-layer costs on one micro-batch, then the exact min-max cut.
  torch::nn::Sequential whole;
  {
    const RandomStateGuard guard;
    whole = model.build(LayerRange{});
  }
  const int64_t N = data.train.input.size(0);
  const torch::Tensor sample = data.train.input.narrow(0, 0, chunk_sizes(std::min(o.batch_size, N), o.micro_batches).front());
  const std::vector<double> costs = o.balance_by == "params" ? parameter_costs(whole)
                                    : o.balance_by == "time" ? time_costs(whole, sample, o.threads)
                                                             : memory_costs(whole, sample, o.optimizer == "sgd" ? 2.0 : 3.0);
  cut.balance = balance_by_cost(costs, o.stages);
  const PartitionPlan plan = plan_partition(costs, cut.balance, o.micro_batches);
  const std::string unit = o.balance_by == "params" ? "parameters" : o.balance_by == "time" ? "s" : "bytes";
  if (!o.json && world().prints()) std::cout << "balance by " << o.balance_by << ":\n" << format_plan(plan, unit);
  cut.plan = {{"balance_by", o.balance_by},         {"unit", unit},
              {"stage_costs", plan.stage_costs},    {"bottleneck_stage", plan.bottleneck_stage},
              {"predicted_step", plan.predicted_step}, {"predicted_efficiency", plan.predicted_efficiency}};
  return cut;
}

// ---------------------------------------------------------------- progress

// Progress on standard error: a bar on a terminal, a plain line every tenth of an epoch otherwise.
class Progress {
 public:
  Progress(int epochs, int64_t steps_per_epoch, bool enabled)
      : epochs_(epochs), steps_(steps_per_epoch), tty_(isatty(fileno(stderr)) != 0), enabled_(enabled) {}

  void update(int epoch, int64_t step, double loss, double samples_per_s, double eta_s) {
    if (!enabled_) return;
    const bool every_tenth = steps_ < 10 || step % (steps_ / 10) == 0 || step == steps_;
    if (!tty_ && !every_tenth) return;
    std::ostringstream line;
    line << "epoch " << epoch << "/" << epochs_ << " ";
    if (tty_) {
      const int width = 24, filled = static_cast<int>(width * step / steps_);
      line << "[" << std::string(static_cast<size_t>(filled), '#')
           << std::string(static_cast<size_t>(width - filled), '.') << "] ";
    }
    line << "step " << step << "/" << steps_ << "  loss " << std::fixed << std::setprecision(4) << loss
         << "  " << std::setprecision(0) << samples_per_s << " samples/s  ETA " << format_eta(eta_s);
    if (tty_)
      std::cerr << "\r" << line.str() << "\x1b[K" << std::flush;
    else
      std::cerr << line.str() << "\n";
  }
  void end_epoch() {
    if (tty_ && enabled_) std::cerr << "\n";
  }

 private:
  static std::string format_eta(double s) {
    const int t = static_cast<int>(s + 0.5);
    std::ostringstream out;
    out << t / 60 << "m" << std::setw(2) << std::setfill('0') << t % 60 << "s";
    return out.str();
  }
  int epochs_;
  int64_t steps_;
  bool tty_;
  bool enabled_;
};

// ---------------------------------------------------------------- test faults

// A test-only switch, GPIPE_TEST_FAULT: "throw:STEP" makes the loss throw in
// step STEP (on the last stage); "exit:RANK:STEP" ends rank RANK abruptly before
// step STEP, as a crash would.
struct Fault {
  std::string kind;
  int rank = -1;
  int64_t step = -1;
};

Fault test_fault() {
  Fault f;
  const char* text = std::getenv("GPIPE_TEST_FAULT");
  if (text == nullptr) return f;
  std::string s(text);
  const size_t colon = s.find(':');
  f.kind = s.substr(0, colon);
  s = colon == std::string::npos ? "" : s.substr(colon + 1);
  if (f.kind == "exit") {
    f.rank = std::stoi(s.substr(0, s.find(':')));
    s = s.substr(s.find(':') + 1);
  }
  f.step = s.empty() ? -1 : std::stoll(s);
  return f;
}

// ---------------------------------------------------------------- the run

// How the library's trainer runs the flags' training.
TrainerOptions trainer_options(const TrainOptions& o, LossFn loss) {
  const LrSchedule schedule = o.lr_schedule == "cosine" ? LrSchedule::kCosine
                              : o.lr_schedule == "step" ? LrSchedule::kStep
                                                        : LrSchedule::kConstant;
  TrainerOptions options;
  options.optimizer(optimizer_options(o))
      .lr_schedule(LrScheduleOptions()
                       .kind(schedule)
                       .warmup_steps(o.warmup_steps)
                       .step_size(o.lr_step_size)
                       .gamma(o.lr_gamma))
      .clip_grad_norm(o.clip_grad_norm)
      .batch_size(o.batch_size)
      .drop_last(o.drop_last)
      .shuffle(o.shuffle)
      .seed(o.seed)
      .epochs(o.epochs)
      .steps(o.steps)
      .loss(std::move(loss))
      .classification(o.loss == "cross_entropy")
      .save(o.save)
      .per_device_files(o.per_stage_files);
  if (o.augment == "flip") {
    const uint64_t seed = o.seed;
    options.augment([seed](const torch::Tensor& x, const torch::Tensor& rows, int epoch) {
      return mirrored(x, rows, epoch, seed);
    });
  }
  return options;
}

// One training run: the engine, its optimizer, where the run stands, and what it measured.
class Run {
 public:
  Run(const TrainOptions& o, const Model& model, const Data& data, const Cut& cut)
      : o_(o), model_(model), data_(data), cut_(cut),
        trainer_(model,
                 PipelineOptions()
                     .balance(cut.balance)
                     .chunks(o.micro_batches)
                     .checkpoint(parse_checkpoint(o.checkpoint))
                     .schedule(parse_schedule(o.schedule))
                     .virtual_stages(o.virtual_stages)
                     .deferred_batch_norm(o.batch_norm == "deferred")
                     .threads_per_stage(o.threads),
                 trainer_options(o, loss()), data.train),
        engine_(trainer_.engine()), K_(engine_.schedule().devices) {}

  void resume() {
    if (!o_.resume.empty()) or_usage_error("--resume", [&] { trainer_.resume(o_.resume); return 0; });
  }

  void print_header() {
    if (!printing()) return;
    const std::string devices = std::to_string(K_) + (K_ == 1 ? " device" : " devices");
    std::cout << "gpipe train: " << model_.name << " on " << (o_.data_file.empty() ? "Fashion-MNIST" : o_.data_file)
              << ", " << trainer_.samples() << " training samples; "
              << (o_.virtual_stages > 1 ? devices + " x " + std::to_string(o_.virtual_stages) + " stages "
                                        : std::to_string(K_) + (K_ == 1 ? " stage " : " stages "))
              << nlohmann::json(cut_.balance).dump() << ", " << o_.micro_batches << " micro-batches of a batch of "
              << o_.batch_size << ", schedule " << o_.schedule << ", checkpoint " << o_.checkpoint << ", "
              << o_.optimizer << " lr " << o_.lr << (o_.lr_schedule != "constant" ? " (" + o_.lr_schedule + ")" : "")
              << (world().mpi ? ", " + engine_.describe() : "")
              << (o_.resume.empty() ? "" : ", resumed at step " + std::to_string(trainer_.start_step())) << "\n";
  }

  // Trains with progress on standard error, the evaluation after every epoch, and the test faults.
  void train() {
    Progress progress(o_.epochs, trainer_.steps_per_epoch(), world().prints());
    TrainerCallbacks callbacks;
    callbacks.before_step = [this](int64_t step) {
      if (fault_.kind == "exit" && fault_.rank == world().rank && fault_.step == step) std::_Exit(3);
      fault_now_ = fault_.kind == "throw" && fault_.step == step;
    };
    callbacks.after_step = [&](int epoch, int64_t batch) {
      if (!o_.trace.empty() && trainer_.step() == trainer_.total_steps()) last_trace_ = engine_.trace();
      const TrainStats& t = trainer_.stats();
      progress.update(epoch, batch, t.last_loss, static_cast<double>(t.samples) / t.train_seconds,
                      static_cast<double>(trainer_.total_steps() - trainer_.step()) * t.train_seconds /
                          static_cast<double>(trainer_.step() - trainer_.start_step()));
    };
    callbacks.after_epoch = [&](int epoch) {
      progress.end_epoch();
      report(epoch);
    };
    trainer_.fit(callbacks);
  }

  // The trace, the summary; returns the exit status (1 if an output could not be written).
  int finish() {
    if (trainer_.step() == trainer_.start_step()) evaluation_ = evaluate();  // no step ran: say what the restored model does
    int status = 0;
    if (!o_.trace.empty() && world().prints()) {
      if (trainer_.step() == trainer_.start_step()) {
        print_error_line("gpipe: --trace: no step ran, so there is no timeline to write");
      } else {
        try {
          write_trace(last_trace_, o_.trace);
        } catch (const std::exception& e) {  // the summary still comes
          print_error_line("gpipe: --trace: " + without_prefix(e.what()));
          status = 1;
        }
      }
    }
    try {
      write_samples();
    } catch (const std::exception& e) {  // the summary still comes
      print_error_line("gpipe: --samples: " + without_prefix(e.what()));
      status = 1;
    }
    const double checksum = engine_.checksum();
    if (!world().prints()) return status;
    print_summary(checksum);
    std::cout.flush();
    if (!std::cout) {
      const int error = errno;
      print_error_line(std::string("gpipe: cannot write to standard output: ") +
                       (error != 0 ? std::strerror(error) : "write error"));
      return 1;
    }
    return status;
  }

 private:
  bool printing() const { return world().prints() && !o_.json; }
  bool denoising() const { return data_.noisy_psnr > 0; }

  // --samples: the first test images, noisy, denoised and clean, one row each, written by the
  // process that holds the model's output for them (under MPI, the first replica's last stage).
  void write_samples() {
    if (o_.samples.empty()) return;
    const int64_t n = std::min<int64_t>(8, data_.eval.input.size(0));
    const torch::Tensor noisy = data_.eval.input.narrow(0, 0, n);
    torch::nn::Sequential layers = engine_.layers();
    layers->eval();
    OutputRows out;
    {
      torch::NoGradGuard no_grad;
      out = engine_.forward(noisy);
    }
    layers->train();
    if (!out.output.defined() || out.first != 0) return;
    const int64_t shown = out.output.size(0);  // under MPI with replicas, the first replica's share
    auto row = [shown](const torch::Tensor& images) {  // [n, 1, 28, 28] normalized -> [58, n * 58] pixels
      const torch::Tensor pixels = (images.detach().cpu() * kFashionStd + kFashionMean).clamp(0, 1).mul(255).round();
      const torch::Tensor big = torch::nn::functional::interpolate(
          pixels, torch::nn::functional::InterpolateFuncOptions().scale_factor(std::vector<double>{2, 2})
                      .mode(torch::kNearest));
      const torch::Tensor framed = torch::constant_pad_nd(big, {1, 1, 1, 1}, 255);  // white gaps
      return framed.squeeze(1).permute({1, 0, 2}).reshape({framed.size(2), shown * framed.size(3)});
    };
    const torch::Tensor picture = torch::cat(
        {row(noisy.narrow(0, 0, shown)), row(out.output), row(data_.eval.target.narrow(0, 0, shown))}, 0);
    write_png(o_.samples, picture.to(torch::kUInt8));
    if (!o_.json)
      std::cout << "samples: " << o_.samples << " (rows: noisy, denoised, clean; " << shown << " test images)"
                << std::endl;
  }

  Evaluation evaluate() { return trainer_.evaluate(data_.eval); }

  void report(int epoch) {
    evaluation_ = evaluate();
    const std::string& eval = data_.eval.name;
    epochs_.push_back({{"epoch", epoch}, {"step", trainer_.step()}, {"loss", trainer_.stats().last_loss}, {eval + "_loss", evaluation_.loss}});
    if (data_.classification) epochs_.back()[eval + "_accuracy"] = evaluation_.accuracy;
    if (denoising()) epochs_.back()[eval + "_psnr_db"] = psnr(evaluation_.loss);
    if (!printing()) return;
    std::cout << "epoch " << epoch << ": loss " << std::fixed << std::setprecision(4) << trainer_.stats().last_loss;
    if (data_.classification)
      std::cout << ", " << eval << " accuracy " << std::setprecision(2) << 100 * evaluation_.accuracy << "%";
    else if (denoising())
      std::cout << ", " << eval << " PSNR " << std::setprecision(2) << psnr(evaluation_.loss) << " dB (noisy input "
                << data_.noisy_psnr << " dB)";
    else
      std::cout << ", " << eval << " loss " << evaluation_.loss;
    std::cout << std::endl;
  }

  void print_summary(double checksum) {
    const nlohmann::json s = summary(checksum);
    if (o_.json) {
      std::cout << s.dump(2) << std::endl;
      return;
    }
    const std::string& eval = data_.eval.name;
    const int64_t run_steps = trainer_.step() - trainer_.start_step();
    std::cout << "\nsummary\n";
    if (run_steps == 0)
      std::cout << "  no step ran: the checkpoint is at step " << trainer_.step() << ", and the run ends at step "
                << trainer_.total_steps() << "\n";
    if (data_.classification)
      std::cout << "  " << eval << " accuracy  " << std::fixed << std::setprecision(2) << 100 * evaluation_.accuracy
                << "%\n";
    else if (denoising())
      std::cout << "  " << eval << " PSNR      " << std::fixed << std::setprecision(2) << psnr(evaluation_.loss)
                << " dB (noisy input " << data_.noisy_psnr << " dB)\n";
    else
      std::cout << "  " << eval << " loss  " << std::fixed << std::setprecision(6) << evaluation_.loss << "\n";
    std::cout << "  training time  " << std::fixed << std::setprecision(1) << trainer_.stats().train_seconds << " s (" << run_steps
              << " steps)\n"
              << "  throughput     " << std::setprecision(0) << s["trainer_.stats().samplesper_s"].get<double>() << " samples/s\n"
              << "  bubble         " << std::setprecision(1) << 100 * s["bubble"].get<double>()
              << "% of stage time idle (measured)\n"
              << "  partition      ";
    for (size_t j = 0; j < cut_.balance.size(); ++j)
      std::cout << (j ? " | " : "") << "stage " << j
                << (o_.virtual_stages > 1 ? " (device " + std::to_string(j % static_cast<size_t>(K_)) + ")" : "")
                << ": " << cut_.balance[j] << (cut_.balance[j] == 1 ? " layer" : " layers");
    std::cout << std::endl;
    if (!o_.save.empty())
      std::cout << "  saved to       "
                << (o_.per_stage_files ? trainer_.snapshot_file(o_.save, 0) + " .. " + trainer_.snapshot_file(o_.save, K_ - 1)
                                       : o_.save)
                << std::endl;
  }

  nlohmann::json summary(double checksum) const {
    const int64_t run_steps = trainer_.step() - trainer_.start_step();
    const std::string& eval = data_.eval.name;
    nlohmann::json stages = nlohmann::json::array();
    for (int j = 0; j < static_cast<int>(cut_.balance.size()); ++j) {
      stages.push_back({{"stage", j}, {"device", j % K_}, {"layers", cut_.balance[static_cast<size_t>(j)]}});
      if (!world().mpi) {
        nlohmann::json names = nlohmann::json::array();
        const int first = stage_offsets(cut_.balance)[static_cast<size_t>(j)];
        const auto children = engine_.layers()->children();
        for (int n = first; n < first + cut_.balance[static_cast<size_t>(j)]; ++n)
          names.push_back(children[static_cast<size_t>(n)]->name());
        stages.back()["modules"] = names;
      }
    }
    const nlohmann::json none;  // null: no step ran, so no loss was measured
    nlohmann::json s = {{"evaluated_on", eval},
                        {eval + "_loss", evaluation_.loss},
                        {"first_loss", run_steps > 0 ? nlohmann::json(trainer_.stats().first_loss) : none},
                        {"final_loss", run_steps > 0 ? nlohmann::json(trainer_.stats().last_loss) : none},
                        {"no_step_ran", run_steps == 0},
                        {"train_seconds", trainer_.stats().train_seconds},
                        {"trainer_.stats().samplesper_s", trainer_.stats().train_seconds > 0 ? static_cast<double>(trainer_.stats().samples) / trainer_.stats().train_seconds : 0.0},
                        {"steps", trainer_.step()},
                        {"steps_this_run", run_steps},
                        {"steps_per_epoch", trainer_.steps_per_epoch()},
                        {"epochs", epochs_},
                        {"stages", K_},
                        {"balance", cut_.balance},
                        {"partition", stages},
                        {"plan", cut_.plan},
                        {"micro_batches", o_.micro_batches},
                        {"checkpoint", o_.checkpoint},
                        {"schedule", o_.schedule},
                        {"virtual_stages", o_.virtual_stages},
                        {"batch_size", o_.batch_size},
                        {"drop_last", o_.drop_last},
                        {"shuffle", o_.shuffle},
                        {"optimizer", o_.optimizer},
                        {"lr", o_.lr},
                        {"lr_schedule", o_.lr_schedule},
                        {"augment", o_.augment},
                        {"batch_norm", o_.batch_norm},
                        {"warmup_steps", o_.warmup_steps},
                        {"weight_decay", o_.weight_decay},
                        {"clip_grad_norm", o_.clip_grad_norm},
                        {"seed", o_.seed},
                        {"bubble", run_steps > 0 ? trainer_.stats().bubble_sum / static_cast<double>(run_steps) : 0.0},
                        {"parameter_checksum", checksum},
                        {"machine", machine()}};
    if (o_.optimizer == "sgd") {
      s["momentum"] = o_.momentum;
      s["nesterov"] = o_.nesterov;
    } else {
      s["betas"] = o_.betas;
    }
    if (world().mpi) s["mpi"] = {{"ranks", world().size}, {"replicas", world().size / K_}};
    if (data_.classification) s[eval + "_accuracy"] = evaluation_.accuracy;
    if (denoising()) {
      s[eval + "_psnr_db"] = psnr(evaluation_.loss);
      s["noisy_" + eval + "_psnr_db"] = data_.noisy_psnr;
    }
    return s;
  }

  // The loss, or with GPIPE_TEST_FAULT=throw:STEP one that throws in that step.
  LossFn loss() const {
    return [this](const torch::Tensor& output, const torch::Tensor& target) {
      if (fault_now_) throw std::runtime_error("injected fault in the loss (GPIPE_TEST_FAULT)");
      return data_.loss(output, target);
    };
  }

  const TrainOptions& o_;
  const Model& model_;
  const Data& data_;
  const Cut& cut_;
  const Fault fault_ = test_fault();
  bool fault_now_ = false;
  Trainer trainer_;
  Engine& engine_;
  const int K_;
  Evaluation evaluation_;
  nlohmann::json epochs_ = nlohmann::json::array();
  StepTrace last_trace_;  // of the last training step, for --trace
};

// The settings every rank of an MPI job must share.
nlohmann::json settings_of(const TrainOptions& o) {
  return {{"--data-dir", o.data_dir},     {"--model", o.model_file},      {"--data", o.data_file},
          {"--loss", o.loss},             {"--stages", o.stages},         {"--balance", o.balance},
          {"--balance-by", o.balance_by}, {"--micro-batches", o.micro_batches}, {"--checkpoint", o.checkpoint},
          {"--batch-norm", o.batch_norm}, {"--augment", o.augment}, {"--schedule", o.schedule},     {"--virtual-stages", o.virtual_stages},
          {"--batch-size", o.batch_size}, {"--drop-last", o.drop_last},   {"--no-shuffle", !o.shuffle},
          {"--epochs", o.epochs},         {"--steps", o.steps},           {"--optimizer", o.optimizer},
          {"--lr", o.lr},                 {"--momentum", o.momentum},     {"--nesterov", o.nesterov},
          {"--weight-decay", o.weight_decay}, {"--betas", o.betas},       {"--lr-schedule", o.lr_schedule},
          {"--warmup-steps", o.warmup_steps}, {"--lr-step-size", o.lr_step_size}, {"--lr-gamma", o.lr_gamma},
          {"--clip-grad-norm", o.clip_grad_norm}, {"--seed", o.seed_text},
          {"--threads-per-stage", o.threads}, {"--train-samples", o.train_samples},
          {"--test-samples", o.test_samples}, {"--save", o.save},         {"--resume", o.resume},
          {"--per-stage-files", o.per_stage_files}, {"--trace", o.trace}, {"--samples", o.samples},
          {"--json", o.json}};
}

int run(TrainOptions o) {
  choose_schedule(o);
  check_same_settings(settings_of(o));
  check_flags(o);
  const Model model = choose_model(o);
  const Data data = load_data(o);
  check_targets(model, data);
  const Cut cut = choose_cut(o, model, data);
  Run run(o, model, data, cut);
  run.resume();
  run.print_header();
  run.train();
  return run.finish();
}

}  // namespace

void add_train_command(CLI::App& app, const std::string&, int& status) {
  auto o = std::make_shared<TrainOptions>();
  CLI::App* sub = app.add_subcommand(
      "train", "Train through a GPipe pipeline: a CNN on Fashion-MNIST by default, or --model/--data from Python");
  sub->add_option("--data-dir", o->data_dir, "folder with the gzipped IDX files of Fashion-MNIST")
      ->capture_default_str();
  sub->add_option("--model", o->model_file,
                  "resnet (a residual network with BatchNorm, cut by --balance-by time), unet (a U-Net that "
                  "denoises the images; reports PSNR), or FILE: a TorchScript nn.Sequential saved in Python "
                  "(torch.jit.script(model).save(FILE)) whose top-level children are the layers cut into stages; "
                  "default: a small CNN");
  sub->add_option("--data", o->data_file,
                  "a dataset saved in Python with torch.save({'input': X, 'target': Y}, FILE), "
                  "instead of Fashion-MNIST (evaluated on itself)");
  sub->add_option("--loss", o->loss, "cross_entropy (integer class targets) or mse (mean reduction)")
      ->check(CLI::IsMember({"cross_entropy", "mse"}))->capture_default_str();
  sub->add_option("--stages", o->stages,
                  "K, the number of devices (with --schedule interleaved each runs V stages); the built-in CNN on "
                  "2 is cut {3, 1, 2, 5} interleaved, or {3, 8}; otherwise evenly; under mpirun -np N, one rank per "
                  "device and N/K pipeline replicas")
      ->check(at_least(1))->capture_default_str();
  sub->add_option("--balance", o->balance, "layers per stage, K x V entries, e.g. --balance 3,8 (overrides the cut)")
      ->delimiter(',')->check(at_least(1));
  sub->add_option("--balance-by", o->balance_by,
                  "cut the --stages stages by per-layer cost on one micro-batch: params (parameter counts), "
                  "time (profiled forward+backward) or memory (activations kept, parameters, gradients, "
                  "optimizer state); the exact min-max cut, printed with its predicted step")
      ->check(CLI::IsMember({"params", "time", "memory"}));
  sub->add_option("--micro-batches", o->micro_batches, "micro-batches M per mini-batch")
      ->check(at_least(1))->capture_default_str();
  sub->add_option("--checkpoint", o->checkpoint,
                  "re-materialization: always, except_last or never (the CNN's activations are small)")
      ->check(CLI::IsMember({"always", "except_last", "never"}))->capture_default_str();
  sub->add_option("--batch-norm", o->batch_norm,
                  "BatchNorm layers in training: deferred (as the paper: each micro-batch normalized by its own "
                  "statistics, the running statistics updated once per step from all its rows) or per-micro-batch "
                  "(updated by each micro-batch, as M small batches would)")
      ->check(CLI::IsMember({"deferred", "per-micro-batch"}))->capture_default_str();
  sub->add_option("--augment", o->augment,
                  "flip: mirror each training image left to right in about half the epochs (chosen per image and "
                  "epoch from --seed, so a resumed run mirrors alike); none; auto: flip for --model resnet, none "
                  "otherwise")
      ->check(CLI::IsMember({"auto", "none", "flip"}))->capture_default_str();
  sub->add_option("--schedule", o->schedule,
                  "the order of forwards and backwards: gpipe (fill-drain), 1f1b, interleaved (V stages per "
                  "device; --micro-batches a multiple of K) or zb1p (zero bubble); auto: interleaved with the cut "
                  "{3, 1, 2, 5} for the built-in CNN on 2 stages (measured fastest), gpipe otherwise; see gpipe "
                  "schedule and docs/schedules.md")
      ->check(CLI::IsMember({"auto", "gpipe", "1f1b", "interleaved", "zb1p"}))->capture_default_str();
  sub->add_option("--virtual-stages", o->virtual_stages,
                  "V, stages per device for --schedule interleaved (default 2): the model is cut into K x V stages, "
                  "stage s on device s mod K")
      ->check(at_least(1));
  sub->add_option("--batch-size", o->batch_size, "samples per mini-batch (one optimizer step)")
      ->check(at_least(1))->capture_default_str();
  sub->add_flag("--drop-last", o->drop_last,
                "leave out each epoch's last batch when it is smaller than --batch-size (kept by default, as "
                "PyTorch's DataLoader keeps it)");
  sub->add_flag("--no-shuffle{false}", o->shuffle, "take the samples in their order every epoch, instead of shuffled");
  sub->add_option("--epochs", o->epochs,
                  "passes over the training set (default: 8 for the CNN, " + std::to_string(kResnetEpochs) +
                      " for resnet, " + std::to_string(kUnetEpochs) + " for unet)")
      ->check(at_least(1));
  sub->add_option("--steps", o->steps, "stop after this many optimizer steps in all, resumed ones included (0: no limit)")
      ->check(at_least(0))->capture_default_str();
  sub->add_option("--optimizer", o->optimizer, "sgd, adam or adamw (torch.optim's)")
      ->check(CLI::IsMember({"sgd", "adam", "adamw"}))->capture_default_str();
  sub->add_option("--lr", o->lr, "learning rate")->check(positive_number())->capture_default_str();
  sub->add_option("--momentum", o->momentum, "SGD's momentum (as torch.optim.SGD: default 0)")
      ->check(non_negative_number())->capture_default_str();
  sub->add_flag("--nesterov", o->nesterov, "SGD with Nesterov momentum (needs --momentum above 0)");
  sub->add_option("--weight-decay", o->weight_decay,
                  "L2 penalty (SGD, Adam) or decoupled weight decay (AdamW); default 0, and 0.01 for adamw, as "
                  "torch.optim")
      ->check(non_negative_number());
  sub->add_option("--betas", o->betas, "Adam's and AdamW's two betas, e.g. --betas 0.9,0.999")
      ->expected(2)->delimiter(',')->check(fraction_below_one());
  sub->add_option("--lr-schedule", o->lr_schedule,
                  "constant (cosine for --model resnet); cosine (from --lr down to 0 over the run); step (times "
                  "--lr-gamma every --lr-step-size steps); after --warmup-steps of linear warm-up")
      ->check(CLI::IsMember({"constant", "cosine", "step"}))->capture_default_str();
  sub->add_option("--warmup-steps", o->warmup_steps, "steps of linear warm-up: step t runs at --lr x (t+1)/W")
      ->check(at_least(0))->capture_default_str();
  sub->add_option("--lr-step-size", o->lr_step_size, "--lr-schedule step: steps between decays (default: one epoch)")
      ->check(at_least(1));
  sub->add_option("--lr-gamma", o->lr_gamma, "--lr-schedule step: the factor of each decay")
      ->check(positive_number())->capture_default_str();
  sub->add_option("--clip-grad-norm", o->clip_grad_norm,
                  "scale the gradient down to this L2 norm when it is larger: the norm of the whole model's "
                  "gradient, over every stage and rank, as torch.nn.utils.clip_grad_norm_ on one device")
      ->check(positive_number());
  sub->add_option("--seed", o->seed_text, "seed of the model, the shuffling and dropout (0 to 2^64-1)")
      ->capture_default_str();
  sub->add_option("--threads-per-stage", o->threads, "intra-op threads of each stage (at most the machine's cores)")
      ->check(at_least(1))->capture_default_str();
  sub->add_option("--train-samples", o->train_samples, "use only the first N training samples (0: all)")
      ->check(at_least(0))->capture_default_str();
  sub->add_option("--test-samples", o->test_samples, "use only the first N Fashion-MNIST test images (0: all)")
      ->check(at_least(0))->capture_default_str();
  sub->add_option("--save", o->save,
                  "write a checkpoint (model, optimizer, step, random states) after every epoch and at the end, "
                  "whole or not at all; with --model it is TorchScript that torch.jit.load reads; under mpirun the "
                  "first rank gathers every stage into this one file");
  sub->add_option("--resume", o->resume,
                  "continue from a checkpoint written by --save, with the same model and optimizer and any "
                  "--stages, schedule or number of ranks");
  sub->add_flag("--per-stage-files", o->per_stage_files,
                "under mpirun, --save and --resume use one file per device (its stages), FILE.stage<j>-of-<K>, "
                "for checkpoints above the 2 GiB one MPI gather carries (resume with the same K)");
  sub->add_option("--trace", o->trace,
                  "write the last training step's timeline: an SVG chart if FILE ends in .svg, otherwise "
                  "Chrome-trace JSON (open it in Perfetto)");
  sub->add_option("--samples", o->samples,
                  "--model unet: write FILE.png, the first 8 test images noisy, denoised and clean, one row each "
                  "(the noise, of standard deviation 0.3 in pixel values, is drawn once from --seed)");
  sub->add_flag("--json", o->json, "print the summary as JSON on standard output (progress stays on standard error)");
  sub->callback([o, sub, &status] {
    o->stages_given = sub->count("--stages") > 0;
    o->loss_given = sub->count("--loss") > 0;
    o->lr_schedule_given = sub->count("--lr-schedule") > 0;
    o->weight_decay_given = sub->count("--weight-decay") > 0;
    o->betas_given = sub->count("--betas") > 0;
    o->step_flags_given = sub->count("--lr-step-size") + sub->count("--lr-gamma") > 0;
    status = run(*o);
  });
}

}  // namespace gpipe::cli
