// helpers.h: small models, a single-device reference run, and tensor comparison for the tests.
#pragma once

#include <gpipe/gpipe.h>
#include <gtest/gtest.h>
#include <torch/torch.h>
#include <torch/csrc/autograd/custom_function.h>

#include <atomic>
#include <memory>
#include <random>

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

/// The tuple model's shapes: x [N, kSeq, kIn] -> [N, kOut].
constexpr int64_t kSeq = 6, kIn = 8, kWidth = 16, kOut = 4;

// Tuple layers. (x [N, 6, 8], scale [8], every micro-batch's whole) -> (hidden [N, 6, 16], mask [N, 6] bool)
struct EmbedImpl : torch::nn::Module {
  EmbedImpl() : proj(register_module("proj", torch::nn::Linear(kIn, kWidth))) {}
  std::vector<torch::Tensor> forward(const std::vector<torch::Tensor>& xs) {
    return {proj(xs.at(0) * xs.at(1)), xs.at(0).select(-1, 0) > -0.5};
  }
  torch::nn::Linear proj;
};
TORCH_MODULE(Embed);

// (hidden, mask) -> (hidden + masked tanh(linear(hidden)), mask)
struct MaskedImpl : torch::nn::Module {
  MaskedImpl() : lin(register_module("lin", torch::nn::Linear(kWidth, kWidth))) {}
  std::vector<torch::Tensor> forward(const std::vector<torch::Tensor>& xs) {
    const torch::Tensor& h = xs.at(0);
    const torch::Tensor m = xs.at(1).unsqueeze(-1).to(h.scalar_type());
    return {h + torch::tanh(lin(h)) * m, xs.at(1)};
  }
  torch::nn::Linear lin;
};
TORCH_MODULE(Masked);

// (hidden, mask) -> (tower a, tower b, a tensor no later layer differentiates, positions without a
// gradient, mask)
struct TowersImpl : torch::nn::Module {
  TowersImpl()
      : a(register_module("a", torch::nn::Linear(kWidth, kWidth))),
        b(register_module("b", torch::nn::Linear(kWidth, kWidth))) {}
  std::vector<torch::Tensor> forward(const std::vector<torch::Tensor>& xs) {
    const torch::Tensor& h = xs.at(0);
    const torch::Tensor positions = torch::arange(kSeq, h.options().requires_grad(false)).expand({h.size(0), kSeq});
    return {a(h), b(h), h * 2, positions, xs.at(1)};
  }
  torch::nn::Linear a, b;
};
TORCH_MODULE(Towers);

// (a, b, unused, positions, mask) -> mean over the unmasked positions of a * sigmoid(b) + positions' weight
struct MergeImpl : torch::nn::Module {
  torch::Tensor forward(const std::vector<torch::Tensor>& xs) {
    const torch::Tensor m = xs.at(4).unsqueeze(-1).to(xs.at(0).scalar_type());
    const torch::Tensor merged = xs.at(0) * torch::sigmoid(xs.at(1)) * m + 0.01 * xs.at(3).unsqueeze(-1);
    return merged.sum(1) / (m.sum(1) + 1);
  }
};
TORCH_MODULE(Merge);

/// 6 layers passing tuples (tensors.h): its input is (x [N, 6, 8], scale [8], whole to every
/// micro-batch); every boundary but the last two passes a tuple (hidden states and a mask, two
/// towers, a tensor no later layer differentiates, one without a gradient). With `keep`, only
/// those layers, named by their index (an MPI rank's share).
inline torch::nn::Sequential tuple_model(uint64_t seed, LayerRange keep = {}) {
  torch::manual_seed(seed);
  const std::vector<torch::nn::AnyModule> layers{
      torch::nn::AnyModule(Embed()), torch::nn::AnyModule(Masked()), torch::nn::AnyModule(Masked()),
      torch::nn::AnyModule(Towers()), torch::nn::AnyModule(Merge()), torch::nn::AnyModule(torch::nn::Linear(kWidth, kOut))};
  torch::nn::Sequential model;
  for (size_t n = 0; n < layers.size(); ++n) add_layer(model, layers[n], static_cast<int>(n), keep);
  return model;
}

/// The same model on one device: loss of the whole mini-batch, gradients accumulated.
// A cost model of `layers` layers that each take `forward_s` and `backward_s` per sample, and nothing else.
inline CostModel uniform_costs(int layers, double forward_s, double backward_s) {
  CostModel costs;
  costs.layers.resize(static_cast<size_t>(layers));
  for (LayerCost& c : costs.layers) {
    c.forward_s = forward_s;
    c.backward_s = backward_s;
  }
  return costs;
}

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

