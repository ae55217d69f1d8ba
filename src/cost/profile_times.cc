// profile_times.cc: the profiler's clock: each layer timed in whole passes through the model, as a
// stage runs them (forward, full backward, and the backward split into I and W), and the
// optimizer's update timed on copies of the parameters.
#include "cost/profile_parts.h"

#include "runtime/backward_split.h"
#include "gpipe/skip.h"
#include "gpipe/stage.h"
#include "gpipe/check.h"

#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <stdexcept>

namespace gpipe::detail {
namespace {

double seconds_since(std::chrono::steady_clock::time_point begin) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - begin).count();
}


double seconds_of(const std::function<void()>& work) {
  const auto begin = std::chrono::steady_clock::now();
  work();
  return seconds_since(begin);
}

// A layer that changes its input in place runs on a copy (layers_changing_their_input found it). One
// that still does (only with a graph, say): autograd refuses it on an input that takes a gradient,
// and the version counter shows it on one that takes none (the data).
void check_not_in_place(const torch::nn::Sequential& layers, size_t l, bool in_place) {
  GPIPE_CHECK(!in_place, "layer ", l, " ('", layers->named_children()[l].key(), "') changes its input in place "
              "when it runs with a graph, which it did not do without one, so it cannot be timed by itself (nor "
              "begin a stage: a stage keeps its input for the backward pass, and the first stage's is the caller's "
              "data); make the layer return a new tensor (e.g. ReLU(inplace=False)), or cut the model without "
              "profiling it: name a `schedule` (not auto) and give the cut (`balance`), or in gpipe train cut it by "
              "parameters (`schedule` gpipe, `balance_by` params)");
}

// One pass of the tensors of `in_flight` micro-batches through a model's layers, forwards first,
// then backwards in reverse, full or split into I and W.
class ProfilePass {
 public:
  ProfilePass(torch::nn::Sequential layers, const std::vector<std::string>& names, const std::vector<bool>& in_place,
              int in_flight, Precision precision)
      : layers_(std::move(layers)), names_(names), in_place_(in_place), in_flight_(in_flight), precision_(precision),
        L_(layers_->size()),
        ins_(in_flight, std::vector<Tensors>(L_)), outs_(in_flight, std::vector<Tensors>(L_)),
        forward_(L_, 0.0), backward_(L_, 0.0), input_grad_(L_, 0.0), weight_grad_(L_, 0.0) {}

  // Every micro-batch's forward through the layers, each layer on a leaf of the one before's output.
  void forwards(const Tensors& sample) {
    for (int c = 0; c < in_flight_; ++c) {
      Tensors h = sample;
      size_t l = 0;
      for (auto it = layers_->begin(); it != layers_->end(); ++it, ++l) {
        Tensors& in = ins_[c][l];
        in = leaves_of(h, leaf_grad_of(l));
        const std::vector<int64_t> versions = versions_of(in);
        const Tensors given = in_place_[l] ? copy_of(in) : in;  // the copy is not timed
        try {
          forward_[l] += seconds_of([&] { outs_[c][l] = run_profiled(*it, given, names_[l], precision_); });
        } catch (const std::exception& e) {
          // Each layer is timed by itself on a leaf input, as a stage's first layer runs.
          const std::string what = e.what();
          check_not_in_place(layers_, l, what.find("in-place") != std::string::npos ||
                                             what.find("inplace") != std::string::npos);
          if (dynamic_cast<const std::invalid_argument*>(&e) != nullptr) throw;
          throw std::runtime_error("layer " + std::to_string(l) + " ('" + layers_->named_children()[l].key() +
                                   "') failed when profiled on " + in.shape() + ": " + short_error(e));
        }
        check_not_in_place(layers_, l, !changed_in_place(in, versions).empty());
        h = outs_[c][l];
      }
    }
  }

  // Every micro-batch's backward, the last first and each layer's in reverse: in one piece, or
  // (`split`) every I, then every W.
  void backwards(bool split) {
    std::vector<std::vector<detail::WeightBackward>> weights(in_flight_, std::vector<detail::WeightBackward>(L_));
    for (int c = in_flight_; c-- > 0;)
      for (size_t n = L_; n-- > 0;) {
        if (!requires_grad(outs_[c][n])) continue;
        const std::vector<torch::Tensor> grads = ones_for(outs_[c][n]);
        if (!split) {
          backward_[n] += seconds_of([&] { backward_from(outs_[c][n], grads); });
        } else {
          input_grad_[n] += seconds_of(
              [&] { detail::WeightBackward::input_backward(outs_[c][n], ins_[c][n], grads, weights[c][n]); });
        }
      }
    if (split)
      for (int c = in_flight_; c-- > 0;)
        for (size_t n = L_; n-- > 0;) {
          if (!requires_grad(outs_[c][n])) continue;
          weight_grad_[n] += seconds_of([&] { weights[c][n].run(); });
        }
  }

