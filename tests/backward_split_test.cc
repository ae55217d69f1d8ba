// backward_split_test.cc: I then W gives the gradients of one backward, and W runs only the
// weight-only branches (the input path is not walked twice), or falls back when a weight is shared.
#include "helpers.h"

#include "runtime/backward_split.h"

#include <torch/csrc/autograd/custom_function.h>

namespace gpipe::testing {
namespace {

// The identity, counting how often autograd runs its backward: once on the input path, once on
// the second Linear's weight-only branch.
int input_path_backwards = 0;
int weight_branch_backwards = 0;
template <int* Count>
struct Counted : torch::autograd::Function<Counted<Count>> {
  static torch::Tensor forward(torch::autograd::AutogradContext*, const torch::Tensor& x) { return x.clone(); }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext*,
                                                 torch::autograd::variable_list grads) {
    ++*Count;
    return {grads[0]};
  }
};

// Linear, then a counted node on the input path, then a second Linear whose weight passes through
// a counted node of its own; with `twice`, the second Linear is used in two branches.
torch::Tensor layer(const torch::Tensor& x, torch::nn::Linear first, torch::nn::Linear second, bool twice) {
  const torch::Tensor h = Counted<&input_path_backwards>::apply(torch::tanh(first->forward(x)));
  const torch::Tensor w = Counted<&weight_branch_backwards>::apply(second->weight);
  const torch::Tensor y = torch::nn::functional::linear(h, w, second->bias);
  return twice ? y + second->forward(h * 2) : y;
}

struct Result {
  torch::Tensor input_grad;
  std::vector<torch::Tensor> grads;
  bool split = false;
  int input_path = 0, weight_branch_after_i = 0, weight_branch = 0;
};

Result run(bool split, bool twice) {
  torch::manual_seed(3);
  torch::nn::Linear first(6, 5), second(5, 4);
  const torch::Tensor x = torch::randn({7, 6}).requires_grad_(true);
  const torch::Tensor g = torch::randn({7, 4});
  const std::vector<torch::Tensor> params = {first->weight, first->bias, second->weight, second->bias};
  input_path_backwards = weight_branch_backwards = 0;
  const torch::Tensor y = layer(x, first, second, twice);
  Result r;
  if (split) {
    detail::WeightBackward w;
    r.input_grad = detail::WeightBackward::input_backward(y, x, g, w);
    r.split = w.split();
    r.weight_branch_after_i = weight_branch_backwards;
    w.run();
  } else {
    y.backward(g);
    r.input_grad = x.grad();
  }
  r.input_path = input_path_backwards;
  r.weight_branch = weight_branch_backwards;
  for (const auto& p : params) r.grads.push_back(p.grad());
  return r;
}

TEST(BackwardSplitTest, InputThenWeightsEqualsOneBackwardAndWalksTheInputPathOnce) {
  const Result whole = run(false, false), parts = run(true, false);
  EXPECT_TRUE(parts.split);
  EXPECT_TRUE(close(parts.input_grad, whole.input_grad, 1e-6));
  for (size_t n = 0; n < whole.grads.size(); ++n) EXPECT_TRUE(close(parts.grads[n], whole.grads[n], 1e-6)) << n;
  // I runs the input path once and skips the weight branch; W runs the branch and not the path again.
  EXPECT_EQ(whole.input_path, 1);
  EXPECT_EQ(parts.input_path, 1);
  EXPECT_EQ(parts.weight_branch_after_i, 0);
  EXPECT_EQ(parts.weight_branch, 1);
}

TEST(BackwardSplitTest, AWeightInTwoBranchesFallsBackToOneBackwardFromTheOutput) {
  const Result whole = run(false, true), parts = run(true, true);
  EXPECT_FALSE(parts.split);
  EXPECT_TRUE(close(parts.input_grad, whole.input_grad, 1e-6));
  for (size_t n = 0; n < whole.grads.size(); ++n) EXPECT_TRUE(close(parts.grads[n], whole.grads[n], 1e-6)) << n;
}

TEST(BackwardSplitTest, AnInputWithoutGradientLeavesTheWholeLayerToW) {
  torch::manual_seed(4);
  torch::nn::Linear first(6, 5), second(5, 4);
  const torch::Tensor x = torch::randn({3, 6});  // the stage's own input: no gradient wanted
  const std::vector<torch::Tensor> params = {first->weight, first->bias, second->weight, second->bias};
  const torch::Tensor g = torch::randn({3, 4});
  detail::WeightBackward w;
  EXPECT_FALSE(detail::WeightBackward::input_backward(layer(x, first, second, false), x, g, w).defined());
  w.run();
  std::vector<torch::Tensor> split_grads;
  for (const auto& p : params) split_grads.push_back(p.grad().clone());
  for (auto p : params) p.mutable_grad() = torch::Tensor();
  layer(x, first, second, false).backward(g);
  for (size_t n = 0; n < params.size(); ++n) EXPECT_TRUE(close(split_grads[n], params[n].grad(), 1e-6)) << n;
}

// W finds its parameters in the graph: one frozen when the stage was built and unfrozen later, and a
// weight that belongs to no module of the layer, get their gradients as in one backward.
TEST(BackwardSplitTest, ParametersAreFoundInTheGraph) {
  torch::manual_seed(6);
  torch::nn::Linear linear(4, 3);
  const torch::Tensor outside = torch::randn({3}).requires_grad_(true);
  const torch::Tensor x = torch::randn({5, 4}).requires_grad_(true), g = torch::randn({5, 3});
  auto y = [&](const torch::Tensor& in) { return linear->forward(in) * outside; };
  y(x).backward(g);
  const torch::Tensor expected_w = linear->weight.grad().clone(), expected_o = outside.grad().clone();
  linear->weight.mutable_grad() = torch::Tensor();
  outside.mutable_grad() = torch::Tensor();
  const torch::Tensor x2 = x.detach().requires_grad_(true);
  detail::WeightBackward w;
  detail::WeightBackward::input_backward(y(x2), x2, g, w);
  w.run();
  EXPECT_TRUE(close(linear->weight.grad(), expected_w, 1e-6));
  EXPECT_TRUE(close(outside.grad(), expected_o, 1e-6));
}

// A TransformerEncoderLayer (many weighted operations, layer norms, attention) splits too.
TEST(BackwardSplitTest, EncoderBlockSplitsExactly) {
  torch::manual_seed(5);
  EncoderBlock block(16, 2, 32, 0.0);
  const torch::Tensor x = torch::randn({3, 5, 16}).requires_grad_(true);
  const torch::Tensor g = torch::randn({3, 5, 16});
  const auto params = block->parameters();
  block->forward(x).backward(g);
  std::vector<torch::Tensor> expected;
  for (const auto& p : params) expected.push_back(p.grad().clone());
  const torch::Tensor expected_input = x.grad().clone();
  for (auto p : params) p.mutable_grad() = torch::Tensor();

  const torch::Tensor x2 = x.detach().requires_grad_(true);
  detail::WeightBackward w;
  const torch::Tensor input_grad = detail::WeightBackward::input_backward(block->forward(x2), x2, g, w);
  EXPECT_TRUE(w.split());
  w.run();
  EXPECT_TRUE(close(input_grad, expected_input, 1e-5));
  for (size_t n = 0; n < params.size(); ++n) EXPECT_TRUE(close(params[n].grad(), expected[n], 1e-5)) << n;
}

}  // namespace
}  // namespace gpipe::testing
