// snapshot.h: a training run's saved state (what `gpipe train --save` writes and `--resume` reads):
// the whole model, its optimizer state and where the run stands, by parameter name, in one file
// written whole or not at all. (Re-materialization, PipelineOptions::checkpoint, is another thing.)
//
// Everything is keyed by the parameter's (or buffer's) name in the whole model,
// so a snapshot saved by any number of stages, in one process or gathered
// from MPI ranks, resumes with any other: each process takes what it holds.
#pragma once

#include "gpipe/loss_scale.h"
#include "gpipe/pipeline_config.h"
#include "gpipe/schedule.h"

#include <torch/nn/modules/container/sequential.h>
#include <torch/script.h>

#include <torch/optim/optimizer.h>

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace gpipe {

/// How the pipeline that saved a snapshot ran its steps. The micro-batches and the cut decide the
/// order in which a step's sums are taken, so a resumed run that takes this again (what `gpipe
/// train`'s `schedule` auto does) repeats the unbroken run bit for bit.
struct SavedPipeline {
  PipelineConfig config;  ///< its schedule, K, V, M, cut, re-materialization and stage times
  int64_t batch = 1;      ///< rows per step (a shorter last batch of an epoch aside)
};

/// What a training run needs to continue exactly where it stopped.
struct TrainState {
  int64_t step = 0;               ///< optimizer steps taken
  torch::Tensor shuffle_state;    ///< the shuffling generator at the start of the current epoch
  torch::Tensor random_state;     ///< the default generator (dropout seeds)
  std::optional<SavedPipeline> pipeline;  ///< absent in files of the Python package and of gpipe before it
  std::optional<LossScaleState> loss_scale;  ///< where the run scales its loss (TrainerOptions::loss_scale)
};

/// What one process holds of a snapshot, as bytes: the parameters and
/// buffers of `layers` and the optimizer's state of each parameter, by name.
/// The parts of every process merge into one snapshot.
std::string encode_snapshot_part(const torch::nn::Sequential& layers, torch::optim::Optimizer& optimizer);

/// Writes the snapshot made of `parts` (encode_snapshot_part of every process, or of
/// this one) to `path`, whole or not at all. With `script`, the file is that
/// TorchScript module, which torch.jit.load reads, with the snapshot inside
/// as an extra file: `layers` must share the script module's tensors, and get
/// the parts' values before it is written. Otherwise a pickle.
void save_snapshot(const std::string& path, const std::vector<std::string>& parts,
                     const torch::nn::Sequential& layers, const std::optional<torch::jit::Module>& script,
                     const std::string& optimizer_name, const TrainState& state);

/// A snapshot read from its file and checked against what this process
/// holds, not yet restored: read_snapshot makes one, restore_snapshot applies it.
struct Snapshot {
  TrainState state;
  int64_t parameters_taken = 0;    ///< how many of the file's parameters this process holds
  int64_t parameters_in_file = 0;  ///< how many the file holds: all processes together must take them all
  std::map<std::string, torch::Tensor> parameters, buffers;  ///< by name in the whole model
  c10::impl::GenericDict optimizer_states{c10::StringType::get(), c10::AnyType::get()};  ///< by parameter name
  std::string optimizer_name;
};

/// Reads a snapshot written by save_snapshot and checks it against `layers`:
/// readable, complete, this process's names and shapes present, the same
/// optimizer. Changes nothing; a bad file throws std::runtime_error saying
/// what is wrong. `script`: the file is TorchScript.
Snapshot read_snapshot(const std::string& path, const torch::nn::Sequential& layers,
                       const std::string& optimizer_name, bool script);

/// `payload` followed by the digest that ends a checkpoint file (save_snapshot seals the pickled
/// dict with it; read_snapshot refuses a file whose digest does not match). For tools that write
/// checkpoint files, and the checkpoint fuzzer.
std::string seal_snapshot(std::string payload);

/// Whether the file at `path` is sealed as save_snapshot seals the checkpoint files of built-in
/// models and per-device files (its digest matches): what a model file given by mistake may be.
/// False for a file that cannot be read.
bool is_sealed_snapshot(const std::string& path);

/// Restores what this process holds of `snapshot` into `layers` and
/// `optimizer`, by name: the layers read_snapshot checked it against.
void restore_snapshot(const Snapshot& snapshot, const torch::nn::Sequential& layers,
                      torch::optim::Optimizer& optimizer);

}  // namespace gpipe
