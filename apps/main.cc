// main.cc: the gpipe program: GPipe pipeline-parallel training from the command line.
#include "commands.h"
#include "common.h"

#include <gpipe/gpipe.h>

#include <CLI/CLI.hpp>

#include <cstdlib>
#include <iostream>
#include <regex>
#include <stdexcept>
#include <vector>

namespace {

// The first argument that is not an option: the command the user typed, or "".
std::string command_word(int argc, char** argv) {
  for (int i = 1; i < argc; ++i)
    if (argv[i][0] != '-') return argv[i];
  return "";
}

// For a command gpipe does not have: a message with the nearest one.
std::string unknown_command(const CLI::App& app, const std::string& word) {
  std::vector<std::string> names;
  std::string all;
  for (const CLI::App* sub : app.get_subcommands({})) {
    names.push_back(sub->get_name());
    all += (all.empty() ? "" : ", ") + sub->get_name();
  }
  const std::string nearest = gpipe::nearest_name(word, names);
  return "gpipe: unknown command '" + word + "'" + (nearest.empty() ? "" : "; did you mean '" + nearest + "'?") +
         " (commands: " + all + ")";
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
  if (n == "1" && m[2].str() == "Most")  // a flag of one value given again: --stages 2 --stages 3
    return m[1].str() + ": given " + m[4].str() + " times; give it once; see gpipe " + (command.empty() ? "" : command + " ") +
           "--help";
  return m[1].str() + ": takes " + n + " values separated by commas (got " + m[4].str() + "); see gpipe " +
         (command.empty() ? "" : command + " ") + "--help";
}

// Whether this process is the first (or only) of its job, by what mpirun and torchrun set before it
// starts: the one that prints what the whole job does alike.
bool first_process() {
  for (const char* name : {"OMPI_COMM_WORLD_RANK", "PMI_RANK", "RANK"})
    if (const char* rank = std::getenv(name); rank != nullptr && *rank != '\0') return std::string(rank) == "0";
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace gpipe;
  using namespace gpipe::cli;
  // First, before any work: the BLAS kernel this CPU deserves (blas.h), starting again with it if needed.
  try {
    if (const std::string line = run_with_best_blas_kernel(argv); !line.empty() && first_process())
      std::cerr << line << "\n";
  } catch (const std::exception& e) {  // every process of a job refuses alike: the first says why
    if (first_process()) std::cerr << e.what() << "\n";
    return 2;
  }
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
  add_machine_command(app, command, status);
  // Errors come here after the run has unwound (its device threads joined).
  // Under mpirun every rank runs the same command; an error on one ends them all.
  try {
    start_job(&argc, &argv);
    check_same_settings(settings_of_command_line(argc, argv), "give every rank the same command line");
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
  } catch (const StageError& e) {
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
