// train.cc: `gpipe train`: pipelined training of a CNN on Fashion-MNIST, with progress and a summary.
#include "commands.h"
#include "common.h"
#include "fashion_mnist.h"

#include <gpipe/gpipe.h>
#include <torch/torch.h>

#include <CLI/CLI.hpp>

#include <cstdio>
#include <iomanip>
#include <iostream>
#include <sstream>
#include <unistd.h>

namespace gpipe::cli {
namespace {

struct TrainOptions {
  std::string data_dir = kFashionMnistDir;
  int stages = 2;
  bool stages_given = false;  // --stages on the command line, not the default
  std::vector<int> balance;
  int micro_batches = 4;
  std::string checkpoint = "never";
  int64_t batch_size = 128;
  int epochs = 8;
  int64_t steps = 0;
  std::string optimizer = "adam";
  double lr = 1e-3;
  uint64_t seed = 0;
  int threads = 1;
  int64_t train_samples = 0;
  int64_t test_samples = 0;
  std::string trace;
  bool json = false;
};

// Two convolution blocks and a classifier: 11 layers. With one core per stage
// the cut {3, 8} gives the two stages about the same time per micro-batch.
torch::nn::Sequential fashion_cnn() {
  namespace nn = torch::nn;
  return nn::Sequential(nn::Conv2d(nn::Conv2dOptions(1, 32, 3).padding(1)), nn::ReLU(), nn::MaxPool2d(2),
                        nn::Conv2d(nn::Conv2dOptions(32, 64, 3).padding(1)), nn::ReLU(), nn::MaxPool2d(2),
                        nn::Flatten(), nn::Linear(64 * 7 * 7, 256), nn::ReLU(), nn::Dropout(0.3),
                        nn::Linear(256, 10));
}
const std::vector<int> kDefaultBalance{3, 8};

// Progress on standard error: a bar on a terminal, a plain line every tenth of an epoch otherwise.
class Progress {
 public:
  Progress(int epochs, int64_t steps_per_epoch)
      : epochs_(epochs), steps_(steps_per_epoch), tty_(isatty(fileno(stderr)) != 0) {}

