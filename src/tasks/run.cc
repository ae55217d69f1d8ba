// run.cc: a training run as a front end asks for it (TrainSettings): the settings checked and
// completed with the task's own before any work, the model, the data and the cut made ready
// (TrainingRun), and the options a Trainer runs them with. Errors name the settings in backquotes,
// as gpipe train's in_flags shows them as flags. A run's summary and checks of its data: summary.cc.
#include "gpipe/tasks.h"

#include "gpipe/settings.h"

#include "tasks/builtin.h"

#include "gpipe/check.h"
#include "gpipe/cost_model.h"
#include "gpipe/device.h"
#include "gpipe/digest.h"
#include "gpipe/io.h"
#include "gpipe/job.h"
#include "gpipe/microbatch.h"
#include "gpipe/partition.h"

#include <torch/torch.h>

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <iomanip>
#include <map>
#include <sstream>
#include <stdexcept>

namespace gpipe {
using tasks::said_about;

// ---------------------------------------------------------------- a training run as asked for

namespace {

// `schedule` auto, chosen by prediction (under MPI on rank 0, and taken by every rank). Not with
// per-device files under MPI: each holds one device's layers of the cut it was saved with, which a
// resumed run must repeat before it has read them, so that auto is the task's own there.
bool predicted(const TrainSettings& s) {
  return s.schedule == "auto" && !(job().distributed && s.per_device_files);
}

// What `s` ask of the pipeline: M left open only to a prediction (otherwise the default's 4 runs).
PipelineRequest run_request(const TrainSettings& s) {
  PipelineRequest r;
  r.devices = s.balance.empty() || s.was_given("devices") ? std::optional<int>(s.devices) : std::nullopt;
  r.micro_batches = s.was_given("micro_batches") || !predicted(s) ? std::optional<int>(s.micro_batches) : std::nullopt;
  r.schedule = s.schedule;
  if (s.virtual_stages != 0) r.virtual_stages = s.virtual_stages;
  r.balance = s.balance;
  r.balance_by = s.balance_by;
  return with_request_settings(r, s);
}

// The schedule of "task" (or of "auto" where nothing is predicted), V and the cut by time: the task's
// own choices.
void resolve_own(TrainSettings& s, const Task& task) {
  PipelineRequest r = run_request(s);
  r.devices = s.devices;
  r.micro_batches = s.micro_batches;  // nothing predicts it here: the settings' own (4 by default)
  r = resolve_run(task.own(), r);  // "auto" is "task" there
  s.schedule = r.schedule;
  s.virtual_stages = r.virtual_stages.value_or(0);
  s.balance_by = r.balance_by;
}

bool generates(const Task& task) { return task.context > 0; }

// Every setting that can be judged without reading a file.
void check_settings(const TrainSettings& s) {
  GPIPE_CHECK(!job().distributed || s.balance_by.empty(), "`balance_by` profiles the whole model in one process; "
              "run it once without ", job().launcher, " and pass the cut it prints with `balance`");
  const bool builtin = is_builtin_task(s.model);
  GPIPE_CHECK(!builtin || !std::filesystem::exists(s.model), "`model` ", s.model, " names a built-in model, and "
              "there is also a file ", s.model, " here; for the file, say `model` ./", s.model);
  if (builtin && !s.model.empty() && !s.data.empty()) {
    const Task& task = find_task(s.model);
    GPIPE_CHECK(false, "`model` ", s.model, " is built to train on ",
                task.data_dir == kFortunesDir ? "the fortune files; give their folder with `data_dir`"
                : task.workload               ? "its own random batch"
                                              : "Fashion-MNIST",
                "; leave out `data` (or give a TorchScript model file of your own to `model`)");
  }
  GPIPE_CHECK(!s.was_given("epochs") || s.epochs != 0 || !s.resume.empty(), "`epochs` 0 trains nothing: it evaluates the "
              "model of a checkpoint; give it with `resume` FILE, or ask for 1 or more epochs");
  check_threads_per_device(s.threads_per_device);
  GPIPE_CHECK(s.balance.empty() || s.balance_by.empty(), "`balance` and `balance_by` ", s.balance_by,
              " both choose the cut; give one of them");
  if (!predicted(s))
    said_about("`virtual_stages` " + std::to_string(s.virtual_stages), [&] {
      check_virtual_stages(parse_schedule(s.schedule), s.virtual_stages);
      return 0;
    });
  // The optimizer's settings, as torch.optim takes them.
  optimizer_options_of(s).check();
  GPIPE_CHECK(s.lr_schedule == "step" || !(s.was_given("lr_step_size") || s.was_given("lr_gamma")),
              "`lr_step_size` and `lr_gamma` belong to `lr_schedule` step");
  GPIPE_CHECK(s.save_every == 0 || !s.save.empty(), "`save_every` ", s.save_every, " needs `save` FILE: the file to "
              "save to");
  GPIPE_CHECK(!s.per_device_files || !s.save.empty() || !s.resume.empty(), "`per_device_files` says how `save` "
              "writes and `resume` reads a checkpoint file; give `save` FILE or `resume` FILE with it");
  // Outputs: found unwritable now, not after training.
  GPIPE_CHECK(!s.per_device_files || job().distributed, "`per_device_files` is for a job of several processes "
              "(mpirun, torchrun), where each device writes its own file; in one process `save` writes the whole model");
  // No output may replace an input or the other output (`save` may replace `resume`'s file).
  auto same_file = [](const std::string& a, const std::string& b) {
    std::error_code error;
    return !a.empty() && !b.empty() &&
           std::filesystem::weakly_canonical(a, error) == std::filesystem::weakly_canonical(b, error);
  };
  using Named = std::pair<std::string, std::string>;
  for (const auto& [output, path] : {Named{"save", s.save}, {"trace", s.trace}, {"samples", s.samples}}) {
    for (const auto& [input, other] : {Named{"data", s.data}, {"model", s.model}, {"resume", s.resume},
                                       {"trace", s.trace}, {"samples", s.samples}})
      GPIPE_CHECK(output == input || (output == "save" && input == "resume") || !same_file(path, other), "`",
                  output, "` ", path, " is the file of `", input, "`; writing it would replace ",
                  input == "trace" || input == "samples" ? "that output" : "your input", ": give another path");
    // Nor a file of the data set's folder (read when no `data` file is given).
    std::error_code error;
    const bool in_data_dir = s.data.empty() && !path.empty() && std::filesystem::is_regular_file(path, error) &&
                             same_file(std::filesystem::absolute(path, error).parent_path().string(), s.data_dir);
    GPIPE_CHECK(!in_data_dir, "`", output, "` ", path, " is a file of `data_dir` ", s.data_dir,
                ", the data set's folder; writing it would replace your input: give another path");
  }
  // The single checkpoint file and the trace are written by the first rank; per-device files are
  // checked where they are written, once the devices are placed.
  for (const auto& [name, path] : {Named{"save", s.per_device_files ? "" : s.save}, {"trace", s.trace},
                                   {"samples", s.samples}})
    if (job().rank == 0 && !path.empty()) said_about("`" + name + "`", [&, path = path] { check_writable(path); return 0; });
}

// The task's defaults for the settings not given, and the settings that do not fit the task.
void apply_task(TrainSettings& s, const Task& task) {
  const TaskDefaults& d = task.defaults;
  if (s.was_given("loss") && s.loss != task.loss_name)
    GPIPE_CHECK(false, is_builtin_task(s.model) && !s.model.empty()
                           ? "`model` " + s.model + ": its loss is " + task.loss_name + "; leave out `loss`"
                           : "`loss` " + s.loss + " needs `data` with real-valued targets; Fashion-MNIST has class labels");
  s.loss = task.loss_name;
  if (s.epochs == 0 && !s.was_given("epochs")) s.epochs = d.epochs;
  if (!s.was_given("batch_size")) s.batch_size = d.batch_size;
  if (!s.was_given("lr")) s.lr = d.lr;
  if (!s.was_given("lr_schedule")) s.lr_schedule = lr_schedule_name(d.lr_schedule);
  if (s.augment == "auto") s.augment = d.flip ? "flip" : "none";
  const bool images = task.scoring.classification && task.data_dir == kFashionMnistDir;
  GPIPE_CHECK(s.augment != "flip" || images, "`augment` flip mirrors Fashion-MNIST's training images for a "
              "classifier; it is not for ",
              task.denoises      ? "`model` unet, whose targets are the images themselves"
              : task.context > 0 ? "`model` gpt, which reads text"
              : !s.data.empty()  ? "`data`"
                                 : "`model` " + s.model,
              ": use `augment` none");
  // M left to `schedule` auto is chosen among those the batch takes: the default's 4 is only its profile's.
  if (predicted(s) && !s.was_given("micro_batches")) s.micro_batches = static_cast<int>(std::min<int64_t>(s.micro_batches, s.batch_size));
  GPIPE_CHECK(s.micro_batches <= s.batch_size, "`micro_batches` ", s.micro_batches, " is larger than `batch_size` ",
              s.batch_size, "; every micro-batch needs a sample");
  // The task's extras: `bytes` sampled from a language model, `samples` of a denoiser.
  const std::string model = s.model.empty() ? "the default model" : "`model` " + s.model;
  GPIPE_CHECK(s.generate == 0 || generates(task), "`bytes` samples bytes from a language model: it is for `model` "
              "gpt (", model, " is not one)");
  GPIPE_CHECK((!s.was_given("prompt") && !s.was_given("temperature")) || s.generate != 0, s.was_given("prompt") ? "`prompt`" : "`temperature`",
              " belongs to `bytes` N, the bytes to sample from `model` gpt; add ", generates(task) ? "" : "`model` gpt ",
              "`bytes` 200, say");
  GenerateOptions().bytes(s.generate).temperature(s.temperature).check();
  GPIPE_CHECK(s.generate == 0 || !job().distributed, "`bytes` samples byte by byte in one process; train under ",
              job().launcher, " with `save` FILE, then run gpipe train `model` gpt `resume` FILE `epochs` 0 `bytes` N "
              "without ", job().launcher);
  GPIPE_CHECK(!s.was_given("epochs") || s.epochs != 0 || s.save.empty(), "`epochs` 0 trains nothing, so `save` would write "
              "the checkpoint it resumed; leave out `save`");
  GPIPE_CHECK(!s.was_given("epochs") || s.epochs != 0 || s.trace.empty(), "`epochs` 0 trains nothing, so there is no "
              "step for `trace` to draw; leave out `trace`");
  // Settings of a data set that this run would not read.
  GPIPE_CHECK(!task.workload || (s.train_samples == 0 && s.test_samples == 0 && !s.was_given("data_dir")), "`model` ",
              s.model, " trains on its own random batch: `train_samples`, `test_samples` and `data_dir` are for the "
              "tasks with a data set; leave them out");
  GPIPE_CHECK(s.data.empty() || !s.was_given("data_dir"), "`data_dir` is the folder of a built-in data set, which `data` ",
              s.data, " replaces; leave out `data_dir`");
  GPIPE_CHECK(s.samples.empty() || task.denoises, "`samples` writes a picture of denoised test "
              "images: it is for `model` unet");
  GPIPE_CHECK(s.samples.empty() || (s.samples.size() >= 5 && has_extension(s.samples, ".png")), "`samples` ",
              s.samples, ": the picture is a PNG file; give a path that ends in .png");
}

// The pipeline (pipeline_options_of: `balance`, `balance_by`'s min-max cut of measured costs, or
// the task's cut) and its plan, made once.
void choose_cut(const TrainSettings& s, TrainingRun& c) {
  const int V = s.virtual_stages;
  PipelineRequest request = run_request(s);
  if (c.choice) request = with_choice(request, *c.choice);  // `schedule` auto: the cut predicted
  else if (!s.balance_by.empty()) request.balance_by = "even";  // checked before the profile, then cut by cost
  c.options = with_pipeline_settings(pipeline_options_of(c.task.own(), request), s);
  // Every setting the plan is made of, with its value, before what the plan says is wrong with them.
  std::string settings = s.balance.empty() || s.was_given("devices") ? "`devices` " + std::to_string(s.devices) : "";
  if (!s.balance.empty()) settings += (settings.empty() ? "" : " ") + ("`balance` " + format_balance(s.balance));
  settings += " `micro_batches` " + std::to_string(s.micro_batches) + " `schedule` " + s.schedule +
              (V > 1 ? " `virtual_stages` " + std::to_string(V) : "");
  c.plan = said_about(settings, [&] { return make_plan(c.task.layers, c.options); });
  if (s.balance_by.empty() || c.choice) return;
  // `balance_by`: per-layer costs on one micro-batch, then the exact min-max cut (in one process).
  const Dataset& train = c.data.train;
  const torch::Tensor sample =
      train.input.narrow(0, 0, micro_batch_sizes(std::min(s.batch_size, train.size()), s.micro_batches).front());
  c.cost = balance_by(c.model, sample,
                      BalanceByOptions()
                          .method(s.balance_by)
                          .devices(s.devices)
                          .virtual_stages(V)
                          .schedule(parse_schedule(s.schedule))
                          .micro_batches(s.micro_batches)
                          .checkpoint(parse_checkpoint(s.checkpoint))
                          .threads(s.threads_per_device)
                          .optimizer_copies(state_per_parameter_byte(optimizer_options_of(s)))
                          .precision(parse_precision(s.precision)));
  c.options.cut(CutRequest::given(c.cost->balance)).stage_times(c.cost->stage_times);
  c.plan = make_plan(c.task.layers, c.options);
}

// Under MPI every rank reads the model, the data and the checkpoint itself: each from its own
// working folder and machine. A rank that read other bytes would train a mixture, so the bytes
// read must agree.
void check_same_inputs(const TrainSettings& s, const TrainingRun& c) {
  if (!job().distributed) return;
  std::vector<std::pair<std::string, uint64_t>> inputs;
  if (!is_builtin_task(s.model))
    inputs.emplace_back("`model` " + s.model, said_about("`model`", [&] { return file_digest(s.model); }));
  const std::string source = !s.data.empty() ? "`data` " + s.data : c.data.source;
  inputs.emplace_back(source, tensors_digest({c.data.train.input, c.data.train.target, c.data.test.input,
                                              c.data.test.target}));
  if (!s.resume.empty() && !s.per_device_files)  // per-device files differ by design: each rank reads its own
    inputs.emplace_back("`resume` " + s.resume, said_about("`resume`", [&] { return file_digest(s.resume); }));
  check_same_bytes(inputs);
}

// `schedule` auto on `resume`: the pipeline the checkpoint file was trained with where the run is the
// one it was saved by (resumed_choice); else nothing, and `why_not` says what differs.
std::optional<ScheduleChoice> saved_choice(const TrainSettings& s, const TrainingRun& c,
                                           const std::optional<SavedPipeline>& saved, std::string& why_not) {
  if (!saved) return std::nullopt;
  PipelineRequest request = run_request(s);
  request.devices = s.devices;  // compared even where `balance` gives K
  request.checkpoint = parse_checkpoint(s.checkpoint);
  // The file, its pipeline and batch; this run's batch, the one asked for, and the model's layers.
  const ResumedRun run{s.resume, saved->config, saved->batch, std::min(s.batch_size, c.data.train.size()),
                       s.batch_size, c.task.layers};
  return resumed_choice(request, run, why_not);
}

void take_choice(TrainSettings& s, TrainingRun& c, const ScheduleChoice& choice) {
  s.schedule = to_string(choice.config.schedule);
  s.micro_batches = choice.config.micro_batches;
  s.virtual_stages = choice.config.virtual_stages;
  c.choice = choice;
}

// Settings that leave `schedule` auto no configuration at all (K, `balance`, V and M against the
// model's layers and the batch) are refused before the profile: with the error the task's own run
// gives them, which names the setting, where it has one; else auto's.
void check_some_configuration(const TrainSettings& s, const TrainingRun& c) {
  LayerCost layer;  // any positive costs: what fits does not depend on them
  layer.forward_s = layer.backward_s = 2e-3;
  layer.input_grad_s = layer.weight_grad_s = 1e-3;
  CostModel uniform;
  uniform.layers.assign(static_cast<size_t>(c.task.layers), layer);
  PipelineRequest request = run_request(s);
  request.schedule = "auto";
  request.checkpoint = parse_checkpoint(s.checkpoint);
  auto search = [&] { return schedule_candidates(uniform, request, std::min(s.batch_size, c.data.train.size()), 0, 1, 0); };
  try {
    search();
  } catch (const std::invalid_argument&) {
    TrainSettings own = s;
    resolve_own(own, c.task);
    TrainingRun probe = c;
    try {
      choose_cut(own, probe);  // throws the task's run's error, the more precise one, said to be that
    } catch (const std::invalid_argument& e) {
      throw std::invalid_argument("gpipe: `schedule` auto finds no pipeline these settings allow; the task's own "
                                  "(`schedule` " + own.schedule +
                                  ", `micro_batches` " + std::to_string(own.micro_batches) +
                                  ") says why: " + without_program_name(what_of(e)));
    }
    said_about("`schedule` auto", search);
  }
}

// `schedule` auto: the layers profiled on micro-batches of each M weighed (the M given, or each left
// open), and the fastest predicted configuration of those the settings leave open. Under MPI each
// replica's pipeline runs its share of the batch: predicted on that share. With `balance_by` (one
// process), its cut by that cost of the profile at the M given (or the default's). A failure of the
// profile itself (the model's, not the settings') also leaves its message in `profile_error`.
ScheduleChoice choose_by_prediction(const TrainSettings& s, TrainingRun& c, std::optional<std::string>& profile_error) {
  keep_freed_memory();  // profiled with the allocator's settings the pipeline runs with
  const Dataset& train = c.data.train;
  const int64_t batch = first_micro_batch_rows(std::min(s.batch_size, train.size()), replicas_of(s.devices));
  const int64_t rows = first_micro_batch_rows(batch, s.micro_batches);
  const RandomStateGuard guard;  // building the whole model draws random numbers
  const torch::nn::Sequential whole = c.model.build(LayerRange{});
  const torch::Tensor sample = train.input.narrow(0, 0, rows);
  const std::string optimizer = s.optimizer == "sgd" ? (s.momentum > 0 ? "momentum" : "sgd") : "adam";
  // Each M is predicted from the layers profiled on micro-batches of its rows. The Trainer applies the
  // update on the devices unless told otherwise, or a weight is shared by layers (it may be tied
  // across stages, which the Trainer updates on the calling thread): predicted so.
  const bool update_on_devices = !s.update_after_step && shared_tensors(whole).empty();
  PipelineRequest request = run_request(s);
  request.schedule = "auto";
  request.checkpoint = parse_checkpoint(s.checkpoint);
  const int64_t least_rows = said_about("`schedule` auto", [&] { return least_micro_batch_rows(whole, sample); });
  // Each size profiled once (every size the search weighs first, in rounds): `balance_by`'s cut and the
  // search share the profile at `rows`.
  const CostsAtRows profiled = profiles_at_rows(
      whole, train.input.narrow(0, 0, batch), train.target.narrow(0, 0, batch), batch,
      PlanProfileOptions().optimizer(optimizer).layers(ProfileLayersOptions()
                                                           .threads(s.threads_per_device)
                                                           .loss(c.task.loss)
                                                           .precision(parse_precision(s.precision))),
      update_on_devices, profiled_rows(request, batch, least_rows));
  const CostsAtRows profile_at = [&](int64_t at) {
    try {
      return profiled(at);
    } catch (const std::exception& e) {
      profile_error = without_program_name(what_of(e));
      throw;
    }
  };
  std::vector<double> costs;  // `balance_by`'s, for its plan
  if (!s.balance_by.empty()) {
    costs = layer_costs_by(s.balance_by, whole, profile_at(rows), rows);
    request.layer_costs = costs;
  }
  const ScheduleChoice choice = said_about("`schedule` auto", [&] {
    // The devices of this machine share its cores, each running threads_per_device of them.
    return choose_schedule(profile_at, request, batch, 0, least_rows, std::max(1, machine_cores() / s.threads_per_device));
  });
  if (!s.balance_by.empty()) c.cost = cost_balance_of(costs, choice.config, s.balance_by);
  return choice;
}

// `schedule` auto's prediction (under MPI rank 0's, taken by every rank). Where auto is only the
// default and the model cannot be profiled (a layer that changes its input in place, one that fails,
// too little memory), the task's own schedule runs instead, on every rank, and `c.auto_fallback` says
// why; the training then fails, if at all, as its own.
void choose_auto(TrainSettings& s, TrainingRun& c, const std::string& why_not) {
  std::string fallback;
  const std::optional<ScheduleChoice> choice = chosen_on_first_rank(
      [&]() -> std::optional<ScheduleChoice> {
        std::optional<std::string> profile_error;
        try {
          return choose_by_prediction(s, c, profile_error);
        } catch (const std::invalid_argument&) {
          if (s.was_given("schedule") || !profile_error) throw;
          fallback = *profile_error;
          return std::nullopt;
        }
      },
      "`schedule` auto");
  if (!choice) {
    if (!fallback.empty())  // rank 0, which prints it
      c.auto_fallback = "`schedule` auto could not profile the model, so the task's own schedule runs: " + fallback +
                        (why_not.empty() ? "" : "; " + why_not);
    resolve_own(s, c.task);
    return;
  }
  take_choice(s, c, *choice);
  c.choice->not_as_saved = why_not;
}

}  // namespace

bool is_builtin_task(const std::string& model) {
  const std::vector<std::string> names = task_names(/*workloads=*/true);
  return model.empty() || std::find(names.begin(), names.end(), model) != names.end();
}

Task known_task(const TrainSettings& s) {
  Task known = find_task(is_builtin_task(s.model) && !s.model.empty() ? s.model : "cnn");
  if (!is_builtin_task(s.model)) known.cut = nullptr, known.schedule = nullptr;  // another model: the CNN's data and run only
  if (!s.data.empty()) known = said_about("`loss`", [&] { return with_data_file(known, s.data, s.loss); });
  return known;
}

void resolve_training(TrainSettings& s, const Task& task) {
  // The schedule of "task", V and the cut by time: the task's own choices ("auto" is chosen by
  // prediction in prepare_training, once the model and the data are read; under MPI rank 0 predicts it).
  check_train_settings(s);  // each setting by its row: what a flag or a keyword argument is checked for
  check_precision_runs(parse_precision(s.precision), c10::DeviceType::CPU);  // the stages are CPU threads here
  if (!predicted(s)) resolve_own(s, task);
  check_settings(s);
  s.weight_decay = optimizer_options_of(s).decay();
  apply_task(s, task);
}

TaskOptions task_options_of(const TrainSettings& s) {
  return TaskOptions()
      .seed(s.seed)
      .data_dir(s.was_given("data_dir") ? s.data_dir : "")
      .train_samples(s.train_samples)
      .test_samples(s.test_samples);
}

OptimizerOptions optimizer_options_of(const TrainSettings& s) {
  OptimizerOptions options;
  options.kind(parse_optimizer(s.optimizer)).lr(s.lr).momentum(s.momentum).nesterov(s.nesterov);
  if (s.was_given("weight_decay")) options.weight_decay(s.weight_decay);
  if (s.was_given("betas")) options.betas(std::make_tuple(s.betas[0], s.betas[1]));
  return options;
}

void check_resumed_precision(const TrainSettings& s, const Trainer& trainer) {
  const std::optional<SavedPipeline>& file = trainer.resumed_pipeline();
  const Precision runs = trainer.pipeline().plan().precision;
  GPIPE_CHECK(!file || setting_asked(s, "precision") || file->config.precision == runs, s.resume, " was trained in ",
              to_string(file->config.precision), "; give `precision` ", to_string(file->config.precision),
              " to continue it as it was trained, or `precision` ", to_string(runs), " to change it");
}

TrainerOptions trainer_options_of(const TrainSettings& s, const Task& task) {
  TrainerOptions options;
  options.optimizer(optimizer_options_of(s))
      .lr_schedule(LrScheduleOptions()
                       .kind(parse_lr_schedule(s.lr_schedule))
                       .warmup_steps(s.warmup_steps)
                       .step_size(s.lr_step_size)
                       .gamma(s.lr_gamma))
      .clip_grad_norm(s.clip_grad_norm)
      .loss_scale(loss_scale_of(s))
      .batch_size(s.batch_size)
      .drop_last(s.drop_last)
      .shuffle(s.shuffle)
      .seed(s.seed)
      .epochs(std::max(1, s.epochs))  // `epochs` 0: no fit(), only the evaluation
      .steps(s.steps)
      .loss(task.loss)
      .classification(task.scoring.classification)
      .save(s.save)
      .save_every(s.save_every)
      .per_device_files(s.per_device_files)
      .update_on_devices(!s.update_after_step);
  if (s.augment == "flip") {
    const uint64_t seed = s.seed;
    options.augment([seed](const torch::Tensor& x, const torch::Tensor& rows, int epoch) {
      return mirrored(x, rows, epoch, seed);
    });
  }
  return options;
}

TrainingRun prepare_training(TrainSettings& s, const Task& known, const std::function<void()>& profiling) {
  TrainingRun c;
  c.task = is_builtin_task(s.model) ? known : said_about("`model`", [&] { return script_task(s.model, s.data, s.loss); });
  c.model = c.task.model(task_options_of(s));
  c.data = said_about(s.data.empty() ? "`data_dir`" : "`data`", [&] { return c.task.data(task_options_of(s)); });
  if (predicted(s) && !s.was_given("micro_batches"))  // M is chosen among those the data takes
    s.micro_batches = static_cast<int>(std::clamp<int64_t>(c.data.train.size(), 1, s.micro_batches));
  check_run_data(c.task, c.data, s.micro_batches, s.was_given("batch_size") ? s.batch_size : 0);
  check_same_inputs(s, c);
  run_length(trainer_options_of(s, c.task), c.data.train.size());  // the run's length and schedule, before a profile
  // The model against its data before `balance_by` profiles it (the Trainer checks it too).
  if (!s.balance_by.empty() || predicted(s))
    check_model_and_data(c.model, c.data.train, c.task.loss_name == "cross_entropy");
  // `resume` read and checked against the whole model before the profile, which would otherwise be
  // done for a file refused after it (under MPI by every rank, as it reads the whole file).
  // Under `schedule` auto, the pipeline it was trained with is taken again rather than predicted; a
  // run that asks for no `precision` continues in the file's (per-device files are read by the
  // Trainer's resume alone, and check_resumed_precision refuses one trained in another precision).
  std::optional<SavedPipeline> saved;
  if (!s.resume.empty() && (!s.balance_by.empty() || predicted(s) || !setting_asked(s, "precision")) &&
      !s.per_device_files)
    saved = said_about("`resume`", [&] {
      return check_snapshot_of(s.resume, c.model, optimizer_name(parse_optimizer(s.optimizer)));
    });
  if (saved && !setting_asked(s, "precision")) {
    s.precision = to_string(saved->config.precision);
    check_precision_runs(saved->config.precision, c10::DeviceType::CPU);
  }
  // Where auto is only the default, a run that trains nothing (`epochs` 0) and a file that does not
  // say how it was trained (saved by the Python package or an older gpipe) take the task's own, as
  // that default was: nothing to choose for, and the run the file was saved by, most likely.
  const bool evaluates_only = s.was_given("epochs") && s.epochs == 0;
  if (predicted(s) && !s.was_given("schedule") && (evaluates_only || (!s.resume.empty() && !saved)))
    resolve_own(s, c.task);
  if (predicted(s)) {
    std::string why_not;
    if (const std::optional<ScheduleChoice> taken = saved_choice(s, c, saved, why_not)) {
      take_choice(s, c, *taken);
    } else {
      check_some_configuration(s, c);
      if (profiling) profiling();
      choose_auto(s, c, why_not);
    }
  }
  choose_cut(s, c);
  return c;
}

}  // namespace gpipe
