// main.cc: the gpipe program: GPipe pipeline-parallel training from the command line.
#include "commands.h"
#include "common.h"

#include <CLI/CLI.hpp>

#include <iostream>
#include <stdexcept>

int main(int argc, char** argv) {
  CLI::App app{"gpipe: train neural networks with GPipe pipeline parallelism"};
  app.require_subcommand(1);
  const std::string command = gpipe::cli::command_line(argc, argv);
  gpipe::cli::add_train_command(app, command);
  gpipe::cli::add_bench_command(app, command);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const std::invalid_argument& e) {
    std::cerr << e.what() << "\n";
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "gpipe: error: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