/// Where and when a FaultPoint throws during the next step: the `countdown`-th
/// time point `point` runs `phase`. Points of one pipeline share a plan; each
/// stage's thread reads it, so the countdown is atomic.
struct FaultPlan {
  enum Phase { kForward, kInputPath, kWeightBranch };
  int point = -1;  // -1: no fault
  Phase phase = kForward;
  std::atomic<int> countdown{0};

  void arm(int p, Phase ph, int n) {
    phase = ph;
    countdown = n;
    point = p;
  }
  void disarm() { point = -1; }
  // Whether point p throws now in phase ph.
  bool fires(int p, Phase ph) { return point == p && phase == ph && countdown.fetch_sub(1) == 1; }
};

/// An identity layer with a weight of ones, y = x * w, that throws as its plan
/// says: in its forward, in the backward of its input path (B or I), or in the
/// backward of its weight-only branch (B or W).
class FaultPointImpl : public torch::nn::Module {
 public:
  FaultPointImpl(int index, int64_t width, std::shared_ptr<FaultPlan> plan)
      : index_(index), plan_(std::move(plan)) {
    weight_ = register_parameter("weight", torch::ones({width}));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    if (is_training() && plan_->fires(index_, FaultPlan::kForward)) throw std::runtime_error("injected forward fault");
    return Throwing::apply(x, plan_.get(), index_, FaultPlan::kInputPath) *
           Throwing::apply(weight_, plan_.get(), index_, FaultPlan::kWeightBranch);
  }

 private:
  // The identity, whose backward throws when the plan says so.
  struct Throwing : torch::autograd::Function<Throwing> {
    static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x, FaultPlan* plan,
                                 int64_t index, int64_t phase) {
      ctx->saved_data["plan"] = reinterpret_cast<int64_t>(plan);
      ctx->saved_data["index"] = index;
      ctx->saved_data["phase"] = phase;
      return x.clone();
    }
    static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                   torch::autograd::variable_list grads) {
      auto* plan = reinterpret_cast<FaultPlan*>(ctx->saved_data["plan"].toInt());
      if (plan->fires(static_cast<int>(ctx->saved_data["index"].toInt()),
                      static_cast<FaultPlan::Phase>(ctx->saved_data["phase"].toInt())))
        throw std::runtime_error("injected backward fault");
      return {grads[0], torch::Tensor(), torch::Tensor(), torch::Tensor()};
    }
  };

  int index_;
  std::shared_ptr<FaultPlan> plan_;
  torch::Tensor weight_;
};
TORCH_MODULE(FaultPoint);

/// `steps` SGD steps of `faulty` and `clean` (two Pipelines) on the same batches
/// and Dropout seeds; before about half of faulty's steps `plan` is armed at a random point (of
/// 3), phase and moment. A step that throws `Failure` must leave every gradient zero, and its
/// retry must work. Adds the failed steps to `*failures`.
template <typename Failure, typename Trainer>
void train_with_random_faults(Trainer& faulty, Trainer& clean, FaultPlan& plan, int steps, unsigned seed,
                              int* failures) {
  torch::optim::SGD sgd_a(faulty.parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  torch::optim::SGD sgd_b(clean.parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  std::mt19937 rng(seed);
  for (int step = 0; step < steps; ++step) {
    torch::manual_seed(1000 + step);
    const torch::Tensor x = torch::randn({10, 8}), y = torch::randn({10, 3});
    sgd_b.zero_grad();
    torch::manual_seed(7000 + step);  // the generator each step draws its Dropout seed from
    clean.train_step(x, y, gpipe::mse_loss);
    sgd_b.step();

    sgd_a.zero_grad();
    if (rng() % 2 == 0)
      plan.arm(static_cast<int>(rng() % 3), static_cast<FaultPlan::Phase>(rng() % 3), 1 + static_cast<int>(rng() % 4));
    torch::manual_seed(7000 + step);
    try {
      faulty.train_step(x, y, gpipe::mse_loss);
    } catch (const Failure&) {
      ++*failures;
      for (const torch::Tensor& p : faulty.parameters())
        ASSERT_TRUE(!p.grad().defined() || p.grad().eq(0).all().template item<bool>())
            << "the failed step changed a gradient";
      plan.disarm();
      faulty.train_step(x, y, gpipe::mse_loss);  // the retry, which must work
    }
    plan.disarm();  // a fault whose moment did not come is dropped
    sgd_a.step();
  }
}

}  // namespace gpipe::testing
