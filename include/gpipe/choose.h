// choose.h: the one place a pipeline is chosen from what a run asks (a request) and the model's
// profile (calibrate.h): "auto"'s search over the configurations a request leaves open, the fastest
// predicted (choose_schedule); a resumed run's, the pipeline its checkpoint file was trained with
// (resumed_choice); the cut by cost (choose_cut_by_cost); and the agreement of the ranks of a job on
// what rank 0 chose (chosen_on_first_rank), which gpipe train and Python's GPipe take under MPI and
// torchrun. What it chooses is a
// PipelineConfig (pipeline_config.h), with its prediction and where it came from. A schedule named,
// or a task's own schedule and cut (OwnPipeline, Task::own), make the pipeline through resolve_run
// and pipeline_options_of.
//
//   gpipe::PipelineRequest request;               // K = 2, M and re-materialization left open
//   request.devices = 2;
//   request.micro_batches.reset();
//   request.checkpoint.reset();
//   request.schedule = "auto";
//   const gpipe::ScheduleChoice choice = *gpipe::chosen_on_first_rank([&] {
//     return gpipe::choose_schedule(gpipe::profiles_at_rows(whole, input, target, batch, profile, false),
//                                   request, batch);
//   }, "schedule auto");
//   gpipe::PipelineOptions options = gpipe::PipelineOptions().config(choice.config);
#pragma once

#include "gpipe/calibrate.h"
#include "gpipe/cost_model.h"
#include "gpipe/partition.h"
#include "gpipe/pipeline_config.h"
#include "gpipe/plan.h"
#include "gpipe/planner.h"
#include "gpipe/schedule.h"

#include <torch/arg.h>
#include <torch/nn/modules/container/sequential.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace gpipe {

/// What a run asks of its pipeline, as a front end's flags give it (gpipe train's --stages,
/// --micro-batches, --schedule, --virtual-stages, --balance, --balance-by and --checkpoint; one point
/// of gpipe bench's sweep; gpipe schedule's K, M and schedule; Python's GPipe arguments): each field
/// given, or left to the chooser.
struct PipelineRequest {
  std::optional<int> devices = 1;    ///< K; none: a given balance's length divided by V
  /// M; none: "auto" chooses it (default_micro_batch_counts), and a pipeline made without a choice
  /// (pipeline_options_of) runs 1.
  std::optional<int> micro_batches = 1;
  /// A schedule's name (schedule_names()); "task": the own pipeline's (OwnPipeline::schedule) when the cut is
  /// the task's own too, otherwise fill-drain, or interleaved for a V above 1; "auto": the fastest
  /// predicted (choose_schedule), which a front end that profiles the model resolves first (gpipe
  /// train and bench in one process, Python): left unresolved (under MPI), it is taken as "task".
  std::string schedule = "task";
  std::optional<int> virtual_stages;  ///< V; none: the schedule's own (the task's, with its own schedule)
  std::vector<int> balance;           ///< a given cut, K·V entries; empty: none
  /// How the cut is chosen when none is given: "" the own pipeline's (OwnPipeline::cut); "even" (a workload's
  /// blocks evenly, else the layers evenly: never a tuned cut); or a cost method of layer_costs_by
  /// ("params", "time", "memory"): the min-max cut of `layer_costs` (with "auto", "time" is the
  /// search's own cut: the min-max of the same times, refined by the simulation).
  std::string balance_by;
  std::vector<double> layer_costs;  ///< with a cost method: one cost per layer (layer_costs_by)
  /// The order of a V schedule by its stages' F, I and W times (PipelineOptions::stage_times), as a
  /// choice predicted it; empty: the unit order.
  std::vector<ActionTimes> stage_times;
  /// Re-materialization; none: "auto" chooses it too, the fastest mode predicted to fit (none where it
  /// fits: recomputing only adds work).
  std::optional<Checkpoint> checkpoint = Checkpoint::kExceptLast;
  /// Of each stage's forward: kept as asked, never chosen; none: a resumed file's (resumed_choice), else float32.
  std::optional<Precision> precision;
};

/// What a task runs where a front end names no schedule or cut (schedule "task", and "auto" left
/// unresolved): its schedule and V for K devices and M micro-batches, its cut, and whether a model
/// whose layers differ in time by 10x is cut by measured time. A task's is Task::own(); OwnPipeline()
/// is a model of no task's: fill-drain on the even cut.
struct OwnPipeline {
  /// The schedule and V (0: the schedule's own) on K `devices` with M micro-batches; unset: fill-drain.
  std::function<std::pair<ScheduleKind, int>(int devices, int micro_batches)> schedule;
  /// The cut on K `devices` of V stages each under `schedule`: a tuned cut, its blocks evenly, or the
  /// even cut. Unset: the even cut.
  std::function<CutRequest(int devices, ScheduleKind schedule, int virtual_stages)> cut;
  bool cut_by_time = false;
};

