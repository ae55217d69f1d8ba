// common.h: what the gpipe subcommands share: usage errors, machine description, statistics,
// list parsing, progress on standard error.
#pragma once

#include <gpipe/check.h>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <torch/types.h>

#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

namespace gpipe::cli {

/// Cores, BLAS and libtorch version, for result files.
nlohmann::json machine();

/// `value` with `digits` decimals.
std::string fixed(double value, int digits);

/// Refuses (a usage error naming --results) a results path that write_results could not write,
/// before the work; creates its folder, as write_results would. Empty: nothing is written.
void check_results_path(const std::string& path);

/// Writes a benchmark's `rows` to `path` (nothing when it is empty), whole or not at all, with the
/// command, the date and the machine; says so on standard error.
void write_results(const std::string& path, const nlohmann::json& rows, const std::string& command);

/// The command line as one string, for result files.
std::string command_line(int argc, char** argv);


/// Checks for numeric flags, each with a message that names the rule and the
/// value: a whole number of at least `least` ("must be a whole number, at least
/// 1 (got 0)"); a finite number above 0, or of at least 0; a number in [0, 1).
CLI::Validator at_least(int64_t least, int64_t most = std::numeric_limits<int32_t>::max());
/// The largest value of a flag read into an int64_t (at_least's `most` for such flags).
inline constexpr int64_t kMostInt64 = std::numeric_limits<int64_t>::max();
CLI::Validator positive_number();
CLI::Validator non_negative_number();
CLI::Validator fraction_below_one();
/// A number from `least` to `most` (a whole one with `whole`): "must be a number from 0.000001 to
/// 1e+09 (got 0)", where CLI::Range says "Value 0 not in range ...".
CLI::Validator in_range(double least, double most, bool whole = false);
/// One of `choices`: "must be 2 or 4 (got x)".
CLI::Validator one_of(const std::vector<std::string>& choices, const std::string& meaning = "");
/// A file or folder name that is not empty ("--save \"\"" would silently write nothing).
CLI::Validator non_empty();

/// Parses a seed: a whole number from 0 to 2^64-1; throws UsageError otherwise.
uint64_t parse_seed(const std::string& text);

/// A mistake in the command line or in the files it names. main() prints its
/// message and ends with status 2, after everything the run built has been
/// torn down (device threads joined), so no error leaves a thread running.
struct UsageError : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};

/// `message` with the library's option names in backquotes (`micro_batches`) written as the
/// command line's flags (--micro-batches): the one place the library's words become flags.
std::string in_flags(const std::string& message);

/// `message` without a leading "gpipe: ", to put a flag or a context before it.
std::string without_prefix(const std::string& message);

/// Throws UsageError("gpipe: " + message).
[[noreturn]] void usage_error(const std::string& message);

/// fn(), with any exception it throws turned into a usage error about `flag`:
/// "gpipe: --resume: <what went wrong>".
template <typename Fn>
auto or_usage_error(const std::string& flag, Fn&& fn) {
  try {
    return fn();
  } catch (const std::exception& e) {
    usage_error(flag + ": " + without_prefix(what_of(e)));  // libtorch's stack and TorchScript's traceback: --verbose
  }
}

/// Progress of a training run on standard error: a bar on a terminal, a plain line every tenth
/// of an epoch otherwise; nothing when not `enabled`.
class Progress {
 public:
  Progress(int epochs, int64_t steps_per_epoch, bool enabled);
  /// After step `step` (1-based) of epoch `epoch`.
  void update(int epoch, int64_t step, double loss, double samples_per_s, double eta_s);
  void end_epoch();

 private:
  int epochs_;
  int64_t steps_;
  bool tty_;
  bool enabled_;
};

}  // namespace gpipe::cli
