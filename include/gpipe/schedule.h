// schedule.h: pipeline schedules as data: for each stage, the ordered actions its executor runs.
//
// Index names used throughout gpipe: K stages (j = 0..K-1), M micro-batches
// (i = 0..M-1). An action "jFi" is the forward of micro-batch i on stage j;
// "jBi" its backward. A schedule generator is a pure function; the executors
// run its lists and decide nothing.
#pragma once

#include <cstdint>
#include <functional>
#include <iosfwd>
#include <string>
#include <vector>

namespace gpipe {

/// What an action does: the forward or the backward of one micro-batch.
enum class Phase : char { kForward = 'F', kBackward = 'B' };

/// One unit of work of one stage: `{stage, phase, micro_batch}`, written "1F0".
struct Action {
  int stage = 0;
  Phase phase = Phase::kForward;
  int micro_batch = 0;

  /// The text form, e.g. "1F0" (stage 1, forward, micro-batch 0).
  std::string str() const;
  /// Parses the text form back; throws std::invalid_argument on malformed text.
  static Action parse(const std::string& text);

  bool operator==(const Action& other) const {
    return stage == other.stage && phase == other.phase && micro_batch == other.micro_batch;
  }
  bool operator!=(const Action& other) const { return !(*this == other); }
};
std::ostream& operator<<(std::ostream& out, const Action& action);

/// A schedule: for each stage j, the actions its executor runs, in order.
struct Schedule {
  int stages = 0;
  int micro_batches = 0;
  bool backward = true;                      ///< false for inference (forward only)
  std::vector<std::vector<Action>> actions;  ///< actions[j]: stage j's list
};

/// GPipe's fill-drain schedule for training: every stage runs the forwards of
/// micro-batches 0..M-1, then their backwards in reverse order M-1..0 (the last
/// micro-batch's backward can start first, as soon as its forward ends).
Schedule fill_drain(int stages, int micro_batches);

/// Inference: every stage runs the forwards of micro-batches 0..M-1.
Schedule forward_only(int stages, int micro_batches);

/// When each action would start, in an idealised run where every action takes
/// `cost(action)` time units and communication is free.
struct SimulatedRun {
  std::vector<std::vector<int64_t>> start;  ///< start[j][n]: start of actions[j][n]
  int64_t makespan = 0;                      ///< time at which the last action ends
};

/// Unit cost: every action takes one time slot.
int64_t unit_cost(const Action& action);

/// Simulates `schedule`, honouring the data dependencies (jFi needs (j-1)Fi;
/// jBi needs jFi and (j+1)Bi) and each stage's order. Throws std::logic_error,
/// with the grid of what could run, if the schedule deadlocks.
SimulatedRun simulate(const Schedule& schedule,
                      const std::function<int64_t(const Action&)>& cost = unit_cost);

/// Checks that `schedule` is complete and can run: every stage has exactly one
/// forward (and, when training, one backward after it) per micro-batch, every
/// action is on its own stage, and the dependencies leave no deadlock. Throws
/// std::logic_error naming the problem, with the offending row marked
/// "<-- ERROR HERE".
void validate(const Schedule& schedule);

/// The schedule as a grid, one row per stage and one column per time slot of a
/// unit-cost simulation; idle slots show as ".":
///
///   stage 0 | 0F0 0F1  .   .  0B1 0B0
///   stage 1 |  .  1F0 1F1 1B1 1B0  .
std::string format_grid(const Schedule& schedule);

/// The ideal speedup of a balanced K-stage pipeline over one device: K·M/(M+K-1).
double ideal_speedup(int stages, int micro_batches);

/// The ideal idle fraction of a fill-drain step: (K-1)/(M+K-1).
double ideal_bubble(int stages, int micro_batches);

}  // namespace gpipe