  // Adds this pass's times, per micro-batch, to `timings`: the forwards' and the full backwards', or
  // (`split`) the I's and W's.
  void add_to(LayerTimings& timings, bool split) const {
    if (!split)
      for (size_t l = 0; l < L_; ++l) timings.forward[l].push_back(forward_[l] / in_flight_);
    for (size_t n = 0; n < L_; ++n) {
      if (!requires_grad(outs_[0][n])) continue;
      if (!split) {
        timings.backward[n].push_back(backward_[n] / in_flight_);
      } else {
        timings.input_grad[n].push_back(input_grad_[n] / in_flight_);
        timings.weight_grad[n].push_back(weight_grad_[n] / in_flight_);
      }
    }
  }

 private:
  torch::nn::Sequential layers_;
  const std::vector<std::string>& names_;
  const std::vector<bool>& in_place_;  // per layer: run on a copy of its input
  int in_flight_;
  Precision precision_;  // of the forwards (autocast)
  size_t L_;
  std::vector<std::vector<Tensors>> ins_, outs_;  // [micro-batch][layer]
  std::vector<double> forward_, backward_, input_grad_, weight_grad_;  // [layer], summed over the micro-batches
};

}  // namespace

LayerTimings time_layers(const torch::nn::Sequential& layers, const std::vector<std::string>& names,
                         const Tensors& sample, const ProfileLayersOptions& options) {
  const size_t L = layers->size();
  LayerTimings timings{std::vector<std::vector<double>>(L), std::vector<std::vector<double>>(L),
                       std::vector<std::vector<double>>(L), std::vector<std::vector<double>>(L),
                       std::vector<bool>(L, false)};
  {
    const AutocastScope autocast(options.precision(), sample.items.front().device().type());
    std::map<std::string, torch::Tensor> tray;  // what its Stash layers stash, apart from the passes'
    const SkipTrayScope scope(tray);
    // Where a layer fails, none: its timed run says why.
    timings.in_place = layers_changing_their_input(layers, sample, names).value_or(std::vector<bool>(L, false));
  }
  const std::vector<bool>& in_place = timings.in_place;
  for (int rep = 0; rep < options.warmup() + options.repetitions(); ++rep) {
    if (options.between()) options.between()();
    for (bool split : {false, true}) {
      ProfilePass pass(layers, names, in_place, options.in_flight(), options.precision());
      pass.forwards(sample);
      pass.backwards(split);
      if (rep >= options.warmup()) pass.add_to(timings, split);
    }
  }
  return timings;
}

double update_s_per_parameter_byte(const torch::nn::Sequential& model, const ProfileLayersOptions& options) {
  constexpr int64_t kMostTimedUpdateBytes = int64_t{256} << 20;
  std::vector<torch::Tensor> copies;
  int64_t timed_bytes = 0;
  for (const auto& p : model->parameters()) {
    const int64_t room = (kMostTimedUpdateBytes - timed_bytes) / std::max<int64_t>(1, p.element_size());
    if (room <= 0) break;
    if (p.numel() == 0) continue;
    torch::Tensor copy = p.detach().flatten().narrow(0, 0, std::min(room, p.numel())).clone().requires_grad_(true);
    copy.mutable_grad() = torch::ones_like(copy);
    timed_bytes += static_cast<int64_t>(copy.nbytes());
    copies.push_back(copy);
  }
  if (timed_bytes == 0) return 0;
  if (options.between()) options.between()();
  const double state = options.state_per_parameter_byte();
  std::unique_ptr<torch::optim::Optimizer> optimizer;
  if (state >= 3)
    optimizer = std::make_unique<torch::optim::Adam>(copies, torch::optim::AdamOptions(1e-3));
  else
    optimizer = std::make_unique<torch::optim::SGD>(copies,
                                                    torch::optim::SGDOptions(1e-3).momentum(state >= 2 ? 0.9 : 0.0));
  std::vector<double> update;
  for (int rep = 0; rep < options.warmup() + options.repetitions(); ++rep) {
    const auto begin = std::chrono::steady_clock::now();
    optimizer->step();
    if (rep >= options.warmup()) update.push_back(seconds_since(begin));
  }
  return median_of(update) / static_cast<double>(timed_bytes);
}

}  // namespace gpipe::detail
