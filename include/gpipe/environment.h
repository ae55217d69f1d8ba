// environment.h: gpipe's environment variables (GPIPE_*), read one way: empty is unset, and a value
// that is not one of the variable's choices is refused naming them.
#pragma once

#include <string>
#include <vector>

namespace gpipe {

/// The value of the environment variable `name`, "" when it is unset or empty.
std::string environment_value(const char* name);

/// The value of `name` when it is one of `choices`, "" when unset or empty; otherwise throws
/// std::invalid_argument: "gpipe: GPIPE_SHM=2 is not one of 0, 1 (<meaning>); unset it or give one
/// of them". `meaning` says what the choices do.
std::string environment_choice(const char* name, const std::vector<std::string>& choices,
                               const std::string& meaning);

}  // namespace gpipe
