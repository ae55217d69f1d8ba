// main.cc: the gpipe program: GPipe pipeline-parallel training from the command line.
#include "commands.h"
#include "common.h"
#include <gpipe/gpipe.h>

#include <gpipe/stage.h>

#include <CLI/CLI.hpp>


#include <algorithm>
#include <regex>
#include <stdexcept>
#include <vector>

namespace {

// The edit distance between two words, for "did you mean".
size_t distance(const std::string& a, const std::string& b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diagonal = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t next = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diagonal = row[j];
      row[j] = next;
    }
  }
  return row[b.size()];
}

// The first argument that is not an option: the command the user typed, or "".
std::string command_word(int argc, char** argv) {
  for (int i = 1; i < argc; ++i)
    if (argv[i][0] != '-') return argv[i];
  return "";
}

// The command line as the settings every rank of an MPI job must share: every word, in order, named
// by itself when it is a flag and by the flag before it when it is a value (--micro-batches = 8).
std::vector<std::pair<std::string, std::string>> settings_of_command(int argc, char** argv) {
  std::vector<std::pair<std::string, std::string>> settings;
  for (int i = 1; i < argc; ++i) {
    const std::string word = argv[i], before = i > 1 ? argv[i - 1] : "";
    const bool flag = word.rfind("--", 0) == 0;
    settings.emplace_back(flag ? word.substr(0, word.find('='))
                          : before.rfind("--", 0) == 0 ? before : "word " + std::to_string(i),
                          flag && word.find('=') != std::string::npos ? word.substr(word.find('=') + 1) : word);
  }
  return settings;
}

// For a command gpipe does not have: a message with the nearest one.
std::string unknown_command(const CLI::App& app, const std::string& word) {
  std::string names, nearest;
  size_t best = 3;  // suggest only near misses
  for (const CLI::App* sub : app.get_subcommands({})) {
    names += (names.empty() ? "" : ", ") + sub->get_name();
    const size_t d = distance(word, sub->get_name());
    if (d < best) best = d, nearest = sub->get_name();
  }
  return "gpipe: unknown command '" + word + "'" + (nearest.empty() ? "" : "; did you mean '" + nearest + "'?") +
         " (commands: " + names + ")";
}

// CLI11's own words for a count of values, with the flag: "--betas: At Most 2 required but
// received 3" becomes "--betas: takes 2 values separated by commas (got 3); see gpipe train --help".
// Other messages are returned as they are.
std::string readable(const std::string& message, const std::string& command) {
  static const std::regex count(R"(^(--[A-Za-z0-9-]+): At (Most|least) (\d+) required but received (\d+)$)");
  static const std::regex conversion(R"(^Could not convert: (--[A-Za-z0-9-]+) = (.*)$)");
  std::smatch m;
  if (std::regex_match(message, m, conversion))
    return m[1].str() + ": cannot take " + m[2].str() + " (not a number of its kind, or out of its range); see gpipe " +
           (command.empty() ? "" : command + " ") + "--help";
  if (!std::regex_match(message, m, count)) return message;
  const std::string n = m[3].str();
  return m[1].str() + ": takes " + n + (n == "1" ? " value" : " values") +
         (n == "1" ? "" : " separated by commas") + " (got " + m[4].str() + "); see gpipe " +
         (command.empty() ? "" : command + " ") + "--help";
}

}  // namespace

int main(int argc, char** argv) {
  using namespace gpipe::cli;
  using gpipe::check_same_settings;
  using gpipe::end_job;
  using gpipe::job;
  using gpipe::start_job;
  using gpipe::verbose_errors;
  using gpipe::what_of;
  CLI::App app{"gpipe: train neural networks with GPipe pipeline parallelism"};
  app.require_subcommand(1);
  app.fallthrough();  // --verbose after the command too
  bool& verbose = verbose_errors();
  app.add_flag("--verbose", verbose, "on errors from libtorch, also print its full report with C++ stack frames");
  const std::string command = command_line(argc, argv);
  int status = 0;
  add_train_command(app, command, status);
  add_bench_command(app, command, status);
  add_schedule_command(app, command, status);
  add_plan_command(app, command, status);
  // Errors come here after the run has unwound (its device threads joined).
  // Under mpirun every rank runs the same command; an error on one ends them all.
  try {
    start_job(&argc, &argv);
    check_same_settings(settings_of_command(argc, argv), "give every rank the same command line");
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const std::string word = command_word(argc, argv);
    std::string message = readable(e.what(), word);
    if (message != e.what()) return end_job(2, "gpipe: " + message);
    if (!word.empty() && app.get_subcommands([&word](CLI::App* s) { return s->get_name() == word; }).empty() &&
        app.get_subcommands().empty())
      message = unknown_command(app, word);
    else
      message = "gpipe: " + message;
    if (job().size > 1 && e.get_exit_code() != 0) return end_job(2, message);
    if (e.get_exit_code() == 0 || message.rfind("gpipe: unknown command", 0) != 0)
      return (job().prints() ? app.exit(e) : e.get_exit_code()) == 0 ? 0 : 2;
    return end_job(2, message);
  } catch (const gpipe::StageError& e) {
    return end_job(1, verbose && !e.backtrace().empty() ? std::string(e.what()) + "\nlibtorch's report:\n" + e.backtrace()
                                                     : e.what());
  } catch (const std::invalid_argument& e) {
    return end_job(2, in_flags(e.what()));
  } catch (const std::exception& e) {  // libtorch's C++ stack only with --verbose (what_of)
    const std::string what = in_flags(what_of(e));  // the library's option names as flags
    return end_job(1, what == without_prefix(what) ? "gpipe: error: " + what : what);
  }
  return status;
}
