// backward_split.cc: I runs the input path of a layer's graph and records the gradients entering
// the nodes where weight-only branches leave it; W starts the engine there.
#include "runtime/backward_split.h"

#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <memory>
#include <unordered_map>
#include <unordered_set>

namespace gpipe::detail {
namespace {

using torch::autograd::Edge;
using torch::autograd::edge_list;
using torch::autograd::Node;
using torch::autograd::variable_list;

constexpr int kReachesInput = 1;
constexpr int kReachesParameter = 2;

bool accumulates_a_parameter(const Node* n, const Node* input) {
  return n != input && dynamic_cast<const torch::autograd::AccumulateGrad*>(n) != nullptr;
}

// For every node of the graph below `root`: whether it reaches the input's
// accumulator, a parameter's (any other accumulator), or both (an iterative
// depth-first walk: the graph is a DAG, so a node's children are done before it is).
std::unordered_map<const Node*, int> reachability(Node* root, const Node* input) {
  std::unordered_map<const Node*, int> reach;
  std::vector<std::pair<Node*, size_t>> stack;  // (node, next child to look at)
  auto enter = [&](Node* n) {
    reach.emplace(n, (n == input ? kReachesInput : 0) | (accumulates_a_parameter(n, input) ? kReachesParameter : 0));
    stack.emplace_back(n, 0);
  };
  enter(root);
  while (!stack.empty()) {
    Node* n = stack.back().first;
    const size_t next = stack.back().second;
    if (next < n->num_outputs()) {
      ++stack.back().second;
      Node* child = n->next_edge(next).function.get();
      if (child != nullptr && reach.count(child) == 0) enter(child);
      continue;
    }
    stack.pop_back();
    int bits = reach[n];
    for (const Edge& e : n->next_edges())
      if (e.function) bits |= reach[e.function.get()];
    reach[n] = bits;
  }
  return reach;
}

// The parameters' accumulators below `start`, which is off the input path.
std::vector<Node*> parameters_below(Node* start, const Node* input) {
  std::vector<Node*> found, stack{start};
  std::unordered_set<const Node*> seen{start};
  while (!stack.empty()) {
    Node* n = stack.back();
    stack.pop_back();
    if (accumulates_a_parameter(n, input)) found.push_back(n);
    for (const Edge& e : n->next_edges())
      if (e.function && seen.insert(e.function.get()).second) stack.push_back(e.function.get());
  }
  return found;
}

// Records the gradients entering a node, once, when the engine runs it.
class Record : public torch::autograd::FunctionPreHook {
 public:
  explicit Record(variable_list* slot) : slot_(slot) {}
  variable_list operator()(const variable_list& grads) override {
    *slot_ = grads;
    return grads;
  }

 private:
  variable_list* slot_;
};

// Adds a Record hook to each node while alive; removes them whatever happens.
class Recording {
 public:
  Recording(const std::vector<std::shared_ptr<Node>>& nodes, std::vector<variable_list>& slots) : nodes_(nodes) {
    for (size_t n = 0; n < nodes_.size(); ++n) {
      auto hook = std::make_unique<Record>(&slots[n]);
      hooks_.push_back(hook.get());
      nodes_[n]->add_pre_hook(std::move(hook));
    }
  }
  ~Recording() {
    for (size_t n = 0; n < nodes_.size(); ++n) {
      auto& hooks = nodes_[n]->pre_hooks();
      for (auto it = hooks.begin(); it != hooks.end(); ++it)
        if (it->get() == hooks_[n]) {
          hooks.erase(it);
          break;
        }
    }
  }
  Recording(const Recording&) = delete;
  Recording& operator=(const Recording&) = delete;

