// check.cc: the one place that throws gpipe's configuration errors.
#include "gpipe/check.h"

namespace gpipe {
namespace detail {

void throw_invalid_argument(const std::string& message) {
  throw std::invalid_argument("gpipe: " + message);
}

}  // namespace detail
}  // namespace gpipe
