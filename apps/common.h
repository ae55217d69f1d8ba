// common.h: what the gpipe subcommands share: machine description, statistics, list parsing.
#pragma once

#include <nlohmann/json.hpp>
#include <torch/types.h>

#include <string>
#include <vector>

namespace gpipe::cli {

/// Cores, BLAS and libtorch version, for result files.
nlohmann::json machine();

double median(std::vector<double> values);

/// The command line as one string, for result files.
std::string command_line(int argc, char** argv);

/// Drops every parameter's grad (cheaper than zeroing: the next step writes fresh ones).
void clear_grads(const std::vector<torch::Tensor>& params);

/// A clear one-line error for the user, then exit code 2.
[[noreturn]] void usage_error(const std::string& message);

}  // namespace gpipe::cli
