// commands.h: the subcommands of the gpipe program.
#pragma once

#include <CLI/CLI.hpp>

#include <string>

namespace gpipe::cli {

// Each add_*_command registers a subcommand whose callback runs it and sets
// `status` to its exit status; errors are thrown to main().

/// `gpipe bench`: benchmark workloads through the pipeline.
void add_bench_command(CLI::App& app, const std::string& command, int& status);
/// `gpipe machine`: the CPU, the BLAS and its kernel, as gpipe sees them.
void add_machine_command(CLI::App& app, const std::string& command, int& status);
/// `gpipe plan`: predict the configurations that fit a model on a cluster, fastest first.
void add_plan_command(CLI::App& app, const std::string& command, int& status);
/// `gpipe schedule`: print a schedule's step program.
void add_schedule_command(CLI::App& app, const std::string& command, int& status);
/// `gpipe train`: train a model on Fashion-MNIST (the default) through the pipeline.
void add_train_command(CLI::App& app, const std::string& command, int& status);

}  // namespace gpipe::cli
