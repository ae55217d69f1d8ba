// main.cc: the gpipe program: GPipe pipeline-parallel training from the command line.
#include "commands.h"
#include "common.h"
#include "world.h"

#include <CLI/CLI.hpp>

#include <stdexcept>

int main(int argc, char** argv) {
  using namespace gpipe::cli;
  CLI::App app{"gpipe: train neural networks with GPipe pipeline parallelism"};
  app.require_subcommand(1);
  const std::string command = command_line(argc, argv);
  int status = 0;
  add_train_command(app, command, status);
  add_bench_command(app, command, status);
  add_schedule_command(app, command, status);
  // Errors come here after the run has unwound (its stage threads joined).
  // Under mpirun every rank runs the same command; an error on one ends them all.
  try {
    start_world(&argc, &argv);
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (world().size > 1 && e.get_exit_code() != 0) return fail(2, "gpipe: " + std::string(e.what()));
    return world().prints() ? app.exit(e) : e.get_exit_code();
  } catch (const std::invalid_argument& e) {
    return fail(2, e.what());
  } catch (const std::exception& e) {
    const std::string what = e.what();
    return fail(1, what.rfind("gpipe: ", 0) == 0 ? what : "gpipe: error: " + what);
  }
  return status;
}
