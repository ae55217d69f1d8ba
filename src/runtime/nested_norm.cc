// nested_norm.cc: the op gpipe::batch_norm and the scope a stage's forward gives it.
#include "runtime/nested_norm.h"

#include "gpipe/check.h"

#include <ATen/Context.h>

namespace gpipe::detail {
namespace {

struct Current {
  std::vector<DeferredNorm>* norms = nullptr;
  bool gather = false;
};

thread_local Current current;

// The stage's entry for the BatchNorm whose running mean is `mean`.
DeferredNorm& entry_for(std::vector<DeferredNorm>& norms, const torch::Tensor& mean) {
  for (DeferredNorm& norm : norms)
    if (norm.layer == DeferredNorm::kInside && norm.running.mean.is_same(mean)) return norm;
  throw std::invalid_argument(
      "a DeferredBatchNorm ran in a stage that does not hold it among its layers' modules, so its statistics "
      "would not be summed with its other replicas'; give the pipeline the model that holds it");
}

torch::Tensor batch_norm(const torch::Tensor& x, const c10::optional<torch::Tensor>& weight,
                         const c10::optional<torch::Tensor>& bias, const torch::Tensor& running_mean,
                         const torch::Tensor& running_var, const torch::Tensor& batches, bool training,
                         c10::optional<double> momentum, double eps) {
  const bool cudnn = at::globalContext().userEnabledCuDNN();
  if (!training) return at::batch_norm(x, weight, bias, running_mean, running_var, false, 0.0, eps, cudnn);
  // torch.nn.BatchNorm's words, which gpipe's Python turns into advice on chunks.
  TORCH_CHECK(x.dim() < 2 || x.numel() / std::max<int64_t>(1, x.size(1)) > 1,
              "Expected more than 1 value per channel when training, got input size ", x.sizes());
  if (current.norms != nullptr) {
    if (current.gather) gather_statistics(entry_for(*current.norms, running_mean), x);
    return at::batch_norm(x, weight, bias, {}, {}, true, 0.0, eps, cudnn);
  }
  // Outside a stage: torch.nn.BatchNorm's own update.
  double factor = momentum.value_or(0.0);
  {
    const torch::NoGradGuard no_grad;
    batches.add_(1);
    if (!momentum) factor = 1.0 / batches.item<double>();
  }
  return at::batch_norm(x, weight, bias, running_mean, running_var, true, factor, eps, cudnn);
}

}  // namespace

DeferredNorm deferred_norm(size_t layer, RunningStatistics running) {
  const auto f64 = torch::dtype(torch::kDouble).device(running.mean.device());
  const int64_t channels = running.mean.numel();
  return {layer, std::move(running), torch::zeros({1}, f64), torch::zeros({channels}, f64),
          torch::zeros({channels}, f64)};
}

// From the input's own mean and variance: on the CPU in two passes and in float at least, the
// mean's then the squared distances' (libtorch's var_mean over the dimensions around the channels
// took 3x as long as the BatchNorm itself there), elsewhere var_mean's one pass.
void gather_statistics(DeferredNorm& norm, const torch::Tensor& input) {
  torch::NoGradGuard no_grad;
  std::vector<int64_t> dims;
  for (int64_t d = 0; d < input.dim(); ++d)
    if (d != 1) dims.push_back(d);
  const double n = static_cast<double>(input.numel() / input.size(1));
  torch::Tensor var, mean;
  if (input.is_cpu()) {
    const torch::Tensor x = input.detach().to(torch::promote_types(input.scalar_type(), torch::kFloat));
    mean = x.mean(dims, /*keepdim=*/true);
    var = (x - mean).square_().mean(dims);
    mean = mean.flatten();
  } else {
    std::tie(var, mean) = torch::var_mean(input.detach(), at::IntArrayRef(dims), /*unbiased=*/false, /*keepdim=*/false);
  }
  mean = mean.to(torch::kDouble);  // on the layer's device: no wait for it here
  var = var.to(torch::kDouble);
  norm.count += n;
  norm.sum += mean * n;
  norm.squares += (var + mean * mean) * n;
}

NestedNormScope::NestedNormScope(std::vector<DeferredNorm>* norms, bool gather)
    : previous_norms_(current.norms), previous_gather_(current.gather) {
  current = {norms, gather};
}

NestedNormScope::~NestedNormScope() { current = {previous_norms_, previous_gather_}; }

}  // namespace gpipe::detail

// gpipe.DeferredBatchNorm's forward (python/gpipe/norm.py): a TorchScript file holding it loads
// wherever the library is linked. Composite: autograd goes through at::batch_norm. Outside a stage
// it writes the running statistics, as torch.nn.BatchNorm does.
TORCH_LIBRARY_FRAGMENT(gpipe, ops) {
  ops.def("batch_norm(Tensor x, Tensor? weight, Tensor? bias, Tensor(a!) running_mean, Tensor(b!) running_var, "
          "Tensor(c!) num_batches_tracked, bool training, float? momentum, float eps) -> Tensor");
  ops.impl("batch_norm",
           torch::dispatch(c10::DispatchKey::CompositeImplicitAutograd, TORCH_FN(gpipe::detail::batch_norm)));
}
