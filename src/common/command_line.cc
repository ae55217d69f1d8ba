// command_line.cc: the command line as one string, as the settings ranks share, and the nearest
// name for "did you mean".
#include "gpipe/command_line.h"

#include <algorithm>

namespace gpipe {

std::string command_line(int argc, char** argv) {
  std::string out;
  for (int i = 0; i < argc; ++i) out += (i ? " " : "") + std::string(argv[i]);
  return out;
}

std::vector<std::pair<std::string, std::string>> settings_of_command_line(int argc, char** argv) {
  std::vector<std::pair<std::string, std::string>> settings;
  int positional = 0;
  bool after_flag = false;
  for (int i = 1; i < argc; ++i) {
    const std::string word = argv[i];
    if (word.size() > 2 && word.rfind("--", 0) == 0) {  // a flag, alone or with "=value"
      const size_t equals = word.find('=');
      settings.emplace_back(word.substr(0, equals), equals == std::string::npos ? "" : word.substr(equals + 1));
      after_flag = true;
    } else if (after_flag) {  // a value of the flag before
      std::string& value = settings.back().second;
      value += (value.empty() ? "" : " ") + word;
    } else {
      settings.emplace_back("word " + std::to_string(++positional), word);
    }
  }
  std::stable_sort(settings.begin(), settings.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  return settings;
}

namespace {

// The edit distance between two words.
size_t distance(const std::string& a, const std::string& b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diagonal = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t next = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diagonal = row[j];
      row[j] = next;
    }
  }
  return row[b.size()];
}

}  // namespace

std::string nearest_name(const std::string& word, const std::vector<std::string>& names) {
  std::string nearest;
  size_t best = 3;  // near misses only
  for (const std::string& name : names) {
    const size_t d = distance(word, name);
    if (d < best) best = d, nearest = name;
  }
  return nearest;
}

}  // namespace gpipe
