// cost_model.cc: per-layer costs (profiled or from FLOPs) and the prediction of a configuration:
// the program simulated with those costs, then replayed device by device for the bytes it holds.
#include "gpipe/cost_model.h"

#include "runtime/backward_split.h"
#include "gpipe/check.h"
#include "gpipe/device.h"
#include "gpipe/memory.h"
#include "gpipe/partition.h"
#include "gpipe/skip.h"

#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <functional>
#include <iomanip>
#include <map>
#include <mutex>
#include <set>
#include <sstream>

namespace gpipe {
namespace {

double median_of(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

double seconds_since(std::chrono::steady_clock::time_point begin) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - begin).count();
}

// Runs the calling thread with `threads` intra-op threads while alive, and OpenBLAS with as many
// (a stage's setting, which a Pipeline sets again when it is built).
class IntraOpThreads {
 public:
  explicit IntraOpThreads(int threads) : previous_(at::get_num_threads()) {
    at::set_num_threads(threads);
    set_blas_threads(threads);
  }
  ~IntraOpThreads() { at::set_num_threads(previous_); }
  IntraOpThreads(const IntraOpThreads&) = delete;
  IntraOpThreads& operator=(const IntraOpThreads&) = delete;

 private:
  int previous_;
};

// A stage's costs: its layers' summed, and its peaks from theirs (cost_model.h explains the model).
struct StageCost {
  double forward_s = 0, backward_s = 0, input_grad_s = 0, weight_grad_s = 0;
  double kept = 0, output = 0, input = 0;  // bytes per sample
  double split_kept = 0;   // kept by a forward whose backward is split into I and W
  double weight_kept = 0;  // kept from I to W
  double forward_peak = 0;    // with autograd, above what the stage held before its F
  double recompute_peak = 0;  // forward without autograd (a re-materialized F)
  double backward_extra = 0;  // during B, above the stage's kept bytes
  int64_t parameter_bytes = 0;
  // The stage holds a Stash or Pop: a split backward runs in one piece. Its W walks the whole graph
  // again, so the stage keeps the graph and the gradients it received until W ends.
  bool whole = false;
  // A split backward's W keeps the gradient of the stage's output (whole, or weights in the last layer).
  bool weight_keeps_output_grad = false;
};

// The compute of one action of a stage on `rows` rows, with the pipeline's own overhead: a B or I whose
// forward was re-materialized (`recomputed`) runs that forward again first.
double compute_seconds(const StageCost& c, ActionKind kind, double rows, bool recomputed, double own) {
  const double again = recomputed ? c.forward_s * rows : 0.0;
  switch (kind) {
    case ActionKind::kForward: return own + c.forward_s * rows;
    case ActionKind::kBackward: return own + again + c.backward_s * rows;
    case ActionKind::kInputGrad: return own + again + c.input_grad_s * rows;
    case ActionKind::kWeightGrad: return own + c.weight_grad_s * rows;
    case ActionKind::kSend:
    case ActionKind::kRecv: break;  // no compute: the link's time, where there is one, is the caller's
  }
  return 0.0;
}

std::vector<StageCost> stage_costs_of(const CostModel& costs, const std::vector<int>& balance) {
  check_balance(balance, costs.layer_count());
  const std::vector<int> offsets = stage_offsets(balance);
  std::vector<StageCost> out(balance.size());
  for (size_t s = 0; s < balance.size(); ++s) {
    StageCost& c = out[s];
    const int first = offsets[s], last = offsets[s + 1];
    c.input = first == 0 ? 0.0 : costs.layers[static_cast<size_t>(first - 1)].output_bytes;  // no gradient for the data
    double kept_before = 0, backward_abs = 0, previous_output = 0;
    for (int l = first; l < last; ++l) {
      const LayerCost& layer = costs.layers[static_cast<size_t>(l)];
      // Skip tensors this stage stashed before layer l and has not popped (without autograd nothing
      // else keeps them), and the gradients of those it pops after l, alive until the backward
      // reaches the stash or the stage's input.
      double stashed = 0, popped_grads = 0;
      for (const SkipCost& skip : costs.skips) {
        const int stash = skip.connection.stash_layer, pop = skip.connection.pop_layer;
        if (stash >= first && stash < l && l <= pop) stashed += skip.bytes;
        if (pop < last && stash <= l && l < pop) popped_grads += skip.bytes;
      }
      c.forward_s += layer.forward_s;
      c.backward_s += layer.backward_s;
      c.input_grad_s += layer.input_grad_s;
      c.weight_grad_s += layer.weight_grad_s;
      c.parameter_bytes += layer.parameter_bytes;
      c.forward_peak = std::max(c.forward_peak, kept_before + layer.forward_peak_bytes);
      c.recompute_peak = std::max(c.recompute_peak, previous_output + stashed + layer.forward_peak_bytes);
      kept_before += l + 1 < last ? layer.chain_kept_bytes : layer.kept_bytes;  // the stage keeps its output
      c.split_kept += layer.kept_bytes;  // a split backward records every layer's output
      // After I, W keeps the layer's input (recorded), what its graph keeps for W, and, for a layer
      // with weights, the gradient of its output.
      c.weight_kept += (l > first ? previous_output : 0.0) + layer.weight_kept_bytes +
                       (layer.parameter_bytes > 0 && l + 1 < last ? layer.output_bytes : 0.0);  // the last
                       // layer's output gradient comes from the next stage, which counts it
      // During layer l's backward: what layers first..l kept, the gradient of l's output (made
      // by layer l+1's backward on this stage; the last layer's comes from the next stage), the
      // popped skip tensors' gradients, and l's own buffers.
      const double output_grad = l + 1 < last ? layer.output_bytes : 0.0;
      backward_abs = std::max(backward_abs, kept_before + output_grad + popped_grads + layer.backward_peak_bytes);
      previous_output = layer.output_bytes;
    }
    if (last == costs.layer_count()) {  // the loss, on the last stage
      kept_before += costs.loss_kept_bytes;
      backward_abs = std::max(backward_abs, kept_before + costs.loss_backward_peak_bytes);
    }
    c.kept = kept_before;
    c.output = previous_output;
    c.backward_extra = std::max(0.0, backward_abs - c.kept);
    c.whole = std::any_of(costs.skips.begin(), costs.skips.end(), [&](const SkipCost& skip) {
      const auto inside = [&](int layer) { return layer >= first && layer < last; };
      return inside(skip.connection.stash_layer) || inside(skip.connection.pop_layer);
    });
    // In one piece, I takes the input's (and skip tensors') gradients from the whole graph, and W
    // walks the graph again into the parameters: about a whole backward (U-Net's stage of 12 layers
    // at 64 rows: I 4.5 ms, W 7.6 ms, the forward 4.4 ms), which it keeps from F until W.
    if (c.whole) {
      c.split_kept = c.weight_kept = c.kept;
      c.weight_grad_s = c.backward_s;
    }
    c.weight_keeps_output_grad = c.whole || costs.layers[static_cast<size_t>(last - 1)].parameter_bytes > 0;
  }
  return out;
}

// What a device holds over a step: changes at simulated times, and the transient peak of each action.
struct Ledger {
  std::vector<std::pair<double, double>> changes;  // (time, bytes): + allocated, - freed
  std::vector<std::pair<double, double>> peaks;    // (start time, extra bytes during the action)
};

int64_t peak_of(Ledger ledger) {
  // Frees before allocations at the same instant: a send waited for is already consumed.
  std::sort(ledger.changes.begin(), ledger.changes.end(),
            [](const auto& a, const auto& b) { return a.first != b.first ? a.first < b.first : a.second < b.second; });
  std::sort(ledger.peaks.begin(), ledger.peaks.end());
  double held = 0, peak = 0;
  size_t c = 0;
  for (const auto& [start, extra] : ledger.peaks) {
    while (c < ledger.changes.size() && ledger.changes[c].first <= start) {
      held += ledger.changes[c++].second;
      peak = std::max(peak, held);
    }
    peak = std::max(peak, held + extra);
  }
  for (; c < ledger.changes.size(); ++c) {
    held += ledger.changes[c].second;
    peak = std::max(peak, held);
  }
  return static_cast<int64_t>(std::llround(std::min(peak, 4.0e18)));  // beyond any device, and no overflow
}

// Ones as the gradient of each tensor of `out` that requires grad (undefined for the others).
std::vector<torch::Tensor> ones_for(const Tensors& out) {
  std::vector<torch::Tensor> grads;
  for (const auto& t : out.items) grads.push_back(t.requires_grad() ? torch::ones_like(t) : torch::Tensor());
  return grads;
}

// A backward from the tensors of `out` that require grad.
void backward_from(const Tensors& out, const std::vector<torch::Tensor>& grads) {
  std::vector<torch::Tensor> roots, given;
  add_roots(out, grads, roots, given);
  torch::autograd::backward(roots, given);
}

// Whether `t` shares its storage with a tensor of `in` (a view, or an input handed on).
bool alias_of_input(const torch::Tensor& t, const Tensors& in) {
  return std::any_of(in.items.begin(), in.items.end(),
                     [&t](const torch::Tensor& i) { return t.storage().is_alias_of(i.storage()); });
}

// References to the input's tensors, but those the layer handed on as they are (a mask a tuple
// layer passes through): what a graph that saves its input adds to.
size_t input_uses(const Tensors& in, const Tensors& out) {
  size_t n = 0;
  for (const auto& t : in.items) {
    n += t.use_count();
    for (const auto& o : out.items)
      if (o.unsafeGetTensorImpl() == t.unsafeGetTensorImpl()) --n;
  }
  return n;
}

// Profiling never changes the model it measures: on leaving (also by an exception) the
// parameters' gradients, the buffers (BatchNorm's running statistics, which a forward in
// training mode updates) and the default CPU generator (which Dropout draws from) are as they were.
class UntouchedModel {
 public:
  explicit UntouchedModel(const torch::nn::Sequential& model)
      : generator_(at::globalContext().defaultGenerator(torch::kCPU)) {
    {
      std::lock_guard<std::mutex> lock(generator_.mutex());
      random_state_ = generator_.get_state();
    }
    for (const torch::Tensor& p : model->parameters()) {
      params_.push_back(p);
      grads_.push_back(p.grad());  // the profile's backwards start from none, so this one stays untouched
      p.mutable_grad() = torch::Tensor();
    }
    torch::NoGradGuard no_grad;
    for (const torch::Tensor& b : model->buffers()) {
      buffers_.push_back(b);
      values_.push_back(b.clone());
    }
  }
  ~UntouchedModel() {
    torch::NoGradGuard no_grad;
    for (size_t n = 0; n < params_.size(); ++n) params_[n].mutable_grad() = grads_[n];
    for (size_t n = 0; n < buffers_.size(); ++n) buffers_[n].copy_(values_[n]);
    std::lock_guard<std::mutex> lock(generator_.mutex());
    generator_.set_state(random_state_);
  }
  UntouchedModel(const UntouchedModel&) = delete;
  UntouchedModel& operator=(const UntouchedModel&) = delete;

