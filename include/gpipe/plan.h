// plan.h: a pipeline's plan: how many devices and stages, the cut, where each stage runs, the skip
// routes and the lowered programs, built and checked by one function before any tensor moves.
//
//   PipelineOptions ──make_plan(L layers, skip connections)──▶ PipelinePlan ──▶ Pipeline (threads or MPI ranks),
//     K, V, M, the cut request                                  K, V, balance,         the cost model's prediction,
//     (even, given, blocks, by cost),                           placement, skip        gpipe bench, plan and train
//     schedule, checkpoint                                      routes, programs
//
// The policy is decided here once: K (given, or a given balance's length / V), V (given, or the
// schedule's own from its table entry, schedule_traits), the cut (CutRequest) and the placement
// (the schedule's). Every check of K, V, M and the balance against each other and the model lives
// in make_plan (the MPI transport adds its tag-space limit on M, and the front
// ends check their flags' own ranges); everything else reads the plan: which
// device runs a stage, which stages a device runs, which layers a stage holds.
#pragma once

#include "gpipe/device.h"
#include "gpipe/layers.h"
#include "gpipe/pipeline_config.h"
#include "gpipe/schedule.h"
#include "gpipe/skip_connections.h"

#include <torch/arg.h>

#include <string>
#include <utility>
#include <vector>

namespace gpipe {

/// Which request made a plan's cut (PipelinePlan::cut).
enum class CutKind {
  kEven,    ///< the layers split evenly
  kGiven,   ///< a balance given as is
  kBlocks,  ///< blocks split evenly, lead layers with the first stage and tail layers with the last
  kByCost,  ///< the exact min-max cut of per-layer costs
};
/// "even", "given", "blocks" or "by cost".
std::string to_string(CutKind kind);

/// How the model's L layers are cut into S = K·V stages: a request make_plan resolves once, for
/// the S its K and V give (with V > 1 the cut is over all K·V stages).
///
///   CutRequest::even()                        {4, 3, 3} for 10 layers and 3 stages: the first L mod S take one more
///   CutRequest::given({3, 8})                 as given: S entries, summing to L (K may then be left 0: S / V)
///   CutRequest::blocks({2, 2, 2, 2}, 1, 2)    the 4 blocks split evenly over the stages (2 layers each here),
///                                             the 1 lead layer (an embedding) with the first stage and the
///                                             2 tail layers (a norm and the head) with the last: {5, 6} for S = 2
///   CutRequest::by_cost(costs)                the min-max cut of one cost per layer (balance_by_cost)
struct CutRequest {
  CutKind kind = CutKind::kEven;
  std::vector<int> balance;        ///< kGiven: layers per stage
  std::vector<int> block_layers;   ///< kBlocks: the layers of each block, in order
  int lead_layers = 0;             ///< kBlocks: layers before the first block
  int tail_layers = 0;             ///< kBlocks: layers after the last block
  std::vector<double> layer_costs;  ///< kByCost: one cost per layer

  static CutRequest even() { return {}; }
  static CutRequest given(std::vector<int> balance);
  static CutRequest blocks(std::vector<int> block_layers, int lead_layers = 0, int tail_layers = 0);
  static CutRequest by_cost(std::vector<double> layer_costs);

  /// The cut of `layers` layers into `stages` stages. By cost with a `placement` (the device of each
  /// stage) of several stages per device, the cut that balances the devices (balance_devices_by_cost);
  /// otherwise the stages (balance_by_cost). Throws std::invalid_argument naming the request and the
  /// fix when it is not a cut of that many layers into that many stages.
  std::vector<int> resolve(int layers, int stages, const std::vector<int>& placement = {}) const;
  /// The request in words for messages and summaries: "even", "given {3, 8}",
  /// "blocks (1 lead layer, 4 blocks, 2 tail layers)", "by cost".
  std::string str() const;
};

/// What a pipeline is asked to be, set with chainable setters:
///
///   gpipe::PipelineOptions().devices(2).micro_batches(8)
///   gpipe::PipelineOptions().balance({3, 5}).micro_batches(4).checkpoint(gpipe::Checkpoint::kAlways)
///   gpipe::PipelineOptions().devices(2).micro_batches(8).schedule(gpipe::ScheduleKind::kInterleaved)
///   gpipe::PipelineOptions().devices(2).micro_batches(2).program("device 0 | 0F0 0F1 0B0 0B1\n"
///                                                                 "device 1 | 1F0 1B0 1F1 1B1")
struct PipelineOptions {
  /// K, the number of devices. 0: the given balance's length divided by V.
  TORCH_ARG(int, devices) = 0;
  /// How the layers are cut into K·V stages (CutRequest): even unless asked otherwise.
  TORCH_ARG(CutRequest, cut) = CutRequest::even();

