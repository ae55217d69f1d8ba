// calibrate.h: the cost model calibrated on this machine: what gpipe's own pipeline adds to the
// times its layers take alone (pipeline_overhead), measured by running a real pipeline, and a
// model's profile that counts it (profile_model, plan_model_of), as gpipe plan, gpipe train's auto
// and Python's gpipe.profile, gpipe.plan and gpipe.predict take it. The profile itself is the cost
// model's (planner.h's profile_model_alone); it runs no pipeline.
//
//   const gpipe::CostModel costs = gpipe::profile_model(sequential, micro_batch);  // with the overhead
//   const gpipe::CostModel alone = gpipe::profile_model_alone(sequential, micro_batch, options);
#pragma once

#include "gpipe/cost_model.h"
#include "gpipe/planner.h"
#include "gpipe/tensors.h"

#include <torch/nn/modules/container/sequential.h>

#include <utility>
#include <vector>

namespace gpipe {

/// What gpipe's pipeline of threads adds on this machine to the time its layers take alone:
/// CostModel::action_overhead_s and step_overhead_s.
struct PipelineOverhead {
  double action_s = 0;  ///< per F, B, I or W
  double step_s = 0;    ///< per step
};

/// The pipeline's own overhead with `threads` intra-op threads per device, measured the first time
/// it is asked in this process (a few tenths of a second) and remembered: a pipeline of 16 small
/// layers (8 x [Linear(64, 64), ReLU], 256 rows) on 2 devices, fill-drain at M = 1, 4 and 16; the
/// median of its timed steps less the step predicted from its profiled layers, fitted by least
/// squares to a time per step plus a time per action on the predicted critical path, neither below
/// 0; with gradients on whatever the caller's mode, and at most half the machine's cores per device. The
/// default random generator is left as it was. Throws std::invalid_argument for fewer than 1 thread.
PipelineOverhead pipeline_overhead(int threads = 1);

/// The fit pipeline_overhead makes: `residuals` holds, per probe, the measured step less the predicted
/// one and the actions on the predicted critical path; the least-squares time per step plus time per
/// action, neither below 0 (one at 0, the other fitted alone; a residual that is not finite counts
/// as 0).
PipelineOverhead fit_pipeline_overhead(const std::vector<std::pair<double, double>>& residuals);

/// `costs` with pipeline_overhead(threads) as its action_overhead_s and step_overhead_s.
CostModel with_pipeline_overhead(CostModel costs, int threads);

/// profile_model_alone (planner.h) of `model` on `sample` (one micro-batch), with the pipeline's own
/// overhead at `options`' threads (pipeline_overhead) where `options` count it
/// (PlanProfileOptions::count_pipeline_overhead, the default). Leaves the model as it was; throws as
/// profile_model_alone does.
CostModel profile_model(const torch::nn::Sequential& model, const Tensors& sample,
                        const PlanProfileOptions& options = PlanProfileOptions());

/// `model` as profile_model profiles it, cut by the min-max of its layers' times, with its least
/// rows per micro-batch (least_micro_batch_rows); left as it was (plan_model_from, planner.h). Throws
/// as profile_model does.
PlannedModel plan_model_of(const torch::nn::Sequential& model, const Tensors& sample,
                           const PlanProfileOptions& options = PlanProfileOptions());

}  // namespace gpipe
