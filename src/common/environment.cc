// environment.cc: gpipe's environment variables, read one way.
#include "gpipe/environment.h"

#include "gpipe/check.h"

#include <algorithm>
#include <cstdlib>

namespace gpipe {

std::string environment_value(const char* name) {
  const char* value = std::getenv(name);
  return value == nullptr ? "" : value;
}

std::string environment_choice(const char* name, const std::vector<std::string>& choices,
                               const std::string& meaning) {
  const std::string value = environment_value(name);
  if (value.empty() || std::find(choices.begin(), choices.end(), value) != choices.end()) return value;
  std::string listed;
  for (const std::string& choice : choices) listed += (listed.empty() ? "" : ", ") + choice;
  GPIPE_CHECK(false, name, "=", value, " is not one of ", listed, " (", meaning, "); unset it or give one of them");
  return value;
}

}  // namespace gpipe