 private:
  at::Generator generator_;
  torch::Tensor random_state_;
  std::vector<torch::Tensor> params_, grads_, buffers_, values_;
};

double seconds_of(const std::function<void()>& work) {
  const auto begin = std::chrono::steady_clock::now();
  work();
  return seconds_since(begin);
}

// Each layer is timed as the first layer of a stage, on a leaf input that takes a gradient, except
// the model's first: the first stage's input is the data, which takes a gradient only where it
// asks for one (a convolution's input gradient can cost more than its weights').
LeafGrad leaf_grad_of(size_t l) { return l == 0 ? LeafGrad::kKept : LeafGrad::kFloating; }

// A layer that changes its input in place: autograd refuses it on an input that takes a gradient,
// and the version counter shows it on one that takes none (the data).
void check_not_in_place(const torch::nn::Sequential& layers, size_t l, bool in_place) {
  GPIPE_CHECK(!in_place, "layer ", l, " ('", layers->named_children()[l].key(), "') changes its input in place, "
              "so it cannot be timed by itself (nor begin a stage: a stage keeps its input for the backward pass, "
              "and the first stage's is the caller's data); make the layer return a new tensor (e.g. "
              "ReLU(inplace=False)), or cut the model without profiling it: name a `schedule` (not auto) and give "
              "the cut (`balance`), or in gpipe train cut it by parameters (`schedule` gpipe, `balance_by` params)");
}

// The sample's tensor that gives the rows (the first not taken whole), once `options` and the
// sample have passed profile_layers' checks.
torch::Tensor checked_rows_tensor(const Tensors& sample, const ProfileLayersOptions& options) {
  GPIPE_CHECK(sample.size() > 0, "profile_layers needs a sample");
  const std::vector<int>& whole = options.whole();
  int lead = 0;  // the first tensor with the batch dimension gives the rows
  while (std::find(whole.begin(), whole.end(), lead) != whole.end()) ++lead;
  GPIPE_CHECK(static_cast<size_t>(lead) < sample.size(), "profile_layers needs a sample tensor that is not whole");
  const torch::Tensor rows = sample.items[static_cast<size_t>(lead)];
  GPIPE_CHECK(options.repetitions() >= 1, "profile_layers needs at least 1 repetition (got ", options.repetitions(), ")");
  GPIPE_CHECK(options.threads() >= 1, "profile_layers needs at least 1 thread (got ", options.threads(), ")");
  GPIPE_CHECK(options.in_flight() >= 1, "profile_layers needs at least 1 micro-batch in flight (got ",
              options.in_flight(), ")");
  GPIPE_CHECK(rows.dim() >= 1 && rows.size(0) >= 1, "profile_layers needs a sample of at least one row");
  const double state = options.state_per_parameter_byte();
  GPIPE_CHECK(state >= 0 && std::isfinite(state), "state_per_parameter_byte must be finite and not negative (got ",
              state, "); use 1 for SGD, 2 for SGD with momentum, 3 for Adam");
  const torch::Tensor& target = options.target();
  GPIPE_CHECK(!options.loss() || (target.defined() && target.dim() >= 1 && target.size(0) == rows.size(0)),
              "profile_layers needs the sample's target, ", rows.size(0), " rows, to profile the loss");
  return rows;
}

// Each layer's timed passes, seconds per micro-batch: forward, full backward, and the backward split
// into I and W. [layer][timed pass]; a layer whose output takes no gradient has no backward.
struct LayerTimings {
  std::vector<std::vector<double>> forward, backward, input_grad, weight_grad;
};

// One pass of the tensors of `in_flight` micro-batches through a model's layers, forwards first,
// then backwards in reverse, full or split into I and W.
class ProfilePass {
 public:
  ProfilePass(torch::nn::Sequential layers, const std::vector<std::string>& names, int in_flight)
      : layers_(std::move(layers)), names_(names), in_flight_(in_flight), L_(layers_->size()),
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
        try {
          forward_[l] += seconds_of([&] { outs_[c][l] = run_layer(*it, in, names_[l]); });
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
  int in_flight_;
  size_t L_;
  std::vector<std::vector<Tensors>> ins_, outs_;  // [micro-batch][layer]
  std::vector<double> forward_, backward_, input_grad_, weight_grad_;  // [layer], summed over the micro-batches
};

// Times: whole passes through the layers in a stage's order, forwards first, then backwards in
// reverse (a layer timed many times in a row, or its backward right after its forward, would find
// its weights in cache, which a pass through many layers does not). `in_flight` micro-batches at
// once, their forwards before their backwards (as a schedule holds them): each layer's time then
// includes the cache it loses to the others' activations.
LayerTimings time_layers(const torch::nn::Sequential& layers, const std::vector<std::string>& names,
                         const Tensors& sample, const ProfileLayersOptions& options) {
  const size_t L = layers->size();
  LayerTimings timings{std::vector<std::vector<double>>(L), std::vector<std::vector<double>>(L),
                       std::vector<std::vector<double>>(L), std::vector<std::vector<double>>(L)};
  for (int rep = 0; rep < options.warmup() + options.repetitions(); ++rep) {
    if (options.between()) options.between()();
    for (bool split : {false, true}) {
      ProfilePass pass(layers, names, options.in_flight());
      pass.forwards(sample);
      pass.backwards(split);
      if (rep >= options.warmup()) pass.add_to(timings, split);
    }
  }
  return timings;
}

// What profiling a model's bytes layer by layer carries from one layer to the next.
struct ByteProfile {
  std::shared_ptr<MemoryCounter> counter = std::make_shared<MemoryCounter>("profile");
  std::map<std::string, torch::Tensor>* tray = nullptr;  // where the model's Stash and Pop layers meet (skip.h)
  double rows = 1;
  std::map<const void*, size_t> tied_index;  // a parameter tensor → its entry in CostModel::tied
  std::vector<bool> saves_input, saves_output, views;  // per layer
};

// Layer `index`'s parameter bytes into `c`, and each of its parameter tensors into `costs.tied`.
void count_parameters(torch::nn::AnyModule& layer, size_t index, LayerCost& c, CostModel& costs,
                      std::map<const void*, size_t>& tied_index) {
  std::set<const void*> here;  // a layer that registers a tensor under two names uses it once
  for (const auto& p : layer.ptr()->parameters()) {
    if (!here.insert(p.unsafeGetTensorImpl()).second) continue;
    c.parameter_bytes += static_cast<int64_t>(p.nbytes());
    const auto [entry, first] = tied_index.emplace(p.unsafeGetTensorImpl(), costs.tied.size());
    if (first) costs.tied.push_back({static_cast<int64_t>(p.nbytes()), {}});
    costs.tied[entry->second].layers.push_back(static_cast<int>(index));
  }
}

// The bytes of layer `index`'s backward after its forward made `out` (its input still held): its
// backward's peak, and what its graph keeps from I to W when run again on its input `x` with the
// tray as before the forward.
void measure_backward_bytes(torch::nn::AnyModule& layer, size_t index, const std::string& name, const Tensors& x,
                            const Tensors& out, const std::map<std::string, torch::Tensor>& tray_before,
                            ByteProfile& p, LayerCost& c) {
  MemoryCounter& counter = *p.counter;
  const std::vector<torch::Tensor> grads = ones_for(out);
  const int64_t held = counter.current_bytes();
  counter.reset_peak();
  backward_from(out, grads);
  c.backward_peak_bytes = static_cast<double>(counter.peak_bytes() - held);
  const Tensors leaf = leaves_of(x, leaf_grad_of(index));  // I starts from a leaf, as a stage records its layers
  *p.tray = tray_before;
  const int64_t before_split = counter.current_bytes();
  Tensors again = run_layer(layer, leaf, name);
  detail::WeightBackward weights;
  const Tensors input_grad = Tensors::tuple_of(detail::WeightBackward::input_backward(again, leaf, grads, weights));
  again = Tensors();  // the stage lets go of the layer's output after I
  c.weight_kept_bytes = std::max<double>(
      0.0, static_cast<double>(counter.current_bytes() - before_split) - static_cast<double>(input_grad.bytes()));
  weights.run();
}

// The bytes of layer `index` on the output `x` of the layers before, into `c` (whole, not yet per
// row) and `p`'s per-layer flags; returns its output. Charged as a stage's thread would be: the
// parameters' gradients exist already, the input belongs to the stage before (a non-leaf, so that
// only a graph saving it holds it).
Tensors measure_bytes(torch::nn::AnyModule& layer, size_t index, const std::string& name, const Tensors& x,
                      std::vector<SkipCost>& skips, ByteProfile& p, LayerCost& c) {
  std::map<std::string, torch::Tensor>& tray = *p.tray;
  MemoryCounter& counter = *p.counter;
  const std::map<std::string, torch::Tensor> tray_before = tray;  // the layer runs twice: a Pop takes twice
  const Tensors leaf = leaves_of(x, leaf_grad_of(index));
  Tensors in = leaf;
  for (auto& t : in.items)
    if (t.requires_grad()) t = t.clone();
  const size_t uses_before = input_uses(in, Tensors());
  MemoryScope scope(p.counter);
  counter.reset_peak();
  const int64_t before = counter.current_bytes();
  Tensors out = run_layer(layer, in, name);
  for (SkipCost& skip : skips)  // what the layer stashed
    if (tray.count(skip.connection.name) > tray_before.count(skip.connection.name))
      skip.bytes = static_cast<double>(tray[skip.connection.name].nbytes()) / p.rows;
  c.forward_peak_bytes = static_cast<double>(counter.peak_bytes() - before);
  c.kept_bytes = static_cast<double>(counter.current_bytes() - before);
  // Of a tuple, the tensors the layer made, not those it handed on (a mask passed through).
  bool view = true, output_saved = false;
  for (const auto& t : out.items) {
    if (alias_of_input(t, in)) continue;
    view = false;
    output_saved = output_saved || t.storage().use_count() > 1;
  }
  c.output_bytes = static_cast<double>(out.bytes());
  c.output_tensors = static_cast<int>(out.size());
  p.views.push_back(view);
  // A graph that saves a tensor holds a reference to it: to the input's TensorImpl, or to the
  // output's storage (a saved output is a detached alias).
  p.saves_input.push_back(view || input_uses(in, out) > uses_before);
  p.saves_output.push_back(!view && output_saved);
  if (requires_grad(out)) measure_backward_bytes(layer, index, name, x, out, tray_before, p, c);
  return out;
}

// The loss's bytes per row on the model's output `x` (one floating-point tensor; none for an integer
// output, which takes no gradient): what it keeps for backward, and its backward's peak above that.
void measure_loss_bytes(const Tensors& x, const ProfileLayersOptions& options, ByteProfile& p, CostModel& costs) {
  const torch::Tensor model_output = options.loss() ? x.only("the model's output", "end the model with a layer that "
                                                                                   "returns one tensor, for the loss")
                                                    : torch::Tensor();
  if (!model_output.defined() || !model_output.is_floating_point()) return;
  const torch::Tensor output = model_output.detach().requires_grad_(true);
  MemoryScope scope(p.counter);
  const int64_t before = p.counter->current_bytes();
  const torch::Tensor value = options.loss()(output, options.target());
  costs.loss_kept_bytes = static_cast<double>(p.counter->current_bytes() - before) / p.rows;
  const int64_t held = p.counter->current_bytes();
  p.counter->reset_peak();
  value.backward();
  costs.loss_backward_peak_bytes = static_cast<double>(p.counter->peak_bytes() - held) / p.rows;
}

// The optimizer's update, timed on copies of the parameters (the model's stay as they are) with
// gradients, by the optimizer the state per parameter byte stands for: 1 plain SGD, 2 SGD with
// momentum, 3 Adam; seconds per parameter byte (0 for a model without parameters). The update is
// elementwise: of a model of more than kMostTimedUpdateBytes, the parameters in order up to that
// size are timed (the last one cut short) and the time scaled by bytes.
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

// Each layer's costs from its `timings` and its bytes, profiled layer after layer from `sample`,
// into `costs` (its tied parameters too); returns the model's output.
Tensors measure_layers(const torch::nn::Sequential& model, const std::vector<std::string>& names,
                       const Tensors& sample, const LayerTimings& timings, ByteProfile& p, CostModel& costs) {
  torch::nn::Sequential layers = model;  // a handle to the same modules, to call them
  Tensors x = sample;
  size_t index = 0;
  for (auto it = layers->begin(); it != layers->end(); ++it, ++index) {
    LayerCost c;
    count_parameters(*it, index, c, costs, p.tied_index);
    c.forward_s = median_of(timings.forward[index]) / p.rows;
    if (!timings.backward[index].empty() && !timings.input_grad[index].empty() &&
        !timings.weight_grad[index].empty()) {
      c.backward_s = median_of(timings.backward[index]) / p.rows;
      c.input_grad_s = median_of(timings.input_grad[index]) / p.rows;
      c.weight_grad_s = median_of(timings.weight_grad[index]) / p.rows;
    }
    const Tensors out = measure_bytes(*it, index, names[index], x, costs.skips, p, c);
    for (double* bytes : {&c.kept_bytes, &c.output_bytes, &c.forward_peak_bytes, &c.backward_peak_bytes,
                          &c.weight_kept_bytes})
      *bytes /= p.rows;
    c.chain_kept_bytes = c.kept_bytes;  // until the next layer is known
    x = leaves_of(out, LeafGrad::kNone);
    costs.layers.push_back(c);
  }
  // Of the parameters, those that more than one layer uses (a tied weight), renumbered in order.
  costs.tied.erase(std::remove_if(costs.tied.begin(), costs.tied.end(),
                                  [](const TiedParameter& t) { return t.layers.size() < 2; }),
                   costs.tied.end());
  return x;
}

}  // namespace

CostModel profile_layers(const torch::nn::Sequential& model, const Tensors& sample,
                         const ProfileLayersOptions& options) {
  const torch::Tensor rows_tensor = checked_rows_tensor(sample, options);
  const UntouchedModel untouched(model);
  enable_memory_tracking();
  const IntraOpThreads intra_op(options.threads());
  CostModel costs;
  costs.state_per_parameter_byte = options.state_per_parameter_byte();
  for (const SkipConnection& connection : skip_connections(model)) costs.skips.push_back({connection, 0.0});
  ByteProfile bytes;
  bytes.rows = static_cast<double>(rows_tensor.size(0));
  std::map<std::string, torch::Tensor> tray;
  bytes.tray = &tray;
  const detail::SkipTrayScope tray_scope(tray);
  const std::vector<std::string> names = layer_names(model);
  const LayerTimings timings = time_layers(model, names, sample, options);
  const Tensors output = measure_layers(model, names, sample, timings, bytes, costs);
  measure_loss_bytes(output, options, bytes, costs);
  // A layer's output stays, once the next layer has run, only if one of them saved it.
  for (size_t l = 0; l + 1 < costs.layers.size(); ++l)
    if (!bytes.views[l] && !bytes.saves_output[l] && !bytes.saves_input[l + 1])
      costs.layers[l].chain_kept_bytes -= costs.layers[l].output_bytes;
  costs.update_s_per_parameter_byte = update_s_per_parameter_byte(model, options);
  return costs;  // `untouched` puts back the gradients, buffers and random numbers
}

CostModel with_compute_scaled(CostModel costs, double factor) {
  for (LayerCost& layer : costs.layers)
    for (double* t : {&layer.forward_s, &layer.backward_s, &layer.input_grad_s, &layer.weight_grad_s}) *t *= factor;
  return costs;
}

std::vector<int64_t> Prediction::total_bytes() const {
  std::vector<int64_t> out;
  for (size_t d = 0; d < peak_bytes.size(); ++d) out.push_back(peak_bytes[d] + static_bytes[d]);
  return out;
}

int Prediction::largest_device() const {
  const std::vector<int64_t> totals = total_bytes();
  if (totals.empty()) return -1;
  return static_cast<int>(std::max_element(totals.begin(), totals.end()) - totals.begin());
}

int64_t Prediction::largest_total_bytes() const {
  const int d = largest_device();
  return d < 0 ? 0 : total_bytes()[static_cast<size_t>(d)];
}

double ring_all_reduce_s(const CostModel& costs, double bytes, int holders) {
  if (holders < 2) return 0.0;
  const double send_s = costs.link_bytes_per_s > 0 ? bytes / holders / costs.link_bytes_per_s : 0.0;
  return 2.0 * (holders - 1) * (costs.link_latency_s + send_s);
}

std::vector<double> layer_times(const CostModel& costs, int64_t rows) {
  std::vector<double> out;
  for (const LayerCost& l : costs.layers) out.push_back((l.forward_s + l.backward_s) * static_cast<double>(rows));
  return out;
}

std::vector<double> layer_memory(const CostModel& costs, int64_t rows) {
  std::vector<double> out;
  for (const LayerCost& l : costs.layers)
    out.push_back(l.kept_bytes * static_cast<double>(rows) +
                  static_cast<double>(l.parameter_bytes) * (1 + costs.state_per_parameter_byte));
  return out;
}

std::string cost_unit(const std::string& method) {
  GPIPE_CHECK(method == "params" || method == "time" || method == "memory", "unknown cost '", method,
              "' to balance by; use params, time or memory");
  return method == "params" ? "parameters" : method == "time" ? "s" : "bytes";
}

std::vector<double> layer_costs_by(const std::string& method, const torch::nn::Sequential& model,
                                   const CostModel& profile, int64_t rows) {
  cost_unit(method);  // throws for another method
  if (method == "params") return parameter_costs(model);
  return method == "time" ? layer_times(profile, rows) : layer_memory(profile, rows);
}

std::vector<ActionTimes> stage_action_times(const CostModel& costs, const std::vector<int>& balance, int64_t rows,
                                            Checkpoint mode) {
  GPIPE_CHECK(rows >= 1, "a micro-batch needs at least 1 row (got ", rows, ")");
  const double n = static_cast<double>(rows), own = costs.action_overhead_s;
  // The order is made before lowering decides which forwards keep their activations: under except_last
  // every I is charged its forward again.
  const bool recomputed = mode != Checkpoint::kNever;
  std::vector<ActionTimes> out;
  for (const StageCost& c : stage_costs_of(costs, balance))
    out.push_back({compute_seconds(c, ActionKind::kForward, n, false, own),
                   compute_seconds(c, ActionKind::kInputGrad, n, recomputed, own),
                   compute_seconds(c, ActionKind::kWeightGrad, n, false, own)});
  return out;
}

namespace {

// What every step of a prediction reads: the plan's training program, its stages' costs, the rows of
// each micro-batch, which forwards were re-materialized and the bytes each skip route carries.
class StepModel {
 public:
  StepModel(const CostModel& model, const PipelinePlan& cut, const std::vector<int64_t>& micro_batch_rows)
      : costs(model), plan(cut), schedule(cut.training), micro_batch_rows_(micro_batch_rows) {
    GPIPE_CHECK(plan.layers == costs.layer_count(), "the plan cuts ", plan.layers, " layers but the cost model has ",
                costs.layer_count());
    GPIPE_CHECK(static_cast<int>(micro_batch_rows.size()) == schedule.micro_batches, "the program runs ",
                schedule.micro_batches, " micro-batches but ", micro_batch_rows.size(), " row counts were given");
    stage_ = stage_costs_of(costs, plan.balance);
    // Which forwards were re-materialized: their B or I runs the forward again.
    recomputed_.assign(slots(), 0);
    for (const auto& list : schedule.actions)
      for (const Action& a : list)
        if (a.kind == ActionKind::kForward) recomputed_[slot(a.stage, a.micro_batch)] = a.recompute;
    // The bytes per sample of the tensor skip route k carries, and of its gradient.
    for (const std::string& name : plan.skip_names) {
      const auto it = std::find_if(costs.skips.begin(), costs.skips.end(),
                                   [&](const SkipCost& skip) { return skip.connection.name == name; });
      GPIPE_CHECK(it != costs.skips.end(), "the plan's skip connection \"", name,
                  "\" is not in the cost model; profile the model that has it");
      skip_bytes_.push_back(it->bytes);
    }
  }

