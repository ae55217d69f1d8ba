// common.h: what the gpipe subcommands share: checks of numeric flags, usage errors, the library's
// option names as flags.
#pragma once

#include <gpipe/check.h>
#include <gpipe/progress.h>
#include <gpipe/results.h>
#include <gpipe/settings.h>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

namespace gpipe::cli {

/// The machine of a result file (results.h), for the summary of gpipe train --json.
inline nlohmann::json machine() { return nlohmann::json::parse(machine_json()); }

/// `value` with `digits` decimals.
std::string fixed(double value, int digits);

/// A check of the settings' table (settings.h) as a flag's validator.
CLI::Validator validator(const SettingCheck& check);

/// A mistake in the command line or in the files it names. main() prints its
/// message and ends with status 2, after everything the run built has been
/// torn down (device threads joined), so no error leaves a thread running.
struct UsageError : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};

/// `message` with the library's option names in backquotes (`micro_batches`) written as the
/// command line's flags (--micro-batches): the one place the library's words become flags.
std::string in_flags(const std::string& message);

/// Lets in_flags write the library's name `name` as `flag` (add_fields calls it for each row of a
/// command's table). Throws std::logic_error where `name` is already another flag's.
void remember_flag(const std::string& name, const std::string& flag);

/// `message` without a leading "gpipe: ", to put a flag or a context before it.
std::string without_prefix(const std::string& message);

/// Throws UsageError("gpipe: " + message).
[[noreturn]] void usage_error(const std::string& message);

/// fn() (what it returns, if anything), with any exception it throws turned into a usage error
/// about `flag`: "gpipe: --resume: <what went wrong>".
template <typename Fn>
auto or_usage_error(const std::string& flag, Fn&& fn) {
  try {
    return fn();
  } catch (const std::exception& e) {
    usage_error(flag + ": " + without_prefix(what_of(e)));  // libtorch's stack and TorchScript's traceback: --verbose
  }
}

}  // namespace gpipe::cli
