// check.h: one way to report bad input: a std::invalid_argument naming the value and the fix.
#pragma once

#include <exception>
#include <sstream>
#include <stdexcept>
#include <string>
#include <algorithm>
#include <utility>
#include <vector>

namespace at {
class Tensor;
}  // namespace at

namespace gpipe {

/// Whether error messages carry libtorch's and TorchScript's whole reports
/// (`gpipe --verbose`); off by default.
bool& verbose_errors();

/// An exception's message as a user should first see it: without libtorch's C++
/// stack frames and without the code traceback that TorchScript puts above its
/// message. `report`, when given, receives the whole text (empty if nothing was left out).
std::string short_error(const std::exception& e, std::string* report = nullptr);

/// An exception's message for a person: short_error's, or with
/// verbose_errors() the whole report; notes a TorchScript traceback left out.
std::string what_of(const std::exception& e);

/// A tensor's shape as text: "[2, 3]".
std::string shape_text(const at::Tensor& t);

/// A tensor's dtype as libtorch and Python name it: "Double (float64)".
std::string dtype_text(const at::Tensor& t);

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
///   GPIPE_CHECK(micro_batches >= 1, "micro_batches must be at least 1 (got ", micro_batches, ")");
#define GPIPE_CHECK(cond, ...)                                              \
  do {                                                                      \
    if (!(cond)) {                                                          \
      ::gpipe::detail::throw_invalid_argument(                              \
          ::gpipe::detail::concat(__VA_ARGS__));                            \
    }                                                                       \
  } while (false)

namespace gpipe {

/// An error's message without the "gpipe: " it may begin with: to quote it inside another one.
inline std::string without_program_name(const std::string& what) {
  const std::string prefix = "gpipe: ";
  return what.rfind(prefix, 0) == 0 ? what.substr(prefix.size()) : what;
}

/// Throws std::invalid_argument unless each of `values` (an option's list, named `name`) is listed
/// once: a value listed twice would run or plan its configurations twice.
template <typename T>
void check_listed_once(const std::vector<T>& values, const std::string& name) {
  for (size_t i = 0; i < values.size(); ++i)
    GPIPE_CHECK(std::find(values.begin(), values.begin() + static_cast<std::ptrdiff_t>(i), values[i]) ==
                    values.begin() + static_cast<std::ptrdiff_t>(i),
                "`", name, "` lists ", values[i], " twice; give each value once");
}

}  // namespace gpipe
