// trace.cc: step timelines and the bubble they measure.
#include "gpipe/trace.h"

#include "gpipe/io.h"

#include <algorithm>
#include <chrono>
#include <iomanip>
#include <map>
#include <tuple>
#include <sstream>

namespace gpipe {

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

double StepTrace::seconds() const { return static_cast<double>(end_ns - begin_ns) * 1e-9; }

double StepTrace::busy_seconds(int device) const {
  int64_t busy = 0;
  if (device < 0 || static_cast<size_t>(device) >= devices.size()) return 0;  // no step recorded yet
  for (const ActionSpan& span : devices[static_cast<size_t>(device)]) busy += span.end_ns - span.begin_ns;
  if (static_cast<size_t>(device) < other.size())
    for (const WorkSpan& span : other[static_cast<size_t>(device)]) busy += span.end_ns - span.begin_ns;
  return static_cast<double>(busy) * 1e-9;
}

double StepTrace::bubble() const {
  const double total = seconds() * static_cast<double>(devices.size());
  if (total <= 0) return 0;
  double busy = 0;
  for (size_t j = 0; j < devices.size(); ++j) busy += busy_seconds(static_cast<int>(j));
  return 1.0 - busy / total;
}

double overhead_seconds(const StepTrace& trace, const Schedule& program) {
  std::map<std::tuple<int, char, int>, double> duration;  // (stage, kind, micro-batch) → ns
  for (const auto& row : trace.devices)
    for (const ActionSpan& span : row)
      duration[{span.action.stage, static_cast<char>(span.action.kind), span.action.micro_batch}] =
          static_cast<double>(span.end_ns - span.begin_ns);
  const SimulatedRun ideal = simulate(program, [&](const Action& a) {
    const auto it = duration.find({a.stage, static_cast<char>(a.kind), a.micro_batch});
    return a.is_compute() && it != duration.end() ? it->second : 0.0;
  });
  return (static_cast<double>(trace.end_ns - trace.begin_ns) - ideal.makespan) * 1e-9;
}

namespace {

// Forward, the input-gradient backward (B or I), and W, in three colours.
const char* category(ActionKind kind) {
  return kind == ActionKind::kForward ? "forward" : kind == ActionKind::kWeightGrad ? "weight" : "backward";
}
const char* colour(ActionKind kind) {
  return kind == ActionKind::kForward ? "#4c78a8" : kind == ActionKind::kWeightGrad ? "#54a24b" : "#f58518";
}

}  // namespace

std::string chrome_trace_json(const StepTrace& trace) {
  std::ostringstream out;
  out << "{\"displayTimeUnit\": \"ms\", \"traceEvents\": [";
  const char* sep = "\n";
  for (size_t j = 0; j < trace.devices.size(); ++j) {
    out << sep << "{\"name\": \"thread_name\", \"ph\": \"M\", \"pid\": 0, \"tid\": " << j
        << ", \"args\": {\"name\": \"device " << j << "\"}}";
    sep = ",\n";
  }
  for (size_t j = 0; j < trace.devices.size(); ++j)
    for (const ActionSpan& span : trace.devices[j]) {
      out << sep << "{\"name\": \"" << span.action.str() << "\", \"cat\": \"" << category(span.action.kind) << "\", \"ph\": \"X\", \"pid\": 0, \"tid\": " << j
          << ", \"ts\": " << static_cast<double>(span.begin_ns - trace.begin_ns) * 1e-3
          << ", \"dur\": " << static_cast<double>(span.end_ns - span.begin_ns) * 1e-3
          << ", \"args\": {\"micro_batch\": " << span.action.micro_batch << "}}";
    }
  for (size_t j = 0; j < trace.other.size(); ++j)
    for (const WorkSpan& span : trace.other[j])
      out << sep << "{\"name\": \"" << span.stage << "U\", \"cat\": \"update\", \"ph\": \"X\", \"pid\": 0, \"tid\": " << j
          << ", \"ts\": " << static_cast<double>(span.begin_ns - trace.begin_ns) * 1e-3
          << ", \"dur\": " << static_cast<double>(span.end_ns - span.begin_ns) * 1e-3 << ", \"args\": {\"stage\": "
          << span.stage << "}}";
  out << "\n]}\n";
  return out.str();
}

void write_chrome_trace(const StepTrace& trace, const std::string& path) {
  write_file_atomically(path, chrome_trace_json(trace));
}

std::string timeline_svg(const StepTrace& trace) {
  const double width = 1000, left = 80, right = 20, top = 56, row = 40, gap = 8;
  const size_t K = trace.devices.size();
  const double height = top + static_cast<double>(K) * row + 56;
  const double span_ns = std::max<double>(1.0, static_cast<double>(trace.end_ns - trace.begin_ns));
  const double scale = (width - left - right) / span_ns;  // pixels per nanosecond
  auto x_of = [&](int64_t ns) { return left + static_cast<double>(ns - trace.begin_ns) * scale; };

  std::ostringstream out;
  out << std::fixed << std::setprecision(1);
  out << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << width << "\" height=\"" << height
      << "\" font-family=\"sans-serif\" font-size=\"12\">\n"
      << "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
      << "<text x=\"" << left << "\" y=\"22\" font-size=\"15\">Pipeline step: " << K << " devices, "
      << trace.seconds() * 1e3 << " ms, bubble " << 100 * trace.bubble() << "% (measured)</text>\n"
      << "<rect x=\"" << left << "\" y=\"32\" width=\"12\" height=\"12\" fill=\"#4c78a8\"/>"
      << "<text x=\"" << left + 16 << "\" y=\"43\">forward</text>"
      << "<rect x=\"" << left + 80 << "\" y=\"32\" width=\"12\" height=\"12\" fill=\"#f58518\"/>"
      << "<text x=\"" << left + 96 << "\" y=\"43\">backward (B, I)</text>"
      << "<rect x=\"" << left + 210 << "\" y=\"32\" width=\"12\" height=\"12\" fill=\"#54a24b\"/>"
      << "<text x=\"" << left + 226 << "\" y=\"43\">weight gradients (W)</text>"
      << "<rect x=\"" << left + 370 << "\" y=\"32\" width=\"12\" height=\"12\" fill=\"#9d9d9d\"/>"
      << "<text x=\"" << left + 386 << "\" y=\"43\">a stage's update (U)</text>\n";
  for (size_t j = 0; j < K; ++j) {
    const double y = top + static_cast<double>(j) * row;
    out << "<text x=\"" << left - 8 << "\" y=\"" << y + row / 2 + 4 << "\" text-anchor=\"end\">device " << j
        << "</text>\n<rect x=\"" << left << "\" y=\"" << y + gap / 2 << "\" width=\"" << width - left - right
        << "\" height=\"" << row - gap << "\" fill=\"#f2f2f2\"/>\n";
    for (const ActionSpan& span : trace.devices[j]) {
      const double x = x_of(span.begin_ns), w = std::max(1.0, x_of(span.end_ns) - x);
      out << "<rect x=\"" << x << "\" y=\"" << y + gap / 2 << "\" width=\"" << w << "\" height=\"" << row - gap
          << "\" fill=\"" << colour(span.action.kind) << "\" stroke=\"white\" stroke-width=\"0.5\"><title>"
          << span.action.str() << ": " << static_cast<double>(span.end_ns - span.begin_ns) * 1e-6
          << " ms</title></rect>\n";
      if (w >= 18)
        out << "<text x=\"" << x + w / 2 << "\" y=\"" << y + row / 2 + 4 << "\" text-anchor=\"middle\" fill=\"white\">"
            << span.action.str() << "</text>\n";
    }
    if (j < trace.other.size())
      for (const WorkSpan& span : trace.other[j]) {  // a stage's held update, grey
        const double x = x_of(span.begin_ns), w = std::max(1.0, x_of(span.end_ns) - x);
        out << "<rect x=\"" << x << "\" y=\"" << y + gap / 2 << "\" width=\"" << w << "\" height=\"" << row - gap
            << "\" fill=\"#9d9d9d\" stroke=\"white\" stroke-width=\"0.5\"><title>" << span.stage << "U: stage "
            << span.stage << "'s update, " << static_cast<double>(span.end_ns - span.begin_ns) * 1e-6
            << " ms</title></rect>\n";
      }
  }
  // A time axis with about ten ticks at round milliseconds.
  const double axis_y = top + static_cast<double>(K) * row + 8, span_ms = span_ns * 1e-6;
  double step_ms = 1e-3;
  for (double s : {1e-3, 2e-3, 5e-3, 1e-2, 2e-2, 5e-2, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0,
                   500.0, 1000.0, 2000.0, 5000.0})
    if (span_ms / s <= 10) { step_ms = s; break; }
  out << "<line x1=\"" << left << "\" y1=\"" << axis_y << "\" x2=\"" << width - right << "\" y2=\"" << axis_y
      << "\" stroke=\"black\"/>\n";
  for (double t = 0; t <= span_ms + 1e-9; t += step_ms) {
    const double x = left + t * 1e6 * scale;
    out << "<line x1=\"" << x << "\" y1=\"" << axis_y << "\" x2=\"" << x << "\" y2=\"" << axis_y + 5
        << "\" stroke=\"black\"/><text x=\"" << x << "\" y=\"" << axis_y + 18 << "\" text-anchor=\"middle\">"
        << std::setprecision(step_ms < 1 ? 3 : 0) << t << "</text>\n";
  }
  out << "<text x=\"" << width - right << "\" y=\"" << axis_y + 36 << "\" text-anchor=\"end\">time (ms)</text>\n"
      << "</svg>\n";
  return out.str();
}

void write_trace(const StepTrace& trace, const std::string& path) {
  write_file_atomically(path, has_extension(path, ".svg") ? timeline_svg(trace) : chrome_trace_json(trace));
}

}  // namespace gpipe
