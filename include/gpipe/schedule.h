// schedule.h: a training step as a program: what each device computes, in which order, and what it
// sends and receives; generators, the lowering pass, the validator, the simulator and the grid printer.
//
// Index names used throughout gpipe: K devices (d = 0..K-1), S stages (s = 0..S-1;
// S = K·V with V stages per device (interleaved, zbv, v-half), S = K otherwise), M
// micro-batches (i = 0..M-1). Where each stage runs is the schedule's placement:
// stage s on device s mod K (a loop), or as a V for zbv and v-half (stage s and 2K-1-s on device s).
// Each schedule's traits (its V, placement, rules on K, M and V, I/W split and memory bound) sit in
// one table beside its generator (ScheduleTraits, schedule_table): a new schedule is a generator
// and one entry.
//
// A step is built in three passes, all before any tensor moves:
//
//   generator (K, M, V) ──▶ compute schedule ──lower(mode)──▶ program ──▶ validate / simulate
//     F, B, I, W per device     + placement          + SEND/RECV by stage,     + executors run it
//                                                       recompute flags
//
// Text forms (each parses back with Action::parse):
//   1F0         forward of micro-batch 0 on stage 1, keeping its activations
//   1F0r        the same forward keeping only its input (re-materialized in its backward)
//   1B0         full backward of micro-batch 0 on stage 1
//   1I0, 1W0    backward split in two: I the gradient of the stage input, W later the weights'
//   1SEND_F0>2  stage 1 sends micro-batch 0's activation to stage 2
//   2RECV_F0<1  stage 2 receives it from stage 1
//   2SEND_B0>1  stage 2 sends the gradient of its input back to stage 1 (1RECV_B0<2 receives it)
//   0SEND_S1.0>2  stage 0 sends what it stashed for skip connection 1 in micro-batch 0 to stage 2
//   2SEND_G1.0>0  stage 2 sends that tensor's gradient back (skip.h)
#pragma once

#include <cstdint>
#include <functional>
#include <iosfwd>
#include <string>
#include <vector>

namespace gpipe {

/// What an action does.
enum class ActionKind : char {
  kForward = 'F',     ///< forward of one micro-batch through one stage
  kBackward = 'B',    ///< full backward: input gradient and weight gradients
  kInputGrad = 'I',   ///< backward to the stage input only; keeps what W needs
  kWeightGrad = 'W',  ///< the weight gradients of an earlier I
  kSend = 'S',        ///< hand a boundary tensor to another stage
  kRecv = 'R',        ///< take a boundary tensor from another stage
};

/// What a message carries. Skip connections (skip.h) have channels of their
/// own beyond these two: skip_channel(k, gradient) for connection k.
enum class Channel : int {
  kActivation = 0,  ///< a stage's output, to the next stage
  kGradient = 1,    ///< the gradient of a stage's input, to the previous stage
};
/// The channel of skip connection `skip`'s stashed tensor (from the stage that
/// stashes it to the one that pops it) or, with `gradient`, of its gradient (back).
Channel skip_channel(int skip, bool gradient);
/// The skip connection a channel belongs to, or -1 for kActivation and kGradient.
int skip_of(Channel channel);
/// Whether a channel carries a gradient (kGradient or a skip connection's gradient).
bool carries_gradient(Channel channel);

/// A skip connection between two stages: `from` stashes, `to` (a later stage) pops.
struct SkipRoute {
  int from = 0;
  int to = 0;
};

/// Which micro-batches re-materialize (keep only the stage input in forward and
/// recompute the stage's forward inside backward). As in torchgpipe.
enum class Checkpoint {
  kAlways,      ///< every micro-batch: least memory, about one extra forward
  kExceptLast,  ///< all but those whose backward directly follows their forward on the device
  kNever,       ///< none: every stage keeps every micro-batch's activations
};

/// "always", "except_last" or "never".
std::string to_string(Checkpoint mode);
/// Parses "always", "except_last" or "never"; throws std::invalid_argument otherwise.
Checkpoint parse_checkpoint(const std::string& text);
/// Every mode's name: "always", "except_last", "never".
std::vector<std::string> checkpoint_names();

/// One action of one stage; a compute action or, in a lowered program, a send or receive.
struct Action {
  int stage = 0;
  ActionKind kind = ActionKind::kForward;
  int micro_batch = 0;
  Channel channel = Channel::kActivation;  ///< kSend/kRecv: what travels
  int peer = -1;                           ///< kSend: the receiving stage; kRecv: the sending stage
  bool recompute = false;                  ///< kForward: keep only the input; its B or I re-runs the forward