  void update(int epoch, int64_t step, double loss, double samples_per_s, double eta_s) {
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
    if (tty_) std::cerr << "\n";
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
};

double accuracy(Pipeline& pipe, const Dataset& test) {
  pipe.model()->eval();
  int64_t correct = 0;
  for (int64_t at = 0; at < test.images.size(0); at += 1000) {
    const int64_t n = std::min<int64_t>(1000, test.images.size(0) - at);
    torch::Tensor predicted = pipe.forward(test.images.narrow(0, at, n)).argmax(1);
    correct += predicted.eq(test.labels.narrow(0, at, n)).sum().item<int64_t>();
  }
  pipe.model()->train();
  return static_cast<double>(correct) / static_cast<double>(test.images.size(0));
}

std::unique_ptr<torch::optim::Optimizer> make_optimizer(const TrainOptions& o,
                                                        const std::vector<torch::Tensor>& params) {
  if (o.optimizer == "sgd")
    return std::make_unique<torch::optim::SGD>(params, torch::optim::SGDOptions(o.lr).momentum(0.9));
  return std::make_unique<torch::optim::Adam>(params, torch::optim::AdamOptions(o.lr));
}

int run(TrainOptions o) {
  // Every flag is checked before any data is read or any work is done.
  torch::manual_seed(o.seed);
  torch::nn::Sequential model = fashion_cnn();
  const int layers = static_cast<int>(model->size());
  if (!o.balance.empty()) {
    try {
      check_balance(o.balance, layers);
    } catch (const std::invalid_argument& e) {
      const std::string what = e.what(), prefix = "gpipe: ";
      usage_error("--balance: " + (what.rfind(prefix, 0) == 0 ? what.substr(prefix.size()) : what));
    }
    if (o.stages_given && o.stages != static_cast<int>(o.balance.size()))
      usage_error("--stages " + std::to_string(o.stages) + " and --balance (" +
                  std::to_string(o.balance.size()) + " stages) disagree; give one of them");
  } else if (o.stages > layers) {
    usage_error("--stages " + std::to_string(o.stages) + " is more than the model's " +
                std::to_string(layers) + " layers; use --stages 1.." + std::to_string(layers));
  }
  if (o.micro_batches > o.batch_size)
    usage_error("--micro-batches " + std::to_string(o.micro_batches) + " is larger than --batch-size " +
                std::to_string(o.batch_size) + "; every micro-batch needs a sample");
  const std::vector<int> balance =
      !o.balance.empty() ? o.balance : (o.stages == 2 ? kDefaultBalance : even_balance(layers, o.stages));

  Dataset train = load_fashion_mnist(o.data_dir, true, o.train_samples);
  Dataset test = load_fashion_mnist(o.data_dir, false, o.test_samples);

  Pipeline pipe(model, PipelineOptions()
                           .balance(balance)
                           .chunks(o.micro_batches)
                           .checkpoint(parse_checkpoint(o.checkpoint))
                           .threads_per_stage(o.threads));
  auto optimizer = make_optimizer(o, pipe.parameters());
  const LossFn loss_fn = cross_entropy_loss;

  const int64_t N = train.images.size(0);
  const int64_t steps_per_epoch = (N + o.batch_size - 1) / o.batch_size;
  const int64_t total_steps = o.steps > 0 ? std::min(o.steps, steps_per_epoch * o.epochs)
                                          : steps_per_epoch * o.epochs;
  if (!o.json)
    std::cout << "gpipe train: Fashion-MNIST, " << N << " training and " << test.images.size(0)
              << " test images; " << pipe.stages() << " stages " << nlohmann::json(balance).dump()
              << ", " << o.micro_batches << " micro-batches of a batch of " << o.batch_size
              << ", checkpoint " << o.checkpoint << ", " << o.optimizer << " lr " << o.lr << "\n";

  Progress progress(o.epochs, steps_per_epoch);
  torch::Generator shuffle_rng = at::detail::createCPUGenerator(o.seed);
  nlohmann::json epochs = nlohmann::json::array();
  StepTrace last_step_trace;  // of the last training step, for --trace
  int64_t step = 0, samples = 0;
  double train_seconds = 0, bubble_sum = 0, first_loss = 0, last_loss = 0, test_accuracy = 0;
  for (int epoch = 1; epoch <= o.epochs && step < total_steps; ++epoch) {
    const torch::Tensor order = torch::randperm(N, shuffle_rng, torch::kLong);
    for (int64_t b = 0; b < steps_per_epoch && step < total_steps; ++b) {
      const int64_t size = std::min(o.batch_size, N - b * o.batch_size);
      if (size < o.micro_batches) continue;  // a last batch too small to split
      const torch::Tensor index = order.narrow(0, b * o.batch_size, size);
      const torch::Tensor x = train.images.index_select(0, index);
      const torch::Tensor y = train.labels.index_select(0, index);
      const int64_t begin = now_ns();
      clear_grads(pipe.parameters());
      last_loss = pipe.train_step(x, y, loss_fn).item<double>();
      if (step == 0) first_loss = last_loss;
      optimizer->step();
      train_seconds += static_cast<double>(now_ns() - begin) * 1e-9;
      bubble_sum += pipe.last_trace().bubble();
      last_step_trace = pipe.last_trace();
      samples += size;
      ++step;
      const double rate = static_cast<double>(samples) / train_seconds;
      progress.update(epoch, b + 1, last_loss, rate,
                      static_cast<double>(total_steps - step) * train_seconds / static_cast<double>(step));
    }
    progress.end_epoch();
    test_accuracy = accuracy(pipe, test);
    epochs.push_back({{"epoch", epoch}, {"loss", last_loss}, {"test_accuracy", test_accuracy}});
    if (!o.json)
      std::cout << "epoch " << epoch << ": loss " << std::fixed << std::setprecision(4) << last_loss
                << ", test accuracy " << std::setprecision(2) << 100 * test_accuracy << "%" << std::endl;
  }

  if (!o.trace.empty() && step > 0) write_chrome_trace(last_step_trace, o.trace);

  nlohmann::json stage_rows = nlohmann::json::array();
  for (int j = 0; j < pipe.stages(); ++j) {
    std::vector<std::string> names;
    for (const auto& m : pipe.stage(j)->children()) names.push_back(m->name());
    stage_rows.push_back({{"stage", j}, {"layers", pipe.balance()[static_cast<size_t>(j)]}, {"modules", names}});
  }
  const nlohmann::json summary = {
      {"test_accuracy", test_accuracy},
      {"first_loss", first_loss},
      {"final_loss", last_loss},
      {"train_seconds", train_seconds},
      {"samples_per_s", train_seconds > 0 ? static_cast<double>(samples) / train_seconds : 0.0},
      {"steps", step},
      {"epochs", epochs},
      {"stages", pipe.stages()},
      {"balance", pipe.balance()},
      {"partition", stage_rows},
      {"micro_batches", o.micro_batches},
      {"checkpoint", o.checkpoint},
      {"batch_size", o.batch_size},
      {"optimizer", o.optimizer},
      {"lr", o.lr},
      {"seed", o.seed},
      {"bubble", step > 0 ? bubble_sum / static_cast<double>(step) : 0.0},
      {"machine", machine()}};
  if (o.json) {
    std::cout << summary.dump(2) << std::endl;
    return 0;
  }
  std::cout << "\nsummary\n"
            << "  test accuracy  " << std::fixed << std::setprecision(2) << 100 * test_accuracy << "%\n"
            << "  training time  " << std::setprecision(1) << train_seconds << " s (" << step
            << " steps)\n"
            << "  throughput     " << std::setprecision(0) << summary["samples_per_s"].get<double>()
            << " samples/s\n"
            << "  bubble         " << std::setprecision(1) << 100 * summary["bubble"].get<double>()
            << "% of stage time idle (measured)\n"
            << "  partition      ";
  for (int j = 0; j < pipe.stages(); ++j)
    std::cout << (j ? " | " : "") << "stage " << j << ": " << pipe.balance()[static_cast<size_t>(j)]
              << " layers";
  std::cout << std::endl;
  return 0;
}

}  // namespace

void add_train_command(CLI::App& app, const std::string&) {
  auto o = std::make_shared<TrainOptions>();
  CLI::App* sub = app.add_subcommand(
      "train", "Train a CNN on Fashion-MNIST through a GPipe pipeline (the default job)");
  sub->add_option("--data-dir", o->data_dir, "folder with the gzipped IDX files of Fashion-MNIST")
      ->capture_default_str();
  sub->add_option("--stages", o->stages, "number of pipeline stages K (default cut: {3, 8} for K=2, even otherwise)")
      ->check(CLI::PositiveNumber)->capture_default_str();
  sub->add_option("--balance", o->balance, "layers per stage, e.g. --balance 3 8 (overrides the default cut)");
  sub->add_option("--micro-batches", o->micro_batches, "micro-batches M per mini-batch")
      ->check(CLI::PositiveNumber)->capture_default_str();
  sub->add_option("--checkpoint", o->checkpoint,
                  "re-materialization: always, except_last or never (this model's activations are small)")
      ->check(CLI::IsMember({"always", "except_last", "never"}))->capture_default_str();
  sub->add_option("--batch-size", o->batch_size, "samples per mini-batch (one optimizer step)")
      ->check(CLI::PositiveNumber)->capture_default_str();
  sub->add_option("--epochs", o->epochs, "passes over the training set")->check(CLI::PositiveNumber)
      ->capture_default_str();
  sub->add_option("--steps", o->steps, "stop after this many optimizer steps (0: no limit)")
      ->check(CLI::NonNegativeNumber)->capture_default_str();
  sub->add_option("--optimizer", o->optimizer, "sgd (momentum 0.9) or adam")
      ->check(CLI::IsMember({"sgd", "adam"}))->capture_default_str();
  const CLI::Validator positive(
      [](std::string& text) {
        double value = 0;
        if (!CLI::detail::lexical_cast(text, value) || !(value > 0))
          return "must be a positive number (got " + text + ")";
        return std::string();
      },
      "POSITIVE");
  sub->add_option("--lr", o->lr, "learning rate")->check(positive)->capture_default_str();
  sub->add_option("--seed", o->seed, "seed of the model, the shuffling and dropout")->capture_default_str();
  sub->add_option("--threads-per-stage", o->threads, "intra-op threads of each stage")
      ->check(CLI::PositiveNumber)->capture_default_str();
  sub->add_option("--train-samples", o->train_samples, "use only the first N training images (0: all)")
      ->check(CLI::NonNegativeNumber)->capture_default_str();
  sub->add_option("--test-samples", o->test_samples, "use only the first N test images (0: all)")
      ->check(CLI::NonNegativeNumber)->capture_default_str();
  sub->add_option("--trace", o->trace,
                  "write the last training step's timeline as Chrome-trace JSON (open it in Perfetto)");
  sub->add_flag("--json", o->json, "print the summary as JSON on standard output (progress stays on standard error)");
  sub->callback([o, sub] {
    o->stages_given = sub->count("--stages") > 0;
    std::exit(run(*o));
  });
}

}  // namespace gpipe::cli
