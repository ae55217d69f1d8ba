// stop.h: asking a training run to stop at its next step boundary, saved, from a signal handler;
// and the signal handlers gpipe train installs (SIGINT, SIGTERM).
//
//   gpipe::install_signal_handlers(gpipe::OnSignal::kStopAtStep);  // before Trainer::fit
//   trainer.fit();                                                 // returns early after a signal
//   if (trainer.stopped_by() != 0) return 128 + trainer.stopped_by();
//
// Trainer::fit checks for a request after every step (under MPI all ranks agree on the step),
// saves the run to TrainerOptions::save and returns; a step still running
// TrainerOptions::stop_timeout seconds after the request is abandoned with the parameters as
// they were (in one process; under MPI the step runs to its end).
#pragma once

#include <cstdint>
#include <string>

namespace gpipe {

/// Asks every Trainer of this process to stop at its next step boundary; `signal` (above 0) is
/// the reason, as stopped_by() reports it. Async-signal-safe: a signal handler may call it. The
/// first request since clear_stop_request() counts; later ones change nothing.
void request_stop(int signal);

/// The signal of the pending stop request, or 0 when there is none.
int stop_requested();

/// Seconds since the pending stop request was made (0 when there is none).
double seconds_since_stop_request();

/// "SIGINT", "SIGTERM", "SIGHUP" or "SIGQUIT"; "a signal" for any other. Async-signal-safe.
const char* signal_name(int signal);

/// Forgets the pending stop request (a run that stopped can then be continued by fit()).
void clear_stop_request();

/// What the handlers of SIGINT, SIGTERM and SIGHUP that install_signal_handlers() sets do (SIGHUP,
/// a closed terminal or a dropped ssh connection, as SIGTERM). SIGQUIT always ends the process at
/// once, as its default action would, but first removes the temporary file being written and says
/// which save is whole.
enum class OnSignal {
  /// The first signal calls request_stop(); a second one removes the temporary file being
  /// written (remove_partial_files) and ends the process at once with status 128 + signal,
  /// every file that was whole before still whole, saying on standard error which one the last
  /// save wrote and at which step (note_saved), or that nothing was saved. The same signal again within 0.1 s of the
  /// first is not a second one: `timeout` and batch systems signal the process, then its group.
  kStopAtStep,
  /// The first signal removes the temporary file being written, says on standard error that the
  /// process ended and which save is whole (or that nothing was saved), and ends it as the signal's default action would (killed
  /// by the signal).
  kEndNow,
};

/// Installs handlers of SIGINT, SIGTERM and SIGHUP that do what `mode` says, and of SIGQUIT; SIGHUP
/// ignored when the process started (`nohup gpipe train ...`) stays ignored.
void install_signal_handlers(OnSignal mode);

/// Tells the handlers that `path` was written whole at `step` (Trainer's saves call it), for the
/// line a process ended by a second signal prints. Not for a signal handler.
void note_saved(const std::string& path, int64_t step);

}  // namespace gpipe
