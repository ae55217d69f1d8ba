// stage_backward.cc: a stage's backward: B from the gradient it received (its forward run again
// first where it kept only the input), or the backward split into I, the gradient of its input, and
// later W, its weights' (backward_split.h); and the gradients of the skip tensors it popped.
#include "runtime/stage_parts.h"

#include "runtime/backward_split.h"
#include "gpipe/check.h"

#include <memory>
#include <vector>

namespace gpipe {
namespace {

// The gradient of a stage's (or a layer's) input `input`: `grads`, one per tensor (undefined for
// one that takes none, or that no gradient reached: as on one device, nothing flows from there).
Tensors gradients_of(const Tensors& input, std::vector<torch::Tensor> grads) {
  Tensors out = input;
  grads.resize(input.size());
  out.items = std::move(grads);
  return out;
}

// The gradient of this stage's output, checked against the output it belongs to.
void check_gradient(int stage, const Tensors& output_grad, const Tensors& output) {
  GPIPE_CHECK(output_grad.size() == output.size(), "stage ", stage, " got a gradient of ", output_grad.size(),
              " tensors for an output of ", output.size());
}

}  // namespace

void Stage::backward_roots(int i, const Tensors& output_grad, Kept& k, std::vector<torch::Tensor>& roots,
                           std::vector<torch::Tensor>& grads) {
  if (last()) {
    if (k.loss.requires_grad()) {
      roots.push_back(k.loss);
      grads.push_back(torch::ones_like(k.loss));
    }
  } else {
    check_gradient(index_, output_grad, k.output);
    add_roots(k.output, output_grad.to(device_.device).items, roots, grads);  // [3]
  }
  for (const auto& [skip, name] : stashed_) {
    auto it = skip_inbox_.find({i, static_cast<int>(skip_channel(skip, true))});
    GPIPE_CHECK(it != skip_inbox_.end(), "stage ", index_, " got no gradient for \"", name,
                "\", which it stashed in micro-batch ", i);
    const torch::Tensor& stashed = k.stashed.at(skip);
    if (stashed.requires_grad()) {
      roots.push_back(stashed);
      grads.push_back(it->second.to(device_.device));
    }
    skip_inbox_.erase(it);
  }
}

void Stage::send_skip_gradients(int i, Kept& k, const std::vector<torch::Tensor>& grads) {
  size_t n = 0;
  for (const auto& [skip, name] : popped_) {
    const torch::Tensor& leaf = k.skip_inputs.at(skip);
    torch::Tensor g = n < grads.size() ? grads[n] : leaf.grad();
    ++n;
    skip_outbox_[{i, static_cast<int>(skip_channel(skip, true))}] = g.defined() ? g : torch::zeros_like(leaf);
  }
}

Tensors Stage::kept_input_gradient(int i, Tensors input_grad, StepData& step) const {
  if (!first()) return input_grad;
  if (step.keep_input_gradients) step.input_gradients[static_cast<size_t>(i)] = std::move(input_grad);
  return {};
}

Tensors Stage::backward(int i, const Tensors& output_grad, StepData& step) {
  Kept& k = kept(i);
  if (k.recompute) {
    detail::RandomStream stream(stochastic_, device_.device, seed_of(i, step));
    const detail::KeepBuffers keep(layers_->buffers());
    run_layers(i, k.input, false, /*gather=*/false, k, step);
  }
  std::vector<torch::Tensor> roots, grads;
  backward_roots(i, output_grad, k, roots, grads);
  if (!roots.empty()) torch::autograd::backward(roots, grads);
  Tensors input_grad;
  if (!first() || step.keep_input_gradients) {  // [4]
    std::vector<torch::Tensor> grads;
    for (const auto& x : k.input.items) grads.push_back(x.grad());
    input_grad = gradients_of(k.input, grads);
  }
  send_skip_gradients(i, k);
  kept_.erase(i);
  return kept_input_gradient(i, std::move(input_grad), step);
}

Tensors Stage::input_grad(int i, const Tensors& output_grad, StepData& step) {
  Kept& k = kept(i);
  GPIPE_CHECK(k.split, "stage ", index_, " ran the forward of micro-batch ", i,
              " without recording its layers, so its backward cannot be split into I and W");
  if (k.recompute) {
    detail::RandomStream stream(stochastic_, device_.device, seed_of(i, step));
    const detail::KeepBuffers keep(layers_->buffers());
    run_layers(i, k.input, !skips_inside_, /*gather=*/false, k, step);
  }
  if (skips_inside_) {
    // In one piece: I is the gradients of the stage's input and skip tensors, from the whole graph,
    // which W then walks again into the parameters.
    backward_roots(i, output_grad, k, k.roots, k.root_grads);
    std::vector<torch::Tensor> inputs;
    if (!first() || step.keep_input_gradients) inputs = k.input.items;
    const auto own = static_cast<std::ptrdiff_t>(inputs.size());
    for (const auto& [skip, name] : popped_) inputs.push_back(k.skip_inputs.at(skip));
    const std::vector<torch::Tensor> grads = detail::input_gradients(k.roots, k.root_grads, inputs);
    Tensors input_grad;
    if (!first() || step.keep_input_gradients)
      input_grad = gradients_of(k.input, std::vector<torch::Tensor>(grads.begin(), grads.begin() + own));
    send_skip_gradients(i, k, std::vector<torch::Tensor>(grads.begin() + own, grads.end()));
    return kept_input_gradient(i, std::move(input_grad), step);
  }
  const size_t L = k.layer_outputs.size();
  k.weight_backward.clear();
  Tensors g;
  if (!last()) {
    check_gradient(index_, output_grad, k.output);
    g = output_grad.to(device_.device);
  } else if (k.loss.requires_grad()) {
    g = torch::autograd::grad({k.loss}, {k.output.only()})[0];
  }
  for (size_t l = L; l-- > 0;) {
    const Tensors y = std::move(k.layer_outputs[l]);
    const Tensors& a = k.layer_inputs[l];
    if (!g.any_defined() || !requires_grad(y)) {  // nothing before this layer takes a gradient from it
      g = Tensors();
      break;
    }
    // d/da, and W's share of this layer kept for later (backward_split.h).
    auto w = std::make_shared<detail::WeightBackward>();
    g = gradients_of(a, detail::WeightBackward::input_backward(y, a, g.items, *w));
    k.weight_backward.push_back(std::move(w));
  }
  Tensors input_grad;
  if (!first() || step.keep_input_gradients) input_grad = gradients_of(k.input, g.items);
  input_grad = kept_input_gradient(i, std::move(input_grad), step);
  k.layer_inputs.clear();
  k.layer_outputs.clear();
  k.output = Tensors();
  k.loss = torch::Tensor();
  return input_grad;
}

void Stage::weight_grad(int i) {
  Kept& k = kept(i);
  for (const auto& w : k.weight_backward) w->run();
  if (!k.roots.empty()) {  // a split backward in one piece: into the parameters alone
    std::vector<torch::Tensor> params;
    for (const auto& p : unique_parameters(*layers_))
      if (p.requires_grad()) params.push_back(p);
    if (!params.empty()) torch::autograd::backward(k.roots, k.root_grads, /*retain_graph=*/false, false, params);
  }
  kept_.erase(i);
}

}  // namespace gpipe
