// named.cc: a pipeline made of a request as it names it: a schedule by name, or the own pipeline's
// of a task ("task", and "auto" left unresolved), its V and its cut (choose.h).
#include "gpipe/choose.h"

#include "gpipe/check.h"
#include "gpipe/job.h"

#include <utility>

namespace gpipe {

namespace {

// The schedule of "task" (and of "auto" not chosen by prediction) and the V of 0: the own pipeline's
// schedule when the cut is its own too; otherwise fill-drain, or interleaved for a V above 1.
PipelineRequest with_schedule(const OwnPipeline& own, PipelineRequest r) {
  const int given_V = r.virtual_stages.value_or(0);  // 0: the schedule's own
  if (r.schedule == "task" || r.schedule == "auto") {
    const bool its_own = own.schedule && r.balance.empty() && r.balance_by.empty();
    const auto [kind, V] = its_own ? own.schedule(r.devices.value_or(0), r.micro_batches.value_or(1))
                                   : std::pair{ScheduleKind::kGPipe, 1};
    const bool takes = given_V == 0 || takes_virtual_stages(kind, given_V);
    r.schedule = to_string(takes ? kind : given_V > 1 ? ScheduleKind::kInterleaved : ScheduleKind::kGPipe);
    if (takes && given_V == 0) r.virtual_stages = V;
  }
  if (r.virtual_stages.value_or(0) == 0) r.virtual_stages = default_virtual_stages(parse_schedule(r.schedule));
  return r;
}

}  // namespace

PipelineRequest resolve_run(const OwnPipeline& own, PipelineRequest request) {
  PipelineRequest r = with_schedule(own, std::move(request));
  // A model whose layers differ in time by 10x is cut by measured time unless told otherwise (under
  // MPI each rank would profile alone: the own pipeline's cut there).
  if (own.cut_by_time && r.balance.empty() && r.balance_by.empty() && r.virtual_stages == 1 &&
      r.devices.value_or(0) > 1 && !job().distributed)
    r.balance_by = "time";
  return r;
}

CutRequest cut_of(const OwnPipeline& own, const PipelineRequest& r) {
  if (!r.balance.empty()) return CutRequest::given(r.balance);
  const CutRequest its_own =
      own.cut ? own.cut(r.devices.value_or(0), parse_schedule(r.schedule), r.virtual_stages.value_or(0))
              : CutRequest::even();
  if (r.balance_by.empty()) return its_own;
  if (r.balance_by == "even") return its_own.kind == CutKind::kBlocks ? its_own : CutRequest::even();
  GPIPE_CHECK(!r.layer_costs.empty(), "the cut by ", r.balance_by, " needs one cost per layer (layer_costs_by, "
              "PipelineRequest::layer_costs); profile the model first, or ask for the even cut");
  return CutRequest::by_cost(r.layer_costs);
}

PipelineOptions pipeline_options_of(const OwnPipeline& own, const PipelineRequest& request) {
  const PipelineRequest r = with_schedule(own, request);
  return PipelineOptions()
      .devices(r.devices.value_or(0))
      .micro_batches(r.micro_batches.value_or(1))
      .schedule(parse_schedule(r.schedule))
      .virtual_stages(r.virtual_stages.value_or(0))
      .cut(cut_of(own, r))
      .stage_times(r.stage_times)
      .precision(r.precision.value_or(Precision::kFloat32));
}

}  // namespace gpipe
