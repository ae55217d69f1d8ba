// tensors.h: what a layer hands the next layer, and a stage the next stage: one tensor, or a tuple
// of tensors (hidden states and an attention mask; two towers side by side).
//
//   C++ layers:         torch::Tensor forward(const torch::Tensor& x)               one tensor
//                       std::vector<torch::Tensor> forward(const torch::Tensor& x)   a tuple out
//                       torch::Tensor forward(const std::vector<torch::Tensor>& xs)  a tuple in
//   TorchScript layers: def forward(self, x: Tensor) -> Tuple[Tensor, Tensor]    a tuple out
//                       def forward(self, xs: Tuple[Tensor, Tensor]) -> Tensor   a tuple in
//
// A tuple crosses a stage boundary as one message of all its tensors, and its
// gradient comes back the same way: one entry per tensor, undefined for a
// tensor that takes no gradient (an integer or boolean mask, or one no later
// layer differentiates).
#pragma once

#include <torch/nn/modules/container/any.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/types.h>

#include <c10/core/Event.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace gpipe {

/// One tensor, or a tuple of them, as a layer returned it.
struct Tensors {
  std::vector<torch::Tensor> items;
  bool tuple = false;  ///< a tuple (a C++ std::vector<torch::Tensor>, a TorchScript Tuple), even of one tensor
  /// On a GPU, between stages: an event of the producing stage's stream, complete once these
  /// tensors are written; the receiving stage's stream waits for it (executor.h). Null on CPU.
  std::shared_ptr<c10::Event> ready;

  Tensors() = default;
  /// One tensor (not a tuple).
  Tensors(torch::Tensor tensor) : items{std::move(tensor)} {}  // NOLINT(google-explicit-constructor)
  /// A tuple of `items`.
  static Tensors tuple_of(std::vector<torch::Tensor> items);

  /// Whether any of its tensors is defined (a defaulted Tensors holds none).
  bool any_defined() const;
  size_t size() const { return items.size(); }
  /// The one tensor of a value that is not a tuple. For a tuple throws std::invalid_argument:
  /// "`what` is a tuple of N tensors where one tensor is needed; `fix`".
  torch::Tensor only(const std::string& what = "the value", const std::string& fix = "") const;
  /// Bytes of tensor data, over the defined tensors.
  int64_t bytes() const;
  /// Its shape as a user reads it: "[32, 16]", or "([32, 16], [32, 64] Bool)" for a tuple.
  std::string shape() const;
  /// Each defined tensor moved to `device` (no copy where it is there already).
  Tensors to(const torch::Device& device) const;
};

/// A layer that takes and returns TorchScript values (ScriptLayer): run_layer hands it a Tensor,
/// or a tuple as a Tuple.
class ValueLayer {
 public:
  virtual ~ValueLayer() = default;
  virtual torch::IValue forward_value(torch::IValue x) = 0;
};

/// Runs one layer of a torch::nn::Sequential on `x`: one tensor as a torch::Tensor, a tuple as a
/// std::vector<torch::Tensor> (a TorchScript layer, ScriptLayer, as its Tensor or Tuple). Throws
/// std::invalid_argument naming the layer (`name`, e.g. "layer 3") when the layer does not take
/// what it is given, or returns something that is neither a tensor nor a tuple of one or more
/// defined tensors.
Tensors run_layer(torch::nn::AnyModule& layer, const Tensors& x, const std::string& name);

/// How errors name the layer of a Sequential under `key`: "layer 3", or "layer 'mask'".
std::string layer_name(const std::string& key);
/// layer_name of each layer of `layers`, in order.
std::vector<std::string> layer_names(const torch::nn::Sequential& layers);

/// Which tensors of a detached copy require grad (leaves_of).
enum class LeafGrad {
  kNone,      ///< none: a value handed on
  kFloating,  ///< every floating-point tensor: a stage's input in training
  kKept,      ///< those that required grad: a layer's input in a split backward
};
/// Each tensor of `x` detached, as a leaf that requires grad as `grad` says: where a graph starts.
Tensors leaves_of(const Tensors& x, LeafGrad grad);
/// `x` with each tensor copied (clone, in the graph): what a layer that changes its input in place
/// runs on where that input must stay as it was.
Tensors copy_of(const Tensors& x);
/// Whether a tensor of `a` shares its storage with a tensor of `b` (one is the other, or a view of it).
bool shares_storage(const Tensors& a, const Tensors& b);

/// The version counter of each tensor of `x` (an in-place change bumps it).
std::vector<int64_t> versions_of(const Tensors& x);
/// Which tensor of `x` changed in place since `versions` (versions_of): "" for none, else "its
/// input" for one tensor, "tensor 1 of its input" for a tuple's, for an error about a layer.
std::string changed_in_place(const Tensors& x, const std::vector<int64_t>& versions);

/// Whether any tensor of `x` requires grad.
bool requires_grad(const Tensors& x);

/// Adds to (`roots`, `root_grads`) each tensor of `outputs` that requires grad and has a defined
/// gradient in `grads` (one per tensor): what a backward from `outputs` starts from.
void add_roots(const Tensors& outputs, const std::vector<torch::Tensor>& grads, std::vector<torch::Tensor>& roots,
               std::vector<torch::Tensor>& root_grads);

}  // namespace gpipe
