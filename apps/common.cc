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

namespace {

// The library's option and argument names, as the command line's flags: gpipe train's settings first,
// then the rows of the other commands' tables (remember_flag) and the library's own options the flags set.
std::vector<std::pair<std::string, std::string>>& flag_names() {
  static std::vector<std::pair<std::string, std::string>> names = [] {
    std::vector<std::pair<std::string, std::string>> out;
    for (const Setting& row : train_settings()) out.emplace_back(row.name, row.flag);
    out.insert(out.end(), {{"stages", "--stages"}, {"verbose", "--verbose"},
                           {"deferred_batch_norm=false", "--batch-norm per-micro-batch"},
                           {"update_on_devices=false", "--update-after-step"}});
    return out;
  }();
  return names;
}

}  // namespace

void remember_flag(const std::string& name, const std::string& flag) {
  auto& names = flag_names();
  const auto known = std::find_if(names.begin(), names.end(), [&](const auto& f) { return f.first == name; });
  if (known == names.end())
    names.emplace_back(name, flag);
  else if (known->second != flag)  // two commands' rows of one name: a mistake in gpipe
    throw std::logic_error("gpipe: the flags' tables name `" + name + "` both " + known->second + " and " + flag);
}

std::string in_flags(const std::string& message) {
  const auto& flags = flag_names();
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

}  // namespace gpipe::cli
