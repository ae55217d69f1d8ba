// settings.h: the one table of a training run's settings. Each row is a setting: the name the
// library's errors give it in backquotes, gpipe train's flag, Python's keyword argument where
// gpipe.GPipe takes it, its help, the TrainSettings member it fills and the check of what it takes.
// The command line's options, their checks and help, the library's names as flags in its errors
// (in_flags), the checks a C++ caller's settings get, and GPipe's keyword arguments beyond its own
// signature (precision=: set, checked and documented by their rows) all come from it; GPipe's own
// keywords (chunks, devices, ...) keep their Python checks, and the table gives their names in errors.
// Only a setting of the pipeline (with_pipeline_settings) has a keyword.
//
//   for (const gpipe::Setting& s : gpipe::train_settings()) std::cout << s.flag << ": " << s.help << "\n";
//   gpipe::check_setting(gpipe::find_setting("micro_batches"), "0");  // "must be at least 1 (got 0)"
//
// A new setting is its member in TrainSettings (tasks.h) and its row in train_settings() (settings.cc).
#pragma once

#include "gpipe/tasks.h"

#include <cstdint>
#include <functional>
#include <limits>
#include <string>
#include <variant>
#include <vector>

namespace gpipe {

/// What a setting takes, checked on its text: the same rule for a flag, a keyword argument and a
/// member a C++ caller set.
struct SettingCheck {
  /// The rule as a help text shows it: "INT>=1", "NUMBER>0", "{sgd,adam,adamw}", "PATH"; empty: any.
  std::string shape;
  /// "" where `text` is taken, else what is wrong: "must be at least 1 (got 0)". Empty: any text.
  std::function<std::string(const std::string& text)> check;
};

/// A whole number from `least` to `most`.
SettingCheck whole_number(int64_t least, int64_t most = std::numeric_limits<int32_t>::max());
/// The most a setting read into an int64_t takes (whole_number's `most` for such settings).
inline constexpr int64_t kMostInt64 = std::numeric_limits<int64_t>::max();
/// A finite number above 0; of at least 0; from 0 up to, not including, 1.
SettingCheck positive_number();
SettingCheck non_negative_number();
SettingCheck fraction_below_one();
/// A number from `least` to `most` (a whole one with `whole`): "must be a number from 0.000001 to 1e+09 (got 0)".
SettingCheck number_in(double least, double most, bool whole = false);
/// One of `choices`: "must be 2 or 4 (got x)", then ": <meaning>" where `meaning` says what they mean.
SettingCheck one_of(const std::vector<std::string>& choices, const std::string& meaning = "");
/// A file or folder name that is not empty (an empty one would silently write or read nothing).
SettingCheck non_empty();
/// A whole number from 0 to 2^64-1 (a seed).
SettingCheck seed_number();

/// Where a setting lives in TrainSettings.
using SettingMember =
    std::variant<bool TrainSettings::*, int TrainSettings::*, int64_t TrainSettings::*, uint64_t TrainSettings::*,
                 double TrainSettings::*, std::string TrainSettings::*, std::vector<int> TrainSettings::*,
                 std::vector<double> TrainSettings::*>;

/// One setting of a training run.
struct Setting {
  std::string name;     ///< the library's, as its errors give it in backquotes: "micro_batches"
  std::string flag;     ///< gpipe train's: "--micro-batches"
  std::string help;     ///< in the library's words: other settings by name in backquotes
  SettingMember member;
  SettingCheck check;
  std::string keyword;  ///< gpipe.GPipe's keyword argument ("chunks"); empty where Python has none
  /// A bool's flag sets it to this (false: --no-shuffle clears `shuffle`).
  bool flag_sets = true;
  int values = 0;              ///< a list's number of values (betas: 2); 0: any
  bool shows_default = false;  ///< the help shows the default value
  std::string old_flag;        ///< a flag it was known by before, still taken
};

/// Every setting of a training run, in the order gpipe train --help lists them.
const std::vector<Setting>& train_settings();

/// The row `name`. Throws std::logic_error for a name no row has (a mistake in the library).
const Setting& find_setting(const std::string& name);

/// "" where `setting` takes `text`, else what is wrong with it ("must be at least 1 (got 0)"): a
/// list's entries each, separated by single commas ("3,,8" has an empty one), a bool "true" or "false".
std::string check_setting(const Setting& setting, const std::string& text);

/// The value `settings` hold for `setting`, as text (a list's entries separated by commas).
std::string setting_text(const Setting& setting, const TrainSettings& settings);

/// Sets `setting` in `settings` to `text`, checked by its row first (a list's entries separated by
/// commas, a bool "true" or "false"), and marks it given. Throws std::invalid_argument "`precision`
/// must be fp32, bf16 or fp16 (got fp8)".
void set_setting(const Setting& setting, TrainSettings& settings, const std::string& text);

/// Whether `settings` ask for the setting `name`: marked given (a flag, a keyword), or changed from
/// TrainSettings' default by a C++ caller.
bool setting_asked(const TrainSettings& settings, const std::string& name);

/// `request` with the settings of `settings` that the pipeline's value holds and nothing chooses: its
/// precision, where given or not the default (else left to a resumed file's, then float32).
PipelineRequest with_request_settings(PipelineRequest request, const TrainSettings& settings);

/// `options` with the pipeline's settings of `settings` that its value does not hold: its checkpoint,
/// BatchNorm and threads per device (the rest of the pipeline is chosen: PipelineRequest, choose.h).
PipelineOptions with_pipeline_settings(PipelineOptions options, const TrainSettings& settings);

/// TrainerOptions::loss_scale of `settings`' `loss_scale`: none for auto (left to the precision), GradScaler's
/// defaults for dynamic, disabled for off.
std::optional<LossScaleOptions> loss_scale_of(const TrainSettings& settings);

/// Checks every setting a caller changed from TrainSettings' default against its row; throws
/// std::invalid_argument "`lr` must be a finite number above 0 (got -1)". resolve_training calls it.
void check_train_settings(const TrainSettings& settings);

}  // namespace gpipe
