// trace.cc: step timelines and the bubble they measure.
#include "gpipe/trace.h"

#include "gpipe/io.h"

#include <chrono>
#include <sstream>

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

std::string chrome_trace_json(const StepTrace& trace) {
  std::ostringstream out;
  out << "{\"displayTimeUnit\": \"ms\", \"traceEvents\": [";
  const char* sep = "\n";
  for (size_t j = 0; j < trace.stages.size(); ++j) {
    out << sep << "{\"name\": \"thread_name\", \"ph\": \"M\", \"pid\": 0, \"tid\": " << j
        << ", \"args\": {\"name\": \"stage " << j << "\"}}";
    sep = ",\n";
  }
  for (size_t j = 0; j < trace.stages.size(); ++j)
    for (const ActionSpan& span : trace.stages[j]) {
      const bool forward = span.action.phase == Phase::kForward;
      out << sep << "{\"name\": \"" << span.action.str() << "\", \"cat\": \""
          << (forward ? "forward" : "backward") << "\", \"ph\": \"X\", \"pid\": 0, \"tid\": " << j
          << ", \"ts\": " << static_cast<double>(span.begin_ns - trace.begin_ns) * 1e-3
          << ", \"dur\": " << static_cast<double>(span.end_ns - span.begin_ns) * 1e-3
          << ", \"args\": {\"micro_batch\": " << span.action.micro_batch << "}}";
    }
  out << "\n]}\n";
  return out.str();
}

void write_chrome_trace(const StepTrace& trace, const std::string& path) {
  write_file_atomically(path, chrome_trace_json(trace));
}

}  // namespace gpipe
