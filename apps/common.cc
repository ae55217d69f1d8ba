// common.cc: helpers shared by the gpipe subcommands.
#include "common.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <functional>
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
  static const std::vector<std::pair<std::string, std::string>> flags = {
      {"balance", "--balance"}, {"devices", "--stages"}, {"stages", "--stages"}, {"micro_batches", "--micro-batches"},
      {"virtual_stages", "--virtual-stages"}, {"schedule", "--schedule"}, {"checkpoint", "--checkpoint"},
      {"threads_per_device", "--threads-per-stage"}, {"batch_size", "--batch-size"}, {"epochs", "--epochs"},
      {"steps", "--steps"}, {"seed", "--seed"}, {"lr", "--lr"}, {"momentum", "--momentum"},
      {"nesterov", "--nesterov"}, {"weight_decay", "--weight-decay"}, {"betas", "--betas"},
      {"clip_grad_norm", "--clip-grad-norm"}, {"drop_last", "--drop-last"}, {"optimizer", "--optimizer"},
      {"loss", "--loss"}, {"data_dir", "--data-dir"}, {"save", "--save"}, {"save_every", "--save-every"},
      {"resume", "--resume"}, {"per_device_files", "--per-device-files"}, {"temperature", "--temperature"},
      {"bytes", "--generate"}, {"lr_schedule", "--lr-schedule"}, {"warmup_steps", "--warmup-steps"},
      {"lr_step_size", "--lr-step-size"}, {"lr_gamma", "--lr-gamma"}, {"shuffle", "--no-shuffle"},
      {"augment", "--augment"}, {"balance_by", "--balance-by"}, {"tie_embeddings", "--tie-embeddings"},
      {"model", "--model"}, {"verbose", "--verbose"}, {"deferred_batch_norm=false", "--batch-norm per-micro-batch"},
      {"update_on_devices=false", "--update-after-step"},
      {"input_shape", "--input-shape"}, {"input_tokens", "--input-tokens"}, {"workload", "--workload"}, {"layers", "--layers"}, {"width", "--width"},
      {"data", "--data"}, {"train_samples", "--train-samples"}, {"test_samples", "--test-samples"},
      {"samples", "--samples"}, {"prompt", "--prompt"}, {"trace", "--trace"}};
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

CLI::Validator at_least(int64_t least, int64_t most) {
  return CLI::Validator(
      [least, most](std::string& text) {
        int64_t value = 0;
        if (!CLI::detail::lexical_cast(text, value))
          return "must be one whole number" + std::string(least > 0 ? ", at least " + std::to_string(least) : "") +
                 " (got " + text + ")";
        if (value < least) return "must be at least " + std::to_string(least) + " (got " + text + ")";
        // Past the flag's type (an int, unless said): CLI11 would say "Could not convert".
        if (value > most)
          return "must be a whole number from " + std::to_string(least) + " to " + std::to_string(most) + " (got " +
                 text + ")";
        return std::string();
      },
      least > 0 ? "INT>=" + std::to_string(least) : "INT>=0");
}

namespace {
// A finite number (a whole one with `whole`) that is `ok`; else "must be <rule> (got <text>)".
CLI::Validator number_check(const std::string& rule, const std::string& name, std::function<bool(double)> ok,
                            bool whole = false) {
  return CLI::Validator(
      [rule, ok, whole](std::string& text) {
        double value = 0;
        int64_t integer = 0;
        const bool read = whole ? CLI::detail::lexical_cast(text, integer) : CLI::detail::lexical_cast(text, value);
        if (whole) value = static_cast<double>(integer);
        if (!read || !std::isfinite(value) || !ok(value)) return "must be " + rule + " (got " + text + ")";
        return std::string();
      },
      name);
}

std::string shown(double value) {
  std::ostringstream out;
  out << value;
  return out.str();
}
}  // namespace

CLI::Validator positive_number() {
  return number_check("a finite number above 0", "NUMBER>0", [](double v) { return v > 0; });
}

CLI::Validator non_negative_number() {
  return number_check("a finite number, 0 or more", "NUMBER>=0", [](double v) { return v >= 0; });
}

CLI::Validator fraction_below_one() {
  return number_check("a number from 0 up to, not including, 1", "[0,1)", [](double v) { return v >= 0 && v < 1; });
}

CLI::Validator in_range(double least, double most, bool whole) {
  return number_check(std::string(whole ? "a whole number" : "a number") + " from " + shown(least) + " to " + shown(most),
                      "[" + shown(least) + "," + shown(most) + "]",
                      [least, most](double v) { return v >= least && v <= most; }, whole);
}

CLI::Validator one_of(const std::vector<std::string>& choices, const std::string& meaning) {
  std::string rule, all;
  for (size_t n = 0; n < choices.size(); ++n) {
    rule += (n == 0 ? "" : n + 1 == choices.size() ? " or " : ", ") + choices[n];
    all += (n == 0 ? "" : ",") + choices[n];
  }
  rule = "must be " + rule + (meaning.empty() ? "" : " (" + meaning + ")");
  return CLI::Validator(
      [rule, choices](std::string& text) {
        return std::find(choices.begin(), choices.end(), text) != choices.end() ? std::string() : rule + "; got " + text;
      },
      "{" + all + "}");
}

CLI::Validator non_empty() {
  return CLI::Validator(
      [](std::string& text) { return text.empty() ? std::string("needs a name: it is empty") : std::string(); },
      "PATH");
}

uint64_t parse_seed(const std::string& text) {
  const std::string rule = "--seed must be a whole number from 0 to 18446744073709551615 (got " + text + ")";
  if (text.empty() || text.find_first_not_of("0123456789") != std::string::npos) usage_error(rule);
  errno = 0;
  char* end = nullptr;
  const unsigned long long value = std::strtoull(text.c_str(), &end, 10);
  if (errno == ERANGE || end != text.c_str() + text.size()) usage_error(rule);
  return static_cast<uint64_t>(value);
}

}  // namespace gpipe::cli
