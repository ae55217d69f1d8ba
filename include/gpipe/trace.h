// trace.h: per-action timestamps of a step, and what they say: step time, busy time, bubble.
#pragma once

#include "gpipe/schedule.h"

#include <cstdint>
#include <string>
#include <vector>

namespace gpipe {

/// Nanoseconds on a monotonic clock.
int64_t now_ns();

/// One action as it ran: when it began and ended.
struct ActionSpan {
  Action action;
  int64_t begin_ns = 0;
  int64_t end_ns = 0;
};

/// Work a device did outside its program before stage `stage`'s first action: the stage's held
/// optimizer update (Pipeline::set_before_stage).
struct WorkSpan {
  int stage = 0;
  int64_t begin_ns = 0;
  int64_t end_ns = 0;
};

/// The timeline of one step: its compute actions (F, B, I, W) per device.
/// Each device appends only to its own row, so recording takes no lock; rows
/// are read after the step has ended.
struct StepTrace {
  int64_t begin_ns = 0;
  int64_t end_ns = 0;
  std::vector<std::vector<ActionSpan>> devices;  ///< devices[d]: device d's compute actions in order
  std::vector<std::vector<WorkSpan>> other;     ///< other[d]: device d's work outside the program, counted busy

  /// Wall time of the step, in seconds.
  double seconds() const;
  /// Time device d spent inside compute actions and other work, in seconds (0 before any step).
  double busy_seconds(int device) const;
  /// The measured bubble: the share of device-time in which devices were idle,
  /// 1 - Σ_d busy_d / (K · step time). 0 for an empty trace.
  double bubble() const;
};

/// The pipeline's own overhead in a step, in seconds: the step time less the
/// time `program` would take if every compute action took exactly its measured
/// duration and sends and receives took none (a simulation). Waiting that the
/// schedule implies (the bubble) is not overhead; thread hand-offs, messages,
/// micro-batch splitting and bookkeeping are. A span starts after its inputs
/// were received and ends before its output is sent, so the simulated chain
/// of spans never exceeds the step and the overhead is never negative.
double overhead_seconds(const StepTrace& trace, const Schedule& program);

/// The trace as Chrome-trace JSON (the Trace Event Format that Perfetto and
/// chrome://tracing open): one complete event per action, named by its text
/// form ("1F0"), on one row per device, in microseconds from the step's start; work outside the
/// program as "1U" (stage 1's update).
std::string chrome_trace_json(const StepTrace& trace);

/// Writes chrome_trace_json(trace) to `path`, whole or not at all (a
/// temporary file, then a rename). Throws std::runtime_error if it cannot.
void write_chrome_trace(const StepTrace& trace, const std::string& path);

/// The trace as an SVG chart like the paper's Figure 2: one row per device,
/// time to the right, forwards, backwards and weight gradients in three colours
/// labelled with their action, idle time blank; the title gives step time and measured bubble.
std::string timeline_svg(const StepTrace& trace);

/// Writes the trace to `path`, whole or not at all: an SVG chart when the name
/// ends in ".svg" (in any case: ".SVG" too), Chrome-trace JSON otherwise.
void write_trace(const StepTrace& trace, const std::string& path);

}  // namespace gpipe
