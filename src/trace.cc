// trace.cc: step timelines and the bubble they measure.
#include "gpipe/trace.h"

#include <chrono>

namespace gpipe {

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

double StepTrace::seconds() const { return static_cast<double>(end_ns - begin_ns) * 1e-9; }

double StepTrace::busy_seconds(int stage) const {
  int64_t busy = 0;
  for (const ActionSpan& span : stages[static_cast<size_t>(stage)]) busy += span.end_ns - span.begin_ns;
  return static_cast<double>(busy) * 1e-9;
}

double StepTrace::bubble() const {
  const double total = seconds() * static_cast<double>(stages.size());
  if (total <= 0) return 0;
  double busy = 0;
  for (size_t j = 0; j < stages.size(); ++j) busy += busy_seconds(static_cast<int>(j));
  return 1.0 - busy / total;
}

}  // namespace gpipe
