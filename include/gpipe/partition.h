// partition.h: how a model's L layers are cut into S consecutive stages (a "balance": S = K·V): the
// arithmetic of the cuts make_plan resolves from a cut request (CutRequest in plan.h), and what a
// cut means for a schedule's step (plan_partition). Plain data and the schedule simulator only.
//
// Per-layer costs come from parameter_costs, costs_from, or the cost model's one profiler
// (cost_model.h): layer_times(profile_layers(model, micro-batch), rows) for time,
// layer_memory(...) for bytes.
#pragma once

#include "gpipe/schedule.h"

#include <torch/nn/modules/container/sequential.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace gpipe {

/// Layers per stage for an even cut of `layers` layers into `stages` stages:
/// the first `layers % stages` stages take one layer more.
///
///   even_balance(10, 3) == {4, 3, 3}
std::vector<int> even_balance(int layers, int stages);

/// Throws std::invalid_argument unless `balance` is a valid cut of `layers`
/// layers: non-empty, every entry at least 1, summing to `layers`.
void check_balance(const std::vector<int>& balance, int layers);

/// A balance as text for messages: "{3, 8}".
std::string format_balance(const std::vector<int>& balance);

/// Index of the first layer of each stage, plus `layers` at the end:
/// offsets({4, 3, 3}) == {0, 4, 7, 10}.
std::vector<int> stage_offsets(const std::vector<int>& balance);

/// The contiguous cut of layers with costs `costs` into `stages` non-empty
/// stages that minimizes the largest stage cost, ties broken by the smallest
/// variance of stage costs (GPipe's objective). Exact: a dynamic program over
/// prefix sums, O(K·L log L) for the bottleneck and O(K·L·w) for the variance,
/// w the number of cut points that keep a stage within the bottleneck.
/// Throws std::invalid_argument for K < 1, K > L, or a negative, NaN or
/// infinite cost.
///
///   balance_by_cost({1, 1, 1, 6}, 2) == {3, 1}
std::vector<int> balance_by_cost(const std::vector<double>& costs, int stages);

/// The branches balance_devices_by_cost explores before it settles for the best cut found.
inline constexpr int64_t kDeviceCutBranches = int64_t{1} << 22;

/// The contiguous cut of layers with costs `costs` into `placement.size()` stages, stage s run by
/// device placement[s], that minimizes the largest *device* cost (the sum of its stages'), ties
/// broken by the smallest variance of device costs, then by balance_by_cost's cut. With several
/// stages per device (the interleaved and the V schedules) a device does the work of all its
/// stages every step, so stages of even cost can still load one device more than another.
/// Exact: a branch and bound over the cut points, bounded by balance_by_cost's cut, which it
/// returns when every device runs one stage; past kDeviceCutBranches branches (hundreds of layers
/// in many stages of near-equal cost) it returns the best cut found, never worse than that one.
/// Throws std::invalid_argument as balance_by_cost does, or if a device from 0 to the largest
/// named runs no stage.
///
///   balance_by_cost({4, 1, 1, 1, 1, 1, 1, 6}, 4) == {1, 3, 3, 1}: the interleaved placement
///   {0, 1, 0, 1} loads the devices 7 and 9;
///   balance_devices_by_cost({4, 1, 1, 1, 1, 1, 1, 6}, {0, 1, 0, 1}) == {1, 1, 4, 2}: 8 and 8
std::vector<int> balance_devices_by_cost(const std::vector<double>& costs, const std::vector<int>& placement);

/// The cost of each stage of `balance` for per-layer `costs`.
std::vector<double> stage_costs(const std::vector<double>& costs, const std::vector<int>& balance);

/// What a balance means for a schedule of M micro-batches, given per-layer costs.
struct PartitionPlan {
  std::vector<int> balance;
  std::vector<double> stage_costs;
  int bottleneck_stage = 0;  ///< the slowest stage, which paces the step
  double bottleneck = 0;     ///< its cost
  std::string schedule;      ///< the schedule simulated, e.g. "gpipe"
  int micro_batches = 1;
  /// The schedule simulated with each stage's F taking a third of its cost and B two thirds (I
  /// and W a third each). Fill-drain over balanced stages: (M+K-1)·bottleneck.
  double predicted_step = 0;
  /// Work done over K·step time: M·Σcost / (K·predicted_step), 1 minus the simulated bubble.
  double predicted_efficiency = 0;
  /// The same for balanced stages (fill-drain and 1F1B: M/(M+K-1)), the most a cut can reach.
  double balanced_efficiency = 0;
};

/// The plan of `balance` for per-layer `costs` (time per micro-batch, for the
/// step prediction to be a time) under `schedule`, a compute schedule of
/// balance.size() stages (make_schedule). Throws std::invalid_argument if they
/// disagree on the number of stages.
///
///   plan_partition(costs, balance, make_schedule(ScheduleKind::k1F1B, K, M))
PartitionPlan plan_partition(const std::vector<double>& costs, const std::vector<int>& balance,
                             const Schedule& schedule);

/// The plan as a table: layers and cost of each stage, the bottleneck marked;
/// then, for costs in time, the predicted step and efficiency. `unit` is "s" (shown in ms),
/// "bytes" (shown in MiB) or any other name, printed after the number.
///
///   stage  layers              cost    share
///       0  0-2 (3)          12.10 ms    53.7%  <- bottleneck
///       1  3-10 (8)         10.42 ms    46.3%
std::string format_plan(const PartitionPlan& plan, const std::string& unit);

/// Cost source: the number of parameters of each layer (as DeepSpeed balances).
std::vector<double> parameter_costs(const torch::nn::Sequential& model);

/// Cost source: the user's estimate for each layer, like the paper's cost
/// estimator: `cost(index, layer)` for every layer in order.
std::vector<double> costs_from(const torch::nn::Sequential& model,
                               const std::function<double(size_t, torch::nn::Module&)>& cost);

}  // namespace gpipe
