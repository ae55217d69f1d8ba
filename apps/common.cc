// common.cc: helpers shared by the gpipe subcommands.
#include "common.h"

#include "world.h"

#include <gpipe/device.h>
#include <torch/torch.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <thread>

namespace gpipe::cli {

nlohmann::json machine() {
  std::string cpu = "unknown";
  std::ifstream info("/proc/cpuinfo");
  for (std::string line; std::getline(info, line);)
    if (line.rfind("model name", 0) == 0) {
      cpu = line.substr(line.find(':') + 2);
      break;
    }
  return {{"cores", std::thread::hardware_concurrency()},
          {"cpu", cpu},
          {"blas", gpipe::blas_info()},
          {"malloc", gpipe::keep_freed_memory() ? "glibc, freed memory kept (trim 256 MiB, mmap 32 MiB, top pad 64 MiB)"
                                                : "as the environment or the C library sets it"},
          {"libtorch", TORCH_VERSION},
          {"cuda", torch::cuda::is_available()}};
}

double median(std::vector<double> values) {
  if (values.empty()) return 0;
  std::sort(values.begin(), values.end());
  const size_t n = values.size();
  return n % 2 ? values[n / 2] : 0.5 * (values[n / 2 - 1] + values[n / 2]);
}

std::string command_line(int argc, char** argv) {
  std::string out;
  for (int i = 0; i < argc; ++i) out += (i ? " " : "") + std::string(argv[i]);
  return out;
}

void clear_grads(const std::vector<torch::Tensor>& params) {
  for (auto p : params) p.mutable_grad() = torch::Tensor();
}

void usage_error(const std::string& message) { throw UsageError("gpipe: " + message); }

}  // namespace gpipe::cli