  const CostModel& costs;
  const PipelinePlan& plan;
  const Schedule& schedule;  // the plan's training program

  // One entry per (stage, micro-batch): S·M.
  size_t slots() const { return static_cast<size_t>(schedule.stages) * static_cast<size_t>(schedule.micro_batches); }
  size_t slot(int s, int i) const {
    return static_cast<size_t>(s) * static_cast<size_t>(schedule.micro_batches) + static_cast<size_t>(i);
  }
  const StageCost& at(int s) const { return stage_[static_cast<size_t>(s)]; }
  // The rows of `a`'s micro-batch.
  double rows(const Action& a) const {
    return static_cast<double>(micro_batch_rows_[static_cast<size_t>(a.micro_batch)]);
  }
  // Whether `a`'s forward was re-materialized (the given program's flag).
  bool again(const Action& a) const { return recomputed_[slot(a.stage, a.micro_batch)] != 0; }
  // The bytes per sample a send carries: a skip tensor or its gradient, the stage's output, or the
  // gradient of its input.
  double sent(const Action& a) const {
    const int k = skip_of(a.channel);
    if (k >= 0) return skip_bytes_[static_cast<size_t>(k)];
    return carries_gradient(a.channel) ? at(a.stage).input : at(a.stage).output;
  }

 private:
  const std::vector<int64_t>& micro_batch_rows_;
  std::vector<StageCost> stage_;
  std::vector<char> recomputed_;  // [slot]
  std::vector<double> skip_bytes_;
};

// The parameter bytes of a plan's stages on their devices.
struct ParameterBytes {
  std::vector<double> held;  // per stage: what it adds to its device's
  double unique = 0;         // every parameter once: what one process steps
  double tied_all_reduce_s = 0;  // summing the copies' gradients of tensors tied across devices
};

// The parameter bytes each stage adds to its device's: a tensor tied across layers (CostModel::tied)
// counts on the first of its stages on each device. Across devices, each holds a copy, whose
// gradients are summed when every stage is done (over the link; free between threads), and one
// process steps the tensor once.
ParameterBytes parameter_bytes_of(const StepModel& m) {
  const CostModel& costs = m.costs;
  ParameterBytes p;
  for (int s = 0; s < m.schedule.stages; ++s) {
    p.held.push_back(static_cast<double>(m.at(s).parameter_bytes));
    p.unique += p.held.back();
  }
  const std::vector<int> offsets = stage_offsets(m.plan.balance);
  for (const TiedParameter& tied : costs.tied) {
    std::set<int> holders;
    for (int l : tied.layers) {
      GPIPE_CHECK(l >= 0 && l < costs.layer_count(), "a tied parameter is used by layer ", l,
                  ", which the cost model does not have (layers 0..", costs.layer_count() - 1, ")");
      const int s = static_cast<int>(std::upper_bound(offsets.begin(), offsets.end(), l) - offsets.begin()) - 1;
      if (!holders.insert(m.schedule.placement[static_cast<size_t>(s)]).second)
        p.held[static_cast<size_t>(s)] -= static_cast<double>(tied.bytes);
    }
    p.unique -= static_cast<double>(tied.bytes) * static_cast<double>(tied.layers.size() - 1);
    p.tied_all_reduce_s += ring_all_reduce_s(costs, static_cast<double>(tied.bytes), static_cast<int>(holders.size()));
  }
  return p;
}

// The update on the devices (update_on_devices): each stage's share before its first action on its
// device, or all of a device's before its first action where that is a receive, as the Trainer
// applies it. Keyed by the action's text, unique in a program.
std::map<std::string, double> updates_before(const StepModel& m, const ParameterBytes& parameters) {
  std::map<std::string, double> update_before;
  const Schedule lowered = m.schedule.lowered() ? m.schedule : lower(m.schedule, Checkpoint::kNever);
  for (int d = 0; d < m.schedule.devices; ++d) {
    const std::vector<Action>& row = lowered.actions[static_cast<size_t>(d)];
    if (row.empty()) continue;
    std::set<int> entered;
    for (const Action& a : row)
      if (entered.insert(a.stage).second)
        update_before[(row.front().kind == ActionKind::kRecv ? row.front() : a).str()] +=
            m.costs.update_s_per_parameter_byte * parameters.held[static_cast<size_t>(a.stage)];
  }
  return update_before;
}

// The training program simulated with each action's time: its stage's compute, a send's time on the
// link, and with update_on_devices each stage's update before it.
SimulatedRun simulate_step(const StepModel& m, const ParameterBytes& parameters) {
  const CostModel& costs = m.costs;
  const Schedule& schedule = m.schedule;
  const CostFn cost = [&](const Action& a) -> double {
    const double n = m.rows(a);
    switch (a.kind) {
      case ActionKind::kForward:
      case ActionKind::kBackward:
      case ActionKind::kInputGrad:
      case ActionKind::kWeightGrad:
        return compute_seconds(m.at(a.stage), a.kind, n, m.again(a), costs.action_overhead_s);
      case ActionKind::kSend:  // between two stages of one device the executor hands it over: free
        if (schedule.placement[static_cast<size_t>(a.stage)] == schedule.placement[static_cast<size_t>(a.peer)]) return 0.0;
        return costs.link_bytes_per_s > 0 ? costs.link_latency_s + m.sent(a) * n / costs.link_bytes_per_s : 0.0;
      case ActionKind::kRecv: return 0.0;
    }
    return 0.0;
  };
  if (!costs.update_on_devices) return simulate(schedule, cost, CostFn());
  const std::map<std::string, double> update_before = updates_before(m, parameters);
  const CostFn work_before = [&](const Action& a) {
    const auto it = update_before.find(a.str());
    return it == update_before.end() ? 0.0 : it->second;
  };
  return simulate(schedule, cost, work_before);
}

// When each (stage, micro-batch)'s F, its B or I, and its W end in a simulated run (NaN: there is none).
struct ActionEnds {
  std::vector<double> forward, backward, weight;  // [slot]

