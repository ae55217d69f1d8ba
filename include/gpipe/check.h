// check.h: one way to report bad input: a std::invalid_argument naming the value and the fix.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace gpipe {
namespace detail {

template <typename... Args>
std::string concat(Args&&... args) {
  std::ostringstream out;
  (out << ... << std::forward<Args>(args));
  return out.str();
}

[[noreturn]] void throw_invalid_argument(const std::string& message);

}  // namespace detail
}  // namespace gpipe

/// Throws std::invalid_argument("gpipe: " + message) unless `cond` holds.
/// The message is built from all the arguments, streamed in order, and should
/// name the offending value and say how to fix it:
///
///   GPIPE_CHECK(chunks >= 1, "chunks must be at least 1 (got ", chunks, ")");
#define GPIPE_CHECK(cond, ...)                                              \
  do {                                                                      \
    if (!(cond)) {                                                          \
      ::gpipe::detail::throw_invalid_argument(                              \
          ::gpipe::detail::concat(__VA_ARGS__));                            \
    }                                                                       \
  } while (false)