/// `request` with what it leaves to `own` decided: the schedule of "task" (and of "auto" left
/// unresolved), the V of 0, and the cut by "time" of a model cut by time (OwnPipeline::cut_by_time)
/// when no cut is asked for, K is above 1, V is 1 and this is not an MPI job (each rank would
/// profile alone). Throws std::invalid_argument for an unknown schedule.
PipelineRequest resolve_run(const OwnPipeline& own, PipelineRequest request);

/// The cut `request` asks for: given, the own pipeline's (OwnPipeline::cut, else even), even (a
/// workload's blocks evenly, else the layers) or by cost. Throws std::invalid_argument for a cost
/// method whose costs are not given.
CutRequest cut_of(const OwnPipeline& own, const PipelineRequest& request);

/// The one place a run's pipeline is made of a request: on K devices with M micro-batches, the
/// schedule and the cut of `request` (resolve_run, cut_of) and its precision, as the PipelineOptions
/// that make_plan, make_pipeline and a Trainer take. The rest (checkpoint, threads, BatchNorm, ties)
/// keeps PipelineOptions' defaults, for the caller to set.
PipelineOptions pipeline_options_of(const OwnPipeline& own, const PipelineRequest& request);

/// What "auto" chose: of the configurations a run leaves open, the one predicted fastest (search_plans)
/// among those that fit.
struct ScheduleChoice {
  /// What runs: the schedule, K, M, V, the cut it was predicted with and, for a V schedule, the order
  /// (PipelineOptions::stage_times); its checkpoint is the run's, or the one chosen
  /// (PipelineRequest::checkpoint).
  PipelineConfig config;
  Prediction predicted;      ///< its step and bubble
  bool fits = true;          ///< false: none fits the memory; this one needs the least
  int considered = 0;        ///< the configurations predicted
  bool chose_micro_batches = false;  ///< M was left open
  /// The checkpoint file whose pipeline this repeats (a resumed run; nothing is predicted), or empty.
  std::string taken_from;
  /// Of a resumed run predicted again: why its file's pipeline is not repeated ("m.pt was trained
  /// otherwise: its batch was 128 rows, this run's is 64"), or empty.
  std::string not_as_saved;
};

/// A model's layers' costs profiled on micro-batches of `rows` rows (profile_layers' per-sample
/// figures). A kernel on fewer rows does less per second, which one profile scaled per sample does not
/// show: "auto" predicts each M from a profile at that M's rows (measured on the main job's CNN: a
/// profile at 32 rows predicted M=8 10 ms under the measured 55.6 ms step).
using CostsAtRows = std::function<CostModel(int64_t rows)>;

/// Rounds of the profiles of every size "auto" weighs (profiles_at_rows).
inline constexpr int kProfileRounds = 2;

/// `profile` at each size asked, once per size; on the first call, first every size of `together`
/// in `rounds` rounds (ascending, then descending, ...), each layer's times the least of its rounds.
/// So a burst of other work on the machine during one size's profile weighs on it only where it
/// lasted through every round, and sizes are weighed alike: with one profile per size in turn, the
/// main job was seen to choose M = 1 after a noisy profile, its step then 1.27x the prediction.
CostsAtRows profiled_together(const CostsAtRows& profile, const std::vector<int64_t>& together,
                              int rounds = kProfileRounds);

/// The rows per micro-batch schedule_candidates asks its costs at, for `request` on `batch` rows (one
/// size per M weighed at each K weighed): profiles_at_rows' `together`.
std::vector<int64_t> profiled_rows(const PipelineRequest& request, int64_t batch, int64_t least_micro_batch_rows = 1);

/// The costs "auto" weighs, as front ends profile them: `whole` profiled (profile_model, `options`)
/// on the first `rows` rows of `input` (and of `target`, where defined, for `options`' loss) at each
/// size asked, with as many micro-batches in flight as `batch` holds (a schedule keeps up to M), and
/// CostModel::update_on_devices set to `update_on_devices`; the sizes of `together` profiled first, in
/// kProfileRounds rounds (profiled_together).
CostsAtRows profiles_at_rows(const torch::nn::Sequential& whole, const torch::Tensor& input,
                             const torch::Tensor& target, int64_t batch, const PlanProfileOptions& options,
                             bool update_on_devices, const std::vector<int64_t>& together = {});

