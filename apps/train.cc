// train.cc: `gpipe train`'s choices: the flags checked, the model, the data and the cut chosen; then
// train_run.cc trains and reports.
#include "common.h"
#include "train.h"

#include <gpipe/gpipe.h>
#include <torch/torch.h>

#include <CLI/CLI.hpp>

#include <filesystem>
#include <iostream>

namespace gpipe::cli {

RunRequest run_request(const TrainOptions& o) {
  RunRequest r;
  r.devices = o.balance.empty() || o.stages_given ? o.stages : 0;
  r.micro_batches = o.micro_batches;
  r.schedule = o.schedule;
  r.virtual_stages = o.virtual_stages;
  r.balance = o.balance;
  r.balance_by = o.balance_by;
  return r;
}

OptimizerOptions optimizer_options(const TrainOptions& o) {
  OptimizerOptions options;
  options.kind(parse_optimizer(o.optimizer)).lr(o.lr).momentum(o.momentum).nesterov(o.nesterov);
  if (o.weight_decay_given) options.weight_decay(o.weight_decay);
  if (o.betas_given) options.betas(std::make_tuple(o.betas[0], o.betas[1]));
  return options;
}

namespace {

// --schedule auto, V and the cut by time: the task's own choices (resolve_run).
void choose_schedule(TrainOptions& o, const Task& task) {
  RunRequest r = run_request(o);
  r.devices = o.stages;
  r = resolve_run(task, r);
  o.schedule = r.schedule;
  o.virtual_stages = r.virtual_stages;
  o.balance_by = r.balance_by;
}

// ---------------------------------------------------------------- checks and the cut

bool generates(const Task& task) { return task.metric == Metric::kBitsPerByte && task.context > 0; }

// The flags of a task's extras: --generate (a language model), --samples (a denoiser).
void check_extras_flags(const TrainOptions& o, const Task& task) {
  const std::string model = o.model_file.empty() ? "the default model" : "--model " + o.model_file;
  if (o.generate > 0 && !generates(task))
    usage_error("--generate samples bytes from a language model: it is for --model gpt (" + model + " is not one)");
  if ((o.prompt_given || o.temperature_given) && o.generate == 0)
    usage_error(std::string(o.prompt_given ? "--prompt" : "--temperature") +
                " belongs to --generate N, the bytes to sample from --model gpt; add " +
                (generates(task) ? "" : "--model gpt ") + "--generate 200, say");
  try {
    GenerateOptions().bytes(o.generate).temperature(o.temperature).check();
  } catch (const std::invalid_argument& e) {
    usage_error(without_prefix(e.what()));
  }
  if (o.generate > 0 && job().distributed)
    usage_error("--generate samples byte by byte in one process; train under mpirun with --save FILE, then run "
                "gpipe train --model gpt --resume FILE --epochs 0 --generate N without mpirun");
  if (o.epochs_given && o.epochs == 0 && !o.save.empty())
    usage_error("--epochs 0 trains nothing, so --save would write the checkpoint it resumed; leave out --save");
  if (!o.samples.empty() && task.metric != Metric::kPsnr)
    usage_error("--samples writes a picture of denoised test images: it is for --model unet");
  if (!o.samples.empty() && (o.samples.size() < 5 || !has_extension(o.samples, ".png")))
    usage_error("--samples " + o.samples + ": the picture is a PNG file; give a path that ends in .png");
}

// The task's defaults for the flags not given, and the flags that do not fit the task.
void apply_task(TrainOptions& o, const Task& task) {
  const TaskDefaults& d = task.defaults;
  if (o.loss_given && o.loss != task.loss_name)
    usage_error(is_builtin(o) && !o.model_file.empty()
                    ? "--model " + o.model_file + ": its loss is " + task.loss_name + "; leave out --loss"
                    : "--loss " + o.loss + " needs --data with real-valued targets; Fashion-MNIST has class labels");
  o.loss = task.loss_name;
  if (o.epochs == 0 && !o.epochs_given) o.epochs = d.epochs;
  if (!o.batch_size_given) o.batch_size = d.batch_size;
  if (!o.lr_given) o.lr = d.lr;
  if (!o.lr_schedule_given) o.lr_schedule = lr_schedule_name(d.lr_schedule);
  if (o.augment == "auto") o.augment = d.flip ? "flip" : "none";
  const bool images = task.metric == Metric::kAccuracy && task.data_dir == kFashionMnistDir;
  if (o.augment == "flip" && !images)
    usage_error("--augment flip mirrors Fashion-MNIST's training images for a classifier; it is not for " +
                std::string(task.metric == Metric::kPsnr          ? "--model unet, whose targets are the images themselves"
                            : task.metric == Metric::kBitsPerByte ? "--model gpt, which reads text"
                            : !o.data_file.empty()                ? "--data"
                                                                  : "--model " + o.model_file) +
                ": use --augment none");
  if (o.micro_batches > o.batch_size)
    usage_error("--micro-batches " + std::to_string(o.micro_batches) + " is larger than --batch-size " +
                std::to_string(o.batch_size) + "; every micro-batch needs a sample");
}

// Every flag that can be judged without reading a file, before any work.
void check_flags(TrainOptions& o) {
  o.seed = parse_seed(o.seed_text);
  if (job().distributed && !o.balance_by.empty())
    usage_error("--balance-by profiles the whole model in one process; run it once without mpirun and pass "
                "the cut it prints with --balance");
  if (is_builtin(o) && std::filesystem::exists(o.model_file))
    usage_error("--model " + o.model_file + " names a built-in model, and there is also a file " + o.model_file +
                " here; for the file, say --model ./" + o.model_file);
  if (is_builtin(o) && !o.model_file.empty() && !o.data_file.empty()) {
    const Task& task = find_task(o.model_file);
    usage_error("--model " + o.model_file + " is built to train on " +
                (task.metric == Metric::kBitsPerByte ? std::string("the fortune files; give their folder with --data-dir")
                 : task.workload                     ? "its own random batch"
                                                     : "Fashion-MNIST") +
                "; leave out --data (or give a TorchScript model file of your own to --model)");
  }
  if (o.epochs_given && o.epochs == 0 && o.resume.empty())
    usage_error("--epochs 0 trains nothing: it evaluates the model of a checkpoint; give it with --resume FILE, "
                "or ask for 1 or more epochs");
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
  if (o.per_stage_files && !job().distributed)
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
  if (job().rank == 0 && !o.save.empty() && !o.per_stage_files)
    or_usage_error("--save", [&] { check_writable(o.save); return 0; });
  if (job().rank == 0 && !o.trace.empty()) or_usage_error("--trace", [&] { check_writable(o.trace); return 0; });
  if (job().rank == 0 && !o.samples.empty())
    or_usage_error("--samples", [&] { check_writable(o.samples); return 0; });
}

// The pipeline (pipeline_options_of: --balance, --balance-by's min-max cut of measured costs, or the
// task's cut) and its plan, made once: the Trainer takes it as it is.
void choose_cut(const TrainOptions& o, Choice& c) {
  const int V = o.virtual_stages;
  RunRequest request = run_request(o);
  if (!o.balance_by.empty()) request.balance_by = "even";  // checked before the profile, then cut by cost
  c.options = pipeline_options_of(c.task, request)
                  .checkpoint(parse_checkpoint(o.checkpoint))
                  .deferred_batch_norm(o.batch_norm == "deferred")
                  .threads_per_device(o.threads);
  // Every flag the plan is made of, with its value, before what the plan says is wrong with them.
  std::string flags = o.balance.empty() || o.stages_given ? "--stages " + std::to_string(o.stages) : "";
  if (!o.balance.empty()) flags += std::string(flags.empty() ? "" : " ") + "--balance " + format_balance(o.balance);
  flags += " --micro-batches " + std::to_string(o.micro_batches) + " --schedule " + o.schedule +
           (V > 1 ? " --virtual-stages " + std::to_string(V) : "");
  c.plan = or_usage_error(flags, [&] { return make_plan(c.task.layers, c.options); });
  if (o.balance_by.empty()) return;
  // --balance-by: per-layer costs on one micro-batch, then the exact min-max cut (in one process).
  const Dataset& train = c.data.train;
  const torch::Tensor sample =
      train.input.narrow(0, 0, micro_batch_sizes(std::min(o.batch_size, train.size()), o.micro_batches).front());
  const CostBalance by = balance_by(o.balance_by, c.model, sample, o.stages, o.micro_batches,
                                    o.threads, state_per_parameter_byte(optimizer_options(o)),
                                    parse_schedule(o.schedule), V);
  c.options.cut(CutRequest::given(by.balance));
  c.plan = make_plan(c.task.layers, c.options);
  if (!o.json && job().prints()) std::cout << "balance by " << o.balance_by << ":\n" << format_plan(by.plan, by.unit);
  c.cost_plan = {{"balance_by", o.balance_by},
                 {"unit", by.unit},
                 {"stage_costs", by.plan.stage_costs},
                 {"bottleneck_stage", by.plan.bottleneck_stage},
                 {"predicted_step", by.plan.predicted_step},
                 {"predicted_efficiency", by.plan.predicted_efficiency}};
}

// Under mpirun every rank reads the model, the data and the checkpoint itself: each from its own
// working folder and machine. A rank that read other bytes would train a mixture, so the bytes
// read must agree.
void check_same_inputs(const TrainOptions& o, const Choice& c) {
  if (!job().distributed) return;
  std::vector<std::pair<std::string, uint64_t>> inputs;
  if (!is_builtin(o) && !o.model_file.empty())
    inputs.emplace_back("--model " + o.model_file, or_usage_error("--model", [&] { return file_digest(o.model_file); }));
  const std::string source = !o.data_file.empty() ? "--data " + o.data_file : c.data.source;
  inputs.emplace_back(source, tensors_digest({c.data.train.input, c.data.train.target, c.data.test.input,
                                              c.data.test.target}));
  if (!o.resume.empty() && !o.per_stage_files)  // per-device files differ by design: each rank reads its own
    inputs.emplace_back("--resume " + o.resume, or_usage_error("--resume", [&] { return file_digest(o.resume); }));
  check_same_bytes(inputs);
}

// --resume read and checked against the whole model before --balance-by's profile, which would
// otherwise be done for a file refused after it (in one process; under mpirun there is no profile).
void check_resume_before_profile(const TrainOptions& o, const Model& model) {
  if (o.resume.empty() || o.balance_by.empty() || o.per_stage_files || job().distributed) return;
  or_usage_error("--resume", [&] {
    check_snapshot_of(o.resume, model, optimizer_name(parse_optimizer(o.optimizer)));
    return 0;
  });
}

}  // namespace

bool is_builtin(const TrainOptions& o) {
  const std::vector<std::string> names = task_names(/*workloads=*/true);
  return o.model_file.empty() || std::find(names.begin(), names.end(), o.model_file) != names.end();
}

TaskOptions task_options(const TrainOptions& o) {
  return TaskOptions()
      .seed(o.seed)
      .data_dir(o.data_dir_given ? o.data_dir : "")
      .train_samples(o.train_samples)
      .test_samples(o.test_samples);
}

int run_train(TrainOptions o) {
  // Before any file is read: the built-in task, or for a model file the CNN's run (its data and
  // defaults); with --data, trained and scored on that file.
  Task known = find_task(is_builtin(o) && !o.model_file.empty() ? o.model_file : "cnn");
  if (!is_builtin(o)) known.cut = nullptr, known.schedule = nullptr;  // another model: the CNN's data and run only
  if (!o.data_file.empty()) known = or_usage_error("--loss", [&] { return with_data_file(known, o.data_file, o.loss); });
  choose_schedule(o, known);
  check_flags(o);
  apply_task(o, known);
  check_extras_flags(o, known);
  Choice c;
  c.task = is_builtin(o) ? known : or_usage_error("--model", [&] { return script_task(o.model_file, o.data_file, o.loss); });
  c.model = c.task.model(task_options(o));
  c.data = or_usage_error(o.data_file.empty() ? "--data-dir" : "--data", [&] { return c.task.data(task_options(o)); });
  check_run_data(c.task, c.data, o.micro_batches, o.batch_size_given ? o.batch_size : 0);
  check_same_inputs(o, c);
  // The model against its data before --balance-by profiles it (the Trainer checks it too).
  if (!o.balance_by.empty()) check_model_and_data(c.model, c.data.train, c.task.loss_name == "cross_entropy");
  check_resume_before_profile(o, c.model);
  choose_cut(o, c);
  return train_and_report(o, c);
}

}  // namespace gpipe::cli
