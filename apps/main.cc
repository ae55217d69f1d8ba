// main.cc: the gpipe program: GPipe pipeline-parallel training from the command line.
#include "commands.h"
#include "common.h"
#include "world.h"

#include <CLI/CLI.hpp>

#include <iostream>
#include <stdexcept>

int main(int argc, char** argv) {
  CLI::App app{"gpipe: train neural networks with GPipe pipeline parallelism"};
  app.require_subcommand(1);
  const std::string command = gpipe::cli::command_line(argc, argv);
  gpipe::cli::add_train_command(app, command);
  gpipe::cli::add_bench_command(app, command);
  gpipe::cli::add_schedule_command(app, command);
  // Under mpirun every rank runs the same command; an error on one ends them all.
  try {
    gpipe::cli::start_world(&argc, &argv);
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (gpipe::cli::world().size > 1 && e.get_exit_code() != 0) gpipe::cli::fail(2, "gpipe: " + std::string(e.what()));
    return gpipe::cli::world().prints() ? app.exit(e) : e.get_exit_code();
  } catch (const std::invalid_argument& e) {
    gpipe::cli::fail(2, e.what());
  } catch (const std::exception& e) {
    const std::string what = e.what();
    gpipe::cli::fail(1, what.rfind("gpipe: ", 0) == 0 ? what : "gpipe: error: " + what);
  }
  return 0;
}
