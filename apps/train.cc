// train.cc: `gpipe train`: pipelined training (a CNN on Fashion-MNIST by default, or a model and data
// saved from Python), with progress, evaluation, a summary, checkpoints and a timeline.
#include "checkpoint.h"
#include "commands.h"
#include "common.h"
#include "fashion_mnist.h"
#include "sources.h"
#include "world.h"

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
  std::string schedule = "gpipe";
  int virtual_stages = 1;
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
// An MPI rank keeps only its stage's layers; every layer draws the same random
// numbers either way.
torch::nn::Sequential fashion_cnn(LayerRange keep = {}) {
  namespace nn = torch::nn;
  nn::Sequential model;
  int n = 0;
  auto add = [&](auto layer) { add_layer(model, nn::AnyModule(layer), n++, keep); };  // built, then kept or dropped
  add(nn::Conv2d(nn::Conv2dOptions(1, 32, 3).padding(1)));
  add(nn::ReLU());
  add(nn::MaxPool2d(2));
  add(nn::Conv2d(nn::Conv2dOptions(32, 64, 3).padding(1)));
  add(nn::ReLU());
  add(nn::MaxPool2d(2));
  add(nn::Flatten());
  add(nn::Linear(64 * 7 * 7, 256));
  add(nn::ReLU());
  add(nn::Dropout(0.3));
  add(nn::Linear(256, 10));
  return model;
}
constexpr int kFashionLayers = 11;
const std::vector<int> kFashionBalance{3, 8};

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

struct Data {
  torch::Tensor input;
  torch::Tensor target;
  std::string name;  // "test" or "training"
};

// A fingerprint of the parameters for comparing runs: a weighted sum, exact for equal parameters.
// Each parameter's weights restart at its first element, so the sum over stages is the whole model's.
double parameter_checksum(const std::vector<torch::Tensor>& params) {
  double sum = 0;
  for (const auto& p : params) {
    const torch::Tensor flat = p.detach().to(torch::kDouble).flatten();
    sum += (flat * (torch::arange(flat.numel(), torch::kDouble).remainder(7) + 1)).sum().item<double>();
  }
  return sum;
}

// What the training loop asks of the pipeline: every stage in this process, or
// this rank's stage of an MPI job (where every call is collective).
class Engine {
 public:
  virtual ~Engine() = default;
  virtual torch::Tensor train_step(const torch::Tensor& x, const torch::Tensor& y, const LossFn& loss) = 0;
  /// Mean loss and (for classification) accuracy on `data`, with pipelined inference.
  virtual std::pair<double, double> evaluate(const Data& data, const LossFn& loss, bool classification) = 0;
  /// What this process's optimizer steps.
  virtual std::vector<torch::Tensor> parameters() const = 0;
  /// The measured bubble and the timeline of the last step (the timeline on the printing rank).
  virtual double bubble() = 0;
  virtual StepTrace trace() = 0;
  /// parameter_checksum of the whole model.
  virtual double checksum() = 0;
  /// Whether every rank has the same `value`.
  virtual bool same_on_all_ranks(double value) = 0;
  /// Module names per stage, where this process knows them.
  virtual std::vector<std::vector<std::string>> modules() const = 0;
};

template <typename Forward>
std::pair<double, double> evaluate_share(Forward forward, const torch::Tensor& input, const torch::Tensor& target,
                                         const LossFn& loss, bool classification) {
  double loss_sum = 0, correct = 0;
  const int64_t N = input.size(0);
  for (int64_t at = 0; at < N; at += 1000) {
    const int64_t n = std::min<int64_t>(1000, N - at);
    const auto [out, rows] = forward(input.narrow(0, at, n), target.narrow(0, at, n));
    if (!out.defined()) continue;  // not the last stage
    loss_sum += loss(out, rows).template item<double>() * static_cast<double>(out.size(0));
    if (classification) correct += static_cast<double>(out.argmax(-1).eq(rows).sum().template item<int64_t>());
  }
  return {loss_sum, correct};
}