 public:
  /// Layers per stage, e.g. {3, 5}: K·V entries; the same as cut(CutRequest::given(balance)). Empty:
  /// no given cut (a given one is cleared back to even; another request stays).
  PipelineOptions& balance(const std::vector<int>& balance) {
    if (!balance.empty())
      cut_ = CutRequest::given(balance);
    else if (cut_.kind == CutKind::kGiven)
      cut_ = CutRequest::even();
    return *this;
  }
  /// The given balance, or empty when the cut is another request.
  const std::vector<int>& balance() const { return cut_.balance; }
  /// `config`'s schedule, K, V, M, cut (its balance, given), checkpoint and stage times.
  PipelineOptions& config(const PipelineConfig& config);
  /// The order in which the devices run forwards and backwards (schedule.h).
  TORCH_ARG(ScheduleKind, schedule) = ScheduleKind::kGPipe;
  /// V, stages per device; the schedule places them (stage s on device s mod K,
  /// or as a V for zbv and v-half). 0: the schedule's own (default_virtual_stages: 2
  /// for interleaved, zbv and v-half, 1 for the others).
  TORCH_ARG(int, virtual_stages) = 0;
  /// M, the number of micro-batches each mini-batch is split into.
  TORCH_ARG(int, micro_batches) = 1;
  /// Which micro-batches re-materialize in backward.
  TORCH_ARG(Checkpoint, checkpoint) = Checkpoint::kExceptLast;
  /// How long each stage's F, I and W of a micro-batch take (cost_model.h's stage_action_times),
  /// K·V entries: the V schedules (zbv, v-half) order each device's actions by them, so that two
  /// stages of unequal length on a device do not leave it waiting on an order made for equal ones.
  /// Empty: the order of equal times. Only the order changes (and with it the order in which a weight
  /// tied across a device's stages sums its gradients).
  TORCH_ARG(std::vector<ActionTimes>, stage_times) = {};
  /// The arithmetic of each stage's forward and its recompute: Precision::kBFloat16 runs them under
  /// autocast to bfloat16 for the device's kind (torch.autocast's rules: matrix products and
  /// convolutions in bfloat16, reductions and the loss in float32). The parameters, their gradients
  /// and the optimizer's state stay float32; what crosses between stages crosses in the type it has.
  TORCH_ARG(Precision, precision) = Precision::kFloat32;
  /// A training program given as text (schedule.h's parse_program: one row "device D | actions" per
  /// device, as gpipe schedule --program prints), run in place of the schedule's generator. Empty: the
  /// schedule's own. make_plan checks it before any work: its rows, stages and micro-batches must be the
  /// pipeline's K, K·V and M, and each stage on the device the schedule places it on (so `schedule` names
  /// its placement and V: gpipe for one stage per device, zbv for a V, ...); a compute-only program is
  /// lowered with `checkpoint` and the skip connections, and a lowered one must be that lowering of its
  /// compute actions; then it is validated as every program is. A batch of fewer rows than M runs the
  /// schedule's own program for its micro-batches (PipelinePlan::training_program).
  TORCH_ARG(std::string, program) = "";
  /// What each of the K devices is. Empty: a CPU core group of `threads_per_device` threads each.
  TORCH_ARG(std::vector<Device>, device_list) = {};
  /// Intra-op threads of each CPU device when `device_list` is empty.
  TORCH_ARG(int, threads_per_device) = 1;
  /// BatchNorm as in the paper: each micro-batch is normalized by its own
  /// statistics, and the running statistics are updated once per mini-batch,
  /// from the mean and unbiased variance of all its rows, with the layer's
  /// momentum (num_batches_tracked grows by one per step). For BatchNorm layers
  /// of the Sequential itself (one inside a layer is refused). false: each
  /// micro-batch's forward updates them, as M small batches would.
  TORCH_ARG(bool, deferred_batch_norm) = true;
  /// For a model whose input is a tuple (Tensors): the positions of the tensors that every
  /// micro-batch takes whole (an attention mask shared by all rows, a lookup table). The others
  /// have the batch dimension (dim 0) and are split into micro-batches. Empty: all are split.
  TORCH_ARG(std::vector<int>, whole_inputs) = {};
  /// Parameters tied across stages, by name in the model, e.g. {{"0.weight", "9.weight"}} for an
  /// input embedding and an output projection that share their weight. In one process tied
  /// layers hold one tensor, which is what ties them (found without being declared); a
  /// declared group that is not one tensor is refused. Under MPI each rank that holds one keeps
  /// a copy: the copies start as the lowest device's, their gradients are summed over the copies
  /// before the update, so one update keeps them identical to the bit.
  TORCH_ARG(std::vector<std::vector<std::string>>, tied_parameters) = {};
  /// Account CPU memory per device (installs gpipe's tracking allocator for the
  /// process; see memory.h). On by itself when a device has a memory cap.
  TORCH_ARG(bool, track_memory) = false;
};

/// A pipeline's plan: the shape of the pipeline and the programs its devices run.
/// Made by make_plan, which checks it; a value, cheap to copy.
struct PipelinePlan {
  int layers = 0;          ///< L, the model's layers
  int devices = 0;         ///< K
  int virtual_stages = 1;  ///< V, stages per device
  int micro_batches = 1;   ///< M
  ScheduleKind schedule = ScheduleKind::kGPipe;
  Checkpoint checkpoint = Checkpoint::kExceptLast;
  Precision precision = Precision::kFloat32;  ///< of each stage's forward (PipelineOptions::precision)
  std::vector<int> balance;                ///< layers per stage, S = K·V entries
  CutKind cut = CutKind::kEven;            ///< which request made the balance (PipelineOptions::cut)
  std::vector<int> placement;              ///< placement[s]: the device that runs stage s
  std::vector<SkipRoute> skip_routes;      ///< the skip connections that cross stages, route k on skip_channel(k, ...)
  std::vector<std::string> skip_names;     ///< the name of route k
  std::vector<Device> device_list;         ///< what each device is (K entries)
  std::vector<ActionTimes> stage_times;    ///< what the schedule's order took (PipelineOptions::stage_times)
  std::string program;                     ///< the program given as text (PipelineOptions::program), or empty
  Schedule training;                       ///< the lowered, validated program of a step of M micro-batches
                                           ///< (the given `program`'s, or the schedule's generator's)
  Schedule inference;                      ///< the lowered program of pipelined inference of M micro-batches