  ActionEnds(const StepModel& m, const SimulatedRun& run)
      : forward(m.slots(), std::nan("")), backward(m.slots(), std::nan("")), weight(m.slots(), std::nan("")) {
    const Schedule& program = run.program;
    for (size_t d = 0; d < static_cast<size_t>(m.schedule.devices); ++d)
      for (size_t n = 0; n < program.actions[d].size(); ++n) {
        const Action& a = program.actions[d][n];
        const double end = run.end[d][n];
        if (a.kind == ActionKind::kForward) forward[m.slot(a.stage, a.micro_batch)] = end;
        if (a.is_backward()) backward[m.slot(a.stage, a.micro_batch)] = end;
        if (a.kind == ActionKind::kWeightGrad) weight[m.slot(a.stage, a.micro_batch)] = end;
      }
  }
};

// What each device holds over the simulated run: each action replayed on its device's ledger as
// cost_model.h describes (what a stage keeps, what it sends, each action's transient peak).
std::vector<Ledger> replay_bytes(const StepModel& m, const SimulatedRun& run) {
  const ActionEnds ends(m, run);
  auto split = [&](int s, int i) { return !std::isnan(ends.weight[m.slot(s, i)]); };
  // When stage s lets go of micro-batch i (its input, its skip tensors): at the end of its W, or of its B.
  auto released = [&](int s, int i) { return split(s, i) ? ends.weight[m.slot(s, i)] : ends.backward[m.slot(s, i)]; };
  auto backward_end = [&](int s, int i) { return ends.backward[m.slot(s, i)]; };
  auto weight_end = [&](int s, int i) { return ends.weight[m.slot(s, i)]; };

  const Schedule& program = run.program;  // lowered
  std::vector<Ledger> ledger(static_cast<size_t>(m.schedule.devices));
  for (size_t d = 0; d < ledger.size(); ++d) {
    auto hold = [&ledger, d](double bytes, double from, double until) {
      if (bytes <= 0 || !(until > from)) return;
      ledger[d].changes.push_back({from, bytes});
      ledger[d].changes.push_back({until, -bytes});
    };
    for (size_t n = 0; n < program.actions[d].size(); ++n) {
      const Action& a = program.actions[d][n];
      const StageCost& c = m.at(a.stage);
      const int s = a.stage, i = a.micro_batch;
      const double rows_a = m.rows(a), start = run.start[d][n], end = run.end[d][n];
      auto peak = [&](double bytes) { ledger[d].peaks.push_back({start, bytes * rows_a}); };
      switch (a.kind) {
        case ActionKind::kForward:
          if (m.again(a)) {  // the given program's flag (simulate() re-lowers a one-stage program)
            peak(c.recompute_peak);
          } else if (!split(s, i)) {
            peak(c.forward_peak);
            hold(c.kept * rows_a, end, backward_end(s, i));
          } else {  // I frees what W does not need, W the rest
            peak(std::max(c.forward_peak, c.split_kept));
            hold((c.split_kept - c.weight_kept) * rows_a, end, backward_end(s, i));
            hold(c.weight_kept * rows_a, end, weight_end(s, i));
          }
          break;
        case ActionKind::kBackward:
        case ActionKind::kInputGrad:
          if (m.again(a)) {
            peak(std::max(c.forward_peak, c.kept + c.backward_extra));
            if (a.kind == ActionKind::kInputGrad)  // the recomputed forward's W share waits for W
              hold(c.weight_kept * rows_a, end, weight_end(s, i));
          } else {
            peak(c.backward_extra);
          }
          break;
        case ActionKind::kSend: {
          // What a device sends stays charged to it (its thread allocated it) until the receiving stage
          // t is done with it.
          const int t = a.peer;
          if (!carries_gradient(a.channel)) {
            // A stage output or a stashed tensor, made by s's F: t holds it until it lets go of the
            // micro-batch; a forward that kept its activations holds it among them until its B (W).
            const double kept_until = c.whole ? released(s, i) : backward_end(s, i);
            hold(m.sent(a) * rows_a, m.again(a) ? ends.forward[m.slot(s, i)] : kept_until, released(t, i));
          } else {
            // The gradient of s's input or of a tensor it popped, made by its B or I: t's B or I uses
            // it, and a split W keeps it when it starts there (weight_keeps_output_grad).
            const double until = m.at(t).weight_keeps_output_grad ? released(t, i) : backward_end(t, i);
            hold(m.sent(a) * rows_a, backward_end(s, i), until);
          }
          break;
        }
        case ActionKind::kWeightGrad:
        case ActionKind::kRecv:
          break;
      }
    }
  }
  return ledger;
}

}  // namespace

Prediction predict(const CostModel& costs, const PipelinePlan& plan, const std::vector<int64_t>& micro_batch_rows) {
  const StepModel m(costs, plan, micro_batch_rows);
  const ParameterBytes parameters = parameter_bytes_of(m);
  const SimulatedRun run = simulate_step(m, parameters);
  const std::vector<Ledger> ledger = replay_bytes(m, run);
  Prediction p;
  p.bubble = run.bubble;
  for (int d = 0; d < m.schedule.devices; ++d) {
    p.peak_bytes.push_back(peak_of(ledger[static_cast<size_t>(d)]));
    double held = 0;
    for (int s : run.program.stages_of(d)) held += parameters.held[static_cast<size_t>(s)];
    p.static_bytes.push_back(static_cast<int64_t>(std::min(held * (1.0 + costs.state_per_parameter_byte), 4.0e18)));
  }
  p.step_s = run.makespan + costs.step_overhead_s + parameters.tied_all_reduce_s +
             (costs.update_on_devices ? 0.0 : costs.update_s_per_parameter_byte * parameters.unique);
  return p;
}

int64_t TransformerShape::block_parameters() const {
  // Attention: in-projection 3·w·w + 3·w, out-projection w·w + w; feed-forward w·f + f + f·w + w; two LayerNorms 4·w.
  return 4 * width * width + 4 * width + 2 * width * ffn + ffn + width + 4 * width;
}

int64_t TransformerShape::parameters() const {
  return vocab * width + layers * block_parameters() + width * vocab + vocab;
}

CostModel transformer_costs(const TransformerShape& shape, const DeviceSpec& device, double state_per_parameter_byte) {
  GPIPE_CHECK(shape.layers >= 1 && shape.width >= 1 && shape.heads >= 1 && shape.ffn >= 1 && shape.vocab >= 1 &&
                  shape.sequence >= 1,
              "a Transformer needs at least one layer, and a width, heads, feed-forward width, vocabulary and "
              "sequence length of at least 1");
  const double parameters = static_cast<double>(shape.layers) *
                                (4.0 * shape.width * shape.width + 2.0 * shape.width * shape.ffn) +
                            2.0 * static_cast<double>(shape.vocab) * shape.width;
  GPIPE_CHECK(parameters < 1e15, "a Transformer of about ", parameters, " parameters is beyond what gpipe plans (1e15)");
  GPIPE_CHECK(shape.width % shape.heads == 0, "the width ", shape.width, " is not a multiple of the ", shape.heads,
              " heads; each head takes width / heads values");
  GPIPE_CHECK(device.flops_per_s > 0 && std::isfinite(device.flops_per_s),
              "a device needs a positive speed in FLOP/s (got ", device.flops_per_s, ")");
  const double w = static_cast<double>(shape.width), f = static_cast<double>(shape.ffn),
               h = static_cast<double>(shape.heads), t = static_cast<double>(shape.sequence),
               v = static_cast<double>(shape.vocab), value = static_cast<double>(shape.bytes_per_value);
  const double scale = value / 4.0;  // the byte figures below are measured in float32
  CostModel costs;
  costs.state_per_parameter_byte = state_per_parameter_byte;
  auto layer = [&](double forward_flops, int64_t parameters, double kept, double output, double forward_work,
                   double backward_peak, double weight_kept) {
    LayerCost c;
    c.forward_s = forward_flops / device.flops_per_s;
    c.backward_s = 2 * c.forward_s;
    c.input_grad_s = c.forward_s;
    c.weight_grad_s = c.forward_s;
    c.parameter_bytes = parameters * shape.bytes_per_value;
    c.kept_bytes = c.chain_kept_bytes = kept * scale;
    c.output_bytes = output * scale;
    c.forward_peak_bytes = (kept + forward_work) * scale;
    c.backward_peak_bytes = backward_peak * scale;
    c.weight_kept_bytes = weight_kept * scale;
    return c;
  };
  const double hidden = t * w * 4.0;  // one [sequence, width] float32 tensor per sample
  // Embedding: a lookup, its output kept.
  costs.layers.push_back(layer(0.0, shape.vocab * shape.width, hidden, hidden, 0.0, 0.0, 0.0));
  // A block, per sample: FLOPs are 2 per multiply-add over the projections (2·parameters·t),
  // plus the attention scores and their use, 2·(2·t·t·w).
  const double block_flops = 2.0 * static_cast<double>(shape.block_parameters()) * t + 4.0 * t * t * w;
  // Bytes per sample, float32, measured on libtorch's TransformerEncoderLayer (dropout 0) and
  // fitted exactly over width, heads, ffn and sequence (docs/giant-models.md): per token it keeps
  // 8·w + f + h·t + 4 values, its forward needs f more for a moment, its backward about 2·f, and
  // its W keeps 10·w + 2·f + 4.
  const double block_kept = 4.0 * t * (8.0 * w + f + h * t + 4.0);
  for (int64_t l = 0; l < shape.layers; ++l)
    costs.layers.push_back(layer(block_flops, shape.block_parameters(), block_kept, hidden, 4.0 * t * f,
                                 4.0 * t * 2.0 * f, 4.0 * t * (10.0 * w + 2.0 * f + 4.0)));
  // Projection to the vocabulary: its logits kept, for the loss.
  const double logits = t * v * 4.0;
  costs.layers.push_back(layer(2.0 * w * v * t, shape.width * shape.vocab + shape.vocab, logits, logits, 0.0,
                               logits + hidden, hidden));
  return costs;
}

std::string format_bytes(double bytes) {
  std::ostringstream out;
  out << std::fixed << std::setprecision(1);
  if (std::abs(bytes) >= 1024.0 * 1024 * 1024)
    out << bytes / (1024.0 * 1024 * 1024) << " GiB";
  else if (std::abs(bytes) >= 1024.0 * 1024)
    out << bytes / (1024.0 * 1024) << " MiB";
  else if (std::abs(bytes) >= 1024.0)
    out << bytes / 1024.0 << " KiB";
  else
    out << std::setprecision(0) << bytes << " B";
  return out.str();
}

int64_t parse_bytes(const std::string& text) {
  size_t used = 0;
  double number = 0;
  try {
    number = std::stod(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  std::string unit = text.substr(used);
  unit.erase(0, unit.find_first_not_of(' '));
  static const std::map<std::string, double> units = {
      {"", 1.0},          {"B", 1.0},          {"KiB", 1024.0},   {"MiB", 1024.0 * 1024},
      {"GiB", 1024.0 * 1024 * 1024}, {"TiB", 1024.0 * 1024 * 1024 * 1024}, {"KB", 1e3},
      {"MB", 1e6},        {"GB", 1e9},         {"TB", 1e12}};
  const auto it = units.find(unit);
  GPIPE_CHECK(used > 0 && it != units.end() && std::isfinite(number),
              "cannot read \"", text, "\" as a size in bytes; write a positive number with B, KiB, MiB, GiB, TiB, "
              "KB, MB, GB or TB, e.g. 16GiB");
  GPIPE_CHECK(number * it->second >= 1 && number * it->second < 9.0e18, "\"", text, "\" is ",
              number * it->second < 1 ? "less than one byte" : "more bytes than a machine has",
              "; give a size of 1B or more, below 8 EiB, e.g. 16GiB");
  return static_cast<int64_t>(std::llround(number * it->second));
}

}  // namespace gpipe
