// settings.cc: the table of a training run's settings (settings.h), the checks of what settings take,
// and the text of the values any table's rows hold (detail::text_of, read_into).
#include "gpipe/settings.h"

#include "gpipe/check.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <set>
#include <sstream>
#include <type_traits>
#include <stdexcept>

namespace gpipe {

// ---------------------------------------------------------------- checks

namespace {

std::string shown(double value) {
  std::ostringstream out;
  out << value;
  return out.str();
}

// A leading zero: "010", which the command line's parser would read as octal (8).
bool leading_zero(const std::string& text) {
  const size_t first = text.find_first_not_of("+-");
  return first != std::string::npos && text.size() > first + 1 && text[first] == '0';
}

// `text` as a whole number in decimal (all of it, no leading zero), or nullopt.
std::optional<int64_t> whole_of(const std::string& text) {
  if (text.empty() || leading_zero(text)) return std::nullopt;
  errno = 0;
  char* end = nullptr;
  const long long value = std::strtoll(text.c_str(), &end, 10);
  if (errno == ERANGE || end != text.c_str() + text.size() || std::isspace(static_cast<unsigned char>(text[0])))
    return std::nullopt;
  return static_cast<int64_t>(value);
}

// `text` as a finite number (all of it), or nullopt.
std::optional<double> number_of(const std::string& text) {
  if (text.empty() || std::isspace(static_cast<unsigned char>(text[0]))) return std::nullopt;
  char* end = nullptr;
  const double value = std::strtod(text.c_str(), &end);
  if (end != text.c_str() + text.size() || !std::isfinite(value)) return std::nullopt;
  return value;
}

// A number (a whole one with `whole`) that is `ok`, else "must be <rule> (got <text>)".
SettingCheck number_check(const std::string& rule, const std::string& shape, std::function<bool(double)> ok,
                          bool whole = false) {
  return {shape, [rule, ok, whole](const std::string& text) {
            const std::optional<double> value =
                whole ? [&]() -> std::optional<double> {
                  const auto w = whole_of(text);
                  return w ? std::optional<double>(static_cast<double>(*w)) : std::nullopt;
                }()
                      : number_of(text);
            return value && ok(*value) ? std::string() : "must be " + rule + " (got " + text + ")";
          }};
}

}  // namespace

SettingCheck whole_number(int64_t least, int64_t most) {
  return {least > 0 ? "INT>=" + std::to_string(least) : "INT>=0", [least, most](const std::string& text) {
            const std::optional<int64_t> value = whole_of(text);
            if (!value)
              return "must be one whole number" + std::string(least > 0 ? ", at least " + std::to_string(least) : "") +
                     std::string(leading_zero(text) ? ", written without a leading zero" : "") + " (got " + text + ")";
            if (*value < least) return "must be at least " + std::to_string(least) + " (got " + text + ")";
            if (*value > most)
              return "must be a whole number from " + std::to_string(least) + " to " + std::to_string(most) +
                     " (got " + text + ")";
            return std::string();
          }};
}

SettingCheck positive_number() {
  return number_check("a finite number above 0", "NUMBER>0", [](double v) { return v > 0; });
}

SettingCheck non_negative_number() {
  return number_check("a finite number, 0 or more", "NUMBER>=0", [](double v) { return v >= 0; });
}

SettingCheck fraction_below_one() {
  return number_check("a number from 0 up to, not including, 1", "[0,1)", [](double v) { return v >= 0 && v < 1; });
}

SettingCheck number_in(double least, double most, bool whole) {
  return number_check(std::string(whole ? "a whole number" : "a number") + " from " + shown(least) + " to " +
                          shown(most),
                      "[" + shown(least) + "," + shown(most) + "]",
                      [least, most](double v) { return v >= least && v <= most; }, whole);
}

SettingCheck one_of(const std::vector<std::string>& choices, const std::string& meaning) {
  std::string rule, all;
  for (size_t n = 0; n < choices.size(); ++n) {
    rule += (n == 0 ? "" : n + 1 == choices.size() ? " or " : ", ") + choices[n];
    all += (n == 0 ? "" : ",") + choices[n];
  }
  return {"{" + all + "}", [rule, choices, meaning](const std::string& text) {
            return std::find(choices.begin(), choices.end(), text) != choices.end()
                       ? std::string()
                       : "must be " + rule + " (got " + text + ")" + (meaning.empty() ? "" : ": " + meaning);
          }};
}

SettingCheck non_empty() {
  return {"PATH", [](const std::string& text) { return text.empty() ? std::string("needs a name: it is empty") : ""; }};
}

SettingCheck seed_number() {
  return {"UINT64", [](const std::string& text) {
            errno = 0;
            char* end = nullptr;
            const bool digits = !text.empty() && text.find_first_not_of("0123456789") == std::string::npos &&
                                !leading_zero(text);
            if (digits) std::strtoull(text.c_str(), &end, 10);
            return digits && errno != ERANGE && end == text.c_str() + text.size()
                       ? std::string()
                       : "must be a whole number from 0 to 18446744073709551615 (got " + text + ")";
          }};
}

// ---------------------------------------------------------------- the table

namespace {

// "cnn 8, resnet 14, ...": a default of each built-in task, for a help text.
std::string per_task(const std::function<std::string(const TaskDefaults&)>& value) {
  std::string out;
  for (const std::string& name : task_names()) out += (out.empty() ? "" : ", ") + name + " " + value(find_task(name).defaults);
  return out;
}

// Each built-in task and what it is, for `model`'s help.
std::string task_list() {
  std::string out;
  for (const std::string& name : task_names()) out += name + " (" + find_task(name).summary + "), ";
  std::string workloads;
  for (const std::string& name : task_names(true))
    if (find_task(name).workload) workloads += (workloads.empty() ? "" : ", ") + name;
  return out + "a benchmark workload on its random batch (" + workloads + ")";
}

// The model, its data and its pipeline.
std::vector<Setting> model_settings() {
  using S = TrainSettings;
  return {
      {"data_dir", "--data-dir",
       "folder with the gzipped IDX files of Fashion-MNIST; with `model` gpt, the folder of fortune files (default " +
           std::string(kFortunesDir) + ")",
       &S::data_dir, non_empty()},
      {"model", "--model",
       "a built-in task: " + task_list() + "; or FILE: a TorchScript nn.Sequential saved in Python "
       "(torch.jit.script(model).save(FILE)) whose top-level children are the layers cut into stages; default: cnn",
       &S::model, non_empty()},
      {"data", "--data",
       "a dataset saved in Python with torch.save({'input': X, 'target': Y}, FILE), instead of Fashion-MNIST "
       "(evaluated on itself)",
       &S::data, non_empty()},
      {"loss", "--loss", "cross_entropy (integer class targets) or mse (mean reduction)", &S::loss,
       one_of({"cross_entropy", "mse"})},
      {"devices", "--stages",
       "K, the number of devices (with `schedule` interleaved each runs V stages); cut as `schedule` auto predicts "
       "fastest, or with another schedule: the built-in CNN on 2 {3, 1, 2, 5} interleaved (`schedule` task), or "
       "{3, 8}; otherwise evenly; under mpirun -np N or torchrun --nproc_per_node N, one rank per device and N/K "
       "pipeline replicas",
       &S::devices, whole_number(1), "devices"},
      {"balance", "--balance", "layers per stage, K x V entries, e.g. `balance` 3,8 (overrides the cut)", &S::balance,
       whole_number(1), "balance"},
      {"balance_by", "--balance-by",
       "cut the `devices` stages by per-layer cost on one micro-batch: params (parameter counts), time (profiled "
       "forward+backward) or memory (activations kept, parameters, gradients, optimizer state); the exact min-max "
       "cut (of the devices where a schedule puts several stages on one), printed with its predicted step",
       &S::balance_by, one_of({"params", "time", "memory"})},
      {"micro_batches", "--micro-batches",
       "micro-batches M per mini-batch (default: chosen by `schedule` auto; 4 with a schedule named, or task)",
       &S::micro_batches, whole_number(1), "chunks"},
      {"checkpoint", "--checkpoint",
       "re-materialization: always, except_last or never (the CNN's activations are small)", &S::checkpoint,
       one_of(checkpoint_names()), "checkpoint"},
      {"batch_norm", "--batch-norm",
       "BatchNorm layers in training: deferred (as the paper: each micro-batch normalized by its own statistics, "
       "the running statistics updated once per step from all its rows) or per-micro-batch (updated by each "
       "micro-batch, as M small batches would)",
       &S::batch_norm, one_of({"deferred", "per-micro-batch"}), "batch_norm"},
      {"precision", "--precision",
       "the arithmetic of each stage's forward and its recompute: fp32; bf16 (under autocast to bfloat16 for the "
       "device's kind: matrix products and convolutions in bfloat16, the rest in float32); fp16 (the same in "
       "float16, with one loss scale for every stage and rank, as torch.cuda.amp.GradScaler: a step whose "
       "gradients overflow is skipped everywhere and the scale halves; a CPU runs it only with torch 2.4 or "
       "later); the parameters, gradients and optimizer state stay float32, and what crosses between stages "
       "crosses in the type it has; `schedule` auto profiles the layers in it",
       &S::precision, one_of(precision_names()), "precision"},
      {"loss_scale", "--loss-scale",
       "one loss scale for every stage and rank, as torch.cuda.amp.GradScaler keeps it: 65536 at first, halved "
       "after a step whose gradients are not all finite (skipped on every stage and rank, its parameters as they "
       "were), doubled after 2000 finite steps; kept in gpipe train's checkpoint (Python: GPipe.loss_scaler's "
       "state_dict()). auto: under `precision` fp16; dynamic: in any precision; off: never",
       &S::loss_scale, one_of({"auto", "dynamic", "off"}), "loss_scale"},
  };
}

// The schedule, the batches and how long the run is.
std::vector<Setting> batch_settings() {
  using S = TrainSettings;
  return {
      {"augment", "--augment",
       "flip: mirror each training image left to right in about half the epochs (chosen per image and epoch from "
       "`seed`, so a resumed run mirrors alike); none; auto: flip for `model` resnet, none otherwise",
       &S::augment, one_of({"auto", "none", "flip"})},
      {"schedule", "--schedule",
       "the order of forwards and backwards: " + schedule_help() + "; auto (the default): the layers profiled "
       "(about 8 forward and backward passes of the batch for each M weighed, twice, in two rounds over all of "
       "them: a few seconds for the CNN), every "
       "schedule x V x M (M only when `micro_batches` is not given) that fits this machine's memory at `devices` "
       "and `batch_size` simulated, and the fastest predicted run with its cut (unless `balance`, or "
       "`balance_by`'s from the same profile); printed with its predicted and measured step and bubble; with "
       "`resume`, the pipeline the file was trained with; under mpirun or torchrun rank 0 chooses and every rank "
       "takes its choice (with `per_device_files`: task). The choice follows "
       "measured times, so two runs may choose differently and differ in the last bits: name a schedule, or task, "
       "for runs that repeat bit for bit. task: the task's own, interleaved with the cut {3, 1, 2, 5} for the "
       "built-in CNN on 2 stages, gpipe otherwise. See gpipe schedule and docs/schedules.md",
       &S::schedule, one_of(schedule_choices({"task", "auto"})), "schedule"},
      {"virtual_stages", "--virtual-stages",
       "V, stages per device (" + virtual_stages_help() + "): the model is cut into K x V stages, stage s on "
       "device s mod K unless placed as a V",
       &S::virtual_stages, whole_number(1), "virtual_stages"},
      {"batch_size", "--batch-size",
       "samples per mini-batch (one optimizer step), at most the training samples; default: the task's own (" +
           per_task([](const TaskDefaults& d) { return std::to_string(d.batch_size); }) + ")",
       &S::batch_size, whole_number(1, kMostInt64)},
      {"drop_last", "--drop-last",
       "leave out each epoch's last batch when it is smaller than `batch_size` (kept by default, as PyTorch's "
       "DataLoader keeps it)",
       &S::drop_last, {}},
      {"shuffle", "--no-shuffle", "take the samples in their order every epoch, instead of shuffled", &S::shuffle, {}},
      {"epochs", "--epochs",
       "passes over the training set (default: the task's own: " +
           per_task([](const TaskDefaults& d) { return std::to_string(d.epochs); }) +
           "); 0 with `resume`: no training, only the evaluation (and `bytes`) of the checkpoint's model",
       &S::epochs, whole_number(0)},
      {"steps", "--steps", "stop after this many optimizer steps in all, resumed ones included (0: no limit)",
       &S::steps, whole_number(0, kMostInt64)},
  };
}

// The optimizer and its learning rate.
std::vector<Setting> optimizer_settings() {
  using S = TrainSettings;
  return {
      {"optimizer", "--optimizer", "sgd, adam or adamw (torch.optim's)", &S::optimizer,
       one_of({"sgd", "adam", "adamw"})},
      {"lr", "--lr",
       "learning rate (default: the task's own: " + per_task([](const TaskDefaults& d) { return shown(d.lr); }) + ")",
       &S::lr, positive_number()},
      {"momentum", "--momentum", "SGD's momentum (as torch.optim.SGD: default 0)", &S::momentum,
       non_negative_number()},
      {"nesterov", "--nesterov", "SGD with Nesterov momentum (needs `momentum` above 0)", &S::nesterov, {}},
      {"weight_decay", "--weight-decay",
       "L2 penalty (SGD, Adam) or decoupled weight decay (AdamW); default 0, and 0.01 for adamw, as torch.optim",
       &S::weight_decay, non_negative_number()},
      {"betas", "--betas", "Adam's and AdamW's two betas, e.g. `betas` 0.9,0.999", &S::betas, fraction_below_one()},
      {"lr_schedule", "--lr-schedule",
       "constant (cosine for `model` resnet and gpt); cosine (from `lr` down to 0 over the run); step (times "
       "`lr_gamma` every `lr_step_size` steps); after `warmup_steps` of linear warm-up",
       &S::lr_schedule, one_of({"constant", "cosine", "step"})},
      {"warmup_steps", "--warmup-steps",
       "steps of linear warm-up: step t runs at `lr` x (t+1)/W; at most the run's steps (a longer warm-up would "
       "never reach `lr`)",
       &S::warmup_steps, whole_number(0, kMostInt64)},
      {"lr_step_size", "--lr-step-size", "`lr_schedule` step: steps between decays (default: one epoch)",
       &S::lr_step_size, whole_number(1, kMostInt64)},
      {"lr_gamma", "--lr-gamma", "`lr_schedule` step: the factor of each decay", &S::lr_gamma, positive_number()},
      {"clip_grad_norm", "--clip-grad-norm",
       "scale the gradient down to this L2 norm when it is larger: the norm of the whole model's gradient, over "
       "every stage and rank, as torch.nn.utils.clip_grad_norm_ on one device",
       &S::clip_grad_norm, positive_number()},
  };
}

// The seed, the threads, the samples used, and what the run saves, writes and samples.
std::vector<Setting> output_settings() {
  using S = TrainSettings;
  return {
      {"seed", "--seed", "seed of the model, the shuffling and dropout (0 to 2^64-1)", &S::seed, seed_number()},
      {"threads_per_device", "--threads-per-stage", "intra-op threads of each device (at most the machine's cores)",
       &S::threads_per_device, whole_number(1), "threads"},
      {"train_samples", "--train-samples", "use only the first N training samples (0: all)", &S::train_samples,
       whole_number(0, kMostInt64)},
      {"test_samples", "--test-samples", "use only the first N Fashion-MNIST test images (0: all)", &S::test_samples,
       whole_number(0, kMostInt64)},
      {"save", "--save",
       "write a checkpoint file (model, optimizer, step, random states) after every epoch and at the end, whole or "
       "not at all; with `model` it is TorchScript that torch.jit.load reads; under mpirun or torchrun the first "
       "rank gathers every stage into this one file. With `save`, SIGINT (Ctrl-C), SIGTERM or SIGHUP lets the step "
       "in progress finish (one abandoned after 10 s is undone), saves, prints the command that resumes, and exits "
       "130, 143 or 129; a second signal ends at once, the file saved before intact. Without `save` they end the "
       "run at once",
       &S::save, non_empty()},
      {"save_every", "--save-every",
       "with `save`: also save every STEPS optimizer steps (counted over the whole run), so that a killed run or a "
       "dead MPI rank loses at most STEPS steps",
       &S::save_every, whole_number(1, kMostInt64)},
      {"resume", "--resume",
       "continue from a checkpoint file written by `save`, with the same model and optimizer and any `devices`, "
       "schedule or number of ranks; under `schedule` auto (not with `per_device_files`), with the pipeline the "
       "file records, "
       "where the run has its `devices` and `batch_size` and names no other `micro_batches`, `virtual_stages` or "
       "`balance`",
       &S::resume, non_empty()},
      {"update_after_step", "--update-after-step",
       "apply each step's optimizer update after the step on one thread, while the devices wait (default: each "
       "stage's share on its device during the next step, before the stage's first action, in time the device "
       "would wait for its input; the same update to the bit)",
       &S::update_after_step, {}},
      {"per_device_files", "--per-device-files",
       "under mpirun or torchrun, `save` and `resume` use one file per device (its stages), FILE.stage<j>-of-<K>, "
       "for checkpoint files above the 2 GiB one MPI gather carries (or too large for rank 0's memory) (resume "
       "with the same K); --per-stage-files is its old name",
       &S::per_device_files, {}},
      {"trace", "--trace",
       "write the last training step's timeline: an SVG chart if FILE ends in .svg (any case), otherwise "
       "Chrome-trace JSON (open it in Perfetto)",
       &S::trace, non_empty()},
      {"samples", "--samples",
       "`model` unet: write FILE.png, the first 8 test images noisy, denoised and clean, one row each (the noise, "
       "of standard deviation 0.3 in pixel values, is drawn once from `seed`)",
       &S::samples, non_empty()},
      {"bytes", "--generate",
       "`model` gpt: after training (or with `resume` FILE `epochs` 0), print this many bytes sampled from the "
       "model, continuing `prompt` as a new fortune; bytes other than printable ASCII, newline and tab are shown "
       "as \\xNN; where standard output is not a terminal, progress every 2 s on standard error",
       &S::generate, whole_number(0)},
      {"prompt", "--prompt", "`bytes`: the text the sample continues (default: none)", &S::prompt, {}},
      {"temperature", "--temperature",
       "`bytes`: the scores are divided by this before sampling (lower: more likely bytes; seeded by `seed`)",
       &S::temperature, positive_number()},
  };
}

std::vector<Setting> make_train_settings() {
  std::vector<Setting> rows;
  for (auto group : {model_settings, batch_settings, optimizer_settings, output_settings}) {
    std::vector<Setting> more = group();
    rows.insert(rows.end(), more.begin(), more.end());
  }
  // The row `name` (a misspelt name is the library's mistake: said at once).
  auto row = [&rows](const std::string& name) -> Setting& {
    const auto found = std::find_if(rows.begin(), rows.end(), [&](const Setting& s) { return s.name == name; });
    if (found == rows.end()) throw std::logic_error("gpipe: the settings' table has no row " + name);
    return *found;
  };
  // What the help shows the default of, a list's count, and the flags that read otherwise.
  for (const char* name : {"data_dir", "loss", "devices", "checkpoint", "batch_norm", "precision", "loss_scale", "augment",
                           "schedule", "batch_size", "steps", "optimizer", "lr", "momentum", "lr_schedule",
                           "warmup_steps", "lr_gamma", "seed", "threads_per_device", "train_samples", "test_samples",
                           "temperature"})
    row(name).shows_default = true;
  row("betas").values = 2;
  row("shuffle").flag_sets = false;
  row("per_device_files").old_flag = "--per-stage-files";
  return rows;
}

}  // namespace

const std::vector<Setting>& train_settings() {
  static const std::vector<Setting> rows = make_train_settings();
  return rows;
}

std::vector<std::string> schedule_choices(const std::vector<std::string>& first) {
  std::vector<std::string> names = first;
  for (const std::string& name : schedule_names()) names.push_back(name);
  return names;
}

const Setting& find_setting(const std::string& name) {
  const std::vector<Setting>& rows = train_settings();
  const auto row = std::find_if(rows.begin(), rows.end(), [&](const Setting& s) { return s.name == name; });
  if (row == rows.end()) throw std::logic_error("gpipe: no training setting is named " + name);
  return *row;
}

namespace detail {

std::string text_of(bool value) { return value ? "true" : "false"; }
std::string text_of(const std::string& value) { return value; }
std::string text_of(double value) {
  std::ostringstream out;
  out.precision(17);
  out << value;
  return out.str();
}
std::string text_of(int value) { return std::to_string(value); }
std::string text_of(int64_t value) { return std::to_string(value); }
std::string text_of(uint64_t value) { return std::to_string(value); }

// `text` split at its commas, an empty entry kept for the check to refuse ("" is no entry).
std::vector<std::string> entries_of(const std::string& text) {
  std::vector<std::string> out;
  if (text.empty()) return out;
  for (size_t at = 0;;) {
    const size_t comma = text.find(',', at);
    out.push_back(text.substr(at, comma - at));
    if (comma == std::string::npos) return out;
    at = comma + 1;
  }
}

void read_into(const std::string& text, bool& value) { value = text == "true"; }
void read_into(const std::string& text, std::string& value) { value = text; }
void read_into(const std::string& text, double& value) { value = std::strtod(text.c_str(), nullptr); }
void read_into(const std::string& text, uint64_t& value) { value = std::strtoull(text.c_str(), nullptr, 10); }
void read_into(const std::string& text, int& value) { value = static_cast<int>(std::strtoll(text.c_str(), nullptr, 10)); }
void read_into(const std::string& text, int64_t& value) { value = std::strtoll(text.c_str(), nullptr, 10); }

std::string check_entries(const SettingCheck& check, int count, FieldKind kind, const std::string& text) {
  if (kind == FieldKind::kBool && text != "true" && text != "false") return "must be true or false (got " + text + ")";
  const bool list = kind == FieldKind::kList;
  const std::vector<std::string> values = list ? entries_of(text) : std::vector<std::string>{text};
  if (list && std::find(values.begin(), values.end(), "") != values.end())
    return "has an empty entry (got " + text + "): separate its values by one comma each";
  if (count != 0 && static_cast<int>(values.size()) != count)
    return "takes " + std::to_string(count) + " values separated by commas (got " + std::to_string(values.size()) + ")";
  for (const std::string& value : values)
    if (const std::string wrong = check.check ? check.check(value) : ""; !wrong.empty()) return wrong;
  return "";
}

}  // namespace detail

void set_setting(const Setting& setting, TrainSettings& settings, const std::string& text) {
  set_field(setting, settings, text);
  settings.given.insert(setting.name);
}

bool setting_asked(const TrainSettings& s, const std::string& name) {
  static const TrainSettings defaults;
  const Setting& row = find_setting(name);
  return s.was_given(name) || field_text(row, s) != field_text(row, defaults);
}

PipelineRequest with_request_settings(PipelineRequest request, const TrainSettings& s) {
  if (setting_asked(s, "precision")) request.precision = parse_precision(s.precision);
  return request;
}

std::optional<LossScaleOptions> loss_scale_of(const TrainSettings& s) {
  if (s.loss_scale == "auto") return std::nullopt;
  return LossScaleOptions().enabled(s.loss_scale == "dynamic");
}

PipelineOptions with_pipeline_settings(PipelineOptions options, const TrainSettings& s) {
  return options.checkpoint(parse_checkpoint(s.checkpoint))
      .deferred_batch_norm(s.batch_norm == "deferred")
      .threads_per_device(s.threads_per_device);
}

void check_train_settings(const TrainSettings& settings) {
  for (const std::string& name : settings.given) find_setting(name);  // a mark no row has: the caller's mistake
  static const TrainSettings defaults;
  for (const Setting& row : train_settings())
    if (const std::string text = field_text(row, settings); text != field_text(row, defaults))
      check_field_or_throw(row, text);  // a default is taken as it is
}

bool TrainSettings::was_given(const std::string& name) const {
  find_setting(name);
  return given.count(name) > 0;
}

}  // namespace gpipe
