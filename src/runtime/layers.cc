// layers.cc: what a stage and the pipeline ask of a model's layers: whether they draw random numbers,
// their parameters each once and those shared between layers, a BatchNorm's running statistics (and
// one nested where its stage cannot defer them), and which layers change their input in place.
#include "gpipe/stage.h"

#include <torch/torch.h>

#include <map>
#include <optional>
#include <set>
#include <string>
#include <unordered_set>
#include <vector>

namespace gpipe {
namespace {

template <typename Impl>
bool drops(torch::nn::Module& module) {
  auto* dropout = module.as<Impl>();
  return dropout != nullptr && dropout->options.p() > 0;
}

template <typename Impl>
std::optional<RunningStatistics> statistics_of(torch::nn::Module& module) {
  auto* norm = module.as<Impl>();
  if (norm == nullptr || !norm->options.track_running_stats()) return std::nullopt;
  const auto momentum = norm->options.momentum();  // c10::optional in libtorch 1.x
  return RunningStatistics{norm->running_mean, norm->running_var, norm->num_batches_tracked,
                           momentum.has_value() ? std::optional<double>(*momentum) : std::nullopt};
}

}  // namespace

std::vector<torch::Tensor> unique_parameters(const torch::nn::Module& model) {
  std::vector<torch::Tensor> out;
  std::unordered_set<const void*> seen;
  for (const auto& p : model.parameters())
    if (seen.insert(p.unsafeGetTensorImpl()).second) out.push_back(p);
  return out;
}

void clear_grads(const std::vector<torch::Tensor>& params) {
  for (auto p : params) p.mutable_grad() = torch::Tensor();
}

std::vector<std::vector<std::string>> shared_tensors(const torch::nn::Sequential& model, bool buffers) {
  std::map<const void*, std::vector<std::string>> names;  // tensor → its names, one per layer using it
  std::vector<const void*> order;
  for (const auto& layer : model->named_children()) {
    std::set<const void*> here;  // a layer that registers a tensor twice uses it once
    const auto tensors = buffers ? layer.value()->named_buffers() : layer.value()->named_parameters();
    for (const auto& t : tensors) {
      const void* impl = t.value().unsafeGetTensorImpl();
      if (!here.insert(impl).second) continue;
      auto& list = names[impl];
      if (list.empty()) order.push_back(impl);
      list.push_back(layer.key() + "." + t.key());
    }
  }
  std::vector<std::vector<std::string>> groups;
  for (const void* impl : order)
    if (names[impl].size() > 1) groups.push_back(names[impl]);
  return groups;
}

std::optional<RunningStatistics> running_statistics(torch::nn::Module& layer) {
  if (auto s = statistics_of<torch::nn::BatchNorm1dImpl>(layer)) return s;
  if (auto s = statistics_of<torch::nn::BatchNorm2dImpl>(layer)) return s;
  if (auto s = statistics_of<torch::nn::BatchNorm3dImpl>(layer)) return s;
  if (auto* norm = dynamic_cast<BatchNormLayer*>(&layer)) return norm->running_statistics();
  return std::nullopt;
}

std::string nested_batch_norm(const torch::nn::Sequential& layers) {
  for (const auto& layer : layers->named_children()) {
    if (!layer.value()->is_training()) continue;  // in evaluation: its statistics are only read
    if (const auto* norm = dynamic_cast<const BatchNormLayer*>(layer.value().get()))
      if (!norm->inner_batch_norm().empty()) return layer.key() + "." + norm->inner_batch_norm();
    for (const auto& inner : layer.value()->named_modules("", /*include_self=*/false))
      if (inner.value()->is_training() && running_statistics(*inner.value())) return layer.key() + "." + inner.key();
  }
  return "";
}

std::optional<std::vector<bool>> layers_changing_their_input(const torch::nn::Sequential& layers, const Tensors& x,
                                                             const std::vector<std::string>& names) {
  std::vector<bool> found(layers->size(), false);
  torch::nn::Sequential run = layers;  // a handle to the same modules, to call them
  const torch::NoGradGuard no_graph;
  Tensors a = copy_of(x);
  size_t n = 0;
  try {
    for (auto layer = run->begin(); layer != run->end(); ++layer, ++n) {
      const std::vector<int64_t> versions = versions_of(a);
      Tensors out = run_layer(*layer, a, n < names.size() ? names[n] : std::to_string(n));
      found[n] = !changed_in_place(a, versions).empty();
      a = std::move(out);
    }
  } catch (const std::exception&) {
    return std::nullopt;  // the layer's own run says what fails
  }
  return found;
}

bool draws_random_numbers(const torch::nn::Sequential& layers) {
  for (const auto& module : layers->modules(/*include_self=*/false)) {
    if (drops<torch::nn::DropoutImpl>(*module) || drops<torch::nn::Dropout2dImpl>(*module) ||
        drops<torch::nn::Dropout3dImpl>(*module) || drops<torch::nn::AlphaDropoutImpl>(*module) ||
        drops<torch::nn::FeatureAlphaDropoutImpl>(*module))
      return true;
    const auto* random = dynamic_cast<const RandomLayer*>(module.get());
    if (random != nullptr && random->draws_random_numbers()) return true;
  }
  return false;
}

}  // namespace gpipe
