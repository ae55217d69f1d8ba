// fuzz_flags: the command line of gpipe train, bench, schedule and plan (lists such as --balance 3,2
// and --betas 0.9,0.99, numbers, sizes, names, seeds) as CLI11 and gpipe's validators read it,
// without running the command. An input is the arguments after `gpipe`, one per line.
// Promises: a bad command line is refused with CLI11's ParseError or gpipe's usage error
// (std::invalid_argument), never another exception, a crash or undefined behaviour.
#include "fuzz_input.h"

#include "commands.h"
#include "common.h"

#include <CLI/CLI.hpp>

#include <sstream>
#include <stdexcept>
#include <vector>

namespace {
// Thrown once every flag is read and checked, before the command runs: the top-level app's
// parse-complete callback runs before the subcommands' callbacks, which run the command.
struct Parsed {};
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::vector<std::string> args{"gpipe"};
  std::istringstream lines(gpipe::fuzz::as_string(data, size));
  for (std::string line; std::getline(lines, line);) args.push_back(line);
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());

  CLI::App app{"gpipe"};
  app.require_subcommand(1);
  app.fallthrough();
  bool verbose = false;
  app.add_flag("--verbose", verbose);
  int status = 0;
  gpipe::cli::add_train_command(app, "", status);
  gpipe::cli::add_bench_command(app, "", status);
  gpipe::cli::add_schedule_command(app, "", status);
  gpipe::cli::add_plan_command(app, "", status);
  app.parse_complete_callback([] { throw Parsed(); });
  try {
    app.parse(static_cast<int>(argv.size()), argv.data());
    gpipe::fuzz::promise(false, "a command line that parses reaches the parse-complete callback");
  } catch (const Parsed&) {
  } catch (const CLI::ParseError&) {
  } catch (const std::invalid_argument&) {
  }
  const gpipe::Setting& seed = gpipe::find_setting("seed");  // its check, on any text
  for (size_t i = 1; i < args.size(); ++i) gpipe::check_field(seed, args[i]);
  return 0;
}
