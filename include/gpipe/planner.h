// planner.h: the search `gpipe plan` and Python's gpipe.plan run: every configuration of a cluster
// (K devices per pipeline, D = devices / K replicas, M micro-batches, a schedule, a checkpoint mode)
// predicted by the cost model (cost_model.h) and the schedule simulator, before anything runs;
// fastest first.
//
//   PlannedModel model = plan_model_of(sequential, micro-batch, PlanProfileOptions())   // profiled here (calibrate.h)
//                     or plan_model_of(transformer_shape, DeviceSpec{1e14})            // from FLOPs
//                     or plan_model_of(find_task("gpt"), TaskOptions())                // tasks.h
//   model.costs.link_latency_s = ...; model.costs.link_bytes_per_s = ...;   // the cluster's links
//   PlanSearch search;  search.devices = 8;  search.memory_per_device = 16LL << 30;  search.batch = 256;
//   std::vector<PlanCandidate> found = search_plans(model, search);   // found.front(): the fastest that fits
#pragma once

#include "gpipe/cost_model.h"
#include "gpipe/schedule.h"

#include <torch/arg.h>
#include <torch/nn/modules/container/sequential.h>

#include <cstdint>
#include <functional>
#include <limits>
#include <string>
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
  /// layers' forward + backward time (a stage needs a layer), then refined by the simulation: a
  /// boundary moved one layer at a time while the predicted step shortens, within the memory where
  /// the cut fit (what the devices' sums of time leave out: the order of each device's stages, the
  /// transfers, the skip connections that cross stages, the update), the fastest configurations
  /// first, within kMostRefinedPairs.
  int lead = 0, blocks = 0, tail = 0;
  /// With `given_cut`, the cut every configuration takes instead of the above: a given balance
  /// (CutRequest::given, which keeps only the K·V it has entries for), the min-max of other per-layer
  /// costs (CutRequest::by_cost) or the even cut.
  bool given_cut = false;
  CutRequest cut;
  /// V of the schedules that take several stages per device (interleaved); 0: each schedule's own.
  /// A schedule that does not take this V is left out.
  int virtual_stages = 0;
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

/// A search of `devices` devices of `memory_per_device` bytes each, for a global batch of `batch`
/// rows, over the schedules (parse_schedule; "auto": every one) and checkpoint modes (parse_checkpoint) named, the
/// depths `stages` and the micro-batch counts `micro_batches` (empty: PlanSearch's defaults): what
/// gpipe plan and Python's gpipe.plan ask for. Unchecked: see PlanSearch::check.
PlanSearch plan_search_of(int devices, int64_t memory_per_device, int64_t batch,
                          const std::vector<std::string>& schedules, const std::vector<std::string>& checkpoints,
                          const std::vector<int>& stages = {}, const std::vector<int>& micro_batches = {});

