// schedule_parts.h: what the schedule's files share and no user of the library sees: a schedule's
// shape checked, an empty schedule and its compute actions (generators.cc), the lists as text
// (program.cc), and the structural check with its error (check.cc), which simulate.cc runs first.
#pragma once

#include "gpipe/schedule.h"

#include <string>
#include <tuple>
#include <vector>

namespace gpipe::detail {

/// Checks that a schedule of K `devices`, M `micro_batches` and V `virtual_stages` can be planned:
/// each at least 1, and no more (stage, micro-batch) pairs than gpipe holds in memory.
void check_shape(int devices, int micro_batches, int virtual_stages = 1);

/// A schedule with empty rows and stage s on device placement[s], or s mod K when `placement` is empty.
Schedule empty_schedule(const std::string& name, int devices, int micro_batches, int virtual_stages, bool backward,
                        const std::vector<int>& placement = {});

/// The action `kind` of `stage` on `micro_batch` (a send or receive is one with its channel and peer set).
Action compute(int stage, ActionKind kind, int micro_batch);

/// The lists, one row a device, with "<-- ERROR HERE" after row `bad_device` (-1: none).
std::string format_lists(const Schedule& schedule, int bad_device);

/// Throws std::invalid_argument: the schedule is invalid because of `why`, its lists printed with
/// the row of `bad_device` marked.
[[noreturn]] void fail(const Schedule& schedule, int bad_device, const std::string& why);

/// A message: (from stage, to stage, channel, micro-batch), the same for its send and its receive.
using CommKey = std::tuple<int, int, int, int>;
CommKey comm_key(const Action& a);

/// Every check of validate() but the deadlock, which only a simulation finds (fail on the first).
void check_structure(const Schedule& schedule);

}  // namespace gpipe::detail