class LocalEngine : public Engine {
 public:
  LocalEngine(torch::nn::Sequential model, const PipelineOptions& options) : pipe_(std::move(model), options) {}
  torch::Tensor train_step(const torch::Tensor& x, const torch::Tensor& y, const LossFn& loss) override {
    return pipe_.train_step(x, y, loss);
  }
  std::pair<double, double> evaluate(const Data& data, const LossFn& loss, bool classification) override {
    pipe_.model()->eval();
    const auto [loss_sum, correct] = evaluate_share(
        [&](const torch::Tensor& x, const torch::Tensor& y) { return std::make_pair(pipe_.forward(x), y); },
        data.input, data.target, loss, classification);
    pipe_.model()->train();
    const double N = static_cast<double>(data.input.size(0));
    return {loss_sum / N, correct / N};
  }
  std::vector<torch::Tensor> parameters() const override { return pipe_.parameters(); }
  double bubble() override { return pipe_.last_trace().bubble(); }
  StepTrace trace() override { return pipe_.last_trace(); }
  double checksum() override { return parameter_checksum(pipe_.parameters()); }
  bool same_on_all_ranks(double) override { return true; }
  std::vector<std::vector<std::string>> modules() const override {
    std::vector<std::vector<std::string>> out;
    for (int j = 0; j < pipe_.stages(); ++j) {
      out.emplace_back();
      for (const auto& m : pipe_.stage(j)->children()) out.back().push_back(m->name());
    }
    return out;
  }

 private:
  Pipeline pipe_;
};

#if defined(GPIPE_HAS_MPI) && GPIPE_HAS_MPI
class MpiEngine : public Engine {
 public:
  MpiEngine(torch::nn::Sequential layers, const mpi::MpiPipelineOptions& options) : pipe_(std::move(layers), options) {}
  torch::Tensor train_step(const torch::Tensor& x, const torch::Tensor& y, const LossFn& loss) override {
    return pipe_.train_step(x, y, loss);
  }
  std::pair<double, double> evaluate(const Data& data, const LossFn& loss, bool classification) override {
    pipe_.layers()->eval();
    // Each replica's last stage scores its share of every chunk; the sums add up over the ranks.
    const auto [loss_sum, correct] = evaluate_share(
        [&](const torch::Tensor& x, const torch::Tensor& y) {
          const auto [begin, count] = pipe_.share(x.size(0));
          return std::make_pair(pipe_.forward(x), y.narrow(0, begin, count));
        },
        data.input, data.target, loss, classification);
    pipe_.layers()->train();
    const double N = static_cast<double>(data.input.size(0));
    return {pipe_.sum(loss_sum) / N, pipe_.sum(correct) / N};
  }
  std::vector<torch::Tensor> parameters() const override { return pipe_.parameters(); }
  double bubble() override { return pipe_.bubble(); }
  StepTrace trace() override { return pipe_.gather_trace(); }
  double checksum() override {
    return pipe_.sum(pipe_.placement().replica == 0 ? parameter_checksum(pipe_.parameters()) : 0.0);
  }
  bool same_on_all_ranks(double value) override { return pipe_.max(value) == -pipe_.max(-value); }
  std::vector<std::vector<std::string>> modules() const override { return {}; }

 private:
  mpi::MpiPipeline pipe_;
};
#endif

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

template <typename Fn>
auto or_usage_error(const std::string& flag, Fn&& fn) {
  try {
    return fn();
  } catch (const std::exception& e) {
    const std::string what = e.what(), prefix = "gpipe: ";
    usage_error(flag + ": " + (what.rfind(prefix, 0) == 0 ? what.substr(prefix.size()) : what));
  }
}

// The settings every rank of an MPI job must share.
nlohmann::json settings_of(const TrainOptions& o) {
  return {{"--data-dir", o.data_dir},     {"--model", o.model_file},      {"--data", o.data_file},
          {"--loss", o.loss},             {"--stages", o.stages},         {"--balance", o.balance},
          {"--balance-by", o.balance_by}, {"--micro-batches", o.micro_batches}, {"--checkpoint", o.checkpoint},
          {"--schedule", o.schedule}, {"--virtual-stages", o.virtual_stages},
          {"--batch-size", o.batch_size}, {"--epochs", o.epochs},         {"--steps", o.steps},
          {"--optimizer", o.optimizer},   {"--lr", o.lr},                 {"--seed", o.seed},
          {"--threads-per-stage", o.threads}, {"--train-samples", o.train_samples},
          {"--test-samples", o.test_samples}, {"--save", o.save},         {"--resume", o.resume},
          {"--trace", o.trace},           {"--json", o.json}};
}

