// profile.cc: profile_layers: each layer's costs, its times (profile_times.cc) with the bytes it
// keeps, sends and needs for a moment, measured as a stage's thread would hold them, the loss's
// bytes and the optimizer's update; the model is left as it was.
#include "cost/profile_parts.h"

#include "runtime/backward_split.h"
#include "gpipe/check.h"
#include "gpipe/device.h"
#include "gpipe/memory.h"
#include "gpipe/skip.h"

#include <cmath>
#include <map>
#include <memory>
#include <mutex>
#include <set>

namespace gpipe {
namespace {

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

// What profiling a model's bytes layer by layer carries from one layer to the next.
struct ByteProfile {
  std::shared_ptr<MemoryCounter> counter = std::make_shared<MemoryCounter>("profile");
  std::map<std::string, torch::Tensor>* tray = nullptr;  // where the model's Stash and Pop layers meet (skip.h)
  double rows = 1;
  Precision precision = Precision::kFloat32;  // of the forwards (autocast)
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
                            bool in_place, ByteProfile& p, LayerCost& c) {
  MemoryCounter& counter = *p.counter;
  const std::vector<torch::Tensor> grads = detail::ones_for(out);
  const int64_t held = counter.current_bytes();
  counter.reset_peak();
  detail::backward_from(out, grads);
  c.backward_peak_bytes = static_cast<double>(counter.peak_bytes() - held);
  // I starts from a leaf, as a stage records its layers.
  const Tensors leaf = leaves_of(x, detail::leaf_grad_of(index));
  *p.tray = tray_before;
  const int64_t before_split = counter.current_bytes();
  Tensors again = detail::run_profiled(layer, in_place ? copy_of(leaf) : leaf, name, p.precision);
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
                      bool in_place, std::vector<SkipCost>& skips, ByteProfile& p, LayerCost& c) {
  std::map<std::string, torch::Tensor>& tray = *p.tray;
  MemoryCounter& counter = *p.counter;
  const std::map<std::string, torch::Tensor> tray_before = tray;  // the layer runs twice: a Pop takes twice
  const Tensors leaf = leaves_of(x, detail::leaf_grad_of(index));
  Tensors in = leaf;
  for (auto& t : in.items)
    if (t.requires_grad()) t = t.clone();
  const size_t uses_before = input_uses(in, Tensors());
  MemoryScope scope(p.counter);
  counter.reset_peak();
  const int64_t before = counter.current_bytes();
  // A layer that changes its input in place runs on a copy, as a stage runs it where its input is kept
  // (and never on the caller's sample): the copy is counted.
  Tensors out = detail::run_profiled(layer, in_place ? copy_of(in) : in, name, p.precision);
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
  if (requires_grad(out)) measure_backward_bytes(layer, index, name, x, out, tray_before, in_place, p, c);
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
  const torch::Tensor value = [&] {
    const AutocastScope autocast(options.precision(), output.device().type());
    return options.loss()(output, options.target());
  }();
  costs.loss_kept_bytes = static_cast<double>(p.counter->current_bytes() - before) / p.rows;
  const int64_t held = p.counter->current_bytes();
  p.counter->reset_peak();
  value.backward();
  costs.loss_backward_peak_bytes = static_cast<double>(p.counter->peak_bytes() - held) / p.rows;
}
// Each layer's costs from its `timings` and its bytes, profiled layer after layer from `sample`,
// into `costs` (its tied parameters too); returns the model's output.
Tensors measure_layers(const torch::nn::Sequential& model, const std::vector<std::string>& names,
                       const Tensors& sample, const detail::LayerTimings& timings, ByteProfile& p,
                       CostModel& costs) {
  torch::nn::Sequential layers = model;  // a handle to the same modules, to call them
  Tensors x = sample;
  size_t index = 0;
  for (auto it = layers->begin(); it != layers->end(); ++it, ++index) {
    LayerCost c;
    count_parameters(*it, index, c, costs, p.tied_index);
    c.forward_s = detail::median_of(timings.forward[index]) / p.rows;
    if (!timings.backward[index].empty() && !timings.input_grad[index].empty() &&
        !timings.weight_grad[index].empty()) {
      c.backward_s = detail::median_of(timings.backward[index]) / p.rows;
      c.input_grad_s = detail::median_of(timings.input_grad[index]) / p.rows;
      c.weight_grad_s = detail::median_of(timings.weight_grad[index]) / p.rows;
    }
    const Tensors out = measure_bytes(*it, index, names[index], x, timings.in_place[index], costs.skips, p, c);
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
  bytes.precision = options.precision();
  std::map<std::string, torch::Tensor> tray;
  bytes.tray = &tray;
  const detail::SkipTrayScope tray_scope(tray);
  const std::vector<std::string> names = layer_names(model);
  const detail::LayerTimings timings = detail::time_layers(model, names, sample, options);
  const Tensors output = measure_layers(model, names, sample, timings, bytes, costs);
  measure_loss_bytes(output, options, bytes, costs);
  // A layer's output stays, once the next layer has run, only if one of them saved it.
  for (size_t l = 0; l + 1 < costs.layers.size(); ++l)
    if (!bytes.views[l] && !bytes.saves_output[l] && !bytes.saves_input[l + 1])
      costs.layers[l].chain_kept_bytes -= costs.layers[l].output_bytes;
  costs.update_s_per_parameter_byte = detail::update_s_per_parameter_byte(model, options);
  return costs;  // `untouched` puts back the gradients, buffers and random numbers
}

}  // namespace gpipe
