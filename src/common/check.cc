// check.cc: the one place that throws gpipe's configuration errors, and how errors read.
#include "gpipe/check.h"

#include <c10/util/Exception.h>
#include <torch/types.h>

#include <cctype>
#include <cstdlib>
#include <iomanip>
#include <sstream>

namespace gpipe {
namespace detail {

void throw_invalid_argument(const std::string& message) {
  throw std::invalid_argument("gpipe: " + message);
}

}  // namespace detail

std::string shape_text(const torch::Tensor& t) {
  std::ostringstream out;
  out << t.sizes();
  return out.str();
}

std::string dtype_text(const torch::Tensor& t) {
  const std::string name = c10::toString(t.scalar_type());
  const std::string python = t.scalar_type() == torch::kDouble     ? "float64"
                             : t.scalar_type() == torch::kHalf     ? "float16"
                             : t.scalar_type() == torch::kBFloat16 ? "bfloat16"
                             : t.scalar_type() == torch::kByte     ? "uint8"
                             : t.scalar_type() == torch::kFloat    ? "float32"
                                                                   : "";
  return python.empty() ? name : name + " (" + python + ")";
}

bool& verbose_errors() {
  static bool verbose = false;
  return verbose;
}

std::string short_error(const std::exception& e, std::string* report) {
  const auto* error = dynamic_cast<const c10::Error*>(&e);
  std::string what = error ? error->what_without_backtrace() : e.what();
  if (report != nullptr) *report = error ? e.what() : "";
  // libtorch's allocator: "[enforce fail at alloc_cpu.cpp:75] err == 0. DefaultCPUAllocator: can't
  // allocate memory: you tried to allocate N bytes. Error code 12 (...)".
  const std::string alloc = "you tried to allocate ";
  if (what.find("can't allocate memory") != std::string::npos && what.find(alloc) != std::string::npos) {
    const std::string bytes = what.substr(what.find(alloc) + alloc.size());
    const double n = std::strtod(bytes.c_str(), nullptr);
    std::ostringstream out;
    out << "out of memory: a tensor of " << std::setprecision(3) << n / (1024.0 * 1024 * 1024)
        << " GiB does not fit in this machine's memory";
    if (report != nullptr && report->empty()) *report = what;
    return out.str();
  }
  // TorchScript's interpreter: the serialized and the Python code, then the message on the last line.
  if (what.find("Traceback of TorchScript") == std::string::npos) return what;
  if (report != nullptr && report->empty()) *report = what;
  while (!what.empty() && std::isspace(static_cast<unsigned char>(what.back()))) what.pop_back();
  std::string last = what.substr(what.find_last_of('\n') + 1);
  for (const std::string prefix : {"RuntimeError: ", "Exception: "})
    if (last.rfind(prefix, 0) == 0) last = last.substr(prefix.size());
  return last;
}

std::string what_of(const std::exception& e) {
  std::string report;
  const std::string what = short_error(e, &report);
  if (verbose_errors() && !report.empty()) return report;
  return what + (report.find("Traceback of TorchScript") != std::string::npos
                     ? " (`verbose` shows TorchScript's traceback)" : "");
}
}  // namespace gpipe
