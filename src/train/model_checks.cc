// model_checks.cc: a Model from its builder or a TorchScript Sequential, and the checks a model
// passes before it trains: it learns at all, its output reaches its parameters through a gradient and
// keeps one row per sample, and it fits its data and the built-in loss (in the words of the fix).
#include "gpipe/train.h"

#include "gpipe/backend.h"
#include "gpipe/check.h"
#include "gpipe/io.h"
#include "train/trainer_parts.h"

#include <torch/torch.h>

#include <optional>
#include <stdexcept>
#include <string>

namespace gpipe {
namespace {

[[noreturn]] void refuse(const std::string& message) { throw std::invalid_argument("gpipe: " + message); }

}  // namespace

Model Model::of(std::string name, int layers, LayerBuilder build) {
  Model m;
  m.name = std::move(name);
  m.layers = layers;
  m.build = std::move(build);
  return m;
}

Model Model::of(std::string name, const ScriptModel& source) {
  Model m;
  m.name = std::move(name);
  m.layers = static_cast<int>(source.layers->size());
  m.script = source.script;
  const torch::nn::Sequential all = source.layers;
  // A module used at two places of the Sequential shares its tensors: under MPI its parameters are
  // tied across ranks; its buffers would drift apart, so that is refused (in a job of several
  // processes, whichever backend runs it).
  m.tied = shared_tensors(all);
  const auto shared_buffers = shared_tensors(all, /*buffers=*/true);
  GPIPE_CHECK(running_backend() == Runtime::kThreads || shared_buffers.empty(), shared_buffers.empty() ? "" : shared_buffers.front().front(),
              " and ", shared_buffers.empty() ? "" : shared_buffers.front().back(),
              " are one buffer (a module used twice in the Sequential); in a job of several processes each rank would keep a "
              "copy of its own: train this model in one process, or give each use its own module");
  m.build = [all](LayerRange keep) {  // the loaded layers themselves: they share the script module's tensors
    torch::nn::Sequential part;
    const auto names = all->named_children().keys();
    for (int n = 0; n < static_cast<int>(names.size()); ++n)
      if (keep.contains(n)) part->push_back(names[static_cast<size_t>(n)], *(all->begin() + n));
    return part;
  };
  return m;
}

torch::Tensor check_layers_train(torch::nn::Sequential whole, const torch::Tensor& sample) {
  // In eval mode, with gradients (on a few rows, the graph freed at once): an output that no
  // gradient reaches would train nothing.
  whole->eval();
  struct TrainModeAgain {  // the layers may be the training ones (a TorchScript model's)
    torch::nn::Sequential layers;
    ~TrainModeAgain() { layers->train(); }
  } train_mode_again{whole};
  const auto names = whole->named_children();
  auto layer = [&names](size_t i) {
    const std::string index = std::to_string(i);
    return "layer " + index + (names[i].key() == index ? "" : " ('" + names[i].key() + "')");
  };
  bool trains = false;
  for (const torch::Tensor& p : whole->parameters()) trains = trains || p.requires_grad();
  if (!trains)
    refuse(whole->parameters().empty()
               ? "the model has no parameters: training would change nothing; give a model with layers that learn"
               : "none of the model's parameters requires a gradient (all are frozen): training would change "
                 "nothing; unfreeze some (requires_grad=True) before saving the model");
  // The parameters, the optimizer's state and the checkpoint files are float32.
  for (const auto& p : whole->named_parameters()) {
    if (p.value().is_floating_point() && p.value().scalar_type() != torch::kFloat)
      refuse("the model's parameter " + p.key() + " is " + dtype_text(p.value()) + ", but gpipe trains float32 "
             "models: save the model as float32 (model.float() in Python before torch.jit.script)");
    if (p.value().is_floating_point() && !torch::isfinite(p.value()).all().item<bool>())
      refuse("the model's parameter " + p.key() + " holds NaN or infinite values, so every loss would be NaN; "
             "initialize it anew, or save the model before it diverged");
  }
  const int64_t rows = sample.size(0);
  int64_t stopped = -1;  // the layer whose output no gradient reaches, though its input's does
  std::optional<std::string> rows_changed;  // the first layer since which the rows are not the samples'
  Tensors out = sample.clone();  // a first layer may change its input in place: not the caller's data
  for (size_t i = 0; i < whole->size(); ++i) {
    const Tensors in = out;
    try {
      out = run_layer(*(whole->begin() + static_cast<std::ptrdiff_t>(i)), in, "it");
    } catch (const std::exception& e) {
      const bool dtype = i == 0 && sample.scalar_type() != torch::kFloat && sample.scalar_type() != torch::kLong;
      refuse(layer(i) + " fails on " +
             (i == 0 ? "the data's first samples, shape " : "the output of layer " + std::to_string(i - 1) + ", shape ") +
             in.shape() + ": " + what_of(e) +
             (dtype    ? "; the data's 'input' is " + dtype_text(sample) + ": save it as float32 (X.float() in Python)"
              : i == 0 ? "; give the model inputs of the shape its first layer takes"
                       : "; make each layer take the shape the one before it outputs"));
    }
    // Inside the model another layout may come and go (sequence first, say); the output's rows must
    // be the samples', and the first layer that changed them is the one to name.
    const torch::Tensor& lead = out.items.front();  // of a tuple, the first tensor
    const bool rows_kept = lead.dim() > 0 && lead.size(0) == rows;
    if (!rows_kept && !rows_changed)
      rows_changed = layer(i) + " turns " + std::to_string(rows) + " samples (shape " + in.shape() + ") into " +
                     (lead.dim() == 0 ? "a single number"
                                      : std::to_string(lead.size(0)) + (lead.size(0) == 1 ? " row" : " rows") +
                                            " (shape " + out.shape() + ")");
    if (rows_kept) rows_changed.reset();
    if (requires_grad(in) && !requires_grad(out)) stopped = static_cast<int64_t>(i);
    if (requires_grad(out)) stopped = -1;
  }
  if (out.tuple)
    refuse("the model's last layer returns a tuple (shape " + out.shape() + "), but the loss takes one tensor: end "
           "the model with a layer that returns one");
  if (rows_changed)
    refuse(*rows_changed + ", and the model's output keeps that: the outputs no longer pair with the samples; the "
           "model must end with one row per sample (slice, pool or reduce dimensions after the first)");
  if (!requires_grad(out))
    refuse("the model's output does not depend on any parameter through a gradient" +
           (stopped >= 0 ? ": " + layer(static_cast<size_t>(stopped)) +
                               " returns a tensor without one (argmax, a comparison, an integer result or .detach())"
                         : std::string()) +
           ", so training would change nothing; end the model with differentiable scores (argmax belongs after "
           "training, not in the model)");
  return out.only().detach();
}

void check_model_and_data(const Model& model, const Dataset& data, bool classification) {
  GPIPE_CHECK(data.size() > 0, "the training data has no samples");
  const torch::Tensor out = detail::on_the_first_rows(data.input, [&model](const torch::Tensor& rows) {
    const RandomStateGuard guard;  // building the whole model draws random numbers
    return check_layers_train(model.build(LayerRange{}), rows);
  });
  const std::string samples = std::to_string(out.size(0)) + " samples";
  const torch::Tensor& target = data.target;
  if (!classification && target.is_floating_point() && target.scalar_type() != out.scalar_type())
    refuse("`loss` mse: the targets are " + dtype_text(target) + ", but the model outputs " + dtype_text(out) +
           ": save the targets as " + dtype_text(out) + " (Y.float() in Python)");
  const auto out_row = out.sizes().slice(1), target_row = target.sizes().slice(1);
  if (classification) {
    if (out.dim() < 2)
      refuse("`loss` cross_entropy needs the model to output a score per class (shape [N, classes]), but it "
                  "outputs " + shape_text(out) + " for " + samples);
    const int64_t classes = out.size(-1);
    if (target_row != out_row.slice(0, out_row.size() - 1))
      refuse("`loss` cross_entropy: the model outputs " + shape_text(out) + " for " + samples + ", so the targets "
                  "must be class indices of shape [N" + (out.dim() > 2 ? ", ..." : std::string()) + "], but they have "
                  "shape " + shape_text(target) + (target.dim() == 2 && target.size(1) == 1 ? "; squeeze the last "
                  "dimension (target.squeeze(1) in Python)" : ""));
    const int64_t low = target.min().item<int64_t>(), high = target.max().item<int64_t>();
    if (low < 0 || high >= classes)
      refuse("`loss` cross_entropy: the targets hold class " + std::to_string(low < 0 ? low : high) +
                  ", but the model outputs " + std::to_string(classes) + " classes (0 to " +
                  std::to_string(classes - 1) + ")");
  } else if (target_row != out_row) {
    refuse("`loss` mse: the model outputs rows of shape " + shape_text(out.narrow(0, 0, 1).squeeze(0)) +
                ", but the targets' rows have shape " + shape_text(target.narrow(0, 0, 1).squeeze(0)) +
                " (targets " + shape_text(target) + "); give targets of the output's shape");
  }
}

}  // namespace gpipe
