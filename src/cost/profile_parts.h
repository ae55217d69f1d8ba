// profile_parts.h: what the profiler's two files share, and no user of the library sees: the timed
// passes (profile_times.cc) that profile_layers (profile.cc) turns into each layer's costs with its
// bytes, and the small pieces both use.
#pragma once

#include "gpipe/cost_model.h"
#include "gpipe/tensors.h"
#include "runtime/autocast.h"

#include <torch/torch.h>

#include <algorithm>
#include <string>
#include <vector>

namespace gpipe::detail {

// The median of `v` (of an even count, the upper of the two in the middle).
inline double median_of(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// A layer's forward as a stage runs it in `precision`: under its device's autocast (autocast.h); the
// backward outside it.
inline Tensors run_profiled(torch::nn::AnyModule& layer, const Tensors& x, const std::string& name,
                            Precision precision) {
  const AutocastScope autocast(precision, x.items.empty() ? c10::DeviceType::CPU : x.items.front().device().type());
  return run_layer(layer, x, name);
}

// Ones as the gradient of each tensor of `out` that requires grad (undefined for the others).
inline std::vector<torch::Tensor> ones_for(const Tensors& out) {
  std::vector<torch::Tensor> grads;
  for (const auto& t : out.items) grads.push_back(t.requires_grad() ? torch::ones_like(t) : torch::Tensor());
  return grads;
}

// A backward from the tensors of `out` that require grad.
inline void backward_from(const Tensors& out, const std::vector<torch::Tensor>& grads) {
  std::vector<torch::Tensor> roots, given;
  add_roots(out, grads, roots, given);
  torch::autograd::backward(roots, given);
}

// Each layer is timed as the first layer of a stage, on a leaf input that takes a gradient, except
// the model's first: the first stage's input is the data, which takes a gradient only where it
// asks for one (a convolution's input gradient can cost more than its weights').
inline LeafGrad leaf_grad_of(size_t l) { return l == 0 ? LeafGrad::kKept : LeafGrad::kFloating; }

// Each layer's timed passes, seconds per micro-batch: forward, full backward, and the backward split
// into I and W. [layer][timed pass]; a layer whose output takes no gradient has no backward.
struct LayerTimings {
  std::vector<std::vector<double>> forward, backward, input_grad, weight_grad;
  std::vector<bool> in_place;  // per layer: it changes its input in place, so it ran on a copy
};

// Times: whole passes through the layers in a stage's order, forwards first, then backwards in
// reverse (a layer timed many times in a row, or its backward right after its forward, would find
// its weights in cache, which a pass through many layers does not). `in_flight` micro-batches at
// once, their forwards before their backwards (as a schedule holds them): each layer's time then
// includes the cache it loses to the others' activations.
LayerTimings time_layers(const torch::nn::Sequential& layers, const std::vector<std::string>& names,
                         const Tensors& sample, const ProfileLayersOptions& options);

// The optimizer's update, timed on copies of the parameters (the model's stay as they are) with
// gradients, by the optimizer the state per parameter byte stands for: 1 plain SGD, 2 SGD with
// momentum, 3 Adam; seconds per parameter byte (0 for a model without parameters). The update is
// elementwise: of a model of more than kMostTimedUpdateBytes, the parameters in order up to that
// size are timed (the last one cut short) and the time scaled by bytes.
double update_s_per_parameter_byte(const torch::nn::Sequential& model, const ProfileLayersOptions& options);

}  // namespace gpipe::detail
