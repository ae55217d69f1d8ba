// check.cc: the one place that throws gpipe's configuration errors, and how errors read.
#include "gpipe/check.h"

#include "gpipe/stage.h"

#include <torch/types.h>

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

bool& verbose_errors() {
  static bool verbose = false;
  return verbose;
}

std::string what_of(const std::exception& e) {
  std::string report;
  const std::string what = short_error(e, &report);
  if (verbose_errors() && !report.empty()) return report;
  return what + (report.find("Traceback of TorchScript") != std::string::npos
                     ? " (--verbose shows TorchScript's traceback)" : "");
}
}  // namespace gpipe