 private:
  const std::vector<std::shared_ptr<Node>>& nodes_;
  std::vector<const torch::autograd::FunctionPreHook*> hooks_;
};

}  // namespace

torch::Tensor WeightBackward::input_backward(const torch::Tensor& output, const torch::Tensor& input,
                                             const torch::Tensor& output_grad, WeightBackward& w) {
  w = WeightBackward();
  const Edge root = torch::autograd::impl::gradient_edge(output);
  const std::shared_ptr<Node> input_node =
      input.requires_grad() ? torch::autograd::impl::grad_accumulator(input) : nullptr;
  const auto reach = reachability(root.function.get(), input_node.get());
  auto bits = [&](const Node* n) { return reach.at(n); };
  auto edges_to = [](const std::vector<Node*>& nodes) {
    edge_list out;
    for (Node* n : nodes) out.emplace_back(n->shared_from_this(), 0);
    return out;
  };

  // The output does not depend on the input (or the input takes no gradient): W is the whole layer.
  if ((bits(root.function.get()) & kReachesInput) == 0) {
    if (bits(root.function.get()) & kReachesParameter)
      w.branches_.push_back({{root}, {output_grad}, edges_to(parameters_below(root.function.get(), input_node.get()))});
    return {};
  }

  // The nodes of the input path where a weight-only branch leaves it ([1] in backward_split.h),
  // in the order the forward made them, so W runs the same way every time.
  std::vector<Node*> input_path;
  for (const auto& [node, b] : reach)
    if (b & kReachesInput) input_path.push_back(const_cast<Node*>(node));
  std::sort(input_path.begin(), input_path.end(),
            [](const Node* a, const Node* b) { return a->sequence_nr() < b->sequence_nr(); });
  std::vector<std::shared_ptr<Node>> branching;
  std::vector<edge_list> branch_parameters;
  std::unordered_set<const Node*> claimed;
  bool shared = false;
  for (Node* node : input_path) {
    std::vector<Node*> found;
    for (const Edge& e : node->next_edges())
      if (e.function && (bits(e.function.get()) & (kReachesInput | kReachesParameter)) == kReachesParameter)
        for (Node* p : parameters_below(e.function.get(), input_node.get()))
          if (std::find(found.begin(), found.end(), p) == found.end()) found.push_back(p);
    if (found.empty()) continue;
    for (Node* p : found) shared = shared || !claimed.insert(p).second;
    branching.push_back(node->shared_from_this());
    branch_parameters.push_back(edges_to(found));
  }

  if (shared) {  // a parameter below two branches: W from the output, as one backward
    w.whole_ = true;
    w.outputs_ = {output};
    w.output_grads_ = {output_grad};
    for (const Node* p : claimed) w.params_.push_back(static_cast<const torch::autograd::AccumulateGrad*>(p)->variable);
    return torch::autograd::grad({output}, {input}, {output_grad}, /*retain_graph=*/true, /*create_graph=*/false,
                                 /*allow_unused=*/true)[0];
  }

  std::vector<variable_list> seen(branching.size());
  torch::Tensor input_grad;
  {
    Recording recording(branching, seen);
    input_grad = torch::autograd::grad({output}, {input}, {output_grad}, /*retain_graph=*/!branching.empty(),
                                       /*create_graph=*/false, /*allow_unused=*/true)[0];
  }
  // W runs the branching nodes and their branches only: the rest of the input path lets go now.
  for (Node* node : input_path)
    if (std::find_if(branching.begin(), branching.end(), [node](const auto& b) { return b.get() == node; }) ==
        branching.end())
      node->release_variables();
  for (size_t n = 0; n < branching.size(); ++n) {
    Branch branch;
    for (size_t k = 0; k < seen[n].size(); ++k)
      if (seen[n][k].defined()) {
        branch.roots.emplace_back(branching[n], static_cast<uint32_t>(k));
        branch.grads.push_back(seen[n][k]);
      }
    if (branch.roots.empty()) continue;  // no gradient reached it: nothing for W either
    branch.parameters = std::move(branch_parameters[n]);
    w.branches_.push_back(std::move(branch));
  }
  return input_grad;
}

std::vector<torch::Tensor> input_gradients(const std::vector<torch::Tensor>& roots,
                                           const std::vector<torch::Tensor>& root_grads,
                                           const std::vector<torch::Tensor>& inputs) {
  std::vector<torch::Tensor> grads(inputs.size());
  std::vector<torch::Tensor> wanted;  // torch::autograd::grad takes only inputs that require grad
  for (const auto& a : inputs)
    if (a.defined() && a.requires_grad()) wanted.push_back(a);
  if (roots.empty() || wanted.empty()) return grads;
  const auto got = torch::autograd::grad(roots, wanted, root_grads, /*retain_graph=*/true, /*create_graph=*/false,
                                         /*allow_unused=*/true);
  for (size_t n = 0, k = 0; n < inputs.size(); ++n)
    if (inputs[n].defined() && inputs[n].requires_grad()) grads[n] = got[k++];
  return grads;
}

std::vector<torch::Tensor> WeightBackward::input_backward(const Tensors& outputs, const Tensors& inputs,
                                                          const std::vector<torch::Tensor>& output_grads,
                                                          WeightBackward& w) {
  w = WeightBackward();
  std::vector<torch::Tensor> roots, grads;
  add_roots(outputs, output_grads, roots, grads);
  if (roots.empty()) return std::vector<torch::Tensor>(inputs.size());
  if (outputs.size() == 1 && inputs.size() == 1)
    return {input_backward(roots[0], inputs.items[0], grads[0], w)};
  std::vector<torch::Tensor> input_grads = input_gradients(roots, grads, inputs.items);
  std::unordered_set<const Node*> input_nodes;
  for (const auto& a : inputs.items)
    if (a.defined() && a.requires_grad()) input_nodes.insert(torch::autograd::impl::grad_accumulator(a).get());
  // W: the parameters' accumulators below the outputs, the inputs' left out.
  std::vector<Node*> stack;
  std::unordered_set<const Node*> seen;
  for (const auto& r : roots)
    if (Node* n = torch::autograd::impl::gradient_edge(r).function.get(); n != nullptr && seen.insert(n).second)
      stack.push_back(n);
  while (!stack.empty()) {
    Node* n = stack.back();
    stack.pop_back();
    if (input_nodes.count(n) == 0)
      if (const auto* acc = dynamic_cast<const torch::autograd::AccumulateGrad*>(n)) w.params_.push_back(acc->variable);
    for (const Edge& e : n->next_edges())
      if (e.function && seen.insert(e.function.get()).second) stack.push_back(e.function.get());
  }
  w.whole_ = true;
  w.outputs_ = std::move(roots);
  w.output_grads_ = std::move(grads);
  return input_grads;
}

void WeightBackward::run() {
  if (whole_) {
    if (!params_.empty())
      torch::autograd::backward(outputs_, output_grads_, /*retain_graph=*/false, /*create_graph=*/false, params_);
    outputs_.clear();
    output_grads_.clear();
    params_.clear();
    whole_ = false;
    return;
  }
  // Each branch reaches only its own parameters, so no node runs twice and the graph can go as W runs.
  for (Branch& b : branches_)
    torch::autograd::Engine::get_default_engine().execute(b.roots, b.grads, /*keep_graph=*/false,
                                                          /*create_graph=*/false, /*accumulate_grad=*/true,
                                                          b.parameters);
  branches_.clear();
}

}  // namespace gpipe::detail
