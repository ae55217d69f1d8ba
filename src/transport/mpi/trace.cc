// trace.cc: the timeline of a step under MPI: replica 0's ranks' rows gathered on rank 0.
#include "transport/mpi/group.h"

#include <algorithm>
#include <cstring>

namespace gpipe::mpi::detail {

StepTrace MpiGroup::gather_trace(const StepTrace& trace, const PipelinePlan& plan) {
  // Per action: stage, kind, micro-batch, recompute flag, begin and end in ns from this rank's step
  // start. Ranks start a step within a message latency of each other, as the previous one ends with a
  // collective.
  constexpr size_t kFields = 6;
  std::vector<int64_t> mine;
  if (placement_.replica == 0 && static_cast<int>(trace.devices.size()) > placement_.device)
    for (const ActionSpan& span : trace.devices[static_cast<size_t>(placement_.device)])
      mine.insert(mine.end(), {span.action.stage, static_cast<int64_t>(span.action.kind), span.action.micro_batch,
                               span.action.recompute ? 1 : 0, span.begin_ns - trace.begin_ns,
                               span.end_ns - trace.begin_ns});
  const std::vector<std::string> parts =
      gather(std::string(reinterpret_cast<const char*>(mine.data()), mine.size() * sizeof(int64_t)));
  StepTrace out;
  if (parts.empty()) return out;  // not the first rank
  out.devices.assign(static_cast<size_t>(plan.devices), {});
  for (const std::string& part : parts) {
    std::vector<int64_t> all(part.size() / sizeof(int64_t));
    std::memcpy(all.data(), part.data(), all.size() * sizeof(int64_t));
    for (size_t n = 0; n + kFields <= all.size(); n += kFields) {
      ActionSpan span;
      span.action.stage = static_cast<int>(all[n]);
      span.action.kind = static_cast<ActionKind>(all[n + 1]);
      span.action.micro_batch = static_cast<int>(all[n + 2]);
      span.action.recompute = all[n + 3] != 0;
      span.begin_ns = all[n + 4];
      span.end_ns = all[n + 5];
      out.end_ns = std::max(out.end_ns, span.end_ns);
      out.devices[static_cast<size_t>(plan.placement[static_cast<size_t>(span.action.stage)])].push_back(span);
    }
  }
  return out;
}

}  // namespace gpipe::mpi::detail
