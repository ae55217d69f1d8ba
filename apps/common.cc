// common.cc: helpers shared by the gpipe subcommands.
#include "common.h"


#include <gpipe/device.h>
#include <gpipe/io.h>
#include <torch/torch.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <limits>
#include <sstream>
#include <thread>
#include <unistd.h>

namespace gpipe::cli {

nlohmann::json machine() {
  std::string cpu = "unknown";
  std::ifstream info("/proc/cpuinfo");
  for (std::string line; std::getline(info, line);)
    if (line.rfind("model name", 0) == 0) {
      cpu = line.substr(line.find(':') + 2);
      break;
    }
  return {{"cores", std::thread::hardware_concurrency()},
          {"cpu", cpu},
          {"blas", gpipe::blas_info()},
          {"malloc", gpipe::freed_memory_kept() ? "glibc, freed memory kept (trim 256 MiB, mmap 32 MiB, top pad 64 MiB)"
                                                : "as the environment or the C library sets it"},
          {"libtorch", TORCH_VERSION},
          {"cuda", torch::cuda::is_available()}};
}

std::string fixed(double value, int digits) {
  std::ostringstream out;
  out << std::fixed << std::setprecision(digits) << value;
  return out.str();
}

namespace {

// Makes the folder `path` goes into, or throws naming it and what to do.
void make_folder_of(const std::string& path) {
  const std::filesystem::path file(path);
  std::error_code error;
  if (file.has_parent_path() && !std::filesystem::create_directories(file.parent_path(), error) && error)
    throw std::runtime_error("cannot create the folder " + file.parent_path().string() + " (" + error.message() +
                             "); give a path in a folder you can write to");
}

}  // namespace

void check_results_path(const std::string& path) {
  if (path.empty()) return;
  or_usage_error("--results", [&] {
    make_folder_of(path);
    check_writable(path);
    return 0;
  });
}

void write_results(const std::string& path, const nlohmann::json& rows, const std::string& command) {
  if (path.empty()) return;
  make_folder_of(path);
  const std::time_t now = std::time(nullptr);
  char date[32];
  std::strftime(date, sizeof date, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
  const nlohmann::json doc = {{"command", command}, {"date", date}, {"machine", machine()}, {"results", rows}};
  write_file_atomically(path, doc.dump(2) + "\n");
  std::cerr << "results written to " << path << "\n";
}

std::string command_line(int argc, char** argv) {
  std::string out;
  for (int i = 0; i < argc; ++i) out += (i ? " " : "") + std::string(argv[i]);
  return out;
}

void usage_error(const std::string& message) { throw UsageError("gpipe: " + in_flags(message)); }

std::string in_flags(const std::string& message) {
  // The library's option and argument names, as the command line's flags.
  static const std::vector<std::pair<std::string, std::string>> flags = {
      {"balance", "--balance"}, {"devices", "--stages"}, {"micro_batches", "--micro-batches"},
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
      {"input_shape", "--input-shape"}, {"workload", "--workload"}, {"layers", "--layers"}, {"width", "--width"},
      {"data", "--data"}, {"samples", "--samples"}, {"prompt", "--prompt"}, {"trace", "--trace"}};
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
CLI::Validator number_check(const std::string& rule, const std::string& name, bool (*ok)(double)) {
  return CLI::Validator(
      [rule, ok](std::string& text) {
        double value = 0;
        if (!CLI::detail::lexical_cast(text, value) || !std::isfinite(value) || !ok(value))
          return "must be " + rule + " (got " + text + ")";
        return std::string();
      },
      name);
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
  auto shown = [](double v) {
    std::ostringstream out;
    out << v;
    return out.str();
  };
  const std::string rule = "must be " + std::string(whole ? "a whole number" : "a number") + " from " + shown(least) +
                           " to " + shown(most);
  return CLI::Validator(
      [rule, least, most, whole](std::string& text) {
        double value = 0;
        int64_t integer = 0;
        const bool read = whole ? CLI::detail::lexical_cast(text, integer) : CLI::detail::lexical_cast(text, value);
        if (whole) value = static_cast<double>(integer);
        if (!read || !std::isfinite(value) || value < least || value > most) return rule + " (got " + text + ")";
        return std::string();
      },
      "[" + shown(least) + "," + shown(most) + "]");
}

CLI::Validator one_of(const std::vector<std::string>& choices, const std::string& meaning) {
  std::string rule;
  for (size_t n = 0; n < choices.size(); ++n)
    rule += (n == 0 ? "" : n + 1 == choices.size() ? " or " : ", ") + choices[n];
  rule = "must be " + rule + (meaning.empty() ? "" : " (" + meaning + ")");
  return CLI::Validator(
      [rule, choices](std::string& text) {
        return std::find(choices.begin(), choices.end(), text) != choices.end() ? std::string()
                                                                               : rule + "; got " + text;
      },
      "{" + [&] { std::string all; for (const auto& c : choices) all += (all.empty() ? "" : ",") + c; return all; }() + "}");
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

Progress::Progress(int epochs, int64_t steps_per_epoch, bool enabled)
    : epochs_(epochs), steps_(steps_per_epoch), tty_(isatty(fileno(stderr)) != 0), enabled_(enabled) {}

void Progress::update(int epoch, int64_t step, double loss, double samples_per_s, double eta_s) {
  if (!enabled_) return;
  const bool every_tenth = steps_ < 10 || step % (steps_ / 10) == 0 || step == steps_;
  if (!tty_ && !every_tenth) return;
  std::ostringstream line;
  line << "epoch " << epoch << "/" << epochs_ << " ";
  if (tty_) {
    const int width = 24, filled = static_cast<int>(width * step / steps_);
    line << "[" << std::string(static_cast<size_t>(filled), '#')
         << std::string(static_cast<size_t>(width - filled), '.') << "] ";
  }
  const int eta = static_cast<int>(eta_s + 0.5);
  line << "step " << step << "/" << steps_ << "  loss " << std::fixed << std::setprecision(4) << loss << "  "
       << std::setprecision(0) << samples_per_s << " samples/s  ETA " << eta / 60 << "m" << std::setw(2)
       << std::setfill('0') << eta % 60 << "s";
  if (tty_)
    std::cerr << "\r" << line.str() << "\x1b[K" << std::flush;
  else
    std::cerr << line.str() << "\n";
}

void Progress::end_epoch() {
  if (tty_ && enabled_) std::cerr << "\n";
}

}  // namespace gpipe::cli
