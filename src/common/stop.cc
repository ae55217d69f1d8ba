// stop.cc: the process's stop request (set from a signal handler, read by Trainer::fit at step
// boundaries) and the handlers of SIGINT, SIGTERM, SIGHUP and SIGQUIT.
#include "gpipe/stop.h"

#include "gpipe/io.h"

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <string>

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

// What a process ended by a second signal says is whole on disk (note_saved): written by a normal
// thread between saves, read by the handler. state: 0 nothing saved, 1 being changed, 2 holds text.
std::atomic<int> saved_state{0};
char saved_text[4200];
size_t saved_length = 0;

void write_text(const char* text, size_t length) {
  [[maybe_unused]] const ssize_t written = ::write(STDERR_FILENO, text, length);
}

void write_text(const char* text) {
  size_t length = 0;
  while (text[length] != '\0') ++length;
  write_text(text, length);
}

// One line on standard error: "gpipe: ended by SIGINT, a second signal; PATH (step N) is whole",
// or "...; nothing was saved". Async-signal-safe.
void say_what_is_saved(int signal, const char* why) {
  write_text("gpipe: ended by ");
  write_text(signal_name(signal));
  write_text(why);
  if (saved_state.load() == 2) {
    write_text("; the last save is whole: ");
    write_text(saved_text, saved_length);
    write_text("\n");
  } else {
    write_text("; nothing was saved\n");
  }
}

// SIGQUIT: no saved stop, but no half-written file either; then its default action (a core dump).
void on_quit(int signal) {
  remove_partial_files();
  say_what_is_saved(signal, " (quit at once)");
  ::signal(signal, SIG_DFL);
  sigset_t mask;
  sigemptyset(&mask);
  sigaddset(&mask, signal);
  ::pthread_sigmask(SIG_UNBLOCK, &mask, nullptr);
  ::raise(signal);
  ::_exit(128 + signal);  // not reached
}

int64_t monotonic_ns() {  // clock_gettime is async-signal-safe
  timespec t{};
  ::clock_gettime(CLOCK_MONOTONIC, &t);
  return static_cast<int64_t>(t.tv_sec) * 1000000000 + t.tv_nsec;
}

void on_signal(int signal) {
  const int saved_errno = errno;
  if (static_cast<OnSignal>(mode_of_handlers.load()) == OnSignal::kEndNow) {
    remove_partial_files();
    // One line, so that a run ended before its first step (or without a save file) does not end in
    // silence; it names the last whole save, if there was one.
    say_what_is_saved(signal, "");
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
  if (first != 0) {  // the second signal: at once, no half-written file left, and what is whole said
    remove_partial_files();
    say_what_is_saved(signal, ", a second signal (ended at once)");
    ::_exit(128 + signal);
  }
  request_stop(signal);
  errno = saved_errno;
}

}  // namespace

const char* signal_name(int signal) {
  switch (signal) {
    case SIGINT: return "SIGINT";
    case SIGTERM: return "SIGTERM";
    case SIGHUP: return "SIGHUP";
    case SIGQUIT: return "SIGQUIT";
    default: return "a signal";
  }
}

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

void note_saved(const std::string& path, int64_t step) {
  const std::string text = path + " (step " + std::to_string(step) + ")";
  saved_state.store(1);  // the handler reads no half-changed text
  saved_length = std::min(text.size(), sizeof saved_text);
  std::memcpy(saved_text, text.data(), saved_length);
  saved_state.store(2);
}

void install_signal_handlers(OnSignal mode) {
  mode_of_handlers.store(static_cast<int>(mode));
  struct sigaction action {};
  action.sa_handler = on_signal;
  sigemptyset(&action.sa_mask);  // one handler at a time: a second signal is handled after the first
  for (int s : {SIGINT, SIGTERM, SIGHUP, SIGQUIT}) sigaddset(&action.sa_mask, s);
  action.sa_flags = SA_RESTART;  // a signal does not fail the system calls it interrupts
  // SIGHUP (a closed terminal, a dropped ssh connection) stops the run as SIGTERM does.
  // SIGHUP ignored when the process started stays ignored: that is what `nohup` asks. (SIGINT and
  // SIGQUIT are handled even so: a script's background job starts with them ignored, and a user who
  // sends one to it means it.)
  struct sigaction hangup {};
  const bool hangup_ignored = ::sigaction(SIGHUP, nullptr, &hangup) == 0 && hangup.sa_handler == SIG_IGN;
  for (int s : {SIGINT, SIGTERM, SIGHUP})
    if (s != SIGHUP || !hangup_ignored) ::sigaction(s, &action, nullptr);
  struct sigaction quit = action;
  quit.sa_handler = on_quit;
  ::sigaction(SIGQUIT, &quit, nullptr);
}

}  // namespace gpipe
