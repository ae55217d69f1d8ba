// stop.cc: the process's stop request (set from a signal handler, read by Trainer::fit at step
// boundaries) and the handlers of SIGINT and SIGTERM.
#include "gpipe/stop.h"

#include "gpipe/io.h"

#include <atomic>
#include <cerrno>
#include <cstdint>

#include <pthread.h>
#include <signal.h>
#include <time.h>
#include <unistd.h>

namespace gpipe {
namespace {

// Lock-free atomics only: a signal handler reads and writes them.
std::atomic<int> requested{0};
std::atomic<int64_t> requested_at_ns{0};
std::atomic<int> mode_of_handlers{static_cast<int>(OnSignal::kStopAtStep)};

constexpr int64_t kSameRequestNs = 100000000;  // 0.1 s: far below two presses of Ctrl-C

int64_t monotonic_ns() {  // clock_gettime is async-signal-safe
  timespec t{};
  ::clock_gettime(CLOCK_MONOTONIC, &t);
  return static_cast<int64_t>(t.tv_sec) * 1000000000 + t.tv_nsec;
}

void on_signal(int signal) {
  const int saved_errno = errno;
  if (static_cast<OnSignal>(mode_of_handlers.load()) == OnSignal::kEndNow) {
    remove_partial_files();
    // One line, so that a run ended before its first step (or without --save) does not end in silence.
    static const char kInt[] = "gpipe: ended by SIGINT; nothing was saved\n";
    static const char kTerm[] = "gpipe: ended by SIGTERM; nothing was saved\n";
    [[maybe_unused]] const ssize_t written = signal == SIGINT ? ::write(STDERR_FILENO, kInt, sizeof kInt - 1)
                                                              : ::write(STDERR_FILENO, kTerm, sizeof kTerm - 1);
    ::signal(signal, SIG_DFL);  // then the default action: killed by the signal, as without a handler
    sigset_t mask;
    sigemptyset(&mask);
    sigaddset(&mask, signal);
    ::pthread_sigmask(SIG_UNBLOCK, &mask, nullptr);  // it is blocked while its handler runs
    ::raise(signal);
    ::_exit(128 + signal);  // not reached
  }
  // The same signal again within kSameRequestNs is the same request delivered twice: `timeout`,
  // and a batch system ending a job, signal the process and then its process group.
  const int first = requested.load();
  const int64_t first_at = requested_at_ns.load();  // 0: the first is being handled on another thread
  if (first == signal && (first_at == 0 || monotonic_ns() - first_at < kSameRequestNs)) {
    errno = saved_errno;
    return;
  }
  if (first != 0) {  // the second signal: at once, no half-written file left
    remove_partial_files();
    ::_exit(128 + signal);
  }
  request_stop(signal);
  errno = saved_errno;
}

}  // namespace

void request_stop(int signal) {
  int none = 0;
  if (signal > 0 && requested.compare_exchange_strong(none, signal)) requested_at_ns.store(monotonic_ns());
}

int stop_requested() { return requested.load(); }

double seconds_since_stop_request() {
  const int64_t at = requested_at_ns.load();
  if (requested.load() == 0 || at == 0) return 0;  // no request, or its time not yet stored: just now
  return static_cast<double>(monotonic_ns() - at) * 1e-9;
}

void clear_stop_request() {
  requested.store(0);  // first: a signal in between is a new request, not a copy of the old one
  requested_at_ns.store(0);
}

void install_signal_handlers(OnSignal mode) {
  mode_of_handlers.store(static_cast<int>(mode));
  struct sigaction action {};
  action.sa_handler = on_signal;
  sigemptyset(&action.sa_mask);  // one handler at a time: a second signal is handled after the first
  sigaddset(&action.sa_mask, SIGINT);
  sigaddset(&action.sa_mask, SIGTERM);
  action.sa_flags = SA_RESTART;  // a signal does not fail the system calls it interrupts
  ::sigaction(SIGINT, &action, nullptr);
  ::sigaction(SIGTERM, &action, nullptr);
}

}  // namespace gpipe
