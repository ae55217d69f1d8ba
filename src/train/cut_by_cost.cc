// cut_by_cost.cc: balance_by, a model cut by the cost of its layers on one micro-batch (parameters,
// profiled time or memory): the exact min-max cut, by time improved by the simulated step.
#include "gpipe/train.h"

#include "gpipe/cost_model.h"
#include "gpipe/microbatch.h"
#include "gpipe/planner.h"

#include <torch/torch.h>

#include <string>
#include <vector>

namespace gpipe {

CostBalance balance_by(const Model& model, const Tensors& sample, const BalanceByOptions& o) {
  const std::string& method = o.method();
  const int micro_batches = o.micro_batches();
  const std::vector<int>& whole = o.whole();
  const std::string unit = cost_unit(method);  // throws for an unknown method, before any work
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
                               .whole(whole));
  const std::vector<double> costs = layer_costs_by(method, layers, profile, rows);
  const PipelineOptions options = PipelineOptions()
                                      .devices(o.devices())
                                      .virtual_stages(o.virtual_stages())
                                      .schedule(o.schedule())
                                      .micro_batches(micro_batches)
                                      .checkpoint(o.checkpoint())
                                      .cut(CutRequest::by_cost(costs));
  // By time, the min-max cut is then improved by the simulated step (what the sums of times leave out).
  const PipelinePlan plan =
      method == "time" ? refined_plan(profile, options, std::vector<int64_t>(static_cast<size_t>(micro_batches), rows))
                       : make_plan(static_cast<int>(costs.size()), options);
  CostBalance out;
  out.balance = plan.balance;
  out.plan = plan_partition(costs, out.balance,
                            make_schedule(plan.schedule, plan.devices, plan.micro_batches, plan.virtual_stages,
                                          plan.stage_times));
  out.unit = unit;
  out.stage_times = plan.stage_times;
  return out;
}

}  // namespace gpipe
