// helpers.h: small models, a single-device reference run, and tensor comparison for the tests.
#pragma once

#include <gpipe/gpipe.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

namespace gpipe::testing {

/// 7 layers: enough for K up to 4 with uneven stages.
inline torch::nn::Sequential small_mlp(uint64_t seed, double dropout = 0.0) {
  torch::manual_seed(seed);
  torch::nn::Sequential m(torch::nn::Linear(12, 16), torch::nn::ReLU(), torch::nn::Linear(16, 16),
                          torch::nn::Tanh(), torch::nn::Linear(16, 16), torch::nn::ReLU(),
                          torch::nn::Linear(16, 4));
  if (dropout > 0) {
    torch::nn::Sequential d;
    size_t n = 0;
    for (auto it = m->begin(); it != m->end(); ++it, ++n) {
      d->push_back(*it);
      if (n == 1 || n == 3 || n == 5) d->push_back(torch::nn::Dropout(dropout));
    }
    return d;
  }
  return m;
}

constexpr int64_t kVocab = 20;

/// Embedding, 4 batch-first encoder blocks, head: 6 layers.
inline torch::nn::Sequential small_transformer(uint64_t seed) {
  torch::manual_seed(seed);
  torch::nn::Sequential m;
  m->push_back(torch::nn::Embedding(kVocab, 16));
  for (int b = 0; b < 4; ++b) m->push_back(EncoderBlock(16, 2, 32, 0.0));
  m->push_back(torch::nn::Linear(16, kVocab));
  return m;
}

/// The same model on one device: loss of the whole mini-batch, gradients accumulated.
inline torch::Tensor reference_step(torch::nn::Sequential model, const torch::Tensor& x,
                                    const torch::Tensor& y, const LossFn& loss) {
  torch::Tensor l = loss(model->forward(x), y);
  l.backward();
  return l.detach();
}

/// max |a - b| <= tol * max |b| (or tol, when b is all zeros).
inline ::testing::AssertionResult close(const torch::Tensor& a, const torch::Tensor& b,
                                        double tol = 1e-5) {
  if (!a.defined() || !b.defined())
    return ::testing::AssertionFailure() << "undefined tensor (a: " << a.defined()
                                         << ", b: " << b.defined() << ")";
  if (a.sizes() != b.sizes())
    return ::testing::AssertionFailure() << "shapes differ: " << a.sizes() << " vs " << b.sizes();
  const double scale = b.numel() == 0 ? 0.0 : b.abs().max().item<double>();
  const double diff =
      b.numel() == 0 ? 0.0 : (a.to(torch::kDouble) - b.to(torch::kDouble)).abs().max().item<double>();
  if (diff <= tol * (scale > 0 ? scale : 1.0)) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "max |a-b| = " << diff << " > " << tol << " * max|b| ("
                                       << scale << ")";
}

/// Every parameter's grad (or value, with `values`) of `a` equals `b`'s.
inline ::testing::AssertionResult same_parameters(const torch::nn::Sequential& a,
                                                  const torch::nn::Sequential& b, bool values,
                                                  double tol = 1e-5) {
  auto pa = a->named_parameters();
  auto pb = b->named_parameters();
  if (pa.size() != pb.size()) return ::testing::AssertionFailure() << "parameter counts differ";
  for (size_t n = 0; n < pa.size(); ++n) {
    const torch::Tensor& ta = values ? pa[n].value() : pa[n].value().grad();
    const torch::Tensor& tb = values ? pb[n].value() : pb[n].value().grad();
    auto r = close(ta, tb, tol);
    if (!r) return ::testing::AssertionFailure() << (values ? "value" : "grad") << " of "
                                                 << pa[n].key() << ": " << r.message();
  }
  return ::testing::AssertionSuccess();
}

/// Expects `fn` to throw std::invalid_argument whose message contains `needle`.
template <typename Fn>
void expect_invalid(Fn&& fn, const std::string& needle) {
  try {
    fn();
    ADD_FAILURE() << "expected std::invalid_argument containing \"" << needle << "\"";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos)
        << "message: " << e.what() << "\nexpected to contain: " << needle;
  }
}

}  // namespace gpipe::testing
