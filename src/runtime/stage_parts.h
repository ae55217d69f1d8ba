// stage_parts.h: what a stage's forward (stage.cc) and its backward (stage_backward.cc) share, and no
// user of the library sees: buffers kept as they were, and the random stream a re-materialized
// forward replays.
#pragma once

#include "gpipe/stage.h"

#include <torch/torch.h>

#include <cstdint>
#include <mutex>
#include <vector>

namespace gpipe::detail {

// Keeps `buffers` (a BatchNorm's running statistics and batch count) as they
// are for its lifetime: what a forward does to them is undone when it ends.
class KeepBuffers {
 public:
  explicit KeepBuffers(std::vector<torch::Tensor> buffers);
  ~KeepBuffers();
  KeepBuffers(const KeepBuffers&) = delete;
  KeepBuffers& operator=(const KeepBuffers&) = delete;

 private:
  std::vector<torch::Tensor> buffers_, saved_;
};

// The default generators are shared by every thread of the process. A
// stochastic stage holds this lock while it draws, and seeds the generator
// with a value fixed by (step, stage, micro-batch), so the forward and its
// re-materialization draw the same numbers whatever the other stages do.
// Inactive (`active` false): neither.
class RandomStream {
 public:
  RandomStream(bool active, const torch::Device& device, uint64_t seed);

 private:
  std::unique_lock<std::mutex> lock_;
};

}  // namespace gpipe::detail
