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
  std::string schedule = "auto";  // resolved by choose_schedule before anything else
  int virtual_stages = 0;         // 0: 2 for the interleaved schedule, 1 for the others
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

// ---------------------------------------------------------------- the model

// Two convolution blocks and a classifier: 11 layers. With one core per stage
// the cut {3, 8} gives the two stages about the same time per micro-batch.
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

// What is trained: the built-in CNN, or a TorchScript model from Python.
struct Model {
  std::string name;  // for the header line
  int layers = 0;
  LayerBuilder build;
  std::optional<torch::jit::Module> script;  // with --model: what --save writes
};

Model choose_model(const TrainOptions& o) {
  Model m;
  if (o.model_file.empty()) {
    const uint64_t seed = o.seed;
    m.name = "CNN";
    m.layers = kFashionLayers;
    m.build = [seed](LayerRange keep) {
      torch::manual_seed(seed);  // every range starts from the same draws: a rank's layers equal one process's
      return fashion_cnn(keep);
    };
    return m;
  }
  const ModelSource source = or_usage_error("--model", [&] { return load_script_model(o.model_file); });
  m.name = o.model_file;
  m.layers = static_cast<int>(source.layers->size());
  m.script = source.script;
  const torch::nn::Sequential all = source.layers;
  m.build = [all](LayerRange keep) {
    torch::nn::Sequential part;
    const auto names = all->named_children().keys();
    for (int n = 0; n < static_cast<int>(names.size()); ++n)
      if (keep.contains(n)) part->push_back(names[static_cast<size_t>(n)], *(all->begin() + n));
    return part;
  };
  return m;
}

// ---------------------------------------------------------------- the data

struct Split {
  torch::Tensor input;
  torch::Tensor target;
  std::string name;  // "test" or "training"
};

struct Data {
  Split train;
  Split eval;
  bool classification = true;
  LossFn loss;
};

Data load_data(const TrainOptions& o) {
  Data d;
  if (!o.data_file.empty()) {
    std::tie(d.train.input, d.train.target) = or_usage_error("--data", [&] { return load_tensor_data(o.data_file); });
    if (o.train_samples > 0 && o.train_samples < d.train.input.size(0)) {
      d.train.input = d.train.input.narrow(0, 0, o.train_samples);
      d.train.target = d.train.target.narrow(0, 0, o.train_samples);
    }
    d.train.name = "training";
    d.eval = d.train;
  } else {
    const Dataset fashion = load_fashion_mnist(o.data_dir, true, o.train_samples);
    const Dataset test = load_fashion_mnist(o.data_dir, false, o.test_samples);
    d.train = {fashion.images, fashion.labels, "training"};
    d.eval = {test.images, test.labels, "test"};
  }
  d.classification = o.loss == "cross_entropy";
  if (d.classification && d.train.target.is_floating_point())
    usage_error("--loss cross_entropy needs integer class targets, but the targets are " +
                std::string(c10::toString(d.train.target.scalar_type())) + "; use --loss mse");
  d.loss = d.classification ? LossFn(cross_entropy_loss) : LossFn(mse_loss);
  const int64_t N = d.train.input.size(0);
  if (o.micro_batches > N)
    usage_error("--micro-batches " + std::to_string(o.micro_batches) + " is larger than the " + std::to_string(N) +
                " training samples");
  return d;
}

// ---------------------------------------------------------------- checks and the cut

// Every flag that can be judged without reading a file, before any work.
void check_flags(const TrainOptions& o) {
  if (world().mpi && !o.balance_by.empty())
    usage_error("--balance-by profiles the whole model in one process; run it once without mpirun and pass "
                "the cut it prints with --balance");
  if (o.micro_batches > o.batch_size)
    usage_error("--micro-batches " + std::to_string(o.micro_batches) + " is larger than --batch-size " +
                std::to_string(o.batch_size) + "; every micro-batch needs a sample");
  if (o.data_file.empty() && o.loss != "cross_entropy")
    usage_error("--loss " + o.loss + " needs --data with real-valued targets; Fashion-MNIST has class labels");
  if (!o.save.empty()) {
    const auto dir = std::filesystem::absolute(o.save).parent_path();
    if (!std::filesystem::is_directory(dir)) usage_error("--save: no such folder: " + dir.string());
  }
  if (!o.balance.empty() && !o.balance_by.empty())
    usage_error("--balance and --balance-by " + o.balance_by + " both choose the cut; give one of them");
  const int V = o.virtual_stages;
  if (V > 1 && o.schedule != "interleaved")
    usage_error("--virtual-stages " + std::to_string(V) + " needs --schedule interleaved; the " + o.schedule +
                " schedule runs one stage per device");
  if (V > 1 && !o.balance_by.empty())
    usage_error("--balance-by cuts the model into contiguous stages, one per device; with --virtual-stages give "
                "the cut (--stages x V entries) with --balance, or leave it out for an even cut");
}

