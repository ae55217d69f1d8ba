// train.cc: `gpipe train`'s choices: the flags checked, the model, the data and the cut chosen; then
// train_run.cc trains and reports.
#include "common.h"
#include "train.h"
#include "world.h"

#include <gpipe/gpipe.h>
#include <torch/torch.h>

#include <CLI/CLI.hpp>

#include <filesystem>
#include <iostream>

namespace gpipe::cli {

PipelineOptions pipeline_options(const TrainOptions& o) {
  return PipelineOptions()
      .micro_batches(o.micro_batches)
      .checkpoint(parse_checkpoint(o.checkpoint))
      .schedule(parse_schedule(o.schedule))
      .virtual_stages(o.virtual_stages)
      .deferred_batch_norm(o.batch_norm == "deferred")
      .threads_per_device(o.threads);
}

OptimizerOptions optimizer_options(const TrainOptions& o) {
  OptimizerOptions options;
  options.kind(parse_optimizer(o.optimizer)).lr(o.lr).momentum(o.momentum).nesterov(o.nesterov);
  if (o.weight_decay_given) options.weight_decay(o.weight_decay);
  if (o.betas_given) options.betas(std::make_tuple(o.betas[0], o.betas[1]));
  return options;
}

namespace {

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
  if (o.virtual_stages == 0) o.virtual_stages = default_virtual_stages(parse_schedule(o.schedule));
}

// What is trained: the built-in CNN, ResNet, U-Net or GPT, or a TorchScript model from Python.
Model choose_model(const TrainOptions& o) {
  if (is_gpt(o)) {
    const uint64_t seed = o.seed;
    const GptOptions shape = gpt_shape();
    Model model = Model::of("GPT", shape.layers(), [seed, shape](LayerRange keep) {
      torch::manual_seed(seed);  // every range starts from the same draws: a rank's layers equal one process's
      return byte_gpt(shape, keep);
    });
    model.tied = shape.tied();  // the head reads the embedding's bytes: one tensor, or copies summed under MPI
    return model;
  }
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

// --model gpt: the fortunes as windows of bytes, and the two references on the test bytes.
Data load_text(const TrainOptions& o) {
  const TextCorpus text = or_usage_error("--data-dir", [&] { return load_fortunes(o.data_dir); });
  const int64_t T = gpt_shape().context;
  for (const auto& [part, bytes] : {std::pair<const char*, size_t>{"train on", text.train.size()}, {"test on", text.test.size()}})
    if (static_cast<int64_t>(bytes) <= T)
      usage_error("--data-dir " + o.data_dir + " holds too little text: " + std::to_string(text.train.size()) +
                  " bytes to train on and " + std::to_string(text.test.size()) + " to test on (the fortunes in the "
                  "last tenth of each file), but --model gpt needs more than " + std::to_string(T) + " bytes to " + part +
                  ": a window of " + std::to_string(T) + " bytes and the byte after it; give a folder with more fortunes");
  Data d;
  d.language_model = true;
  d.classification = false;  // scored in bits per byte, not by argmax
  d.loss = cross_entropy_loss;
  d.train = {or_usage_error("--data-dir", [&] { return byte_windows(text.train, T); }).first(o.train_samples),
             "training"};
  d.eval = {or_usage_error("--data-dir", [&] { return byte_windows(text.test, T); }).first(o.test_samples), "test"};
  d.train_bytes = static_cast<int64_t>(text.train.size());
  d.test_bytes = static_cast<int64_t>(text.test.size());
  // The references see the test bytes the model is scored on (all of them, or --test-samples' windows).
  const std::string test = text.test.substr(0, static_cast<size_t>(d.eval.size() * T + 1));
  d.bigram_bits_per_byte = bigram_bits_per_byte(text.train, test);
  d.gzip_bits_per_byte = gzip_bits_per_byte(test);
  if (o.micro_batches > d.train.size())
    usage_error("--micro-batches " + std::to_string(o.micro_batches) + " is more than the " +
                std::to_string(d.train.size()) + " training windows; every micro-batch needs a sample");
  return d;
}

Data load_data(const TrainOptions& o) {
  if (is_gpt(o)) return load_text(o);
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
      d.train = {{add_noise(fashion.input, kNoise, o.seed ^ 0x6e6f697365ull), fashion.input}, "training"};
      d.eval = {{add_noise(test.input, kNoise, o.seed ^ 0x74657374ull), test.input}, "test"};
      d.noisy_psnr = psnr_db(torch::mse_loss(d.eval.input, d.eval.target).item<double>());
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

// ---------------------------------------------------------------- checks and the cut

// --model gpt's own flags: where its text is, and what --generate samples.
void check_language_model_flags(TrainOptions& o) {
  if (is_gpt(o) && !o.data_dir_given) o.data_dir = kFortunesDir;
  if (o.generate > 0 && !is_gpt(o))
    usage_error("--generate samples bytes from a language model: it is for --model gpt" +
                std::string(o.model_file.empty() ? " (the default model is an image classifier)"
                                                 : " (--model " + o.model_file + " is not one)"));
  if ((o.prompt_given || o.temperature_given) && o.generate == 0)
    usage_error(std::string(o.prompt_given ? "--prompt" : "--temperature") +
                " belongs to --generate N, the bytes to sample from --model gpt; add " +
                (is_gpt(o) ? "" : "--model gpt ") + "--generate 200, say");
  if (o.generate > kMaxGeneratedBytes)
    usage_error("--generate " + std::to_string(o.generate) + ": at most " + std::to_string(kMaxGeneratedBytes) +
                " bytes (each is one pass of the model); sample more in several runs with other --seed values");
  if (o.generate > 0 && world().mpi)
    usage_error("--generate samples byte by byte in one process; train under mpirun with --save FILE, then run "
                "gpipe train --model gpt --resume FILE --epochs 0 --generate N without mpirun");
  if (o.epochs_given && o.epochs == 0 && !o.save.empty())
    usage_error("--epochs 0 trains nothing, so --save would write the checkpoint it resumed; leave out --save");
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
  if (is_builtin(o) && std::filesystem::exists(o.model_file))
    usage_error("--model " + o.model_file + " names a built-in model, and there is also a file " + o.model_file +
                " here; for the file, say --model ./" + o.model_file);
  if (is_builtin(o) && !o.data_file.empty())
    usage_error("--model " + o.model_file + " is built to train on " +
                (is_gpt(o) ? "the fortune files; give their folder with --data-dir" : "Fashion-MNIST") +
                "; leave out --data (or give a TorchScript model file of your own to --model)");
  if (is_gpt(o) && o.loss_given && o.loss != "cross_entropy")
    usage_error("--model gpt predicts bytes: its loss is cross_entropy; leave out --loss");
  check_language_model_flags(o);
  if (is_unet(o) && o.loss_given && o.loss != "mse")
    usage_error("--model unet denoises images: its loss is mse; leave out --loss");
  if (is_unet(o)) o.loss = "mse";
  if (o.data_file.empty() && o.loss != "cross_entropy" && !is_unet(o))
    usage_error("--loss " + o.loss + " needs --data with real-valued targets; Fashion-MNIST has class labels");
  if (!o.samples.empty() && !is_unet(o))
    usage_error("--samples writes a picture of denoised test images: it is for --model unet");
  if (!o.samples.empty() && (o.samples.size() < 5 || o.samples.compare(o.samples.size() - 4, 4, ".png") != 0))
    usage_error("--samples " + o.samples + ": the picture is a PNG file; give a path that ends in .png");
  if (o.epochs_given && o.epochs == 0 && o.resume.empty())
    usage_error("--epochs 0 trains nothing: it evaluates the model of a checkpoint; give it with --resume FILE, "
                "or ask for 1 or more epochs");
  if (o.epochs == 0 && !o.epochs_given) o.epochs = default_epochs(o);
  if (o.augment == "auto") o.augment = is_resnet(o) ? "flip" : "none";
  if ((is_resnet(o) || is_gpt(o)) && !o.lr_schedule_given) o.lr_schedule = "cosine";
  if (is_gpt(o) && !o.batch_size_given) o.batch_size = kGptBatch;
  if (is_gpt(o) && !o.lr_given) o.lr = kGptLr;
  if (o.augment == "flip" && (is_unet(o) || is_gpt(o) || !o.data_file.empty()))
    usage_error("--augment flip mirrors Fashion-MNIST's training images for a classifier; it is not for " +
                std::string(is_unet(o) ? "--model unet, whose targets are the images themselves"
                            : is_gpt(o) ? "--model gpt, which reads text"
                                        : "--data") +
                ": use --augment none");
  // The residual network's blocks differ in time per layer by 10x: cut it by measured time
  // unless told otherwise (under MPI each rank would profile alone: an even cut there).
  if (is_resnet(o) && o.balance.empty() && o.balance_by.empty() && o.virtual_stages == 1 && o.stages > 1 &&
      !world().mpi)
    o.balance_by = "time";
  check_threads_per_device(o.threads, "--threads-per-stage ");  // std::invalid_argument: a usage error
  if (!o.balance.empty() && !o.balance_by.empty())
    usage_error("--balance and --balance-by " + o.balance_by + " both choose the cut; give one of them");
  const int V = o.virtual_stages;
  or_usage_error("--virtual-stages " + std::to_string(V), [&] { check_virtual_stages(parse_schedule(o.schedule), V); });
  // The optimizer's flags, as torch.optim takes them.
  optimizer_options(o).check();
  o.weight_decay = optimizer_options(o).decay();
  if (o.lr_schedule != "step" && o.step_flags_given)
    usage_error("--lr-step-size and --lr-gamma belong to --lr-schedule step");
  // Outputs: found unwritable now, not after training.
  if (o.per_stage_files && !world().mpi)
    usage_error("--per-device-files is for mpirun, where each device writes its own file; in one process --save "
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
  // The single checkpoint file and the trace are written by the first rank; per-device files are checked
  // where they are written, once the devices are placed.
  if (world().rank == 0 && !o.save.empty() && !o.per_stage_files)
    or_usage_error("--save", [&] { check_writable(o.save); return 0; });
  if (world().rank == 0 && !o.trace.empty()) or_usage_error("--trace", [&] { check_writable(o.trace); return 0; });
  if (world().rank == 0 && !o.samples.empty())
    or_usage_error("--samples", [&] { check_writable(o.samples); return 0; });
}

// Layers per stage: --balance, --balance-by's min-max cut of measured costs, or an even cut.

Cut choose_cut(const TrainOptions& o, const Model& model, const Data& data) {
  const int layers = model.layers, V = o.virtual_stages;
  Cut cut;
  // The plan checks K, V, M, the balance and the schedule; its errors name the flag they concern.
  PipelineOptions options = pipeline_options(o);
  options.devices(o.balance.empty() || o.stages_given ? o.stages : 0).balance(o.balance);
  // Every flag the plan is made of, with its value, before what the plan says is wrong with them.
  std::string flags = o.balance.empty() || o.stages_given ? "--stages " + std::to_string(o.stages) : "";
  if (!o.balance.empty()) flags += std::string(flags.empty() ? "" : " ") + "--balance " + format_balance(o.balance);
  flags += " --micro-batches " + std::to_string(o.micro_batches) + " --schedule " + o.schedule +
           (V > 1 ? " --virtual-stages " + std::to_string(V) : "");
  const PipelinePlan plan = or_usage_error(flags, [&] { return make_plan(layers, options); });
  if (!o.balance.empty()) {
    cut.balance = plan.balance;
    return cut;
  }
  if (o.balance_by.empty()) {
    const bool cnn_on_two = o.model_file.empty() && o.stages == 2;
    // The interleaved cut is for its placement (stages on devices 0, 1, 0, 1); the V's take the even one.
    const bool interleaved = parse_schedule(o.schedule) == ScheduleKind::kInterleaved;
    cut.balance = cnn_on_two && V == 1                  ? kFashionBalance
                  : cnn_on_two && V == 2 && interleaved ? kFashionInterleavedBalance
                                                        : plan.balance;
    // The GPT's blocks split evenly, the embedding with the first, the last LayerNorm and the head
    // with the last stage (an even cut of its layers would give the first stage one block more).
    const int blocks = static_cast<int>(gpt_shape().blocks), S = static_cast<int>(plan.balance.size());
    if (is_gpt(o) && S > 1 && S <= blocks) {
      cut.balance = even_balance(blocks, S);
      cut.balance.front() += 1;
      cut.balance.back() += 2;
    }
    return cut;
  }
  // --balance-by: per-layer costs on one micro-batch, then the exact min-max cut.
  const int64_t N = data.train.size();
  const torch::Tensor sample = data.train.input.narrow(0, 0, micro_batch_sizes(std::min(o.batch_size, N), o.micro_batches).front());
  const CostBalance by = balance_by(o.balance_by, model, sample, o.stages, o.micro_batches, o.threads,
                                    state_per_parameter_byte(optimizer_options(o)), parse_schedule(o.schedule), o.virtual_stages);
  cut.balance = by.balance;
  const PartitionPlan& by_cost = by.plan;
  if (!o.json && world().prints())
    std::cout << "balance by " << o.balance_by << ":\n" << format_plan(by_cost, by.unit);
  cut.plan = {{"balance_by", o.balance_by},
              {"unit", by.unit},
              {"stage_costs", by_cost.stage_costs},
              {"bottleneck_stage", by_cost.bottleneck_stage},
              {"predicted_step", by_cost.predicted_step},
              {"predicted_efficiency", by_cost.predicted_efficiency}};
  return cut;
}

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
          {"--test-samples", o.test_samples}, {"--save", o.save},         {"--save-every", o.save_every}, {"--resume", o.resume},
          {"--per-device-files", o.per_stage_files}, {"--trace", o.trace}, {"--samples", o.samples},
          {"--generate", o.generate},     {"--prompt", o.prompt},         {"--temperature", o.temperature},
          {"--json", o.json}};
}

// Under mpirun every rank reads the model, the data and the checkpoint itself: each from its own
// working folder and machine. A rank that read other bytes would train a mixture, so the bytes
// read must agree.
void check_same_inputs(const TrainOptions& o, const Data& data) {
  if (!world().mpi) return;
  std::vector<std::pair<std::string, uint64_t>> inputs;
  if (!o.model_file.empty() && !is_builtin(o))
    inputs.emplace_back("--model " + o.model_file, or_usage_error("--model", [&] { return file_digest(o.model_file); }));
  const std::string source = !o.data_file.empty() ? "--data " + o.data_file
                             : is_gpt(o)          ? "--data-dir " + o.data_dir + " (the fortune files)"
                                                  : "--data-dir " + o.data_dir + " (Fashion-MNIST)";
  inputs.emplace_back(source, tensors_digest({data.train.input, data.train.target, data.eval.input, data.eval.target}));
  if (!o.resume.empty() && !o.per_stage_files)  // per-device files differ by design: each rank reads its own
    inputs.emplace_back("--resume " + o.resume, or_usage_error("--resume", [&] { return file_digest(o.resume); }));
  check_same_bytes(inputs);
}

// --resume read and checked against the whole model before --balance-by's profile, which would
// otherwise be done for a file refused after it (in one process; under mpirun there is no profile).
void check_resume_before_profile(const TrainOptions& o, const Model& model) {
  if (o.resume.empty() || o.balance_by.empty() || o.per_stage_files || world().mpi) return;
  or_usage_error("--resume", [&] {
    const RandomStateGuard guard;  // building the model draws random numbers
    const torch::nn::Sequential whole = model.build(LayerRange{});
    const Snapshot file = read_snapshot(o.resume, whole, optimizer_name(parse_optimizer(o.optimizer)),
                                        model.script.has_value());
    GPIPE_CHECK(file.parameters_in_file == file.parameters_taken, o.resume, " is a checkpoint file of another model: "
                "it holds ", file.parameters_in_file, " parameters, this model ", file.parameters_taken);
    return 0;
  });
}

// A stage's input is kept for its backward pass: a layer that begins a stage and
// changes its input in place fails in step 1 (or, for a leaf input, at once). Found here, on two
// samples, naming the layer and the cut.
void check_stage_inputs(const Model& model, const Data& data, const Cut& cut) {
  const std::vector<int> offsets = stage_offsets(cut.balance);
  const RandomStateGuard guard;  // building the model draws random numbers
  torch::nn::Sequential whole = model.build(LayerRange{});
  whole->eval();
  const auto names = whole->named_children();
  Tensors x = data.train.input.narrow(0, 0, std::min<int64_t>(2, data.train.size()));
  size_t next = 1;  // the next stage whose first layer is checked: stage 0's input needs no gradient
  for (int layer = 0; layer < static_cast<int>(whole->size()) && next + 1 < offsets.size(); ++layer) {
    auto module = *(whole->begin() + layer);
    const std::string name = layer_name(names[static_cast<size_t>(layer)].key());
    if (layer != offsets[next]) {
      torch::NoGradGuard no_grad;
      x = run_layer(module, x, name);
      continue;
    }
    ++next;
    Tensors input = x;
    for (auto& t : input.items) t = t.detach().clone().requires_grad_(t.is_floating_point());
    const std::vector<int64_t> versions = versions_of(input);
    std::string why;
    try {
      x = leaves_of(run_layer(module, input, name), LeafGrad::kNone);
      if (const std::string changed = changed_in_place(input, versions); !changed.empty())
        why = "it changes " + changed + " in place";
    } catch (const std::exception& e) {
      why = short_error(e);
      if (why.find("in-place") == std::string::npos && why.find("inplace") == std::string::npos) throw;
    }
    while (!why.empty() && (why.back() == '.' || why.back() == ' ')) why.pop_back();
    if (!why.empty())
      usage_error("layer " + std::to_string(layer) + " ('" + names[static_cast<size_t>(layer)].key() +
                  "') begins stage " + std::to_string(next - 1) + " of the cut " + format_balance(cut.balance) +
                  ", and " + why + "; a stage keeps its input for the backward pass: make the layer return a new "
                  "tensor (e.g. ReLU(inplace=False))" + (next > 1 ? ", or cut elsewhere with --balance" : ""));
  }
  whole->train();
}

}  // namespace

int run_train(TrainOptions o) {
  choose_schedule(o);
  check_same_settings(settings_of(o));
  check_flags(o);
  const Model model = choose_model(o);
  const Data data = load_data(o);
  check_same_inputs(o, data);
  check_model_and_data(model, data.train, data.classification || data.language_model);
  check_resume_before_profile(o, model);
  const Cut cut = choose_cut(o, model, data);
  check_stage_inputs(model, data, cut);
  return train_and_report(o, model, data, cut);
}

}  // namespace gpipe::cli
