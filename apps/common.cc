// common.cc: helpers shared by the gpipe subcommands.
#include "common.h"

#include <algorithm>
#include <iomanip>
#include <sstream>

namespace gpipe::cli {

std::string fixed(double value, int digits) {
  std::ostringstream out;
  out << std::fixed << std::setprecision(digits) << value;
  return out.str();
}

void usage_error(const std::string& message) { throw UsageError("gpipe: " + in_flags(message)); }

std::string in_flags(const std::string& message) {
  // The library's option and argument names, as the command line's flags.
  static const std::vector<std::pair<std::string, std::string>> flags = [] {
    std::vector<std::pair<std::string, std::string>> out;
    for (const Setting& row : train_settings()) out.emplace_back(row.name, row.flag);
    // The words of gpipe bench's and plan's options, and of the library's own options the flags set.
    out.insert(out.end(), {{"stages", "--stages"}, {"tie_embeddings", "--tie-embeddings"}, {"verbose", "--verbose"},
                           {"deferred_batch_norm=false", "--batch-norm per-micro-batch"},
                           {"update_on_devices=false", "--update-after-step"}, {"input_shape", "--input-shape"},
                           {"input_tokens", "--input-tokens"}, {"workload", "--workload"}, {"layers", "--layers"},
                           {"width", "--width"}});
    return out;
  }();
  std::string out;
  size_t at = 0;
  while (at < message.size()) {
    const size_t open = message.find('`', at), close = open == std::string::npos ? open : message.find('`', open + 1);
    if (close == std::string::npos) break;
    const std::string name = message.substr(open + 1, close - open - 1);
    const auto flag = std::find_if(flags.begin(), flags.end(), [&](const auto& f) { return f.first == name; });
    out += message.substr(at, open - at) + (flag == flags.end() ? message.substr(open, close - open + 1) : flag->second);
    at = close + 1;
  }
  return out + message.substr(std::min(at, message.size()));
}

std::string without_prefix(const std::string& message) {
  const std::string prefix = "gpipe: ";
  return message.rfind(prefix, 0) == 0 ? message.substr(prefix.size()) : message;
}

CLI::Validator validator(const SettingCheck& check) {
  return CLI::Validator([check](std::string& text) { return check.check(text); }, check.shape);
}

CLI::Validator at_least(int64_t least, int64_t most) { return validator(whole_number(least, most)); }
CLI::Validator in_range(double least, double most, bool whole) { return validator(number_in(least, most, whole)); }
CLI::Validator one_of(const std::vector<std::string>& choices, const std::string& meaning) {
  return validator(gpipe::one_of(choices, meaning));
}


}  // namespace gpipe::cli
