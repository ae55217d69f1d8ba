// progress.cc: progress lines on standard error (ProgressLine), and a training run's (TrainingProgress).
#include "gpipe/progress.h"

#include <cstdio>
#include <iomanip>
#include <sstream>

#include <unistd.h>

namespace gpipe {

ProgressLine::ProgressLine(bool enabled, bool rewrite)
    : enabled_(enabled), rewrite_(rewrite && isatty(STDERR_FILENO) != 0) {}

bool ProgressLine::due(double every_s) const {
  return enabled_ && std::chrono::duration<double>(Clock::now() - last_).count() >= every_s;
}

namespace {
void write_all(const std::string& text) {
  for (size_t done = 0; done < text.size();) {
    const ssize_t n = ::write(STDERR_FILENO, text.data() + done, text.size() - done);
    if (n <= 0) return;
    done += static_cast<size_t>(n);
  }
}
}  // namespace

void ProgressLine::show(const std::string& line) {
  if (!enabled_) return;
  write_all(rewrite_ ? "\r" + line + "\x1b[K" : line + "\n");
  shown_ = true;
  open_ = rewrite_;
  last_ = Clock::now();
}

void ProgressLine::end() {
  if (open_) write_all("\n");
  open_ = false;
}

double ProgressLine::seconds() const { return std::chrono::duration<double>(Clock::now() - begin_).count(); }

TrainingProgress::TrainingProgress(int epochs, int64_t steps_per_epoch, bool enabled)
    : line_(enabled), epochs_(epochs), steps_(steps_per_epoch) {}

void TrainingProgress::update(int epoch, int64_t step, double loss, double samples_per_s, double eta_s) {
  const bool bar = line_.rewrites(), every_tenth = steps_ < 10 || step % (steps_ / 10) == 0 || step == steps_;
  if (!bar && !every_tenth) return;
  std::ostringstream line;
  line << "epoch " << epoch << "/" << epochs_ << " ";
  if (bar) {
    const int width = 24, filled = static_cast<int>(width * step / steps_);
    line << "[" << std::string(static_cast<size_t>(filled), '#') << std::string(static_cast<size_t>(width - filled), '.')
         << "] ";
  }
  const int eta = static_cast<int>(eta_s + 0.5);
  line << "step " << step << "/" << steps_ << "  loss " << std::fixed << std::setprecision(4) << loss << "  "
       << std::setprecision(0) << samples_per_s << " samples/s  ETA " << eta / 60 << "m" << std::setw(2)
       << std::setfill('0') << eta % 60 << "s";
  line_.show(line.str());
}

}  // namespace gpipe
