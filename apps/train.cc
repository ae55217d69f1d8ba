// train.cc: `gpipe train`: pipelined training (a CNN on Fashion-MNIST by default, or a model and data
// saved from Python), with progress, evaluation, a summary, checkpoints and a timeline.
#include "checkpoint.h"
#include "commands.h"
#include "common.h"
#include "fashion_mnist.h"
#include "sources.h"

#include <gpipe/gpipe.h>
#include <torch/torch.h>

#include <CLI/CLI.hpp>

#include <cstdio>
#include <filesystem>
#include <iomanip>
#include <iostream>
#include <sstream>
#include <unistd.h>

namespace gpipe::cli {
namespace {

struct TrainOptions {
  std::string data_dir = kFashionMnistDir;
  std::string model_file;
  std::string data_file;
  std::string loss = "cross_entropy";
  int stages = 2;
  bool stages_given = false;  // --stages on the command line, not the default
  std::vector<int> balance;
  std::string balance_by;
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
  std::string save;
  std::string resume;
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
const std::vector<int> kFashionBalance{3, 8};

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

struct Data {
  torch::Tensor input;
  torch::Tensor target;
  std::string name;  // "test" or "training"
};

// Mean loss and (for classification) accuracy on `data`, with pipelined inference.
std::pair<double, double> evaluate(Pipeline& pipe, const Data& data, const LossFn& loss, bool classification) {
  pipe.model()->eval();
  double loss_sum = 0;
  int64_t correct = 0;
  const int64_t N = data.input.size(0);
  for (int64_t at = 0; at < N; at += 1000) {
    const int64_t n = std::min<int64_t>(1000, N - at);
    const torch::Tensor out = pipe.forward(data.input.narrow(0, at, n));
    const torch::Tensor target = data.target.narrow(0, at, n);
    loss_sum += loss(out, target).item<double>() * static_cast<double>(n);
    if (classification) correct += out.argmax(-1).eq(target).sum().item<int64_t>();
  }
  pipe.model()->train();
  return {loss_sum / static_cast<double>(N), static_cast<double>(correct) / static_cast<double>(N)};
}

std::unique_ptr<torch::optim::Optimizer> make_optimizer(const TrainOptions& o,
                                                        const std::vector<torch::Tensor>& params) {
  if (o.optimizer == "sgd")
    return std::make_unique<torch::optim::SGD>(params, torch::optim::SGDOptions(o.lr).momentum(0.9));
  return std::make_unique<torch::optim::Adam>(params, torch::optim::AdamOptions(o.lr));
}

torch::Tensor generator_state(const at::Generator& generator) {
  at::Generator g = generator;
  return g.get_state();
}

// A fingerprint of the parameters for comparing runs: a weighted sum, exact for equal parameters.
double parameter_checksum(const torch::nn::Sequential& model) {
  double sum = 0;
  for (const auto& p : model->parameters()) {
    const torch::Tensor flat = p.detach().to(torch::kDouble).flatten();
    sum += (flat * (torch::arange(flat.numel(), torch::kDouble).remainder(7) + 1)).sum().item<double>();
  }
  return sum;
}

template <typename Fn>
auto or_usage_error(const std::string& flag, Fn&& fn) {
  try {
    return fn();
  } catch (const std::exception& e) {
    const std::string what = e.what(), prefix = "gpipe: ";
    usage_error(flag + ": " + (what.rfind(prefix, 0) == 0 ? what.substr(prefix.size()) : what));
  }
}

int run(TrainOptions o) {
  // Every flag and file is checked before any training.
  if (o.micro_batches > o.batch_size)
    usage_error("--micro-batches " + std::to_string(o.micro_batches) + " is larger than --batch-size " +
                std::to_string(o.batch_size) + "; every micro-batch needs a sample");
  if (o.data_file.empty() && o.loss != "cross_entropy")
    usage_error("--loss " + o.loss + " needs --data with real-valued targets; Fashion-MNIST has class labels");
  if (!o.resume.empty() && !std::filesystem::is_regular_file(o.resume))
    usage_error("--resume: no such file: " + o.resume);
  if (!o.save.empty()) {
    const auto dir = std::filesystem::absolute(o.save).parent_path();
    if (!std::filesystem::is_directory(dir)) usage_error("--save: no such folder: " + dir.string());
  }

  torch::manual_seed(o.seed);
  ModelSource model;
  if (!o.model_file.empty())
    model = or_usage_error("--model", [&] { return load_script_model(o.model_file); });
  else
    model.layers = fashion_cnn();
  const int layers = static_cast<int>(model.layers->size());
  if (!o.balance.empty() && !o.balance_by.empty())
    usage_error("--balance and --balance-by " + o.balance_by + " both choose the cut; give one of them");
  if (!o.balance.empty()) {
    or_usage_error("--balance", [&] { check_balance(o.balance, layers); return 0; });
    if (o.stages_given && o.stages != static_cast<int>(o.balance.size()))
      usage_error("--stages " + std::to_string(o.stages) + " and --balance (" +
                  std::to_string(o.balance.size()) + " stages) disagree; give one of them");
  } else if (o.stages > layers) {
    usage_error("--stages " + std::to_string(o.stages) + " is more than the model's " +
                std::to_string(layers) + " layers; use --stages 1.." + std::to_string(layers));
  }
  std::vector<int> balance = !o.balance.empty() ? o.balance
                             : (o.model_file.empty() && o.stages == 2) ? kFashionBalance
                                                                        : even_balance(layers, o.stages);

  Data train, eval;
  if (!o.data_file.empty()) {
    std::tie(train.input, train.target) = or_usage_error("--data", [&] { return load_tensor_data(o.data_file); });
    if (o.train_samples > 0 && o.train_samples < train.input.size(0)) {
      train.input = train.input.narrow(0, 0, o.train_samples);
      train.target = train.target.narrow(0, 0, o.train_samples);
    }
    train.name = "training";
    eval = train;
  } else {
    const Dataset fashion = load_fashion_mnist(o.data_dir, true, o.train_samples);
    const Dataset test = load_fashion_mnist(o.data_dir, false, o.test_samples);
    train = {fashion.images, fashion.labels, "training"};
    eval = {test.images, test.labels, "test"};
  }
  const bool classification = o.loss == "cross_entropy";
  if (classification && train.target.is_floating_point())
    usage_error("--loss cross_entropy needs integer class targets, but the targets are " +
                std::string(c10::toString(train.target.scalar_type())) + "; use --loss mse");
  const LossFn loss_fn = classification ? LossFn(cross_entropy_loss) : LossFn(mse_loss);

  const int64_t N = train.input.size(0);
  if (o.micro_batches > N)
    usage_error("--micro-batches " + std::to_string(o.micro_batches) + " is larger than the " +
                std::to_string(N) + " training samples");

  // --balance-by: per-layer costs on one micro-batch, then the exact min-max cut.
  nlohmann::json plan_json;
  if (!o.balance_by.empty()) {
    const int64_t micro_batch = chunk_sizes(std::min(o.batch_size, N), o.micro_batches).front();
    const torch::Tensor sample = train.input.narrow(0, 0, micro_batch);
    const std::vector<double> costs =
        o.balance_by == "params" ? parameter_costs(model.layers)
        : o.balance_by == "time" ? time_costs(model.layers, sample, o.threads)
                                 : memory_costs(model.layers, sample, o.optimizer == "adam" ? 3.0 : 2.0);
    balance = balance_by_cost(costs, o.stages);
    const PartitionPlan plan = plan_partition(costs, balance, o.micro_batches);
    const std::string unit = o.balance_by == "params" ? "parameters" : o.balance_by == "time" ? "s" : "bytes";
    if (!o.json) std::cout << "balance by " << o.balance_by << ":\n" << format_plan(plan, unit);
    plan_json = {{"balance_by", o.balance_by},  {"unit", unit},
                 {"stage_costs", plan.stage_costs}, {"bottleneck_stage", plan.bottleneck_stage},
                 {"predicted_step", plan.predicted_step}, {"predicted_efficiency", plan.predicted_efficiency}};
  }
  Pipeline pipe(model.layers, PipelineOptions()
                                  .balance(balance)
                                  .chunks(o.micro_batches)
                                  .checkpoint(parse_checkpoint(o.checkpoint))
                                  .threads_per_stage(o.threads));
  auto optimizer = make_optimizer(o, pipe.parameters());
  torch::Generator shuffle_rng = at::detail::createCPUGenerator(o.seed);

  TrainState state;
  if (!o.resume.empty()) {
    state = or_usage_error("--resume", [&] { return load_checkpoint(o.resume, model, *optimizer, o.optimizer); });
    shuffle_rng.set_state(state.shuffle_state);
    at::Generator random = at::globalContext().defaultGenerator(torch::kCPU);
    random.set_state(state.random_state);
  }

  // A last batch too small to split into M micro-batches is left out of every epoch.
  const int64_t steps_per_epoch = N / o.batch_size + (N % o.batch_size >= o.micro_batches ? 1 : 0);
  const int64_t total_steps = o.steps > 0 ? std::min(o.steps, steps_per_epoch * o.epochs)
                                          : steps_per_epoch * o.epochs;
  if (!o.json)
    std::cout << "gpipe train: " << (o.model_file.empty() ? "CNN" : o.model_file) << " on "
              << (o.data_file.empty() ? "Fashion-MNIST" : o.data_file) << ", " << N << " training samples; "
              << pipe.stages() << " stages " << nlohmann::json(balance).dump() << ", " << o.micro_batches
              << " micro-batches of a batch of " << o.batch_size << ", checkpoint " << o.checkpoint << ", "
              << o.optimizer << " lr " << o.lr
              << (o.resume.empty() ? "" : ", resumed at step " + std::to_string(state.step)) << "\n";

  Progress progress(o.epochs, steps_per_epoch);
  nlohmann::json epochs = nlohmann::json::array();
  StepTrace last_step_trace;  // of the last training step, for --trace
  const int64_t start_step = state.step;
  int64_t step = start_step, samples = 0, saved_at = -1;
  double train_seconds = 0, bubble_sum = 0, first_loss = 0, last_loss = 0;
  std::pair<double, double> evaluation{0, 0};
  torch::Tensor epoch_start_shuffle_state = generator_state(shuffle_rng);
  auto save = [&] {
    if (o.save.empty() || saved_at == step) return;
    // The shuffling state from which the epoch of the next step is drawn.
    const TrainState now{step, step % steps_per_epoch == 0 ? generator_state(shuffle_rng) : epoch_start_shuffle_state,
                         generator_state(at::globalContext().defaultGenerator(torch::kCPU))};
    save_checkpoint(o.save, model, *optimizer, o.optimizer, now);
    saved_at = step;
  };
  auto report = [&](int epoch) {
    evaluation = evaluate(pipe, eval, loss_fn, classification);
    epochs.push_back({{"epoch", epoch}, {"step", step}, {"loss", last_loss}, {eval.name + "_loss", evaluation.first}});
    if (classification) epochs.back()[eval.name + "_accuracy"] = evaluation.second;
    if (!o.json) {
      std::cout << "epoch " << epoch << ": loss " << std::fixed << std::setprecision(4) << last_loss;
      if (classification)
        std::cout << ", " << eval.name << " accuracy " << std::setprecision(2) << 100 * evaluation.second << "%";
      else
        std::cout << ", " << eval.name << " loss " << evaluation.first;
      std::cout << std::endl;
    }
  };

  for (int epoch = static_cast<int>(step / steps_per_epoch) + 1; step < total_steps; ++epoch) {
    epoch_start_shuffle_state = generator_state(shuffle_rng);
    const torch::Tensor order = torch::randperm(N, shuffle_rng, torch::kLong);
    for (int64_t b = step % steps_per_epoch; b < steps_per_epoch && step < total_steps; ++b) {
      const int64_t size = std::min(o.batch_size, N - b * o.batch_size);
      const torch::Tensor index = order.narrow(0, b * o.batch_size, size);
      const torch::Tensor x = train.input.index_select(0, index);
      const torch::Tensor y = train.target.index_select(0, index);
      const int64_t begin = now_ns();
      clear_grads(pipe.parameters());
      last_loss = pipe.train_step(x, y, loss_fn).item<double>();
      optimizer->step();
      train_seconds += static_cast<double>(now_ns() - begin) * 1e-9;
      if (samples == 0) first_loss = last_loss;
      bubble_sum += pipe.last_trace().bubble();
      last_step_trace = pipe.last_trace();
      samples += size;
      ++step;
      const int64_t done = step - start_step;
      progress.update(epoch, b + 1, last_loss, static_cast<double>(samples) / train_seconds,
                      static_cast<double>(total_steps - step) * train_seconds / static_cast<double>(done));
    }
    progress.end_epoch();
    report(epoch);
    save();
  }
  if (!o.trace.empty() && samples > 0) write_trace(last_step_trace, o.trace);
  save();

  const int64_t run_steps = step - start_step;
  nlohmann::json stage_rows = nlohmann::json::array();
  for (int j = 0; j < pipe.stages(); ++j) {
    std::vector<std::string> names;
    for (const auto& m : pipe.stage(j)->children()) names.push_back(m->name());
    stage_rows.push_back({{"stage", j}, {"layers", pipe.balance()[static_cast<size_t>(j)]}, {"modules", names}});
  }
  nlohmann::json summary = {
      {"evaluated_on", eval.name},
      {eval.name + "_loss", evaluation.first},
      {"first_loss", first_loss},
      {"final_loss", last_loss},
      {"train_seconds", train_seconds},
      {"samples_per_s", train_seconds > 0 ? static_cast<double>(samples) / train_seconds : 0.0},
      {"steps", step},
      {"steps_this_run", run_steps},
      {"epochs", epochs},
      {"stages", pipe.stages()},
      {"balance", pipe.balance()},
      {"partition", stage_rows},
      {"plan", plan_json},
      {"micro_batches", o.micro_batches},
      {"checkpoint", o.checkpoint},
      {"batch_size", o.batch_size},
      {"optimizer", o.optimizer},
      {"lr", o.lr},
      {"seed", o.seed},
      {"bubble", run_steps > 0 ? bubble_sum / static_cast<double>(run_steps) : 0.0},
      {"parameter_checksum", parameter_checksum(model.layers)},
      {"machine", machine()}};
  if (classification) summary[eval.name + "_accuracy"] = evaluation.second;
  if (o.json) {
    std::cout << summary.dump(2) << std::endl;
    return 0;
  }
  std::cout << "\nsummary\n";
  if (classification)
    std::cout << "  " << eval.name << " accuracy  " << std::fixed << std::setprecision(2)
              << 100 * evaluation.second << "%\n";
  else
    std::cout << "  " << eval.name << " loss  " << std::fixed << std::setprecision(6) << evaluation.first << "\n";
  std::cout << "  training time  " << std::fixed << std::setprecision(1) << train_seconds << " s (" << run_steps
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
  if (!o.save.empty()) std::cout << "  saved to       " << o.save << std::endl;
  return 0;
}

}  // namespace

void add_train_command(CLI::App& app, const std::string&) {
  auto o = std::make_shared<TrainOptions>();
  CLI::App* sub = app.add_subcommand(
      "train", "Train through a GPipe pipeline: a CNN on Fashion-MNIST by default, or --model/--data from Python");
  sub->add_option("--data-dir", o->data_dir, "folder with the gzipped IDX files of Fashion-MNIST")
      ->capture_default_str();
  sub->add_option("--model", o->model_file,
                  "a TorchScript nn.Sequential saved in Python (torch.jit.script(model).save(FILE)); "
                  "its top-level children are the layers that are cut into stages");
  sub->add_option("--data", o->data_file,
                  "a dataset saved in Python with torch.save({'input': X, 'target': Y}, FILE), "
                  "instead of Fashion-MNIST (evaluated on itself)");
  sub->add_option("--loss", o->loss, "cross_entropy (integer class targets) or mse (mean reduction)")
      ->check(CLI::IsMember({"cross_entropy", "mse"}))->capture_default_str();
  sub->add_option("--stages", o->stages,
                  "number of pipeline stages K (the built-in CNN is cut {3, 8} for K=2; otherwise evenly)")
      ->check(CLI::PositiveNumber)->capture_default_str();
  sub->add_option("--balance", o->balance, "layers per stage, e.g. --balance 3 8 (overrides the cut)");
  sub->add_option("--balance-by", o->balance_by,
                  "cut the --stages stages by per-layer cost on one micro-batch: params (parameter counts), "
                  "time (profiled forward+backward) or memory (activations kept, parameters, gradients, "
                  "optimizer state); the exact min-max cut, printed with its predicted step")
      ->check(CLI::IsMember({"params", "time", "memory"}));
  sub->add_option("--micro-batches", o->micro_batches, "micro-batches M per mini-batch")
      ->check(CLI::PositiveNumber)->capture_default_str();
  sub->add_option("--checkpoint", o->checkpoint,
                  "re-materialization: always, except_last or never (the CNN's activations are small)")
      ->check(CLI::IsMember({"always", "except_last", "never"}))->capture_default_str();
  sub->add_option("--batch-size", o->batch_size, "samples per mini-batch (one optimizer step)")
      ->check(CLI::PositiveNumber)->capture_default_str();
  sub->add_option("--epochs", o->epochs, "passes over the training set")->check(CLI::PositiveNumber)
      ->capture_default_str();
  sub->add_option("--steps", o->steps, "stop after this many optimizer steps in all, resumed ones included (0: no limit)")
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
  sub->add_option("--train-samples", o->train_samples, "use only the first N training samples (0: all)")
      ->check(CLI::NonNegativeNumber)->capture_default_str();
  sub->add_option("--test-samples", o->test_samples, "use only the first N Fashion-MNIST test images (0: all)")
      ->check(CLI::NonNegativeNumber)->capture_default_str();
  sub->add_option("--save", o->save,
                  "write a checkpoint (model, optimizer, step, random states) after every epoch and at the end, "
                  "whole or not at all; with --model it is TorchScript that torch.jit.load reads");
  sub->add_option("--resume", o->resume, "continue from a checkpoint written by --save (same model and optimizer)");
  sub->add_option("--trace", o->trace,
                  "write the last training step's timeline: an SVG chart if FILE ends in .svg, otherwise "
                  "Chrome-trace JSON (open it in Perfetto)");
  sub->add_flag("--json", o->json, "print the summary as JSON on standard output (progress stays on standard error)");
  sub->callback([o, sub] {
    o->stages_given = sub->count("--stages") > 0;
    std::exit(run(*o));
  });
}

}  // namespace gpipe::cli
