// pipeline_config.cc: PipelineConfig's fields, the one place they are written and read back.
#include "gpipe/pipeline_config.h"

#include "gpipe/check.h"

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <stdexcept>
#include <type_traits>

namespace gpipe {

bool PipelineConfig::operator==(const PipelineConfig& o) const {
  auto same_times = [](const std::vector<ActionTimes>& a, const std::vector<ActionTimes>& b) {
    if (a.size() != b.size()) return false;
    for (size_t s = 0; s < a.size(); ++s)
      if (a[s].forward != b[s].forward || a[s].input_grad != b[s].input_grad || a[s].weight_grad != b[s].weight_grad)
        return false;
    return true;
  };
  return schedule == o.schedule && devices == o.devices && virtual_stages == o.virtual_stages &&
         micro_batches == o.micro_batches && balance == o.balance && checkpoint == o.checkpoint &&
         same_times(stage_times, o.stage_times) && precision == o.precision;
}

namespace {

const std::vector<std::pair<Precision, std::string>>& precisions() {
  static const std::vector<std::pair<Precision, std::string>> all = {
      {Precision::kFloat32, "fp32"}, {Precision::kBFloat16, "bf16"}, {Precision::kFloat16, "fp16"}};
  return all;
}

}  // namespace

std::string to_string(Precision precision) {
  for (const auto& [p, name] : precisions())
    if (p == precision) return name;
  return "fp32";  // not reached
}

std::vector<std::string> precision_names() {
  std::vector<std::string> names;
  for (const auto& [p, name] : precisions()) names.push_back(name);
  return names;
}

Precision parse_precision(const std::string& text) {
  for (const auto& [p, name] : precisions())
    if (name == text) return p;
  GPIPE_CHECK(false, "`precision` must be fp32, bf16 or fp16 (got ", text, ")");
  return Precision::kFloat32;  // not reached
}

Fields fields_of(const PipelineConfig& c) {
  Fields out{{"schedule", to_string(c.schedule)},
             {"devices", int64_t{c.devices}},
             {"micro_batches", int64_t{c.micro_batches}},
             {"virtual_stages", int64_t{c.virtual_stages}},
             {"balance", std::vector<int64_t>(c.balance.begin(), c.balance.end())},
             {"checkpoint", to_string(c.checkpoint)},
             {"precision", to_string(c.precision)}};
  std::vector<double> times;  // F, I, W of each stage
  for (const ActionTimes& t : c.stage_times) times.insert(times.end(), {t.forward, t.input_grad, t.weight_grad});
  if (!times.empty()) out.emplace_back("stage_times", times);
  return out;
}

const FieldValue* find_field(const Fields& fields, const std::string& name) {
  for (const auto& [key, value] : fields)
    if (key == name) return &value;
  return nullptr;
}

namespace {

// The fields of one value read with the errors config_of promises, each naming `what`.
class FieldReader {
 public:
  FieldReader(const Fields& fields, std::string what) : fields_(fields), what_(std::move(what)) {}

  [[noreturn]] void fail(const std::string& problem) const { throw std::runtime_error(what_ + problem); }

  std::string name(const std::string& key) const {
    const FieldValue* v = find_field(fields_, key);
    if (v == nullptr || !std::holds_alternative<std::string>(*v)) fail(" has no " + key);
    return std::get<std::string>(*v);
  }

  int count(const std::string& key) const {
    const FieldValue* v = find_field(fields_, key);
    if (v == nullptr || !std::holds_alternative<int64_t>(*v)) fail(" has no " + key);
    const int64_t n = std::get<int64_t>(*v);
    if (n < 1 || n > (1 << 20)) fail("'s " + key + " is " + std::to_string(n));
    return static_cast<int>(n);
  }

  const FieldValue* find(const std::string& key) const { return find_field(fields_, key); }

