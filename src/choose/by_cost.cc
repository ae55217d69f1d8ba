// by_cost.cc: the cut by cost (`balance_by` "params", "time" or "memory"): a request's per-layer
// costs, the exact min-max cut of a profile (by time improved by the simulated step), and a chosen
// cut weighed by those costs. The profile itself is made by the caller (balance_by, train.h; "auto"'s
// profiles_at_rows), which owns the model.
#include "gpipe/choose.h"

#include "gpipe/partition.h"
#include "gpipe/plan.h"
#include "gpipe/schedule.h"

#include <torch/torch.h>

#include <string>
#include <vector>

namespace gpipe {

PipelineRequest with_layer_costs(PipelineRequest r, const torch::nn::Sequential& whole, const CostModel& profile,
                                 int64_t rows) {
  if (!r.balance.empty() || r.balance_by.empty() || r.balance_by == "even") return r;
  r.layer_costs = layer_costs_by(r.balance_by, whole, profile, rows);
  return r;
}

CostBalance choose_cut_by_cost(const torch::nn::Sequential& layers, const CostModel& profile, int64_t rows,
                               const BalanceByOptions& o) {
  const std::vector<double> costs = layer_costs_by(o.method(), layers, profile, rows);
  const PipelineOptions options = PipelineOptions()
                                      .devices(o.devices())
                                      .virtual_stages(o.virtual_stages())
                                      .schedule(o.schedule())
                                      .micro_batches(o.micro_batches())
                                      .checkpoint(o.checkpoint())
                                      .cut(CutRequest::by_cost(costs));
  // By time, the min-max cut is then improved by the simulated step (what the sums of times leave out).
  const PipelinePlan plan =
      o.method() == "time"
          ? refined_plan(profile, options, std::vector<int64_t>(static_cast<size_t>(o.micro_batches()), rows))
          : make_plan(static_cast<int>(costs.size()), options);
  return cost_balance_of(costs, plan.config(), o.method());
}

CostBalance cost_balance_of(const std::vector<double>& costs, const PipelineConfig& config, const std::string& method) {
  CostBalance out;
  out.balance = config.balance;
  out.plan = plan_partition(costs, config.balance,
                            make_schedule(config.schedule, config.devices, config.micro_batches,
                                          config.virtual_stages, config.stage_times));
  out.unit = cost_unit(method);
  out.stage_times = config.stage_times;
  return out;
}

}  // namespace gpipe
