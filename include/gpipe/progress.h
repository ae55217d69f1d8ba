// progress.h: how far a long piece of work is, on standard error: a line rewritten in place on a
// terminal, lines of their own otherwise; the clock that says when the next one is due.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

namespace gpipe {

/// Lines of progress on standard error, each written at once (one write(2): ranks of a job that
/// share a terminal do not interleave them). Where standard error is a terminal and `rewrite` is
/// set, each line replaces the one before (end() then ends it); otherwise each is a line of its
/// own. Nothing is written when not `enabled`.
class ProgressLine {
 public:
  explicit ProgressLine(bool enabled = true, bool rewrite = true);
  /// Whether a line is due by the clock: `every_s` seconds after the start, then after the last
  /// line shown; never when not enabled.
  bool due(double every_s = 2.0) const;
  void show(const std::string& line);
  /// Ends a line rewritten in place, so that what follows starts a line of its own.
  void end();
  bool shown() const { return shown_; }
  /// Whether lines replace each other (a terminal, and `rewrite`).
  bool rewrites() const { return rewrite_; }
  /// Seconds since the start.
  double seconds() const;

 private:
  using Clock = std::chrono::steady_clock;
  bool enabled_, rewrite_, shown_ = false, open_ = false;
  Clock::time_point begin_ = Clock::now(), last_ = begin_;
};

/// Progress of a training run: a bar rewritten after every step on a terminal, a plain line every
/// tenth of an epoch otherwise ("epoch 1/2 step 30/300  loss 0.5123  812 samples/s  ETA 1m05s");
/// nothing when not `enabled`.
class TrainingProgress {
 public:
  TrainingProgress(int epochs, int64_t steps_per_epoch, bool enabled);
  /// After step `step` (1-based) of epoch `epoch`, `eta_s` seconds before the run ends.
  void update(int epoch, int64_t step, double loss, double samples_per_s, double eta_s);
  void end_epoch() { line_.end(); }

 private:
  ProgressLine line_;
  int epochs_;
  int64_t steps_;
};

}  // namespace gpipe
