// flags.h: a table of settings (settings.h's Field rows) as a subcommand's flags: gpipe train's
// settings, bench's sweep, plan's and schedule's options are all declared as rows and added here.
#pragma once

#include "common.h"

#include <gpipe/settings.h>

#include <CLI/CLI.hpp>

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <type_traits>
#include <variant>
#include <vector>

namespace gpipe::cli {

namespace detail {

// A list's values as given ("3,8", or "3 8" as two), by row name: each checked by the row's rule (an
// empty entry, "3,,8", or an empty value refused) as it is read; joined once the command is parsed.
using ListValues = std::map<std::string, std::vector<std::string>>;

// `row` as a flag of `sub` that fills its member of `values`, or, for a list, its entry of `lists`.
template <typename Values, typename Target>
void add_field(CLI::App* sub, Target& values, ListValues& lists, const Field<Values>& row) {
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
              ->type_name("LIST")
              ->default_str(field_text(row, static_cast<const Values&>(values)))
              ->check(CLI::Validator(
                  [entries = row](std::string& text) mutable {
                    if (text.empty()) return std::string("needs a value: one or more, separated by commas");
                    entries.values = 0;  // each value given: its entries; the count, of them all
                    return check_field(entries, text);
                  },
                  row.check.shape));
        }
      },
      row.member);
  if (row.check.check && !is_list(row)) option->check(validator(row.check));
  if (row.shows_default && !is_list(row)) option->capture_default_str();
}

}  // namespace detail

/// After parsing: sets the lists given in their members (their values joined, "--betas 0.9 0.99" as
/// "--betas 0.9,0.99", and checked whole) and returns the names of the rows given.
using TakeFlags = std::function<std::vector<std::string>()>;

/// Adds every row of `rows` to `sub` as a flag that fills its member of `values` (a `Values`, or a
/// struct made from one; it must outlive `sub`'s parsing): its help in flags' words (the rows may name
/// each other), its check, its default shown where the row says (a list's always). The command's
/// callback calls what it returns before reading `values`; `command` names it in errors.
template <typename Values, typename Target>
[[nodiscard]] TakeFlags add_fields(CLI::App* sub, Target& values, const std::vector<Field<Values>>& rows,
                                   const std::string& command) {
  static_assert(std::is_base_of_v<Values, Target>);
  for (const Field<Values>& row : rows) remember_flag(row.name, row.flag);
  auto lists = std::make_shared<detail::ListValues>();
  for (const Field<Values>& row : rows) detail::add_field(sub, values, *lists, row);
  return [sub, &values, lists, rows, command] {
    std::vector<std::string> given;
    for (const Field<Values>& row : rows) {
      if (sub->count(row.flag) == 0) continue;
      given.push_back(row.name);
      if (!lists->count(row.name)) continue;
      std::string text;
      for (const std::string& value : lists->at(row.name)) text += (text.empty() ? "" : ",") + value;
      if (const std::string wrong = check_field(row, text); !wrong.empty())
        usage_error(row.flag + ": " + wrong + "; see gpipe " + command + " --help");
      set_field(row, static_cast<Values&>(values), text);
    }
    return given;
  };
}

}  // namespace gpipe::cli
