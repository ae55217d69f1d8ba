// planner.h: the search `gpipe plan` runs: every configuration of a cluster (K devices per pipeline,
// D = devices / K replicas, M micro-batches, a schedule, a checkpoint mode) predicted by the cost
// model (cost_model.h) and the schedule simulator, before anything runs; fastest first.
//
//   CostModel costs = profile_layers(model, micro-batch) or transformer_costs(shape, device);
//   costs.link_latency_s = ...; costs.link_bytes_per_s = ...;   // the cluster's links
//   PlanSearch search;  search.devices = 8;  search.memory_per_device = 16LL << 30;  search.batch = 256;
//   std::vector<PlanCandidate> found = search_plans(costs, search);   // found.front(): the fastest that fits
#pragma once

#include "gpipe/cost_model.h"
#include "gpipe/schedule.h"

#include <cstdint>
#include <functional>
#include <vector>

namespace gpipe {

/// What search_plans considers.
struct PlanSearch {
  int devices = 1;                 ///< devices in the cluster (K·D)
  int64_t memory_per_device = 0;   ///< bytes each device has
  int64_t batch = 1;               ///< the global batch, rows per step
  std::vector<ScheduleKind> schedules = all_schedules();
  std::vector<Checkpoint> checkpoints{Checkpoint::kNever, Checkpoint::kExceptLast, Checkpoint::kAlways};
  std::vector<int> stages;         ///< K to consider (empty: every divisor of `devices`)
  /// M to consider (empty: 1, 2, 4, ... up to max(8, 4·K) and the rows per replica).
  std::vector<int> micro_batches;
  /// The cut into S stages. With `blocks` > 0, the model is `lead` layers, `blocks` equal blocks
  /// and `tail` layers: the blocks split evenly, the lead layers go with the first stage and the
  /// tail layers with the last (a stage needs a block). With `blocks` 0, the min-max cut of the
  /// layers' forward + backward time (a stage needs a layer).
  int lead = 0, blocks = 0, tail = 0;
  /// The fewest rows a micro-batch may have: 2 for a model with BatchNorm, which in training
  /// normalizes each micro-batch by its own statistics (one row has none). Configurations whose
  /// smallest micro-batch has fewer are left out.
  int64_t least_micro_batch_rows = 1;
  /// Called after each (K, M, schedule) with the stage x micro-batch pairs simulated so far and in
  /// all, for a progress report (empty: none).
  std::function<void(int64_t done, int64_t total)> progress;

  /// Throws std::invalid_argument for fewer than 1 device, byte of memory or row (or micro-batch row), or a K in
  /// `stages` that does not divide `devices`.
  void check() const;
};

/// One configuration and what the cost model predicts of it.
struct PlanCandidate {
  int devices = 1;         ///< K, devices per pipeline
  int replicas = 1;        ///< D = PlanSearch::devices / K
  int micro_batches = 1;   ///< M
  int virtual_stages = 1;  ///< V, the schedule's own
  ScheduleKind schedule = ScheduleKind::kGPipe;
  Checkpoint checkpoint = Checkpoint::kNever;
  std::vector<int> balance;  ///< layers per stage
  Prediction predicted;      ///< the pipeline of one replica, on its share of the batch
  /// predicted.step_s plus the replicas' ring all-reduce of the largest stage's gradients.
  double step_s = 0;
  double samples_per_s = 0;  ///< PlanSearch::batch / step_s
  int64_t largest_total_bytes = 0;  ///< of the device needing most: static bytes and the step's peak
  bool fits = false;                ///< largest_total_bytes <= PlanSearch::memory_per_device
};

/// Most stage x micro-batch pairs the search simulates per configuration unless `micro_batches`
/// asks for more: what keeps an answer within seconds.
constexpr int64_t kMostPlannedPairs = int64_t{1} << 17;

/// Most stage x micro-batch pairs one search simulates in all (K x V x M over every configuration
/// and checkpoint mode): what keeps an answer within about a minute (a 128-device search of a
/// 128-layer Transformer is about 2.1 million, 30 s on one core here).
constexpr int64_t kMostSearchedPairs = int64_t{1} << 22;

/// Every configuration of `search` the model of `costs` (its layers, and the cluster's link:
/// link_latency_s, link_bytes_per_s) can be cut into, predicted: those that fit first, fastest
/// first; then those that do not, least memory first. Throws std::invalid_argument when
/// search.check() does, when an M asked for is more than the rows a replica gets (or leaves
/// micro-batches below least_micro_batch_rows), when the search is larger than
/// kMostSearchedPairs, or when no configuration can run at all.
std::vector<PlanCandidate> search_plans(const CostModel& costs, const PlanSearch& search);

}  // namespace gpipe
