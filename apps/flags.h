// flags.h: a table of settings (settings.h's Field rows) as a subcommand's flags: gpipe train's
// settings, bench's sweep, plan's and schedule's options are all declared as rows and added here.
#pragma once

#include "common.h"

#include <gpipe/settings.h>

#include <CLI/CLI.hpp>

#include <map>
#include <string>
#include <type_traits>
#include <variant>
#include <vector>

namespace gpipe::cli {

/// A list's values as given ("3,8", or "3 8" as two), by row name: each checked by the row's rule
/// (an empty entry, "3,,8", refused); joined by take_lists, which checks their number.
using ListValues = std::map<std::string, std::vector<std::string>>;

/// `row` as a flag of `sub` that fills its member of `values` (a `Values`, or a struct made from one):
/// its help in flags' words, its check, its default shown where the row says. A list's values go to
/// `lists`, for take_lists to set.
template <typename Values, typename Target>
CLI::Option* add_field(CLI::App* sub, Target& values, ListValues& lists, const Field<Values>& row) {
  static_assert(std::is_base_of_v<Values, Target>);
  remember_flag(row.name, row.flag);
  const std::string help = in_flags(row.help);
  const std::string names = row.flag + (row.old_flag.empty() ? "" : "," + row.old_flag);
  CLI::Option* option = std::visit(
      [&](auto member) -> CLI::Option* {
        auto& value = values.*member;
        using Value = std::decay_t<decltype(value)>;
        if constexpr (std::is_same_v<Value, bool>) {
          return sub->add_flag(row.flag_sets ? names : names + "{false}", value, help);
        } else if constexpr (std::is_arithmetic_v<Value> || std::is_same_v<Value, std::string>) {
          return sub->add_option(names, value, help);
        } else {
          return sub->add_option(names, lists[row.name], help)
              ->expected(1, -1)
              ->default_str(setting_text(row, static_cast<const Values&>(values)))
              ->check(CLI::Validator(
                  [entries = row](std::string& text) mutable {
                    entries.values = 0;  // each value given: its entries; the count, of them all
                    return check_setting(entries, text);
                  },
                  row.check.shape));
        }
      },
      row.member);
  if (row.check.check && !is_list(row)) option->check(validator(row.check));
  if (row.shows_default && !is_list(row)) option->capture_default_str();
  return option;
}

/// Adds every row of `rows` to `sub` (add_field); their help may name each other.
template <typename Values, typename Target>
void add_fields(CLI::App* sub, Target& values, ListValues& lists, const std::vector<Field<Values>>& rows) {
  for (const Field<Values>& row : rows) remember_flag(row.name, row.flag);
  for (const Field<Values>& row : rows) add_field(sub, values, lists, row);
}

/// Sets each list of `rows` given on the command line (in `lists`) in `values`, its values joined
/// ("--betas 0.9 0.99" is "--betas 0.9,0.99") and checked whole; returns the names of the rows given.
template <typename Values, typename Target>
std::vector<std::string> take_lists(const CLI::App* sub, Target& values, const ListValues& lists,
                                    const std::vector<Field<Values>>& rows, const std::string& command) {
  std::vector<std::string> given;
  for (const Field<Values>& row : rows) {
    if (sub->count(row.flag) == 0) continue;
    given.push_back(row.name);
    if (!lists.count(row.name)) continue;
    std::string text;
    for (const std::string& value : lists.at(row.name)) text += (text.empty() ? "" : ",") + value;
    if (const std::string wrong = check_setting(row, text); !wrong.empty())
      usage_error(row.flag + ": " + wrong + "; see gpipe " + command + " --help");
    set_field(row, static_cast<Values&>(values), text);
  }
  return given;
}

}  // namespace gpipe::cli