// Under MPI each stage has its own checkpoint file: PATH.stage<j>-of-<K>.
std::string stage_file(const std::string& path, int stage, int stages) {
  if (!world().mpi) return path;
  return path + ".stage" + std::to_string(stage) + "-of-" + std::to_string(stages);
}

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

int run(TrainOptions o) {
  const World& w = world();
  if (w.mpi) {
    check_same_settings(settings_of(o));
    if (!o.balance_by.empty())
      usage_error("--balance-by profiles the whole model in one process; run it once without mpirun and pass "
                  "the cut it prints with --balance");
  }
  const bool printing = w.prints() && !o.json;
  // Every flag and file is checked before any training.
  if (o.micro_batches > o.batch_size)
    usage_error("--micro-batches " + std::to_string(o.micro_batches) + " is larger than --batch-size " +
                std::to_string(o.batch_size) + "; every micro-batch needs a sample");
  if (o.data_file.empty() && o.loss != "cross_entropy")
    usage_error("--loss " + o.loss + " needs --data with real-valued targets; Fashion-MNIST has class labels");
  if (!o.save.empty()) {
    const auto dir = std::filesystem::absolute(o.save).parent_path();
    if (!std::filesystem::is_directory(dir)) usage_error("--save: no such folder: " + dir.string());
  }

  torch::manual_seed(o.seed);
  ModelSource model;  // the whole model; under MPI with the built-in CNN, not built
  if (!o.model_file.empty())
    model = or_usage_error("--model", [&] { return load_script_model(o.model_file); });
  else if (!w.mpi)
    model.layers = fashion_cnn();
  const int layers = o.model_file.empty() ? kFashionLayers : static_cast<int>(model.layers->size());
  if (!o.balance.empty() && !o.balance_by.empty())
    usage_error("--balance and --balance-by " + o.balance_by + " both choose the cut; give one of them");
  const int V = o.virtual_stages;
  if (V > 1 && o.schedule != "interleaved")
    usage_error("--virtual-stages " + std::to_string(V) + " needs --schedule interleaved; the " + o.schedule +
                " schedule runs one stage per device");
  if (V > 1 && w.mpi)
    usage_error("--virtual-stages under mpirun: gpipe train runs one stage per rank; use it in one process");
  if (V > 1 && (!o.balance.empty() || !o.balance_by.empty()))
    usage_error("--virtual-stages cuts the model evenly into --stages x V stages; leave out --balance and --balance-by");
  if (V > 1 && o.stages * V > layers)
    usage_error("--stages " + std::to_string(o.stages) + " x --virtual-stages " + std::to_string(V) +
                " is more than the model's " + std::to_string(layers) + " layers");
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
                             : (o.model_file.empty() && o.stages == 2 && V == 1) ? kFashionBalance
                                                                                  : even_balance(layers, o.stages * V);
  const int K = static_cast<int>(balance.size());
  int stage = 0, replica = 0;  // this rank's, under MPI
#if defined(GPIPE_HAS_MPI) && GPIPE_HAS_MPI
  if (w.mpi) {
    const mpi::Placement place = or_usage_error("--stages", [&] { return mpi::place(w.rank, w.size, K); });
    stage = place.stage;
    replica = place.replica;
  }
#endif
  if (!o.resume.empty())
    for (int j = 0; j < (w.mpi ? K : 1); ++j)
      if (!std::filesystem::is_regular_file(stage_file(o.resume, j, K)))
        usage_error("--resume: no such file: " + stage_file(o.resume, j, K) +
                    (w.mpi ? " (each stage has its own file; resume with the K of the run that saved)" : ""));

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
  // What --save and --resume hold: the whole model, or under MPI this rank's stage.
  ModelSource saved = model;
  std::unique_ptr<Engine> engine;
  if (w.mpi) {
#if defined(GPIPE_HAS_MPI) && GPIPE_HAS_MPI
    const auto [first, last] = mpi::stage_layers(balance, stage);
    torch::nn::Sequential mine;
    if (o.model_file.empty()) {
      torch::manual_seed(o.seed);  // as in one process: the same numbers for every layer
      mine = fashion_cnn({first, last});
    } else {
      const auto names = model.layers->named_children().keys();
      for (int n = first; n < last; ++n)
        mine->push_back(names[static_cast<size_t>(n)], *(model.layers->begin() + n));
    }
    saved = ModelSource{mine, std::nullopt};
    engine = std::make_unique<MpiEngine>(mine, mpi::MpiPipelineOptions()
                                                   .balance(balance)
                                                   .chunks(o.micro_batches)
                                                   .checkpoint(parse_checkpoint(o.checkpoint))
                                                   .schedule(parse_schedule(o.schedule))
                                                   .device(Device::cpu(o.threads)));
#endif
  } else {
    engine = std::make_unique<LocalEngine>(model.layers, PipelineOptions()
                                                             .balance(balance)
                                                             .chunks(o.micro_batches)
                                                             .checkpoint(parse_checkpoint(o.checkpoint))
                                                             .schedule(parse_schedule(o.schedule))
                                                             .virtual_stages(o.virtual_stages)
                                                             .threads_per_stage(o.threads));
  }
  auto optimizer = make_optimizer(o, engine->parameters());
  torch::Generator shuffle_rng = at::detail::createCPUGenerator(o.seed);

  TrainState state;
  if (!o.resume.empty()) {
    state = or_usage_error("--resume", [&] {
      return load_checkpoint(stage_file(o.resume, stage, K), saved, *optimizer, o.optimizer);
    });
    shuffle_rng.set_state(state.shuffle_state);
    at::Generator random = at::globalContext().defaultGenerator(torch::kCPU);
    random.set_state(state.random_state);
    if (!engine->same_on_all_ranks(static_cast<double>(state.step)))
      usage_error("--resume: the stage files of " + o.resume + " are from different steps (this rank's, " +
                  stage_file(o.resume, stage, K) + ", from step " + std::to_string(state.step) +
                  "); a run stopped while saving: resume from another checkpoint");
  }

  // A last batch too small to split into M micro-batches is left out of every epoch.
  const int64_t steps_per_epoch = N / o.batch_size + (N % o.batch_size >= o.micro_batches ? 1 : 0);
  const int64_t total_steps = o.steps > 0 ? std::min(o.steps, steps_per_epoch * o.epochs)
                                          : steps_per_epoch * o.epochs;
  if (printing)
    std::cout << "gpipe train: " << (o.model_file.empty() ? "CNN" : o.model_file) << " on "
              << (o.data_file.empty() ? "Fashion-MNIST" : o.data_file) << ", " << N << " training samples; "
              << K << " stages " << nlohmann::json(balance).dump() << ", " << o.micro_batches
              << " micro-batches of a batch of " << o.batch_size << ", schedule " << o.schedule << ", checkpoint "
              << o.checkpoint << ", "
              << o.optimizer << " lr " << o.lr
              << (w.mpi ? ", MPI: " + std::to_string(w.size) + " ranks = " + std::to_string(K) + " stages x " +
                              std::to_string(w.size / K) + " replicas"
                        : "")
              << (o.resume.empty() ? "" : ", resumed at step " + std::to_string(state.step)) << "\n";

  Progress progress(o.epochs, steps_per_epoch, w.prints());
  const Fault fault = test_fault();
  const LossFn faulty_loss = [](const torch::Tensor&, const torch::Tensor&) -> torch::Tensor {
    throw std::runtime_error("injected fault in the loss (GPIPE_TEST_FAULT)");
  };
  nlohmann::json epochs = nlohmann::json::array();
  StepTrace last_step_trace;  // of the last training step, for --trace
  const int64_t start_step = state.step;
  int64_t step = start_step, samples = 0, saved_at = -1;
  double train_seconds = 0, bubble_sum = 0, first_loss = 0, last_loss = 0;
  std::pair<double, double> evaluation{0, 0};
  torch::Tensor epoch_start_shuffle_state = generator_state(shuffle_rng);
  auto save = [&] {
    if (o.save.empty() || saved_at == step) return;
    saved_at = step;
    if (replica != 0) return;  // replicas hold the same parameters
    // The shuffling state from which the epoch of the next step is drawn.
    const TrainState now{step, step % steps_per_epoch == 0 ? generator_state(shuffle_rng) : epoch_start_shuffle_state,
                         generator_state(at::globalContext().defaultGenerator(torch::kCPU))};
    save_checkpoint(stage_file(o.save, stage, K), saved, *optimizer, o.optimizer, now);
  };
  auto report = [&](int epoch) {
    evaluation = engine->evaluate(eval, loss_fn, classification);
    epochs.push_back({{"epoch", epoch}, {"step", step}, {"loss", last_loss}, {eval.name + "_loss", evaluation.first}});
    if (classification) epochs.back()[eval.name + "_accuracy"] = evaluation.second;
    if (printing) {
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
      if (fault.kind == "exit" && fault.rank == w.rank && fault.step == step) std::_Exit(3);
      const int64_t begin = now_ns();
      clear_grads(engine->parameters());
      last_loss = engine->train_step(x, y, fault.kind == "throw" && fault.step == step ? faulty_loss : loss_fn)
                      .item<double>();
      optimizer->step();
      train_seconds += static_cast<double>(now_ns() - begin) * 1e-9;
      if (samples == 0) first_loss = last_loss;
      bubble_sum += engine->bubble();
      if (!o.trace.empty() && step + 1 == total_steps) last_step_trace = engine->trace();
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
  if (!o.trace.empty() && samples > 0 && w.prints()) write_trace(last_step_trace, o.trace);
  save();

  const int64_t run_steps = step - start_step;
  const double checksum = engine->checksum();
  if (!w.prints()) return 0;
  nlohmann::json stage_rows = nlohmann::json::array();
  const auto modules = engine->modules();
  for (int j = 0; j < K; ++j) {
    stage_rows.push_back({{"stage", j}, {"layers", balance[static_cast<size_t>(j)]}});
    if (!modules.empty()) stage_rows.back()["modules"] = modules[static_cast<size_t>(j)];
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
      {"stages", K},
      {"balance", balance},
      {"partition", stage_rows},
      {"plan", plan_json},
      {"micro_batches", o.micro_batches},
      {"checkpoint", o.checkpoint},
      {"schedule", o.schedule},
      {"virtual_stages", o.virtual_stages},
      {"batch_size", o.batch_size},
      {"optimizer", o.optimizer},
      {"lr", o.lr},
      {"seed", o.seed},
      {"bubble", run_steps > 0 ? bubble_sum / static_cast<double>(run_steps) : 0.0},
      {"parameter_checksum", checksum},
      {"machine", machine()}};
  if (w.mpi) summary["mpi"] = {{"ranks", w.size}, {"replicas", w.size / K}};
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
  for (int j = 0; j < K; ++j)
    std::cout << (j ? " | " : "") << "stage " << j << ": " << balance[static_cast<size_t>(j)] << " layers";
  std::cout << std::endl;
  if (!o.save.empty())
    std::cout << "  saved to       " << (w.mpi ? stage_file(o.save, 0, K) + " .. " + stage_file(o.save, K - 1, K) : o.save)
              << std::endl;
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
                  "number of pipeline stages K (the built-in CNN is cut {3, 8} for K=2; otherwise evenly); "
                  "under mpirun -np N, one rank per stage and N/K pipeline replicas")
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
  sub->add_option("--schedule", o->schedule,
                  "the order of forwards and backwards: gpipe (fill-drain), 1f1b, interleaved (with "
                  "--virtual-stages V >= 2 and --micro-batches a multiple of K) or zb1p (zero bubble); "
                  "see gpipe schedule and docs/schedules.md")
      ->check(CLI::IsMember({"gpipe", "1f1b", "interleaved", "zb1p"}))->capture_default_str();
  sub->add_option("--virtual-stages", o->virtual_stages,
                  "V, stages per device for --schedule interleaved: the model is cut into K·V stages "
                  "(in one process only)")
      ->check(CLI::PositiveNumber)->capture_default_str();
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
                  "whole or not at all; with --model it is TorchScript that torch.jit.load reads; under mpirun each "
                  "stage writes FILE.stage<j>-of-<K> (a pickled dict)");
  sub->add_option("--resume", o->resume, "continue from a checkpoint written by --save (same model and optimizer; under mpirun the same K)");
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
