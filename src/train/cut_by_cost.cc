// cut_by_cost.cc: balance_by, a model cut by the cost of its layers on one micro-batch (parameters,
// profiled time or memory): the model built and profiled here, the cut chosen from the profile by
// choose_cut_by_cost (choose.h).
#include "gpipe/train.h"

#include "gpipe/choose.h"
#include "gpipe/cost_model.h"
#include "gpipe/microbatch.h"

#include <torch/torch.h>

#include <string>
#include <vector>

namespace gpipe {

CostBalance balance_by(const Model& model, const Tensors& sample, const BalanceByOptions& o) {
  const std::string& method = o.method();
  const std::vector<int>& whole = o.whole();
  cost_unit(method);  // throws for an unknown method, before any work
  const RandomStateGuard guard;  // building the whole model and running it draw random numbers
  const torch::nn::Sequential layers = model.build(LayerRange{});
  // Timing runs backward through the layers, whose parameters may be the caller's own (a TorchScript
  // model's are): their gradients are put back as they were, also when the profile fails.
  struct KeptGradients {
    std::vector<torch::Tensor> params, grads;
    ~KeptGradients() {
      for (size_t n = 0; n < params.size(); ++n) params[n].mutable_grad() = grads[n];
    }
  } kept;
  for (const torch::Tensor& p : layers->parameters()) {
    kept.params.push_back(p);
    kept.grads.push_back(p.grad().defined() ? p.grad().clone() : torch::Tensor());
  }
  const int64_t rows = batch_rows(sample, whole);
  const CostModel profile =
      method == "params"
          ? CostModel{}
          : profile_layers(layers, sample,
                           ProfileLayersOptions()
                               .threads(o.threads())
                               .state_per_parameter_byte(o.optimizer_copies())
                               .whole(whole)
                               .precision(o.precision()));
  return choose_cut_by_cost(layers, profile, rows, o);
}

}  // namespace gpipe