/// One configuration and what the cost model predicts of it.
struct PlanCandidate {
  /// K (devices per pipeline), M, V (the schedule's own), the schedule, re-materialization, the cut
  /// (layers per stage) and, for a V schedule, the order it was predicted with (PipelineOptions::stage_times).
  PipelineConfig config;
  int replicas = 1;  ///< D = PlanSearch::devices / K
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

/// The M a search considers by default for K devices per pipeline and `rows` rows per replica: 1, 2,
/// 4, ... up to max(8, 4·K), while every micro-batch keeps `least_rows` rows and K·M stays within
/// kMostPlannedPairs / 2.
std::vector<int> default_micro_batch_counts(int K, int64_t rows, int64_t least_rows = 1);

/// Most stage x micro-batch pairs one search simulates in all (K x V x M over every configuration
/// and checkpoint mode): what keeps an answer within about a minute (a 128-device search of a
/// 128-layer Transformer is about 2.1 million, 30 s on one core here).
constexpr int64_t kMostSearchedPairs = int64_t{1} << 22;

/// Most stage x micro-batch pairs the search simulates, in all, to refine its own cuts (PlanSearch's
/// `blocks` 0): the configurations are refined fastest first until it is spent (about 2 s here), so
/// a search of many layers and devices refines its leading configurations only.
constexpr int64_t kMostRefinedPairs = int64_t{1} << 17;

/// The plan `options` asks for (its cut, schedule, K, V, M and checkpoint mode; the skip connections
/// of `costs`) with its cut improved by the simulation, as search_plans improves its own cuts: every
/// cut predicted where that is cheap (the main job's 11 layers in 4 stages at M=8, say), else the
/// stage boundaries moved one layer at a time from that cut and from the even cut while the step
/// predicted on micro-batches of `micro_batch_rows` shortens, within kMostRefinedPairs; each device
/// within `memory_per_device` bytes where the cut asked for is (default: any). Throws
/// std::invalid_argument where make_plan or predict does.
PipelinePlan refined_plan(const CostModel& costs, const PipelineOptions& options,
                          const std::vector<int64_t>& micro_batch_rows,
                          int64_t memory_per_device = std::numeric_limits<int64_t>::max());

/// How a search ranks two configurations: those that fit first, the fastest first; then those that do
/// not, the least memory first.
bool ranks_before(const PlanCandidate& a, const PlanCandidate& b);

/// Every configuration of `search` the model of `costs` (its layers, and the cluster's link:
/// link_latency_s, link_bytes_per_s) can be cut into, predicted: those that fit first, fastest
/// first; then those that do not, least memory first. Throws std::invalid_argument when
/// search.check() does, when an M asked for is more than the rows a replica gets (or leaves
/// micro-batches below least_micro_batch_rows), when the search is larger than
/// kMostSearchedPairs, or when no configuration can run at all. No stage of a proposed cut ends
/// after a layer whose output passes more than kMostBoundaryTensors tensors (LayerCost::output_tensors,
/// more than one MPI message carries): the min-max cut goes around such a layer, and a depth K
/// that cannot is left out.
std::vector<PlanCandidate> search_plans(const CostModel& costs, const PlanSearch& search);

/// A model as the planner takes it: its layers' costs, the rule it is cut by, what it needs of a
/// micro-batch, and a line that describes it.
struct PlannedModel {
  /// "model m.pt: 4 layers, 1234 parameters (profiled here, device 1x this machine's core)", or
  /// "Transformer: 24 layers, width 1024, ...".
  std::string description;
  CostModel costs;
  /// The cut rule (PlanSearch's): a Transformer's blocks evenly, with `lead` and `tail` layers;
  /// `blocks` 0: the min-max cut of the layers' time.
  int lead = 0, blocks = 0, tail = 0;
  int64_t parameters = 0;              ///< elements of every parameter
  int64_t least_micro_batch_rows = 1;  ///< 2 when a BatchNorm cannot train on one row
  /// What a stage must have at least one of: a block, or a layer.
  int stage_units() const { return blocks > 0 ? blocks : costs.layer_count(); }
};

/// The rows of the micro-batch gpipe plan profiles a model on (a built-in task's first rows, or
/// random samples of a given shape).
constexpr int64_t kPlanProfileRows = 8;

/// How a model is profiled on this machine (profile_model_alone; profile_model and plan_model_of
/// of a Sequential, calibrate.h).
struct PlanProfileOptions {
  /// "sgd", "momentum", "adam" or "adamw": the state kept per parameter (state_per_parameter_byte_of); it
  /// sets layers' state_per_parameter_byte.
  TORCH_ARG(std::string, optimizer) = "adam";
  /// The planned device's speed relative to this machine's core: every layer's time is divided by
  /// it (the pipeline's own overhead, this machine's threads', is not).
  TORCH_ARG(double, speed) = 1.0;
  /// How each layer is profiled (profile_layers): its threads (as a stage's device runs them),
  /// warmup and repetitions, loss and target (the last stage's bytes), micro-batches in flight, what
  /// runs between repetitions, and the precision.
  TORCH_ARG(ProfileLayersOptions, layers) = {};
  /// What the description calls the model: "model m.pt", "task cnn".
  TORCH_ARG(std::string, name) = "model";
  /// Whether the pipeline's own overhead on this machine goes into the costs
  /// (CostModel::action_overhead_s, step_overhead_s): profile_model (calibrate.h) measures it
  /// (pipeline_overhead at layers' threads) by running a pipeline; profile_model_alone never counts it.
  TORCH_ARG(bool, count_pipeline_overhead) = true;
};

/// The optimizers the planner tells apart by the state they keep per parameter: "sgd", "momentum",
/// "adam", "adamw".
std::vector<std::string> plan_optimizer_names();

/// Bytes of gradient and optimizer state per parameter byte of `optimizer` ("sgd" 1, "momentum" 2,
/// "adam" and "adamw" 3: CostModel::state_per_parameter_byte). Throws std::invalid_argument naming `optimizer`
/// for another name.
double state_per_parameter_byte_of(const std::string& optimizer);

/// The fewest rows a micro-batch of `model` trains on: 2 when a layer (BatchNorm) refuses one row in
/// training mode, else 1. Runs the model in training mode on the first row of `sample`; the model's
/// buffers, gradients, modes and the random numbers are left as they were.
int64_t least_micro_batch_rows(const torch::nn::Sequential& model, const Tensors& sample);

/// profile_layers of `model` on `sample` (one micro-batch) in training mode, with `options`' threads,
/// warmup, repetitions, loss and target, and its optimizer's state per parameter byte; every time
/// divided by `options.speed`. The layers' times alone: the pipeline's own overhead, which only a
/// running pipeline shows, is left at 0 (profile_model, calibrate.h, measures and adds it).
/// Profiling leaves the model as it was: its parameters and their gradients, its buffers
/// (BatchNorm's running statistics and num_batches_tracked), each layer's training mode, and the
/// random numbers. Throws std::invalid_argument for an unknown `optimizer`, a speed that is not a
/// positive finite number, or what profile_layers refuses.
CostModel profile_model_alone(const torch::nn::Sequential& model, const Tensors& sample,
                              const PlanProfileOptions& options = PlanProfileOptions());

/// `model`, whose profile on `sample` is `costs` (profile_model's, calibrate.h: with the pipeline's
/// own overhead where `options` count it), as the planner takes it: cut by the min-max of its
/// layers' times, with its least rows per micro-batch (least_micro_batch_rows), its parameters and
/// a line that describes it. The model is left as it was.
PlannedModel plan_model_from(const CostModel& costs, const torch::nn::Sequential& model, const Tensors& sample,
                             const PlanProfileOptions& options);

/// Most blocks plan_model_of takes of a Transformer: what keeps an answer within seconds.
constexpr int64_t kMostPlannedBlocks = 1000000;

/// The Transformer `shape` on `device` (transformer_costs), its blocks cut evenly with the
/// embedding on the first stage and the projection on the last. Throws std::invalid_argument for a
/// shape or device figure below 1, more than kMostPlannedBlocks blocks, bytes per value other than
/// 4 or 2, or an unknown `optimizer`.
PlannedModel plan_model_of(const TransformerShape& shape, const DeviceSpec& device,
                           const std::string& optimizer = "adam");

/// Why no configuration of a search fits: the one that needs the least memory (the first that
/// search_plans answers when none fits), its device that needs the most, and about how many devices
/// per pipeline would let that device fit, all else equal (static bytes shrink as 1/K); 0 when that
/// is more than the `stage_units` a stage needs one of (PlannedModel::stage_units). Throws
/// std::invalid_argument for an empty `found` or memory below 1 byte.
struct PlanShortfall {
  PlanCandidate least;
  int device = 0;
  int devices_needed = 0;
};
PlanShortfall shortfall_of(const std::vector<PlanCandidate>& found, int64_t memory_per_device, int stage_units);

/// How a front end names what no_fit_message suggests: gpipe plan its flags, Python's gpipe.plan its
/// arguments; by default the library's option names in backquotes.
struct PlanSettingNames {
  std::string checkpoint_always = "`checkpoint` always";  ///< recompute every micro-batch
  std::string devices = "`devices`";                      ///< the devices of the cluster
  std::string half_precision = "`bytes_per_value` 2";     ///< a Transformer's values in half precision
  std::string optimizer = "`optimizer`";                  ///< the optimizer (its state per parameter)
};

/// Why none of `found` (search_plans's answer for `model` and `search`) fits, and what to try:
/// "no configuration fits: the least memory is needed by K=.., M=.., <schedule>, checkpoint <mode>,
/// whose device <d> needs <bytes>; the device has <bytes>; try ..., or devices with more memory".
/// What it suggests: checkpointing every micro-batch where `search` did not try it, then more
/// devices per pipeline (shortfall_of) or else fewer or smaller layers, half precision where
/// `half_precision_helps`, and a lighter optimizer than `optimizer` where it is not "sgd".
std::string no_fit_message(const std::vector<PlanCandidate>& found, const PlannedModel& model, const PlanSearch& search,
                           const std::string& optimizer, bool half_precision_helps,
                           const PlanSettingNames& names = PlanSettingNames());

/// search_plans over `model`'s costs (with the links set in model.costs), its cut rule and its
/// least rows per micro-batch; the step predicted is the pipeline's, without the optimizer's update.
std::vector<PlanCandidate> search_plans(const PlannedModel& model, PlanSearch search);

}  // namespace gpipe