/// The configurations "auto" weighs for `request`, as search_plans predicts them from `costs_at` (one
/// replica of K devices on a batch of `batch` rows; those that fit first, fastest first), each M from
/// the costs at its largest micro-batch's rows (each size asked for once). What the request gives
/// stays: K (`devices`; with a given balance and none, its length over V), M (when given; else
/// default_micro_batch_counts), the checkpoint mode (when given; else every mode), V (when given: only the
/// schedules that take it), the cut (a given `balance`, or the min-max of `layer_costs`; else the
/// min-max of the profiled time, "even" the even cut); the schedule, and what is left open, is
/// chosen. `memory_per_device` 0: this machine's memory over K (the devices of one process share
/// it). The devices of one process share its `cores` too (0: this machine's): where K is more, every
/// device's compute is predicted K / cores times as long (4 devices on 2 cores ran 53 ms, not the 32 ms
/// predicted alone). Throws std::invalid_argument as search_plans does.
std::vector<PlanCandidate> schedule_candidates(const CostsAtRows& costs_at, const PipelineRequest& request, int64_t batch,
                                               int64_t memory_per_device = 0, int64_t least_micro_batch_rows = 1,
                                               int cores = 0);
/// The same from one profile for every M (its per-sample figures at any rows).
std::vector<PlanCandidate> schedule_candidates(const CostModel& costs, const PipelineRequest& request, int64_t batch,
                                               int64_t memory_per_device = 0,
                                               int64_t least_micro_batch_rows = 1, int cores = 0);

/// The first of schedule_candidates: the fastest predicted that fits (or, where none fits, the one
/// that needs the least memory).
ScheduleChoice choose_schedule(const CostsAtRows& costs_at, const PipelineRequest& request, int64_t batch,
                               int64_t memory_per_device = 0,
                               int64_t least_micro_batch_rows = 1, int cores = 0);
ScheduleChoice choose_schedule(const CostModel& costs, const PipelineRequest& request, int64_t batch,
                               int64_t memory_per_device = 0,
                               int64_t least_micro_batch_rows = 1, int cores = 0);

/// `request` as `choice` runs: its schedule, K, M, V, cut (a given balance) and, for a V schedule, the
/// order of its stages' times.
PipelineRequest with_choice(PipelineRequest request, const ScheduleChoice& choice);

/// "schedule auto: zbv (V=2), M=8, cut [3, 2, 2, 3]: predicted step 12.3 ms, bubble 11.4% (the fastest of
/// 14 configurations predicted)".
std::string format_choice(const ScheduleChoice& choice);
/// "  auto's choice  zbv (V=2), M=8: step 12.3 ms predicted, 13.0 ms measured; bubble 11.4% predicted,
/// 12.0% measured\n": `choice` beside what the run measured: `steps` steps in `seconds`, the median
/// step, the bubble (RunFigures' train_seconds, median_step_s and bubble).
std::string format_choice_measured(const ScheduleChoice& choice, int64_t steps, double seconds, double median_step_s,
                                   double bubble);

/// "[3, 1, 2, 5]": a cut as auto's lines write it.
std::string format_cut(const std::vector<int>& balance);

// ---------------------------------------------------------------- the cut by cost (by_cost.cc)

/// `request` with `layer_costs` filled for a cut by cost (`balance_by` "params", "time" or "memory" and
/// no given `balance`): layer_costs_by's costs of the layers of `whole` (the whole model) on
/// micro-batches of `rows` rows, from `profile` (its profile_layers; not read for "params"). Any other
/// request is returned as it is. gpipe bench and gpipe.predict fill their requests here.
PipelineRequest with_layer_costs(PipelineRequest request, const torch::nn::Sequential& whole, const CostModel& profile,
                                 int64_t rows);

/// A cut by per-layer cost: the exact min-max partition (by time, improved by the simulation), and its plan.
struct CostBalance {
  std::vector<int> balance;  ///< layers per stage
  PartitionPlan plan;        ///< stage costs, bottleneck, predicted step (the schedule simulated)
  std::string unit;          ///< "parameters", "s" or "bytes"
  /// The stages' times its V schedule (zbv, v-half) was predicted in the order of
  /// (PipelineOptions::stage_times); empty for another schedule.
  std::vector<ActionTimes> stage_times;
};