 private:
  const Fields& fields_;
  std::string what_;
};

}  // namespace

PipelineConfig config_of(const Fields& fields, const std::string& what) {
  const FieldReader read(fields, what);
  PipelineConfig c;
  const std::string schedule = read.name("schedule"), checkpoint = read.name("checkpoint");
  const std::string precision = read.find("precision") != nullptr ? read.name("precision") : "fp32";
  try {
    c.schedule = parse_schedule(schedule);
    c.checkpoint = parse_checkpoint(checkpoint);
    c.precision = parse_precision(precision);
  } catch (const std::invalid_argument& e) {
    read.fail(": " + without_program_name(e.what()));
  }
  c.devices = read.count("devices");
  c.micro_batches = read.count("micro_batches");
  c.virtual_stages = read.count("virtual_stages");
  const FieldValue* balance = read.find("balance");
  if (balance == nullptr || !std::holds_alternative<std::vector<int64_t>>(*balance))
    read.fail(" has no balance (a list of whole numbers)");
  for (const int64_t layers : std::get<std::vector<int64_t>>(*balance)) {
    if (layers < 1 || layers > (1 << 20)) read.fail("'s balance holds " + std::to_string(layers));
    c.balance.push_back(static_cast<int>(layers));
  }
  if (c.balance.size() != static_cast<size_t>(c.devices) * static_cast<size_t>(c.virtual_stages))
    read.fail("'s balance has " + std::to_string(c.balance.size()) + " stages, not K·V");
  try {  // a pipeline that can run: its schedule takes its V, and its M on its K
    const ScheduleTraits& traits = schedule_traits(c.schedule);
    traits.check_virtual_stages(c.virtual_stages);
    traits.check_micro_batches(c.devices, c.micro_batches);
  } catch (const std::invalid_argument& e) {
    read.fail(" cannot have run: " + without_program_name(e.what()));
  }
  if (const FieldValue* value = read.find("stage_times")) {  // absent: the unit order
    std::vector<double> times;
    if (const auto* whole = std::get_if<std::vector<int64_t>>(value))
      times.assign(whole->begin(), whole->end());
    else if (const auto* real = std::get_if<std::vector<double>>(value))
      times = *real;
    else
      read.fail("'s stage_times is not a list of floats");
    if (times.size() != 3 * c.balance.size())
      read.fail("'s stage_times holds " + std::to_string(times.size()) + " times, not 3 for each of its " +
                std::to_string(c.balance.size()) + " stages");
    for (size_t n = 0; n < times.size(); n += 3) {
      for (size_t k = n; k < n + 3; ++k)
        if (!std::isfinite(times[k]) || times[k] < 0) read.fail("'s stage_times holds " + std::to_string(times[k]));
      c.stage_times.push_back({times[n], times[n + 1], times[n + 2]});
    }
  }
  return c;
}

namespace {

// A double as the 17 significant digits that read back to the same bits.
std::string exact(double value) {
  char text[32];
  std::snprintf(text, sizeof(text), "%.17g", value);
  return text;
}

template <typename T, typename Write>
std::string joined(const std::vector<T>& values, Write write) {
  std::string out;
  for (size_t n = 0; n < values.size(); ++n) out += (n ? "," : "") + write(values[n]);
  return out;
}

}  // namespace

// Each field as NAME:TYPE=VALUE (i a whole number, d a number, s a name, I and D lists of them),
// separated by spaces: names hold no space, so the line splits back where it was joined.
std::string text_of(const FieldValue& value) {
  const auto whole = [](int64_t n) { return std::to_string(n); };
  if (const auto* n = std::get_if<int64_t>(&value)) return whole(*n);
  if (const auto* x = std::get_if<double>(&value)) return exact(*x);
  if (const auto* ns = std::get_if<std::vector<int64_t>>(&value)) return joined(*ns, whole);
  if (const auto* xs = std::get_if<std::vector<double>>(&value)) return joined(*xs, exact);
  return std::get<std::string>(value);
}

std::string text_of(const Fields& fields) {
  std::string out;
  for (const auto& [name, value] : fields) {
    GPIPE_CHECK(name.find_first_of(" :=") == std::string::npos, "a field's name holds a space, ':' or '=': ", name);
    const auto* s = std::get_if<std::string>(&value);
    GPIPE_CHECK(s == nullptr || s->find(' ') == std::string::npos, "the field ", name, " holds a space: ", *s);
    const char kind = std::visit(
        [](const auto& v) {
          using T = std::decay_t<decltype(v)>;
          return std::is_same_v<T, int64_t> ? 'i' : std::is_same_v<T, double> ? 'd'
                 : std::is_same_v<T, std::string>                           ? 's'
                 : std::is_same_v<T, std::vector<int64_t>>                  ? 'I'
                                                                            : 'D';
        },
        value);
    out += (out.empty() ? "" : " ") + name + ":" + kind + "=" + text_of(value);
  }
  return out;
}

Fields fields_of_text(const std::string& text, const std::string& what) {
  const auto fail = [&](const std::string& word) -> void {
    throw std::runtime_error(what + " is not a pipeline's fields (at \"" + word.substr(0, 40) +
                             "\"): do the ranks run the same gpipe? install one build of it for every rank");
  };
  // A whole number or a number that is all of `word`, or fail.
  const auto whole = [&](const std::string& word) {
    char* end = nullptr;
    errno = 0;
    const long long n = std::strtoll(word.c_str(), &end, 10);
    if (word.empty() || *end != '\0' || errno != 0) fail(word);
    return static_cast<int64_t>(n);
  };
  const auto real = [&](const std::string& word) {
    char* end = nullptr;
    const double x = std::strtod(word.c_str(), &end);
    if (word.empty() || *end != '\0') fail(word);
    return x;
  };
  const auto list = [](const std::string& value, const auto& parse) {
    std::vector<decltype(parse(std::string()))> out;
    std::stringstream items(value);
    for (std::string item; std::getline(items, item, ',');) out.push_back(parse(item));
    return out;
  };
  Fields out;
  std::istringstream words(text);
  for (std::string word; words >> word;) {
    const size_t colon = word.find(':');
    if (colon == std::string::npos || word.size() < colon + 3 || word[colon + 2] != '=') fail(word);
    const std::string name = word.substr(0, colon), value = word.substr(colon + 3);
    switch (word[colon + 1]) {
      case 'i': out.emplace_back(name, whole(value)); break;
      case 'd': out.emplace_back(name, real(value)); break;
      case 's': out.emplace_back(name, value); break;
      case 'I': out.emplace_back(name, list(value, whole)); break;
      case 'D': out.emplace_back(name, list(value, real)); break;
      default: fail(word);
    }
  }
  return out;
}

std::string describe(const PipelineConfig& c) {
  std::string out = to_string(c.schedule);
  if (c.virtual_stages > 1) out += " (V=" + std::to_string(c.virtual_stages) + ")";
  out += ", M=" + std::to_string(c.micro_batches);
  if (c.checkpoint != Checkpoint::kNever) out += ", checkpoint " + to_string(c.checkpoint);
  if (c.precision != Precision::kFloat32) out += ", " + to_string(c.precision);
  return out;
}

}  // namespace gpipe
