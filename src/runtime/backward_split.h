// backward_split.h (internal): one layer's backward split into I (the input's gradient) and W (the
// weights'), with the autograd engine's edges, so that together they do the work of one backward.
//
// A layer's backward graph, from its output y back to its input a and its parameters:
//
//        y.grad_fn ─▶ n1 ─▶ n2 ─▶ … ─▶ a's accumulator        the input path: I runs these
//                      │          │
//                      └▶ [1]     └▶ [1] ─▶ … ─▶ w's accumulator   weight-only branches: W runs these
//
//   [1] where a weight-only branch leaves the input path. I runs the input path
//       with torch::autograd::grad(y, a), which skips every branch (n1 computes
//       only the gradient towards n2, not the weight's); a pre-hook on each
//       branching node records the gradient entering it. W then starts the
//       engine at those nodes with the recorded gradients and the branch's
//       parameters as outputs, so it runs the branching node again for the
//       weight's share alone, and the branch.
//
// So a layer that is many weighted operations (a TransformerEncoderLayer) costs
// about one backward in I + W, instead of W walking its whole graph again. The
// parameters are whatever leaves the graph accumulates gradients into (every
// gradient accumulator but the input's), as for a plain backward. After I, the
// input-path nodes W does not run let go of their saved tensors. When two
// branches lead to the same parameter (a weight used twice in the layer), W
// cannot start at both without counting twice; such a layer falls back to W as
// a backward from y into the parameters (correct, slower).
//
// This uses libtorch's autograd internals (Node pre-hooks, Engine::execute with
// edges as roots and outputs, AccumulateGrad), which libtorch 1.13 and 2.x
// share; it assumes the graph holds C++ nodes only (no Python functions).
#pragma once

#include <torch/csrc/autograd/edge.h>
#include <torch/csrc/autograd/function.h>
#include "gpipe/tensors.h"

#include <torch/types.h>

#include <vector>

namespace gpipe::detail {

/// The gradients of `inputs` from a backward of `roots` with `root_grads`, keeping the graph:
/// one per input, undefined for an input that does not require grad or that no root reaches.
std::vector<torch::Tensor> input_gradients(const std::vector<torch::Tensor>& roots,
                                           const std::vector<torch::Tensor>& root_grads,
                                           const std::vector<torch::Tensor>& inputs);

/// The W half of one layer's backward, planned and primed by input_backward.
class WeightBackward {
 public:
  /// I for one layer: returns d loss / d `input` (undefined if `input` does not
  /// require grad), given `output_grad` = d loss / d `output`, and fills `w` with
  /// what W needs. What W runs of the layer's graph is kept until w runs.
  static torch::Tensor input_backward(const torch::Tensor& output, const torch::Tensor& input,
                                      const torch::Tensor& output_grad, WeightBackward& w);
  /// The same for a layer of several inputs or outputs (a tuple, tensors.h): one gradient per
  /// input (undefined where it takes none), from one per output (undefined where none came).
  /// A layer of one input and one output is split as above; any other computes I as one
  /// gradient of the inputs, and W as a backward from the outputs into the parameters (its
  /// graph walked again: correct, slower).
  static std::vector<torch::Tensor> input_backward(const Tensors& outputs, const Tensors& inputs,
                                                   const std::vector<torch::Tensor>& output_grads, WeightBackward& w);

  /// W: accumulates the parameters' gradients into their grad(). Runs once.
  void run();

  /// Whether W starts at the branching nodes (false: the fallback, a backward from the output).
  bool split() const { return !whole_; }

 private:
  struct Branch {
    torch::autograd::edge_list roots;       // inputs of a branching node
    std::vector<torch::Tensor> grads;       // the gradients I saw entering them
    torch::autograd::edge_list parameters;  // the accumulators the branch ends at
  };
  std::vector<Branch> branches_;
  bool whole_ = false;  // fall back: backward from outputs_ with output_grads_ into params_
  std::vector<torch::Tensor> outputs_, output_grads_;
  std::vector<torch::Tensor> params_;
};

}  // namespace gpipe::detail