/// How a model is cut by cost: by which cost, and for which pipeline. choose_cut_by_cost reads the
/// method and the pipeline; the profile's settings (threads, optimizer_copies, whole) are
/// balance_by's (train.h), which profiles the model.
struct BalanceByOptions {
  /// "params" (parameter counts), "time" (forward+backward, profile_layers with `threads` intra-op
  /// threads; the min-max cut then improved by the simulated step of `schedule` under `checkpoint`,
  /// refined_plan) or "memory" (activations kept, and parameters with `optimizer_copies` bytes of
  /// gradient and optimizer state per parameter byte: layer_memory).
  TORCH_ARG(std::string, method) = "time";
  /// K, and V stages for each (0 for the schedule's own: 2 for interleaved, else 1).
  TORCH_ARG(int, devices) = 1;
  TORCH_ARG(int, virtual_stages) = 0;
  /// The schedule and micro-batches whose step the plan predicts.
  TORCH_ARG(ScheduleKind, schedule) = ScheduleKind::kGPipe;
  TORCH_ARG(int, micro_batches) = 1;
  TORCH_ARG(Checkpoint, checkpoint) = Checkpoint::kExceptLast;
  TORCH_ARG(int, threads) = 1;
  TORCH_ARG(double, optimizer_copies) = 2.0;
  /// A tuple sample's PipelineOptions::whole_inputs (a model whose input is a tuple).
  TORCH_ARG(std::vector<int>, whole) = {};
  /// The arithmetic the layers are profiled in (ProfileLayersOptions::precision): the run's.
  TORCH_ARG(Precision, precision) = Precision::kFloat32;
};

/// The cut of `layers` (the whole model) into `options`' K·V contiguous stages by their cost on
/// micro-batches of `rows` rows (BalanceByOptions::method; layer_costs_by, from `profile`, profile_layers'
/// of one micro-batch, not read for "params"): the exact min-max cut, by time then improved by the
/// simulated step of `options`' schedule under its checkpoint mode (refined_plan); with its plan
/// (cost_balance_of). Throws std::invalid_argument for an unknown method, or a pipeline make_plan refuses.
CostBalance choose_cut_by_cost(const torch::nn::Sequential& layers, const CostModel& profile, int64_t rows,
                               const BalanceByOptions& options);

/// The cut of `config` weighed by the per-layer `costs` of `method` (layer_costs_by): its plan
/// (plan_partition, `config`'s schedule simulated over its K, M and V, in the order of its stage
/// times), the costs' unit (cost_unit) and that order. Throws std::invalid_argument as
/// plan_partition and cost_unit do.
CostBalance cost_balance_of(const std::vector<double>& costs, const PipelineConfig& config, const std::string& method);

// ---------------------------------------------------------------- a resumed run (resumed.cc)

/// A run resumed from a checkpoint file that says how the pipeline that saved it ran (snapshot.h's
/// SavedPipeline), and what this run is.
struct ResumedRun {
  std::string file;         ///< the checkpoint file, as the choice and its reasons name it
  PipelineConfig saved;     ///< the pipeline it was trained with
  int64_t saved_batch = 1;  ///< its rows per step
  int64_t batch = 1;        ///< this run's rows per step
  /// The rows per step asked for: more than `batch` where the training set holds fewer.
  int64_t batch_size = 1;
  int layers = 0;  ///< the model's layers
};

/// "auto" on a resumed run: the pipeline `run`'s file was trained with, where `request` is the run that
/// saved it (the same K, given, and batch; M, V and the cut not asked otherwise, `balance_by` none or
/// "time", which is auto's own cut; the file's cut of the model's layers), so that the run repeats the
/// unbroken one bit for bit: its config (the order it ran in: a tied weight's gradients are summed in
/// it) with `request`'s checkpoint mode, which changes no result; taken_from the file. Else nothing (the
/// choice is predicted again), and `not_as_saved` says every difference ("m.pt was trained otherwise:
/// `devices` 2 differs from its 4; `batch_size` 64 differs from its 128").
std::optional<ScheduleChoice> resumed_choice(const PipelineRequest& request, const ResumedRun& run,
                                             std::string& not_as_saved);

/// What `choose` returns on rank 0 of a job of several processes (MPI, c10d), on every rank: rank 0
/// alone calls it (a profile is made once, on a machine the other ranks leave to it) and every rank
/// takes its config and prediction, every number exact, so that every rank runs the same program. In
/// one process, `choose` itself. Where rank 0's `choose` chose nothing (std::nullopt: a front end's
/// fallback to a pipeline every rank makes alike), nothing on every rank. A failure on rank 0 fails
/// every rank: rank 0 rethrows its own, the others throw std::runtime_error "`what`: rank 0 could not
/// ...: " and the first line of its error. A collective: every rank calls it.
std::optional<ScheduleChoice> chosen_on_first_rank(const std::function<std::optional<ScheduleChoice>()>& choose,
                                                   const std::string& what);

/// Rank 0's `config` on every rank of a job of several processes (a cut rank 0 measured, and the order
/// of its V schedule), every number exact; `config` itself in one process. A collective.
PipelineConfig first_rank_config(const PipelineConfig& config);

}  // namespace gpipe
