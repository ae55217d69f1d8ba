// stage_cost.h: a stage's costs summed from its layers', which the prediction (predict.cc) and the
// action times a V schedule is ordered by (cost_model.cc) both read; no user of the library sees it.
#pragma once

#include "gpipe/cost_model.h"
#include "gpipe/schedule.h"

#include <cstdint>
#include <vector>

namespace gpipe::detail {

// A stage's costs: its layers' summed, and its peaks from theirs (cost_model.h explains the model).
struct StageCost {
  double forward_s = 0, backward_s = 0, input_grad_s = 0, weight_grad_s = 0;
  double kept = 0, output = 0, input = 0;  // bytes per sample
  double split_kept = 0;   // kept by a forward whose backward is split into I and W
  double weight_kept = 0;  // kept from I to W
  double forward_peak = 0;    // with autograd, above what the stage held before its F
  double recompute_peak = 0;  // forward without autograd (a re-materialized F)
  double backward_extra = 0;  // during B, above the stage's kept bytes
  int64_t parameter_bytes = 0;
  // The stage holds a Stash or Pop: a split backward runs in one piece. Its W walks the whole graph
  // again, so the stage keeps the graph and the gradients it received until W ends.
  bool whole = false;
  // A split backward's W keeps the gradient of the stage's output (whole, or weights in the last layer).
  bool weight_keeps_output_grad = false;
};

// The compute of one action of a stage on `rows` rows, with the pipeline's own overhead: a B or I whose
// forward was re-materialized (`recomputed`) runs that forward again first.
double compute_seconds(const StageCost& c, ActionKind kind, double rows, bool recomputed, double own);

// Each stage's costs, from `costs`' layers cut by `balance` (layers per stage; checked here).
std::vector<StageCost> stage_costs_of(const CostModel& costs, const std::vector<int>& balance);

}  // namespace gpipe::detail
