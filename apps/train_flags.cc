// train_flags.cc: `gpipe train`'s flags, their help and their checks that need no file.
#include "commands.h"
#include "common.h"
#include "train.h"

#include <CLI/CLI.hpp>

#include <csignal>
#include <type_traits>
#include <variant>
#include <map>
#include <memory>
#include <string>

namespace gpipe::cli {

namespace {

// A list's values as given ("3,8", or "3 8" as two): each checked by the row's rule, an empty entry
// ("3,,8") refused; their number is checked once they are joined (list_text).
using ListValues = std::map<std::string, std::vector<std::string>>;

// A row of the settings' table (settings.h) as a flag of `sub` that fills its member of `o`: its
// help in flags' words, its check, its default shown where the row says. A list's values go to
// `lists`, which the callback joins for the library to read whole (set_setting).
void add_setting(CLI::App* sub, TrainOptions& o, ListValues& lists, const Setting& row) {
  const std::string help = in_flags(row.help);
  const std::string names = row.flag + (row.old_flag.empty() ? "" : "," + row.old_flag);
  CLI::Option* option = std::visit(
      [&](auto member) -> CLI::Option* {
        auto& value = o.*member;
        using Value = std::decay_t<decltype(value)>;
        if constexpr (std::is_same_v<Value, bool>)
          return sub->add_flag(row.flag_sets ? names : names + "{false}", value, help);
        else if constexpr (std::is_same_v<Value, std::vector<int>> || std::is_same_v<Value, std::vector<double>>)
          return sub->add_option(names, lists[row.name], help)
              ->expected(1, -1)
              ->default_str(setting_text(row, o))
              ->check(CLI::Validator(
                  [entries = Setting(row)](std::string& text) mutable {
                    entries.values = 0;  // each value given: its entries; the count, of them all
                    return check_setting(entries, text);
                  },
                  row.check.shape));
        else
          return sub->add_option(names, value, help);
      },
      row.member);
  if (row.check.check && lists.count(row.name) == 0) option->check(validator(row.check));
  if (row.shows_default) option->capture_default_str();
}

}  // namespace

void add_train_command(CLI::App& app, const std::string&, int& status) {
  auto o = std::make_shared<TrainOptions>();
  auto lists = std::make_shared<ListValues>();
  CLI::App* sub = app.add_subcommand(
      "train", "Train through a GPipe pipeline: a CNN on Fashion-MNIST by default, or --model/--data from Python");
  for (const Setting& row : train_settings()) add_setting(sub, *o, *lists, row);
  sub->add_flag("--json", o->json, "print the summary as JSON on standard output (progress stays on standard error)");
  sub->callback([o, lists, sub, &status] {
    // A closed standard output (gpipe train ... | head) stops the printing, not the training; SIGINT
    // and SIGTERM end the run, no half-written file left (with --save, train_run.cc stops it saved).
    std::signal(SIGPIPE, SIG_IGN);
    install_signal_handlers(OnSignal::kEndNow);
    o->given.clear();  // what the command line names, whatever the library's defaults take as given
    for (const Setting& row : train_settings())
      if (sub->count(row.flag) > 0) {
        if (lists->count(row.name)) {  // the values given, one list: "--betas 0.9 0.99" is "--betas 0.9,0.99"
          std::string text;
          for (const std::string& value : lists->at(row.name)) text += (text.empty() ? "" : ",") + value;
          if (const std::string wrong = check_setting(row, text); !wrong.empty())
            usage_error(row.flag + ": " + wrong + "; see gpipe train --help");
          set_setting(row, *o, text);
        }
        o->given.insert(row.name);
      }
    status = run_train(*o);
  });
}

}  // namespace gpipe::cli
