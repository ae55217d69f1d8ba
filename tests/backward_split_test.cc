// backward_split_test.cc: I then W gives the gradients of one backward, and W runs only the
// weight-only branches (the input path is not walked twice), or falls back when a weight is shared.
#include "helpers.h"

#include "../src/backward_split.h"

#include <torch/csrc/autograd/custom_function.h>

namespace gpipe::testing {
namespace {

// The identity, counting how often autograd runs its backward.
int counted_backwards = 0;
struct Counted : torch::autograd::Function<Counted> {
  static torch::Tensor forward(torch::autograd::AutogradContext*, const torch::Tensor& x) { return x.clone(); }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext*,
                                                 torch::autograd::variable_list grads) {
    ++counted_backwards;
    return {grads[0]};
  }
};

// Linear, then a counted node on the input path, then a second Linear that uses `shared` weights
// when given (the same Linear in two branches).
torch::Tensor layer(const torch::Tensor& x, torch::nn::Linear first, torch::nn::Linear second, bool twice) {
  torch::Tensor h = Counted::apply(torch::tanh(first->forward(x)));
  return twice ? second->forward(h) + second->forward(h * 2) : second->forward(h);
}

struct Result {
  torch::Tensor input_grad;
  std::vector<torch::Tensor> grads;
  bool split = false;
  int backwards = 0;
};

Result run(bool split, bool twice) {
  torch::manual_seed(3);
  torch::nn::Linear first(6, 5), second(5, 4);
  const torch::Tensor x = torch::randn({7, 6}).requires_grad_(true);
  const torch::Tensor g = torch::randn({7, 4});
  const std::vector<torch::Tensor> params = {first->weight, first->bias, second->weight, second->bias};
  counted_backwards = 0;
  const torch::Tensor y = layer(x, first, second, twice);
  Result r;
  if (split) {
    detail::WeightBackward w;
    r.input_grad = detail::WeightBackward::input_backward(y, x, g, params, w);
    r.split = w.split();
    w.run();
  } else {
    y.backward(g);
    r.input_grad = x.grad();
  }
  r.backwards = counted_backwards;
  for (const auto& p : params) r.grads.push_back(p.grad());
  return r;
}

TEST(BackwardSplitTest, InputThenWeightsEqualsOneBackwardAndWalksTheInputPathOnce) {
  const Result whole = run(false, false), parts = run(true, false);
  EXPECT_TRUE(parts.split);
  EXPECT_TRUE(close(parts.input_grad, whole.input_grad, 1e-6));
  for (size_t n = 0; n < whole.grads.size(); ++n) EXPECT_TRUE(close(parts.grads[n], whole.grads[n], 1e-6)) << n;
  // The counted node sits on the input path, before the first Linear's weight branch: I runs it,
  // and W starts below it.
  EXPECT_EQ(whole.backwards, 1);
  EXPECT_EQ(parts.backwards, 1);
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
  EXPECT_FALSE(detail::WeightBackward::input_backward(layer(x, first, second, false), x, g, params, w).defined());
  for (const auto& p : params) EXPECT_FALSE(p.grad().defined()) << "I computes no weight gradient";
  w.run();
  std::vector<torch::Tensor> split_grads;
  for (const auto& p : params) split_grads.push_back(p.grad().clone());
  for (auto p : params) p.mutable_grad() = torch::Tensor();
  layer(x, first, second, false).backward(g);
  for (size_t n = 0; n < params.size(); ++n) EXPECT_TRUE(close(split_grads[n], params[n].grad(), 1e-6)) << n;
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
  const torch::Tensor input_grad = detail::WeightBackward::input_backward(block->forward(x2), x2, g, params, w);
  EXPECT_TRUE(w.split());
  w.run();
  EXPECT_TRUE(close(input_grad, expected_input, 1e-5));
  for (size_t n = 0; n < params.size(); ++n) EXPECT_TRUE(close(params[n].grad(), expected[n], 1e-5)) << n;
}

}  // namespace
}  // namespace gpipe::testing
