// trainer_files.cc: the Trainer's run saved and resumed: one whole snapshot file, or under MPI one
// file per device with a manifest written last (a save that does not end leaves the set it names);
// every rank checks the files it resumes from before any restores them.
#include "gpipe/train.h"

#include "gpipe/check.h"
#include "gpipe/digest.h"
#include "gpipe/io.h"
#include "gpipe/stop.h"
#include "train/stage_updates.h"
#include "train/trainer_parts.h"

#include <torch/torch.h>

#include <algorithm>
#include <filesystem>
#include <functional>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

namespace gpipe {
namespace {

// How a save at `path` is named on standard error when a signal ends the process (note_saved).
std::string saved_name(const std::string& path, bool per_device) {
  return per_device ? path + " (per-device files)" : path;
}

// Per-device files: the manifest, written by the first rank once every device's file is whole,
// names their step; until then each device keeps its file of the step before as FILE.prev.
const char* kManifestFormat = "gpipe-per-device-snapshot-1";

std::string manifest_text(int64_t step, int devices) {
  return std::string(kManifestFormat) + "\nstep " + std::to_string(step) + "\ndevices " + std::to_string(devices) +
         "\n";
}

// The device counts K of the per-device files beside `path` (PATH.stage<j>-of-K, any device j:
// a set that lacks device 0's file is still a set of K), smallest first, each once.
std::vector<int> per_device_sets(const std::string& path) {
  namespace fs = std::filesystem;
  const fs::path file(path);
  const fs::path folder = file.parent_path().empty() ? fs::path(".") : file.parent_path();
  const std::string prefix = file.filename().string() + ".stage";
  auto digits = [](const std::string& s) {
    return !s.empty() && s.size() <= 6 && s.find_first_not_of("0123456789") == std::string::npos;
  };
  std::vector<int> sets;
  std::error_code ec;
  for (fs::directory_iterator it(folder, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (name.rfind(prefix, 0) != 0) continue;
    const std::string rest = name.substr(prefix.size());  // <j>-of-<K>
    const size_t of = rest.find("-of-");
    if (of == std::string::npos || !digits(rest.substr(0, of)) || !digits(rest.substr(of + 4))) continue;
    sets.push_back(std::stoi(rest.substr(of + 4)));
  }
  std::sort(sets.begin(), sets.end());
  sets.erase(std::unique(sets.begin(), sets.end()), sets.end());
  return sets;
}

// "2" or "2 and 4": the K of those sets.
std::string counts_text(const std::vector<int>& sets) {
  std::string out;
  for (size_t n = 0; n < sets.size(); ++n)
    out += (n == 0 ? "" : n + 1 == sets.size() ? " and " : ", ") + std::to_string(sets[n]);
  return out;
}

// A whole checkpoint file `path` that is not there, where a job saved per-device files under its
// name: refused, saying how to resume them.
void refuse_per_device_set(const std::string& path) {
  const std::vector<int> sets = per_device_sets(path);
  if (std::filesystem::exists(path) || sets.empty()) return;
  const std::string k = counts_text(sets);
  throw std::invalid_argument("no such file: " + path + "; there are per-device files " + path + ".stage0-of-" +
                              std::to_string(sets.front()) + " ..., one per rank of a job: resume them under "
                              "mpirun -np " + k + " or torchrun --nproc_per_node " + k + " with `devices` " + k +
                              " `per_device_files`");
}

// What per-device files hold: each device's layers of the cut that saved them.
const char* kPerDeviceCut =
    "; per-device files hold the layers each device had when they were saved: resume them with the same "
    "`devices`, `balance`, `schedule` and `virtual_stages` as that run, or save one whole file (without "
    "`per_device_files`), which resumes with any cut";

// The step a manifest names, or -1 when there is no manifest; throws for a file that is not one.
int64_t manifest_step(const std::string& manifest, int devices) {
  if (!std::filesystem::exists(manifest)) return -1;
  std::istringstream in(read_file(manifest));
  std::string format, step_word, devices_word;
  int64_t step = -1;
  int saved_devices = 0;
  if (!(in >> format >> step_word >> step >> devices_word >> saved_devices) || format != kManifestFormat ||
      step_word != "step" || devices_word != "devices" || step < 0)
    throw std::invalid_argument(manifest + " is not a manifest of per-device files written by gpipe train "
                                "`per_device_files`; resume from the files of a run that saved them");
  if (saved_devices != devices)
    throw std::invalid_argument(manifest + " is of a run with " + std::to_string(saved_devices) +
                                " devices; resume with the same number of devices (`devices` " +
                                std::to_string(saved_devices) + ")");
  return step;
}

}  // namespace

std::optional<SavedPipeline> check_snapshot_of(const std::string& path, const Model& model,
                                               const std::string& optimizer_name) {
  refuse_per_device_set(path);
  const RandomStateGuard guard;  // building the model draws random numbers
  const torch::nn::Sequential whole = model.build(LayerRange{});
  const Snapshot file = read_snapshot(path, whole, optimizer_name, model.script.has_value());
  GPIPE_CHECK(file.parameters_in_file == file.parameters_taken, path, " is a checkpoint file of another model: "
              "it holds ", file.parameters_in_file, " parameters, this model ", file.parameters_taken);
  return file.state.pipeline;
}

std::string Trainer::manifest_file(const std::string& path) const { return path + ".manifest"; }

std::string Trainer::snapshot_file(const std::string& path, int device) const {
  if (!options_.per_device_files()) return path;
  const int K = pipeline_->devices();
  return path + ".stage" + std::to_string(device < 0 ? pipeline_->device() : device) + "-of-" + std::to_string(K);
}

void Trainer::resume(const std::string& resume_path) {
  const std::string path = snapshot_file(resume_path);
  const std::string optimizer = optimizer_name(options_.optimizer().kind());
  // Every rank reads and checks the file: all of them refuse it, or none, before any restores it.
  Snapshot r;
  // Per-device files are plain snapshots, also of a TorchScript model.
  const bool script = model_.script.has_value() && !options_.per_device_files();
  on_every_rank([&] {
    const std::string previous = path + ".prev";
    const bool per_device = options_.per_device_files();
    // What a save killed by SIGKILL left (PATH.tmp.<pid>.*, its writer gone) goes, as a save's would.
    remove_stale_temporaries(path);
    if (per_device) remove_stale_temporaries(manifest_file(resume_path));
    if (!std::filesystem::is_regular_file(path) && !(per_device && std::filesystem::is_regular_file(previous))) {
      const std::vector<int> sets = per_device_sets(resume_path);
      const std::string k = counts_text(sets);
      if (!per_device) refuse_per_device_set(path);
      if (!per_device) check_input_file(path);  // a folder, a FIFO, a device: says which
      if (std::filesystem::is_regular_file(resume_path))
        throw std::invalid_argument(resume_path + " is one whole checkpoint file, not a set of per-device files: "
                                    "leave out `per_device_files` (a whole file resumes with any `devices`)");
      // A set of this K that lacks this device's file: the fix is a whole set, not another K.
      const bool same_k = std::find(sets.begin(), sets.end(), pipeline_->devices()) != sets.end();
      throw std::invalid_argument(
          "no such file: " + path +
          (sets.empty()  ? " (each device has its own file; resume with the K of the run that saved)"
           : same_k      ? " (the set of " + std::to_string(pipeline_->devices()) + " per-device files of " +
                           resume_path + " lacks this device's file: it is not whole, and no `devices` makes it "
                           "whole; resume from a whole set, or from a save of the run to another path)"
                         : " (the per-device files of " + resume_path + " are of " + k + " devices: resume with "
                           "`devices` " + k + ")"));
    }
    // Per-device files of another cut lack this device's layers: the fix is the cut, not the model.
    auto read = [&](const std::string& file) {
      try {
        return read_snapshot(file, pipeline_->layers(), optimizer, script);
      } catch (const std::runtime_error& e) {
        if (per_device && std::string(e.what()).find(" is a checkpoint file of another model") != std::string::npos)
          throw std::runtime_error(e.what() + std::string(kPerDeviceCut));
        throw;
      }
    };
    const int64_t step = per_device ? manifest_step(manifest_file(resume_path), pipeline_->devices()) : -1;
    if (step < 0) {  // one file, or per-device files of a gpipe without manifests
      r = read(path);
      return;
    }
    // The file of the manifest's step: the device's file, or the one it kept while a save that did
    // not end was writing the next.
    std::string steps;
    for (const std::string& file : {path, previous}) {
      if (!std::filesystem::is_regular_file(file)) continue;
      Snapshot candidate = read(file);
      if (candidate.state.step == step) {
        r = std::move(candidate);
        whole_in_previous_ = file == previous;
        return;
      }
      steps += (steps.empty() ? "" : " and ") + file + " is of step " + std::to_string(candidate.state.step);
    }
    throw std::invalid_argument(manifest_file(resume_path) + " names step " + std::to_string(step) + ", but " + steps +
                                ": the files are of different runs; resume from a whole set of per-device files");
  });
  // Every parameter of the file is taken by some stage: it is this model's, not a larger one's.
  const double taken = pipeline_->sum(pipeline_->replica() == 0 ? static_cast<double>(r.parameters_taken) : 0.0);
  const int64_t expected = options_.per_device_files() ? r.parameters_taken : static_cast<int64_t>(taken);
  GPIPE_CHECK(r.parameters_in_file == expected, path, " is a checkpoint file of another model: it holds ",
              r.parameters_in_file, " parameters, this model ", expected,
              options_.per_device_files() ? kPerDeviceCut : "");
  GPIPE_CHECK(pipeline_->same_everywhere(static_cast<double>(r.state.step)), "the per-device files of ", resume_path,
              " are from different steps (this rank's, ", path, ", from step ", r.state.step,
              "); a run stopped while saving: resume from another checkpoint file");
  if (options_.per_device_files()) {
    // Files of one run draw the data in one order; a file of another run (another --seed) would have
    // each rank draw other batches.
    const uint64_t digest = tensors_digest({r.state.shuffle_state});
    GPIPE_CHECK(pipeline_->same_everywhere(static_cast<double>(digest & ((uint64_t{1} << 52) - 1))),
                "the per-device files of ", resume_path, " are of different runs (they draw the data in different "
                "orders: another `seed`?); resume from the files of one run");
  }
  restore_snapshot(r, pipeline_->layers(), *optimizer_);
  shuffle_.set_state(r.state.shuffle_state);
  epoch_start_shuffle_ = r.state.shuffle_state;  // what a save before any step writes back
  at::Generator random = detail::default_generator();
  random.set_state(r.state.random_state);
  step_ = start_step_ = r.state.step;
  resumed_pipeline_ = r.state.pipeline;
  // The scale continues where it stood (a file of a run without one: this run's first scale); a file
  // that was scaled goes on scaled unless this run says otherwise (TrainerOptions::loss_scale).
  if (!scaler_ && r.state.loss_scale && !options_.loss_scale()) scaler_.emplace();
  if (scaler_ && r.state.loss_scale) scaler_->set_state(*r.state.loss_scale);
  if (options_.save() == resume_path) saved_at_ = step_;  // the save path holds this step already
  // What a process ended by a signal before its first save names as whole: the file it resumed from.
  note_saved(saved_name(resume_path, options_.per_device_files()), step_);
}

void Trainer::save() {
  const std::string& path = options_.save();
  if (path.empty() || saved_at_ == step_) return;
  finish_held_update();
  if (!pipeline_->all_finite())
    throw std::runtime_error("gpipe: the parameters hold NaN or infinite values at step " + std::to_string(step_) +
                             ": no checkpoint file is written for it" +
                             (saved_at_ >= 0 ? " (the one of step " + std::to_string(saved_at_) + " is kept)" : "") +
                             "; lower `lr`, or add `clip_grad_norm`");
  saved_at_ = step_;
  // The shuffling state from which the epoch of the next step is drawn: that epoch's start when
  // its order was drawn already, else the generator as it is.
  const bool drawn = drawn_epoch_ == step_ / steps_per_epoch_;
  TrainState now{step_, drawn ? epoch_start_shuffle_ : detail::generator_state(shuffle_),
                 detail::generator_state(detail::default_generator()), std::nullopt, std::nullopt};
  const PipelinePlan& plan = pipeline_->plan();
  now.pipeline = SavedPipeline{plan.config(), std::min(options_.batch_size(), train_.size())};
  if (scaler_) now.loss_scale = scaler_->state();
  const std::string optimizer = optimizer_name(options_.optimizer().kind());
  if (options_.per_device_files()) {
    save_per_device_files(path, now, optimizer);
    note_saved(saved_name(path, true), now.step);
    return;
  }
  try {
    save_whole_snapshot(*pipeline_, model_, *optimizer_, optimizer, now, path);
  } catch (const std::length_error& e) {  // too large to gather: every rank is here
    throw std::runtime_error(std::string(e.what()) + "; save one file per device (`per_device_files`)");
  }
  note_saved(saved_name(path, false), now.step);
}

void Trainer::save_per_device_files(const std::string& path, const TrainState& now, const std::string& optimizer) {
  // Every rank learns whether every other wrote its part.
  auto on_all = [this](const std::function<void()>& work) {
    detail::on_all_ranks<std::runtime_error>(*pipeline_, work, "could not save its per-device file");
  };
  const bool holds = pipeline_->replica() == 0;  // replicas hold the same parameters
  const std::string file = snapshot_file(path), previous = file + ".prev";
  // 1. Each device's file, the one the manifest names kept aside until the manifest names this step
  //    (already aside when a save that did not end left it there: then PATH is not whole and goes).
  // All or nothing: when any device's file fails, every device puts its files back as they were, so
  // the set stays the one the manifest names (or, before a first save, no file is left without one).
  bool kept_aside = false, written = false;
  try {
    on_all([&] {
      if (!holds) return;
      std::error_code ec;
      if (!whole_in_previous_ && std::filesystem::is_regular_file(file)) {
        std::filesystem::rename(file, previous, ec);
        if (ec) throw std::runtime_error("gpipe: cannot keep " + file + " as " + previous + ": " + ec.message());
        kept_aside = true;
      }
      save_snapshot(file, {encode_snapshot_part(pipeline_->layers(), *optimizer_)}, pipeline_->layers(),
                    std::nullopt, optimizer, now);
      written = true;
      if (fault_.kind == "save" && fault_.rank == pipeline_->rank() && fault_.step == now.step)
        throw std::runtime_error("gpipe: GPIPE_TEST_FAULT=save:" + std::to_string(fault_.rank) + ":" +
                                 std::to_string(fault_.step) + " made this rank's save fail (a test hook)");
    });
  } catch (...) {
    std::error_code ignored;
    if (written) std::filesystem::remove(file, ignored);
    if (kept_aside) std::filesystem::rename(previous, file, ignored);
    throw;
  }
  // 2. The manifest, last: the files it names are all whole.
  on_all([&] {
    if (pipeline_->root()) write_file_atomically(manifest_file(path), manifest_text(now.step, pipeline_->devices()));
  });
  // 3. The files of the step before are no longer needed.
  whole_in_previous_ = false;
  if (holds) {
    std::error_code ignored;
    std::filesystem::remove(previous, ignored);
  }
}

void save_whole_snapshot(Pipeline& pipeline, const Model& model, torch::optim::Optimizer& optimizer,
                         const std::string& optimizer_name, const TrainState& state, const std::string& path) {
  // Replicas hold the same parameters: replica 0's are gathered.
  const std::vector<std::string> parts =
      pipeline.gather(pipeline.replica() == 0 ? encode_snapshot_part(pipeline.layers(), optimizer) : "");
  if (!pipeline.root()) return;
  // A TorchScript file is the script module with every stage's values: under MPI the first rank's
  // copy of the whole model (its layers share that module's tensors) takes them before it is written.
  torch::nn::Sequential whole = pipeline.layers();
  if (pipeline.device() >= 0 && model.script) {
    const RandomStateGuard guard;
    whole = model.build(LayerRange{});
  }
  save_snapshot(path, parts, whole, model.script, optimizer_name, state);
}

}  // namespace gpipe
