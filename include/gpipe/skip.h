// skip.h: skip connections across stages: a layer stashes a tensor under a name, and a later
// layer, on the same stage or any later one, pops it and merges it into its input.
//
//   layer:    0       1           2      3      4     5                   6
//           conv ─▶ Stash("e1") ─▶ pool ─▶ ... ─▶ up ─▶ Pop("e1", concat) ─▶ conv
//                       │                                  ▲
//                       └──────────── "e1" ────────────────┘
//           stage 0                     stage 1            stage 2
//
// The pipeline sends a stashed tensor from the stage that stashes it straight to
// the stage that pops it (not through the stages between), once per
// micro-batch, and the gradient of what the pop received straight back, so the
// stashing stage's backward adds it where the tensor came from: the gradient is
// exactly one device's. Outside a pipeline (one device, one thread), Stash and
// Pop work as the same model's forward: the stash keeps the tensor until the
// pop on the same thread takes it.
//
//   torch::nn::Sequential unet(
//       conv(1, 16), gpipe::Stash("e1"), torch::nn::MaxPool2d(2), conv(16, 32),
//       torch::nn::Upsample(...), gpipe::Pop("e1", gpipe::concat_skip), conv(48, 16), ...);
//
// A Stash or Pop may sit inside a layer (a block's own forward calling its
// members); the pipeline routes by the layer of the model that holds it. The
// names connect: each name stashed once and popped once, the pop after the
// stash in layer order, which the pipeline checks when it is built
// (skip_connections). What the plan routes, the connections as plain data, is in skip_connections.h.
#pragma once

#include "gpipe/skip_connections.h"

#include <torch/nn/module.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/pimpl.h>
#include <torch/types.h>

#include <functional>
#include <map>
#include <string>
#include <vector>

namespace gpipe {

/// How a Pop merges its input x with the popped tensor: add_skip, concat_skip, or any function.
using SkipMerge = std::function<torch::Tensor(const torch::Tensor& x, const torch::Tensor& skip)>;
/// x + skip: a residual connection.
torch::Tensor add_skip(const torch::Tensor& x, const torch::Tensor& skip);
/// The channels (dim 1) of x, then of skip: a U-Net's long skip.
torch::Tensor concat_skip(const torch::Tensor& x, const torch::Tensor& skip);

/// What a Stash does: keeps `x` under `name` for the Pop of that name (on this
/// thread, or on the stage that pops it), and returns it. For layers that are
/// not StashImpl (gpipe's Python Stash calls it as torch.ops.gpipe.stash).
torch::Tensor stash_tensor(const std::string& name, const torch::Tensor& x);
/// What a Pop takes: the tensor stashed under `name`, removed. Throws
/// std::invalid_argument if nothing was stashed under it.
torch::Tensor pop_tensor(const std::string& name);

/// A layer that passes its input on unchanged and stashes it under `name`.
class StashImpl : public torch::nn::Module {
 public:
  explicit StashImpl(std::string name);
  torch::Tensor forward(const torch::Tensor& x);
  const std::string& name() const { return name_; }

 private:
  std::string name_;
};
TORCH_MODULE(Stash);

/// A layer that pops the tensor stashed under `name` and returns merge(input, it).
class PopImpl : public torch::nn::Module {
 public:
  explicit PopImpl(std::string name, SkipMerge merge = add_skip);
  torch::Tensor forward(const torch::Tensor& x);
  const std::string& name() const { return name_; }

 private:
  std::string name_;
  SkipMerge merge_;
};
TORCH_MODULE(Pop);

/// Where `layers` stash and pop: one entry per Stash or Pop (inside a layer
/// too), with the layer's position in `layers`, or with `named_by_index` the
/// number its name is (an MPI rank's layers, named by their index in the whole
/// model, as add_layer names them; a name that is not a number throws
/// std::invalid_argument).
std::vector<SkipUse> skip_uses(const torch::nn::Sequential& layers, bool named_by_index = false);

/// connect_skips(skip_uses(model)) (skip_connections.h).
std::vector<SkipConnection> skip_connections(const torch::nn::Sequential& model);

namespace detail {

/// Where Stash puts and Pop takes tensors on this thread: while alive, `tray`
/// (a stage's, for one micro-batch); otherwise the thread's own tray.
class SkipTrayScope {
 public:
  explicit SkipTrayScope(std::map<std::string, torch::Tensor>& tray);
  ~SkipTrayScope();
  SkipTrayScope(const SkipTrayScope&) = delete;
  SkipTrayScope& operator=(const SkipTrayScope&) = delete;

 private:
  std::map<std::string, torch::Tensor>* previous_;
};

}  // namespace detail
}  // namespace gpipe