// Layers per stage: --balance, --balance-by's min-max cut of measured costs, or an even cut.
struct Cut {
  std::vector<int> balance;
  nlohmann::json plan;  // --balance-by's plan, for the summary
};

Cut choose_cut(const TrainOptions& o, const Model& model, const Data& data) {
  const int layers = model.layers, V = o.virtual_stages;
  if (V > 1 && o.stages * V > layers)
    usage_error("--stages " + std::to_string(o.stages) + " x --virtual-stages " + std::to_string(V) +
                " is more than the model's " + std::to_string(layers) + " layers");
  Cut cut;
  if (!o.balance.empty()) {
    or_usage_error("--balance", [&] { check_balance(o.balance, layers); return 0; });
    const int entries = static_cast<int>(o.balance.size());
    if (entries % V != 0)
      usage_error("--balance has " + std::to_string(entries) + " stages, not a multiple of --virtual-stages " +
                  std::to_string(V) + "; give K x V entries (stage s runs on device s mod K)");
    if (o.stages_given && o.stages * V != entries)
      usage_error("--stages " + std::to_string(o.stages) + (V > 1 ? " x --virtual-stages " + std::to_string(V) : "") +
                  " and --balance (" + std::to_string(entries) + " stages) disagree; give one of them");
    cut.balance = o.balance;
    return cut;
  }
  if (o.stages > layers)
    usage_error("--stages " + std::to_string(o.stages) + " is more than the model's " + std::to_string(layers) +
                " layers; use --stages 1.." + std::to_string(layers));
  if (o.balance_by.empty()) {
    const bool cnn_on_two = o.model_file.empty() && o.stages == 2;
    cut.balance = cnn_on_two && V == 1   ? kFashionBalance
                  : cnn_on_two && V == 2 ? kFashionInterleavedBalance
                                         : even_balance(layers, o.stages * V);
    return cut;
  }
  // --balance-by: per-layer costs on one micro-batch, then the exact min-max cut.
  const torch::nn::Sequential whole = model.build(LayerRange{});
  const int64_t N = data.train.input.size(0);
  const torch::Tensor sample = data.train.input.narrow(0, 0, chunk_sizes(std::min(o.batch_size, N), o.micro_batches).front());
  const std::vector<double> costs = o.balance_by == "params" ? parameter_costs(whole)
                                    : o.balance_by == "time" ? time_costs(whole, sample, o.threads)
                                                             : memory_costs(whole, sample, o.optimizer == "adam" ? 3.0 : 2.0);
  cut.balance = balance_by_cost(costs, o.stages);
  const PartitionPlan plan = plan_partition(costs, cut.balance, o.micro_batches);
  const std::string unit = o.balance_by == "params" ? "parameters" : o.balance_by == "time" ? "s" : "bytes";
  if (!o.json && world().prints()) std::cout << "balance by " << o.balance_by << ":\n" << format_plan(plan, unit);
  cut.plan = {{"balance_by", o.balance_by},         {"unit", unit},
              {"stage_costs", plan.stage_costs},    {"bottleneck_stage", plan.bottleneck_stage},
              {"predicted_step", plan.predicted_step}, {"predicted_efficiency", plan.predicted_efficiency}};
  return cut;
}