  /// F, B, I or W (not a send or receive).
  bool is_compute() const { return kind != ActionKind::kSend && kind != ActionKind::kRecv; }
  /// B or I: the action that consumes the gradient of the stage's output.
  bool is_backward() const { return kind == ActionKind::kBackward || kind == ActionKind::kInputGrad; }

  /// The text form, e.g. "1F0", "1F0r", "1W3", "1SEND_F0>2".
  std::string str() const;
  /// Parses the text form back; throws std::invalid_argument on malformed text.
  static Action parse(const std::string& text);

  bool operator==(const Action& other) const;
  bool operator!=(const Action& other) const { return !(*this == other); }
};
std::ostream& operator<<(std::ostream& out, const Action& action);

/// How long a stage's F, I and W of one micro-batch take, in any one unit (seconds, say): what the
/// V schedules (zbv, v-half) order their actions by, where given (cost_model.h's stage_action_times
/// derives them from the profiled layers).
struct ActionTimes {
  double forward = 1;
  double input_grad = 1;
  double weight_grad = 1;
};

/// How a program orders its actions, as reports name it: "stage_times" where `times` are given (a V
/// schedule ordered by them), "unit" where none are (the order of equal times).
std::string order_name(const std::vector<ActionTimes>& times);

/// A step: for each device, the actions it runs in order. A generator fills
/// only compute actions; lower() adds the sends and receives.
struct Schedule {
  std::string name;                          ///< the generator, e.g. "1f1b"
  int devices = 0;                           ///< K
  int stages = 0;                            ///< S
  int micro_batches = 0;                     ///< M
  bool backward = true;                      ///< false for inference (forwards only)
  std::vector<int> placement;                ///< placement[s]: the device that runs stage s
  std::vector<std::vector<Action>> actions;  ///< actions[d]: device d's list
  /// Skip connections between stages (index k: channel skip_channel(k, ...)), added by lower().
  std::vector<SkipRoute> skips;

