// checkpoint.h: `gpipe train --save/--resume`: model, optimizer, step and random states in one file.
#pragma once

#include "sources.h"

#include <torch/optim/optimizer.h>

#include <cstdint>
#include <string>

namespace gpipe::cli {

/// What a training run needs to continue exactly where it stopped.
struct TrainState {
  int64_t step = 0;               ///< optimizer steps taken
  torch::Tensor shuffle_state;    ///< the shuffling generator at the start of the current epoch
  torch::Tensor random_state;     ///< the default generator (dropout seeds)
};

/// Writes a checkpoint of `model` (its parameters and buffers), `optimizer`
/// and `state` to `path`, whole or not at all. For a TorchScript model the
/// file is the script module (loadable with torch.jit.load) with the
/// checkpoint as an extra file; otherwise a pickle that torch.load reads.
void save_checkpoint(const std::string& path, const ModelSource& model,
                     torch::optim::Optimizer& optimizer, const std::string& optimizer_name,
                     const TrainState& state);

/// Reads a checkpoint written by save_checkpoint and restores it into `model`,
/// `optimizer` and the returned state. Everything is checked (readable,
/// complete, same parameter names and shapes, same optimizer) before anything
/// changes; a bad file throws std::runtime_error saying what is wrong.
TrainState load_checkpoint(const std::string& path, const ModelSource& model,
                           torch::optim::Optimizer& optimizer, const std::string& optimizer_name);

}  // namespace gpipe::cli