std::unique_ptr<Engine> start_engine(const TrainOptions& o, const Model& model, const Cut& cut) {
  return or_usage_error("--stages", [&] {
    return make_engine(model.build, model.layers,
                       PipelineOptions()
                           .balance(cut.balance)
                           .chunks(o.micro_batches)
                           .checkpoint(parse_checkpoint(o.checkpoint))
                           .schedule(parse_schedule(o.schedule))
                           .virtual_stages(o.virtual_stages)
                           .threads_per_stage(o.threads));
  });
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

// ---------------------------------------------------------------- checkpoints

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

// Under MPI each stage has its own checkpoint file: PATH.stage<j>-of-<K>.
std::string stage_file(const std::string& path, int stage, int stages) {
  if (!world().mpi) return path;
  return path + ".stage" + std::to_string(stage) + "-of-" + std::to_string(stages);
}

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

// One training run: the engine, its optimizer, where the run stands, and what it measured.
class Run {
 public:
  Run(const TrainOptions& o, const Model& model, const Data& data, const Cut& cut)
      : o_(o), model_(model), data_(data), cut_(cut), engine_(start_engine(o, model, cut)),
        optimizer_(make_optimizer(o, engine_->parameters())), shuffle_(at::detail::createCPUGenerator(o.seed)) {
    K_ = static_cast<int>(cut.balance.size()) / o.virtual_stages;
    stage_ = world().rank % K_;
    N_ = data.train.input.size(0);
    // A last batch too small to split into M micro-batches is left out of every epoch.
    steps_per_epoch_ = N_ / o.batch_size + (N_ % o.batch_size >= o.micro_batches ? 1 : 0);
    total_steps_ = o.steps > 0 ? std::min(o.steps, steps_per_epoch_ * o.epochs) : steps_per_epoch_ * o.epochs;
  }

  void resume() {
    if (o_.resume.empty()) return;
    for (int j = 0; j < (world().mpi ? K_ : 1); ++j)
      if (!std::filesystem::is_regular_file(stage_file(o_.resume, j, K_)))
        usage_error("--resume: no such file: " + stage_file(o_.resume, j, K_) +
                    (world().mpi ? " (each stage has its own file; resume with the K of the run that saved)" : ""));
    const TrainState state = or_usage_error("--resume", [&] {
      return load_checkpoint(stage_file(o_.resume, stage_, K_), saved(), *optimizer_, o_.optimizer);
    });
    shuffle_.set_state(state.shuffle_state);
    at::Generator random = at::globalContext().defaultGenerator(torch::kCPU);
    random.set_state(state.random_state);
    if (!engine_->same_everywhere(static_cast<double>(state.step)))
      usage_error("--resume: the stage files of " + o_.resume + " are from different steps (this rank's, " +
                  stage_file(o_.resume, stage_, K_) + ", from step " + std::to_string(state.step) +
                  "); a run stopped while saving: resume from another checkpoint");
    step_ = start_step_ = state.step;
  }

  void print_header() const {
    if (!printing()) return;
    std::cout << "gpipe train: " << model_.name << " on " << (o_.data_file.empty() ? "Fashion-MNIST" : o_.data_file)
              << ", " << N_ << " training samples; "
              << (o_.virtual_stages > 1 ? std::to_string(K_) + " devices x " + std::to_string(o_.virtual_stages) +
                                              " stages "
                                        : std::to_string(K_) + " stages ")
              << nlohmann::json(cut_.balance).dump()
              << ", " << o_.micro_batches << " micro-batches of a batch of " << o_.batch_size << ", schedule "
              << o_.schedule << ", checkpoint " << o_.checkpoint << ", " << o_.optimizer << " lr " << o_.lr
              << (world().mpi ? ", " + engine_->describe() : "")
              << (o_.resume.empty() ? "" : ", resumed at step " + std::to_string(start_step_)) << "\n";
  }

  void train() {
    Progress progress(o_.epochs, steps_per_epoch_, world().prints());
    for (int epoch = static_cast<int>(step_ / steps_per_epoch_) + 1; step_ < total_steps_; ++epoch) {
      epoch_start_shuffle_ = generator_state(shuffle_);
      const torch::Tensor order = torch::randperm(N_, shuffle_, torch::kLong);
      for (int64_t b = step_ % steps_per_epoch_; b < steps_per_epoch_ && step_ < total_steps_; ++b) {
        train_step(order.narrow(0, b * o_.batch_size, std::min(o_.batch_size, N_ - b * o_.batch_size)));
        progress.update(epoch, b + 1, last_loss_, static_cast<double>(samples_) / train_seconds_,
                        static_cast<double>(total_steps_ - step_) * train_seconds_ /
                            static_cast<double>(step_ - start_step_));
      }
      progress.end_epoch();
      report(epoch);
      save();
    }
    if (!o_.trace.empty() && samples_ > 0 && world().prints()) write_trace(last_trace_, o_.trace);
    save();
  }

  void print_summary() {
    const double checksum = engine_->checksum();
    if (!world().prints()) return;
    const nlohmann::json s = summary(checksum);
    if (o_.json) {
      std::cout << s.dump(2) << std::endl;
      return;
    }
    const std::string& eval = data_.eval.name;
    std::cout << "\nsummary\n";
    if (data_.classification)
      std::cout << "  " << eval << " accuracy  " << std::fixed << std::setprecision(2) << 100 * evaluation_.accuracy
                << "%\n";
    else
      std::cout << "  " << eval << " loss  " << std::fixed << std::setprecision(6) << evaluation_.loss << "\n";
    std::cout << "  training time  " << std::fixed << std::setprecision(1) << train_seconds_ << " s ("
              << step_ - start_step_ << " steps)\n"
              << "  throughput     " << std::setprecision(0) << s["samples_per_s"].get<double>() << " samples/s\n"
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
                << (world().mpi ? stage_file(o_.save, 0, K_) + " .. " + stage_file(o_.save, K_ - 1, K_) : o_.save)
                << std::endl;
  }

 private:
  bool printing() const { return world().prints() && !o_.json; }

  // What --save and --resume hold: the whole model in one process, this rank's stage under MPI.
  ModelSource saved() const {
    return world().mpi ? ModelSource{engine_->layers(), std::nullopt} : ModelSource{engine_->layers(), model_.script};
  }

  void train_step(const torch::Tensor& rows) {
    const torch::Tensor x = data_.train.input.index_select(0, rows);
    const torch::Tensor y = data_.train.target.index_select(0, rows);
    if (fault_.kind == "exit" && fault_.rank == world().rank && fault_.step == step_) std::_Exit(3);
    const LossFn faulty = [](const torch::Tensor&, const torch::Tensor&) -> torch::Tensor {
      throw std::runtime_error("injected fault in the loss (GPIPE_TEST_FAULT)");
    };
    const int64_t begin = now_ns();
    clear_grads(engine_->parameters());
    last_loss_ = engine_->train_step(x, y, fault_.kind == "throw" && fault_.step == step_ ? faulty : data_.loss)
                     .item<double>();
    optimizer_->step();
    train_seconds_ += static_cast<double>(now_ns() - begin) * 1e-9;
    if (samples_ == 0) first_loss_ = last_loss_;
    bubble_sum_ += engine_->bubble();
    if (!o_.trace.empty() && step_ + 1 == total_steps_) last_trace_ = engine_->trace();
    samples_ += x.size(0);
    ++step_;
  }

  void report(int epoch) {
    evaluation_ = engine_->evaluate(data_.eval.input, data_.eval.target, data_.loss, data_.classification);
    const std::string& eval = data_.eval.name;
    epochs_.push_back({{"epoch", epoch}, {"step", step_}, {"loss", last_loss_}, {eval + "_loss", evaluation_.loss}});
    if (data_.classification) epochs_.back()[eval + "_accuracy"] = evaluation_.accuracy;
    if (!printing()) return;
    std::cout << "epoch " << epoch << ": loss " << std::fixed << std::setprecision(4) << last_loss_;
    if (data_.classification)
      std::cout << ", " << eval << " accuracy " << std::setprecision(2) << 100 * evaluation_.accuracy << "%";
    else
      std::cout << ", " << eval << " loss " << evaluation_.loss;
    std::cout << std::endl;
  }

  void save() {
    if (o_.save.empty() || saved_at_ == step_) return;
    saved_at_ = step_;
    if (engine_->replica() != 0) return;  // replicas hold the same parameters
    // The shuffling state from which the epoch of the next step is drawn.
    const TrainState now{step_, step_ % steps_per_epoch_ == 0 ? generator_state(shuffle_) : epoch_start_shuffle_,
                         generator_state(at::globalContext().defaultGenerator(torch::kCPU))};
    save_checkpoint(stage_file(o_.save, stage_, K_), saved(), *optimizer_, o_.optimizer, now);
  }

  nlohmann::json summary(double checksum) const {
    const int64_t run_steps = step_ - start_step_;
    const std::string& eval = data_.eval.name;
    nlohmann::json stages = nlohmann::json::array();
    for (int j = 0; j < static_cast<int>(cut_.balance.size()); ++j) {
      stages.push_back({{"stage", j}, {"device", j % K_}, {"layers", cut_.balance[static_cast<size_t>(j)]}});
      if (!world().mpi) {
        nlohmann::json names = nlohmann::json::array();
        const int first = stage_offsets(cut_.balance)[static_cast<size_t>(j)];
        const auto children = engine_->layers()->children();
        for (int n = first; n < first + cut_.balance[static_cast<size_t>(j)]; ++n)
          names.push_back(children[static_cast<size_t>(n)]->name());
        stages.back()["modules"] = names;
      }
    }
    nlohmann::json s = {{"evaluated_on", eval},
                        {eval + "_loss", evaluation_.loss},
                        {"first_loss", first_loss_},
                        {"final_loss", last_loss_},
                        {"train_seconds", train_seconds_},
                        {"samples_per_s", train_seconds_ > 0 ? static_cast<double>(samples_) / train_seconds_ : 0.0},
                        {"steps", step_},
                        {"steps_this_run", run_steps},
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
                        {"optimizer", o_.optimizer},
                        {"lr", o_.lr},
                        {"seed", o_.seed},
                        {"bubble", run_steps > 0 ? bubble_sum_ / static_cast<double>(run_steps) : 0.0},
                        {"parameter_checksum", checksum},
                        {"machine", machine()}};
    if (world().mpi) s["mpi"] = {{"ranks", world().size}, {"replicas", world().size / K_}};
    if (data_.classification) s[eval + "_accuracy"] = evaluation_.accuracy;
    return s;
  }

  const TrainOptions& o_;
  const Model& model_;
  const Data& data_;
  const Cut& cut_;
  std::unique_ptr<Engine> engine_;
  std::unique_ptr<torch::optim::Optimizer> optimizer_;
  torch::Generator shuffle_;
  const Fault fault_ = test_fault();
  int K_ = 1;
  int stage_ = 0;  // this rank's device under MPI
  int64_t N_ = 0;
  int64_t steps_per_epoch_ = 1;
  int64_t total_steps_ = 0;

  int64_t start_step_ = 0, step_ = 0, samples_ = 0, saved_at_ = -1;
  double train_seconds_ = 0, bubble_sum_ = 0, first_loss_ = 0, last_loss_ = 0;
  Evaluation evaluation_;
  nlohmann::json epochs_ = nlohmann::json::array();
  StepTrace last_trace_;  // of the last training step, for --trace
  torch::Tensor epoch_start_shuffle_;
};

// The settings every rank of an MPI job must share.
nlohmann::json settings_of(const TrainOptions& o) {
  return {{"--data-dir", o.data_dir},     {"--model", o.model_file},      {"--data", o.data_file},
          {"--loss", o.loss},             {"--stages", o.stages},         {"--balance", o.balance},
          {"--balance-by", o.balance_by}, {"--micro-batches", o.micro_batches}, {"--checkpoint", o.checkpoint},
          {"--schedule", o.schedule},     {"--virtual-stages", o.virtual_stages},
          {"--batch-size", o.batch_size}, {"--epochs", o.epochs},         {"--steps", o.steps},
          {"--optimizer", o.optimizer},   {"--lr", o.lr},                 {"--seed", o.seed},
          {"--threads-per-stage", o.threads}, {"--train-samples", o.train_samples},
          {"--test-samples", o.test_samples}, {"--save", o.save},         {"--resume", o.resume},
          {"--trace", o.trace},           {"--json", o.json}};
}

int run(TrainOptions o) {
  choose_schedule(o);
  check_same_settings(settings_of(o));
  check_flags(o);
  const Model model = choose_model(o);
  const Data data = load_data(o);
  const Cut cut = choose_cut(o, model, data);
  Run run(o, model, data, cut);
  run.resume();
  run.print_header();
  run.train();
  run.print_summary();
  return 0;
}

}  // namespace

void add_train_command(CLI::App& app, const std::string&, int& status) {
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
                  "the order of forwards and backwards: gpipe (fill-drain), 1f1b, interleaved (V stages per "
                  "device; --micro-batches a multiple of K) or zb1p (zero bubble); auto: interleaved with the cut "
                  "{3, 1, 2, 5} for the built-in CNN on 2 stages (measured fastest), gpipe otherwise; see gpipe "
                  "schedule and docs/schedules.md")
      ->check(CLI::IsMember({"auto", "gpipe", "1f1b", "interleaved", "zb1p"}))->capture_default_str();
  sub->add_option("--virtual-stages", o->virtual_stages,
                  "V, stages per device for --schedule interleaved (default 2): the model is cut into K x V stages, "
                  "stage s on device s mod K")
      ->check(CLI::PositiveNumber);
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
  sub->callback([o, sub, &status] {
    o->stages_given = sub->count("--stages") > 0;
    status = run(*o);
  });
}

}  // namespace gpipe::cli