  /// S, the number of stages (K·V).
  int stages() const { return static_cast<int>(balance.size()); }
  /// Its schedule, K, V, M, balance, checkpoint, stage times and precision: what a checkpoint records of it.
  PipelineConfig config() const;
  /// The stages device `device` runs, in increasing order.
  std::vector<int> stages_of(int device) const;
  /// The device that runs the first stage, and the one that runs the last.
  int first_device() const { return placement.front(); }
  int last_device() const { return placement.back(); }
  /// The layers of stage `stage`, [first, last) in the whole model.
  LayerRange layers_of(int stage) const;
  /// The layers device `device` holds, one range per stage it runs, in stage order.
  std::vector<LayerRange> device_layers(int device) const;

  /// The training program for a batch run in `micro_batches` micro-batches:
  /// `training` for M; for fewer (a batch of fewer rows than M), the same
  /// schedule or, where it cannot take that many, fill-drain over the same stages.
  Schedule training_program(int micro_batches) const;
  /// The inference program for `micro_batches` micro-batches.
  Schedule inference_program(int micro_batches) const;
};

/// `plan` with its training program ordered by `times` (PipelineOptions::stage_times: one per stage;
/// empty: equal times), as make_plan would have made it with them. Throws std::invalid_argument for a
/// count of times other than the plan's stages.
PipelinePlan with_stage_times(PipelinePlan plan, std::vector<ActionTimes> times);

/// The most micro-batches M a plan takes. A micro-batch needs at least one row, and a batch of
/// fewer rows than M runs in one micro-batch per row (PipelinePlan::training_program), so a
/// larger M would only make the programs (which grow with M) slow to build and large.
constexpr int kMostMicroBatches = 1 << 16;

/// The plan of a model of `layers` layers with `skips` (skip_connections) for
/// `options`. Throws std::invalid_argument, naming the value and the fix,
/// for a plan that cannot run: K, V or M below 1, M above kMostMicroBatches, a cut request that is not a cut
/// of the layers (a balance, blocks or costs that do not add up to them) or disagrees with K·V, more stages than layers, a schedule
/// that cannot take K, M and V, a device list that is not K long, an unusable
/// device, a group of tied parameters of fewer than two names.
PipelinePlan make_plan(int layers, const PipelineOptions& options, const std::vector<SkipConnection>& skips = {});

/// Throws std::invalid_argument, naming what differs, unless `plan` is one make_plan made for a model
/// of `layers` layers (-1: not compared) with `options`: the same M, schedule and checkpoint, and the
/// K, V and balance where `options` gives them. A pipeline given a plan checks it so.
void check_plan_of(const PipelinePlan& plan, int layers, const PipelineOptions& options);

/// Routes `skips` (skip_connections) through `plan`, a plan make_plan made: the connections that cross
/// stages become its skip routes, and its programs are lowered again with them (when no connection
/// crosses a stage, and none did, the plan is left as it is). K, V, M and the cut are not resolved
/// again: a pipeline given a plan made once (make_pipeline's, gpipe train's) finds its skip connections
/// in its layers and routes them here. make_plan(layers, options, skips) is make_plan(layers, options)
/// and then route_skips. Throws std::invalid_argument for a connection outside the model's layers.
void route_skips(PipelinePlan& plan, const std::vector<SkipConnection>& skips);

}  // namespace gpipe