  /// Stages per device (V).
  int virtual_stages() const { return devices > 0 ? stages / devices : 0; }
  /// Whether sends and receives have been added (lower()).
  bool lowered() const;
  /// The stages device `d` runs, in increasing order.
  std::vector<int> stages_of(int device) const;
};

/// The schedules gpipe generates. Each has one entry in schedule_table(), beside its generator.
enum class ScheduleKind {
  kGPipe,        ///< "gpipe": fill-drain
  k1F1B,         ///< "1f1b": one forward, one backward (PipeDream-Flush)
  kInterleaved,  ///< "interleaved": 1F1B over V stages per device (Megatron-LM)
  kZB1P,         ///< "zb1p": zero bubble ZB-H1, backward split into I and W
  kZBV,          ///< "zbv": zero bubble ZB-V, 2 stages per device placed as a V, I/W split
  kVHalf,        ///< "v-half": ZB-V's V and I/W split in (K+1)/2K of its activation memory
};

/// Where a schedule runs its S = K·V stages.
enum class StagePlacement {
  kLoop,  ///< stage s on device s mod K: a micro-batch loops over the devices V times
  kV,     ///< 2 stages per device placed as a V: device d runs stage d and stage 2K-1-d
};

/// The device of each of the K·V stages under `placement`: placement[s].
std::vector<int> place_stages(StagePlacement placement, int devices, int virtual_stages);

/// A schedule's traits, kept with its generator in one table (schedule_table) that every
/// question about a schedule reads: make_schedule, make_plan, the planner and the front ends.
/// A new schedule is a generator and one entry.
struct ScheduleTraits {
  ScheduleKind kind = ScheduleKind::kGPipe;
  std::string name;  ///< its name in text (find_schedule, --schedule), and Schedule::name
  /// What it is, in a few words for the help texts (schedule_help): "fill-drain", "zero bubble ZB-V, 2
  /// stages per device placed as a V". The rules below (V, M) are added there from the entry itself.
  std::string summary;
  /// Builds the compute schedule of K devices, M micro-batches and V stages per device; called
  /// by make_schedule once K, M and V have passed the rules below.
  std::function<Schedule(int devices, int micro_batches, int virtual_stages, const std::vector<ActionTimes>& times)>
      generate;
  /// Whether `generate` orders the actions by the stages' times (ActionTimes) where given.
  bool orders_by_times = false;
  /// V when none is asked for.
  int default_virtual_stages = 1;
  /// The V it takes: least_virtual_stages <= V, and V <= most_virtual_stages unless that is 0 (no bound).
  int least_virtual_stages = 1;
  int most_virtual_stages = 1;
  /// The error for a V it does not take, with the fix; "{V}" stands for the V asked for.
  std::string virtual_stages_rule;
  /// Where its stages run.
  StagePlacement placement = StagePlacement::kLoop;
  /// Whether M must be a multiple of K (interleaved takes the micro-batches K at a time).
  bool micro_batches_multiple_of_devices = false;
  /// Whether each backward is split into I (input gradient) and W (weight gradients).
  bool splits_backward = false;
  /// Its memory bound: the most stage-micro-batches device d holds at once (from the start of a
  /// forward to the end of its B or W) for K, M and V; simulate()'s peak_in_flight never exceeds it,
  /// and for M >= 2K some device reaches it. A stage holds 1/V of a device's layers.
  std::function<int(int devices, int micro_batches, int virtual_stages, int device)> peak_in_flight;

