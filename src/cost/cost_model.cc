// cost_model.cc: what is read from per-layer costs (cost_model.h): a stage's costs and its actions'
// times, the layers' costs to cut by, a Transformer's costs from its shape, and sizes in bytes as
// text. The profiler is in profile.cc and profile_times.cc, the prediction in predict.cc.
#include "cost/stage_cost.h"

#include "gpipe/check.h"
#include "gpipe/partition.h"

#include <algorithm>
#include <cmath>
#include <iomanip>
#include <map>
#include <sstream>

namespace gpipe {
namespace detail {

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

}  // namespace detail

CostModel with_compute_scaled(CostModel costs, double factor) {
  for (LayerCost& layer : costs.layers)
    for (double* t : {&layer.forward_s, &layer.backward_s, &layer.input_grad_s, &layer.weight_grad_s}) *t *= factor;
  return costs;
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
  for (const detail::StageCost& c : detail::stage_costs_of(costs, balance))
    out.push_back({detail::compute_seconds(c, ActionKind::kForward, n, false, own),
                   detail::compute_seconds(c, ActionKind::kInputGrad, n, recomputed, own),
                   detail::compute_seconds(c, ActionKind::kWeightGrad, n, false, own)});
  return out;
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
  // The byte figures below are measured in float32; an activation under autocast takes 2 bytes a value.
  const double scale = (shape.precision == Precision::kFloat32 ? value : std::min(value, 2.0)) / 4.0;
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
