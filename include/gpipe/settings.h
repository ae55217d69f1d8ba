// settings.h: tables of settings. Each row (Field) is one: the name the library's errors give it in
// backquotes, its command-line flag, Python's keyword argument where gpipe.GPipe takes it, its help,
// the member of `Values` it fills and the check of what it takes. train_settings() is the table of a
// training run (TrainSettings, `gpipe train`); gpipe bench's (bench_fields(), BenchSweep) and plan's and
// schedule's (in their files under apps/) take train's rows where they take one of its settings
// (train_field: its name, flag and check, over their own member). The command line's options, their
// checks and help, the library's names as flags in its errors (in_flags), the checks a C++ caller's
// settings get, and GPipe's keyword arguments (chunks=, devices=, ... checked by their rows; precision=
// and the others beyond GPipe's signature also set and documented by them) all come from the tables.
// Only a setting of the pipeline (with_pipeline_settings) has a keyword.
//
//   for (const gpipe::Setting& s : gpipe::train_settings()) std::cout << s.flag << ": " << s.help << "\n";
//   gpipe::check_field(gpipe::find_setting("micro_batches"), "0");  // "must be at least 1 (got 0)"
//
// A new setting is its member in TrainSettings (tasks.h) and its row in train_settings() (settings.cc);
// a flag of bench alone, its member in BenchSweep and its row in bench_fields() (bench_fields.cc).
#pragma once

#include "gpipe/tasks.h"

#include <cstdint>
#include <functional>
#include <stdexcept>
#include <type_traits>
#include <limits>
#include <optional>
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

/// Where a field lives in `Values` (TrainSettings, BenchSweep, a command's own options): a member of
/// one of the types a setting's text reads into.
template <typename Values>
using FieldMember =
    std::variant<bool Values::*, int Values::*, int64_t Values::*, uint64_t Values::*, double Values::*,
                 std::string Values::*, std::vector<int> Values::*, std::vector<int64_t> Values::*,
                 std::vector<double> Values::*, std::vector<std::string> Values::*>;

/// One row of a table of settings: a setting of a training run (Setting), or a flag of gpipe bench,
/// plan or schedule, whose values are `Values`.
template <typename Values>
struct Field {
  std::string name;     ///< the library's, as its errors give it in backquotes: "micro_batches"
  std::string flag;     ///< the command line's: "--micro-batches"
  std::string help;     ///< in the library's words: other settings by name in backquotes
  FieldMember<Values> member;
  SettingCheck check = {};   ///< of the value, or of each entry of a list
  std::string keyword = {};  ///< gpipe.GPipe's keyword argument ("chunks"), of train's rows only; else empty
  /// A bool's flag sets it to this (false: --no-shuffle clears `shuffle`).
  bool flag_sets = true;
  int values = 0;              ///< a list's number of values (betas: 2); 0: any
  bool shows_default = false;  ///< the help shows the default value
  std::string old_flag = {};   ///< a flag it was known by before, still taken
};

/// One setting of a training run: a row of train_settings().
using Setting = Field<TrainSettings>;
using SettingMember = FieldMember<TrainSettings>;

/// Every setting of a training run, in the order gpipe train --help lists them.
const std::vector<Setting>& train_settings();

/// The row `name`. Throws std::logic_error for a name no row has (a mistake in the library).
const Setting& find_setting(const std::string& name);

/// The rows of gpipe bench's flags, whose values are the library's sweep: those it shares with gpipe
/// train (`precision`, `checkpoint`, `micro_batches`, `devices`, ...) are train's rows over a sweep's
/// member (train_field), so their names, flags and checks are train's.
const std::vector<Field<BenchSweep>>& bench_fields();

/// Train's row `name` (find_setting) as a field of `Values` that takes `member`: its name, flag, check
/// (or `check`, where a command takes other values: bench's `schedule` no task), what a bool's flag
/// sets and a list's count; `help` (empty: the row's own); no keyword. A list `member` checks each
/// entry by the row.
template <typename Values>
Field<Values> train_field(const std::string& name, FieldMember<Values> member, std::string help = "",
                          std::optional<SettingCheck> check = std::nullopt);