  /// Whether it takes V stages per device.
  bool takes_virtual_stages(int virtual_stages) const;
  /// Whether V is the user's to choose (more than one V is taken): interleaved's.
  bool chooses_virtual_stages() const { return most_virtual_stages != least_virtual_stages; }
  /// Throws std::invalid_argument with virtual_stages_rule unless it takes V stages per device.
  void check_virtual_stages(int virtual_stages) const;
  /// Throws std::invalid_argument naming the rule and the fix unless it takes M micro-batches on K devices.
  void check_micro_batches(int devices, int micro_batches) const;
};

/// Every schedule's traits, in the order help texts list them: the registry. Nothing outside it lists
/// the schedules; the help texts are made from it (schedule_help, virtual_stages_help).
const std::vector<ScheduleTraits>& schedule_table();
/// The entry of `kind` in schedule_table().
const ScheduleTraits& schedule_traits(ScheduleKind kind);
/// The entry named `name` ("1f1b", "zbv", ...): the registry looked up by name. Throws
/// std::invalid_argument naming the schedules there are otherwise.
const ScheduleTraits& find_schedule(const std::string& name);

/// The name of `kind`: its entry's name ("gpipe", "1f1b", ...).
std::string to_string(ScheduleKind kind);
/// The kind of the schedule named `text` (find_schedule(text).kind); throws std::invalid_argument otherwise.
ScheduleKind parse_schedule(const std::string& text);
/// Every schedule gpipe generates, in the order help texts list them (schedule_table's).
std::vector<ScheduleKind> all_schedules();
/// Every schedule's name, in that order ("gpipe", "1f1b", ...).
std::vector<std::string> schedule_names();
/// The schedules for a help text, made from the registry: each name with its summary and its rule on M,
/// e.g. "gpipe (fill-drain), 1f1b (one forward, one backward: PipeDream-Flush), ... or v-half (...)".
std::string schedule_help();
/// The V each schedule takes, for a help text, made from the registry, e.g. "interleaved: 2 or more,
/// default 2; zbv and v-half: 2, placed as a V (stages d and 2K-1-d on device d); the others: 1".
std::string virtual_stages_help();
/// The schedules that place their stages as `placement` does, for messages: "gpipe, 1f1b or interleaved".
std::string schedules_placed(StagePlacement placement);
/// Whether `kind` places its 2 stages per device as a V (zbv, v-half): device d runs stages d and 2K-1-d.
bool v_shaped(ScheduleKind kind);
/// V, stages per device, that `kind` runs when none is asked for: 2 for the
/// interleaved schedule and the V schedules, 1 for the others.
int default_virtual_stages(ScheduleKind kind);
/// Whether `kind` runs V stages per device: interleaved any V >= 2, zbv and v-half V = 2,
/// the others V = 1 (schedule_traits(kind).takes_virtual_stages).
bool takes_virtual_stages(ScheduleKind kind, int virtual_stages);
/// Throws std::invalid_argument naming the rule and the fix unless `kind` takes V stages per device.
void check_virtual_stages(ScheduleKind kind, int virtual_stages);

/// GPipe's fill-drain: every device runs the forwards of micro-batches 0..M-1,
/// then their backwards in reverse order. Bubble (K-1)/(M+K-1); every device
/// keeps all M micro-batches in flight. With V stages per device (stage s on
/// device s mod K), each device runs its stages' forwards in stage order, then
/// their backwards in reverse: any M, but a bubble that grows with V; it is
/// what a pipeline falls back to for a batch whose micro-batch count the
/// interleaved schedule does not take. With `placement` (K·V entries), stage s
/// runs on device placement[s] instead (each device still takes its stages in
/// increasing order).
Schedule fill_drain(int devices, int micro_batches, int virtual_stages = 1, const std::vector<int>& placement = {});

/// 1F1B (PipeDream-Flush): device d runs K-1-d warm-up forwards, then alternates
/// one forward and one backward, then drains. The same bubble as fill-drain,
/// (K-1)/(M+K-1), but device d keeps at most K-d micro-batches in flight.
Schedule one_f_one_b(int devices, int micro_batches);

/// Interleaved 1F1B (Megatron-LM): V stages per device, stage s on device s mod K,
/// so a micro-batch passes each device V times. Bubble (K-1)/(V·M+K-1), about V
/// times smaller than 1F1B's; device d keeps at most (V-1)·K + 2(K-1-d) + 1
/// stage-micro-batches in flight (a little more than 1F1B's K-d, in stages of 1/V
/// the size). Accepts V >= 2 and M a multiple of K (Megatron's rule), as its
/// forward order takes the micro-batches K at a time.
Schedule interleaved(int devices, int micro_batches, int virtual_stages);

/// ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism"): 1F1B with each
/// backward split into I (input gradient, on the critical path) and W (weight
/// gradients, off it). Device d keeps at most K-d micro-batches awaiting their I,
/// as 1F1B does; a W waits until the device would otherwise be idle, so the W's
/// fill the bubble. With equal F, I and W times and M >= K its bubble is
/// (K-1)/(3M+K-1), a third of 1F1B's (with M < K the step takes 2(M+K)-1 slots).
/// The price: a micro-batch awaiting its W still holds its layers' inputs and
/// output gradients, and the devices defer their W's to the drain, so all M
/// micro-batches are held at the end of a step (bounding them by 1F1B's K-d
/// gives back most of the bubble: 0.71 of fill-drain's instead of 0.38 at K=2,
/// M=4 in simulation).
Schedule zb1p(int devices, int micro_batches);

/// ZB-V (Qi et al. 2023, "Zero Bubble Pipeline Parallelism"; PyTorch's
/// ScheduleZBVZeroBubble): 2K stages, device d running stage d and stage 2K-1-d,
/// so a micro-batch goes down the devices and back up (a V) and the first and the
/// last stage (the loss) share device 0; at the V's turn, stage K-1 to K on device
/// K-1, the tensor stays on the device. Each backward is split into I and W. A
/// list schedule: when free, device d runs the first ready of: the next
/// I of its stage d, the next I of its stage 2K-1-d, the next F of stage 2K-1-d,
/// the next F of stage d, the oldest W waiting; an F only while fewer than 2K
/// stage-micro-batches are held on the device (from the start of their F to the
/// end of their W). A stage holds half a device's layers, so that is K whole
/// micro-batches' activations: 1F1B's peak (device 0's K), on every device.
/// With F, I and W of equal time, the steady state has no bubble: for M >= K
/// and K <= 4 a step takes 6M+K-1 slots, the least possible (device K-1 cannot
/// start before slot K-1), so its bubble is (K-1)/(6M+K-1) against fill-drain's
/// (K-1)/(M+K-1) (a few slots more at some larger K and M). Any K, M. With `times`
/// (one per stage), each action takes its stage's time rather than one slot, so that
/// a device whose two stages differ in length does not wait on the order unit slots
/// would give: where none is ready, it waits for the next action to end. Where the
/// bound alone would then leave every device waiting (possible with unequal times), it
/// is ordered again keeping room for each micro-batch to come back, as v-half does.
Schedule zbv(int devices, int micro_batches, const std::vector<ActionTimes>& times = {});

/// V-Half (Qi et al. 2024, "Pipeline Parallelism with Controllable Memory"): ZB-V's
/// V, I/W split and order of preference in less activation memory, about half at large K. A
/// device holds at most K+1 stage-micro-batches (ZB-V: 2K, 1F1B's peak; so (K+1)/2K
/// of it: 3/4 at K=2, 5/8 at K=4, 9/16 at K=8). So that no micro-batch stops
/// halfway, a device starts an F on the way down only while the F's on the way back
/// up of every micro-batch it has taken down still fit under that bound. The price
/// is slots, with F, I and W of equal time: at K=2 one micro-batch at a time
/// crosses device 0, a bubble of 10/58 for M=8 (fill-drain's 1/9, zbv's 1/49);
/// from K=4 it is below fill-drain's: 12/60 for M=8 and 12/108 for M=16 (fill-drain's
/// 3/11 and 3/19). Any K, M. With `times`, ordered by them as zbv is.
Schedule v_half(int devices, int micro_batches, const std::vector<ActionTimes>& times = {});

/// Inference: every device runs the forwards of micro-batches 0..M-1 of its
/// stages, in increasing stage order (stage s on device s mod K, or on
/// placement[s] when given).
Schedule forward_only(int devices, int micro_batches, int virtual_stages = 1, const std::vector<int>& placement = {});

/// The schedule `kind` for K devices, M micro-batches and V stages per device: its
/// table entry's generator, with each stage's action times where it orders by them (zbv, v-half;
/// the others take none, and ignore them). Throws std::invalid_argument naming the rule and the fix if the
/// schedule cannot run that configuration (interleaved with M not a multiple of K, a
/// V the schedule does not take (takes_virtual_stages), ...).
Schedule make_schedule(ScheduleKind kind, int devices, int micro_batches, int virtual_stages = 1,
                       const std::vector<ActionTimes>& times = {});

/// Turns a compute schedule into a program: before each action that needs a
/// tensor from another stage, a receive from that stage; after each action that
/// produces one, a send to the stage that needs it (one stage to the next
/// forwards, back again backwards, whatever devices they are on); and each
/// forward's recompute flag from `mode` (except_last: a forward keeps its
/// activations when the next compute action of its device is its own B or I).
/// With `skips`, each skip connection's tensor goes straight from its stashing
/// stage's forward to its popping stage's, and its gradient straight back from
/// the popping stage's B or I to the stashing stage's.
/// Who talks to whom is decided here; the executors and the transports only
/// follow the program (the MPI runtime maps each stage to its rank). A send and
/// its receive between two stages of one device stay in the program, but the
/// executor hands the tensor over itself: no transport message.
Schedule lower(const Schedule& schedule, Checkpoint mode, const std::vector<SkipRoute>& skips = {});

/// A program as text, one row per device: "device 0 | 0F0 0SEND_F0>1 0B0" (each action's text form, as
/// gpipe schedule --program prints it, and parse_program reads it back).
std::string format_program(const Schedule& program);

/// A training program (compute-only or lowered) from its text: a row per device, "device D | A A ...", in
/// device order from 0, each A an action's text form (Action::parse). Lines without a "|" (a title, the
/// simulated bubble) and lines that begin with "#" are skipped, and a row of device 0 begins the program
/// again, so the whole of what gpipe schedule --program prints reads as its program (its grid comes
/// first). K is the rows, S the highest stage named + 1, M the highest micro-batch + 1, and stage s
/// is placed on the device whose row names it. Throws std::invalid_argument naming the line for a row
/// that does not parse, a device out of order, a stage in two rows or in none. The program is not
/// validated here: validate() it.
Schedule parse_program(const std::string& text, const std::string& name = "program");

/// Checks that `schedule` (compute-only or lowered) can run: placement, one F per
/// stage and micro-batch and then one B or one I and one W after it, every
/// action on the device its stage is placed on, matching sends and receives,
/// and no deadlock. Throws std::invalid_argument naming the offending action,
/// with the lists printed and the offending row marked "<-- ERROR HERE".
void validate(const Schedule& schedule);

/// Cost of an action in a simulation, in any time unit.
using CostFn = std::function<double(const Action&)>;
/// One unit for every compute action, nothing for sends and receives.
double unit_cost(const Action& action);

/// When each action of a program would start in a run where every action takes
/// `cost(action)`: what a schedule costs before it runs.
struct SimulatedRun {
  Schedule program;                        ///< the lowered program simulated
  std::vector<std::vector<double>> start;  ///< start[d][n]: start of program.actions[d][n]
  std::vector<std::vector<double>> end;    ///< end[d][n]
  double makespan = 0;                     ///< when the last action ends
  std::vector<double> busy;                ///< per device: time spent in compute actions
  /// Share of device-time spent idle: 1 - Σ busy / (K · makespan).
  double bubble = 0;
  /// Per device: the most stage-micro-batches held at once between the start of
  /// their forward and the end of their backward (B, or W when split).
  std::vector<int> peak_in_flight;
};

/// Simulates `schedule` (lowered first with Checkpoint::kNever if it is
/// compute-only): each device runs its list in order; an action starts when the
/// device is free and, for a receive, when its send has happened. With
/// `work_before`, a device first spends work_before(action) on work outside the
/// program (counted busy), a receive's wait overlapping it. Throws
/// std::invalid_argument, with the lists and the stuck row marked, on deadlock.
SimulatedRun simulate(const Schedule& schedule, const CostFn& cost = unit_cost, const CostFn& work_before = nullptr);

/// The compute actions as a grid, one row per device and one column per time
/// slot of a unit-cost simulation; idle slots show as ".":
///
///   device 0 | 0F0 0F1  .   .  0B1 0B0
///   device 1 |  .  1F0 1F1 1B1 1B0  .
std::string format_grid(const Schedule& schedule);

/// Balanced stages whose backward costs twice their forward: F 1, B 2, I 1,
/// W 1, sends and receives 0 (B = I + W).
double balanced_cost(const Action& action);

/// The ideal speedup of `schedule` over one device running the same
/// micro-batches, for balanced stages (balanced_cost) and free communication:
/// K·(1 - its simulated bubble). For fill-drain and 1F1B, K·M/(M+K-1).
double ideal_speedup(const Schedule& schedule);

/// The ideal speedup of a balanced fill-drain pipeline of K `devices` (one stage each) over one
/// device: K·M/(M+K-1).
double ideal_speedup(int devices, int micro_batches);

/// The ideal idle fraction of a fill-drain step on K `devices`: (K-1)/(M+K-1).
double ideal_bubble(int devices, int micro_batches);

}  // namespace gpipe