/// The names of the schedules (schedule_names()) after `first`: {"task", "auto"} for gpipe train's.
std::vector<std::string> schedule_choices(const std::vector<std::string>& first);

namespace detail {
enum class FieldKind { kValue, kBool, kList };
std::string check_entries(const SettingCheck& check, int count, FieldKind kind, const std::string& text);
// The text of a value (a list's entries separated by commas) and the value of a checked text.
std::string text_of(bool value);
std::string text_of(int value);
std::string text_of(int64_t value);
std::string text_of(uint64_t value);
std::string text_of(double value);
std::string text_of(const std::string& value);
template <typename T>
std::string text_of(const std::vector<T>& values) {
  std::string out;
  for (const T& value : values) out += (out.empty() ? "" : ",") + text_of(value);
  return out;
}
void read_into(const std::string& text, bool& value);
void read_into(const std::string& text, int& value);
void read_into(const std::string& text, int64_t& value);
void read_into(const std::string& text, uint64_t& value);
void read_into(const std::string& text, double& value);
void read_into(const std::string& text, std::string& value);
std::vector<std::string> entries_of(const std::string& text);
template <typename T>
void read_into(const std::string& text, std::vector<T>& values) {
  values.clear();
  for (const std::string& entry : entries_of(text)) read_into(entry, values.emplace_back());
}
template <typename Values>
FieldKind kind_of(const Field<Values>& row) {
  return std::visit(
      [](auto member) {
        using Value = std::decay_t<decltype(std::declval<Values&>().*member)>;
        if constexpr (std::is_same_v<Value, bool>) return FieldKind::kBool;
        else if constexpr (std::is_same_v<Value, std::string> || std::is_arithmetic_v<Value>) return FieldKind::kValue;
        else return FieldKind::kList;
      },
      row.member);
}
}  // namespace detail

/// Whether `row` takes a list (its entries separated by commas).
template <typename Values>
bool is_list(const Field<Values>& row) {
  return detail::kind_of(row) == detail::FieldKind::kList;
}

/// "" where `row` takes `text`, else what is wrong with it ("must be at least 1 (got 0)"): a list's
/// entries each, separated by single commas ("3,,8" has an empty one), a bool "true" or "false".
template <typename Values>
std::string check_field(const Field<Values>& row, const std::string& text) {
  return detail::check_entries(row.check, row.values, detail::kind_of(row), text);
}

/// Throws std::invalid_argument "`precision` must be fp32, bf16 or fp16 (got fp8)" where `row` does not
/// take `text`.
template <typename Values>
void check_field_or_throw(const Field<Values>& row, const std::string& text) {
  if (const std::string wrong = check_field(row, text); !wrong.empty())
    throw std::invalid_argument("gpipe: `" + row.name + "` " + wrong);
}

/// The value `values` hold for `row`, as text (a list's entries separated by commas).
template <typename Values>
std::string field_text(const Field<Values>& row, const Values& values) {
  return std::visit([&](auto member) { return detail::text_of(values.*member); }, row.member);
}

/// Sets `row` in `values` to `text`, checked by the row first (check_field_or_throw).
template <typename Values>
void set_field(const Field<Values>& row, Values& values, const std::string& text) {
  check_field_or_throw(row, text);
  std::visit([&](auto member) { detail::read_into(text, values.*member); }, row.member);
}

/// set_field, and marks the setting given.
void set_setting(const Setting& setting, TrainSettings& settings, const std::string& text);

template <typename Values>
Field<Values> train_field(const std::string& name, FieldMember<Values> member, std::string help,
                          std::optional<SettingCheck> check) {
  const Setting& row = find_setting(name);
  Field<Values> field{row.name, row.flag, help.empty() ? row.help : std::move(help), member, check.value_or(row.check)};
  field.flag_sets = row.flag_sets;
  field.values = row.values;
  field.old_flag = row.old_flag;
  return field;
}

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
