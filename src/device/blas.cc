// blas.cc: the BLAS kernel this process runs, the one its CPU deserves, and running with that one.
#include "gpipe/blas.h"

#include "gpipe/check.h"
#include "gpipe/device.h"
#include "gpipe/environment.h"

#include <torch/torch.h>

#include <dlfcn.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>

namespace gpipe {
namespace {

// An OpenBLAS function, or nullptr. OpenBLAS may sit in a library loaded without RTLD_GLOBAL (Python's
// torch loads libtorch so): then it is found through the library itself.
template <typename Fn>
Fn* openblas_symbol(const char* name) {
  if (void* found = dlsym(RTLD_DEFAULT, name)) return reinterpret_cast<Fn*>(found);
  for (const char* library : {"libblas.so.3", "libopenblas.so.0", "libopenblasp.so.0"}) {
    void* handle = dlopen(library, RTLD_LAZY | RTLD_NOLOAD);
    if (handle == nullptr) continue;
    void* found = dlsym(handle, name);
    dlclose(handle);
    if (found != nullptr) return reinterpret_cast<Fn*>(found);
  }
  return nullptr;
}

bool same_name(const std::string& a, const std::string& b) {
  return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin(), [](char x, char y) {
           return std::tolower(static_cast<unsigned char>(x)) == std::tolower(static_cast<unsigned char>(y));
         });
}

bool has(const std::vector<std::string>& flags, const char* flag) {
  return std::find(flags.begin(), flags.end(), flag) != flags.end();
}

std::vector<std::string> cpu_flags() {
  std::ifstream info("/proc/cpuinfo");
  for (std::string line; std::getline(info, line);) {
    if (line.rfind("flags", 0) != 0) continue;
    std::istringstream words(line.substr(line.find(':') + 1));
    std::vector<std::string> flags;
    for (std::string word; words >> word;) flags.push_back(word);
    return flags;
  }
  return {};
}

std::string vector_isa_of(const std::vector<std::string>& flags) {
  const std::string best = best_blas_kernel(flags);
  if (best == "Cooperlake" || best == "SkylakeX") return "AVX-512";
  if (best == "Haswell") return "AVX2";
  return best == "Sandybridge" ? "AVX" : "";
}

// The environment variable that tells the process started again what it was started from: the
// kernel before, then OPENBLAS_CORETYPE before (empty: unset), separated by a newline.
constexpr const char* kStartedFrom = "GPIPE_BLAS_STARTED_FROM";
// "gpipe" or "GPIPE_BLAS_CORETYPE" where this process was started again with the kernel gpipe chose
// or the one that variable names; "" otherwise.
std::string kernel_chosen_by;

[[noreturn]] void start_again(char** argv) {
#if defined(__linux__)
  execv("/proc/self/exe", argv);
#else
  (void)argv;
  errno = ENOSYS;  // no /proc/self/exe to start again from
#endif
  throw std::runtime_error(std::string("gpipe: could not start again to change the BLAS kernel (") +
                           std::strerror(errno) + "); set GPIPE_BLAS_CORETYPE=keep to run without it");
}

}  // namespace

bool BlasKernel::generic() const {
  return !running.empty() && blas_kernel_without_avx(running) &&
         (vector_isa == "AVX2" || vector_isa == "AVX-512");
}

std::string BlasKernel::advice() const {
  if (!generic()) return "";
  return "gpipe: OpenBLAS runs its generic " + running + " kernel on this CPU, which has " + vector_isa +
         ": matrix products run several times slower than they can. Export OPENBLAS_CORETYPE=" + best +
         " before the program starts (OpenBLAS reads it only as it loads), or set GPIPE_BLAS_CORETYPE=keep to "
         "leave it as it is";
}

BlasKernel blas_kernel() {
  BlasKernel kernel;
  if (auto* name = openblas_symbol<char*()>("openblas_get_corename")) kernel.running = name();
  const std::vector<std::string> flags = cpu_flags();
  kernel.best = best_blas_kernel(flags);
  kernel.vector_isa = vector_isa_of(flags);
  kernel.coretype = environment_value("OPENBLAS_CORETYPE");
  kernel.chosen_by = !kernel_chosen_by.empty() ? kernel_chosen_by
                     : kernel.coretype.empty()  ? "OpenBLAS"
                                                : "OPENBLAS_CORETYPE";
  return kernel;
}

namespace {

// OpenBLAS's x86 kernels by the names OPENBLAS_CORETYPE takes, and whether each has AVX.
struct KnownKernel {
  const char* name;
  bool avx;
};
constexpr KnownKernel kKernels[] = {
    {"Katmai", false},      {"Coppermine", false}, {"Northwood", false},    {"Prescott", false},
    {"Banias", false},      {"Atom", false},       {"Core2", false},        {"Penryn", false},
    {"Dunnington", false},  {"Nehalem", false},    {"Athlon", false},       {"Opteron", false},
    {"Opteron_SSE3", false}, {"Barcelona", false}, {"Nano", false},         {"Bobcat", false},
    {"Sandybridge", true},  {"Bulldozer", true},   {"Piledriver", true},    {"Haswell", true},
    {"Steamroller", true},  {"Excavator", true},   {"Zen", true},           {"SkylakeX", true},
    {"Cooperlake", true},   {"SapphireRapids", true}};

}  // namespace

const std::vector<std::string>& blas_kernel_names() {
  static const std::vector<std::string> names = [] {
    std::vector<std::string> out;
    for (const KnownKernel& k : kKernels) out.push_back(k.name);
    return out;
  }();
  return names;
}

std::string best_blas_kernel(const std::vector<std::string>& f) {
  if (has(f, "avx512f") && has(f, "avx512bw") && has(f, "avx512vl") && has(f, "avx512dq") && has(f, "avx512cd"))
    return has(f, "avx512_bf16") ? "Cooperlake" : "SkylakeX";
  if (has(f, "avx2") && has(f, "fma")) return "Haswell";
  return has(f, "avx") ? "Sandybridge" : "";
}

bool blas_kernel_without_avx(const std::string& kernel) {
  for (const KnownKernel& k : kKernels)
    if (same_name(kernel, k.name)) return !k.avx;
  return false;
}

double blas_gflops() {
  auto* get = openblas_symbol<int()>("openblas_get_num_threads");
  if (get == nullptr) return 0;
  const int threads = get();
  set_blas_threads(1);
  torch::NoGradGuard no_grad;
  const int64_t n = 512;
  const auto a = torch::rand({n, n}), b = torch::rand({n, n});
  auto c = torch::mm(a, b);
  std::vector<double> seconds;
  for (int i = 0; i < 5; ++i) {
    const auto begin = std::chrono::steady_clock::now();
    c = torch::mm(a, b);
    seconds.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - begin).count());
  }
  set_blas_threads(threads);
  std::sort(seconds.begin(), seconds.end());
  return 2.0 * static_cast<double>(n * n * n) / seconds[2] / 1e9;
}

bool blas_products_right() {
  torch::NoGradGuard no_grad;
  // Sizes that are no multiple of any kernel's blocks, values from the index alone.
  const int64_t rows = 97, inner = 61, columns = 83;
  auto value = [](int64_t i, int64_t j, int64_t salt) { return std::sin(0.37 * i + 0.11 * j + salt); };
  auto a = torch::empty({rows, inner}, torch::kFloat64), b = torch::empty({inner, columns}, torch::kFloat64);
  auto aa = a.accessor<double, 2>();
  auto bb = b.accessor<double, 2>();
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t k = 0; k < inner; ++k) aa[i][k] = value(i, k, 1);
  for (int64_t k = 0; k < inner; ++k)
    for (int64_t j = 0; j < columns; ++j) bb[k][j] = value(k, j, 2);
  auto expected = torch::zeros({rows, columns}, torch::kFloat64);
  auto ee = expected.accessor<double, 2>();
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t k = 0; k < inner; ++k)
      for (int64_t j = 0; j < columns; ++j) ee[i][j] += aa[i][k] * bb[k][j];
  const double scale = expected.abs().max().item<double>();
  const double wrong64 = (torch::mm(a, b) - expected).abs().max().item<double>() / scale;
  const double wrong32 =
      (torch::mm(a.to(torch::kFloat32), b.to(torch::kFloat32)).to(torch::kFloat64) - expected).abs().max().item<double>() /
      scale;
  return wrong64 < 1e-10 && wrong32 < 1e-4;
}

namespace {

// GPIPE_BLAS_CORETYPE: "", auto, keep, or a kernel's name as OpenBLAS writes it (taken in any case).
std::string coretype_setting() {
  const std::string value = environment_value("GPIPE_BLAS_CORETYPE");
  if (value.empty() || value == "auto" || value == "keep") return value;
  for (const std::string& name : blas_kernel_names())
    if (same_name(value, name)) return name;
  GPIPE_CHECK(false, "GPIPE_BLAS_CORETYPE=", value, " is neither auto, keep nor one of OpenBLAS's kernels (Haswell, "
              "SkylakeX, Cooperlake, Zen, Sandybridge, Prescott, ...); unset it for gpipe's choice, keep to leave "
              "OpenBLAS's own, or name a kernel");
  return value;
}

// In the process started again: the line to show, after checking the kernel it runs.
std::string started_again(char** argv, const std::string& from) {
  const std::string before = from.substr(0, from.find('\n'));
  const std::string coretype_before = from.find('\n') == std::string::npos ? "" : from.substr(from.find('\n') + 1);
  const BlasKernel kernel = blas_kernel();
  const std::string asked = kernel.coretype;
  if (!same_name(kernel.running, asked)) {  // as it was: what this process starts runs as OpenBLAS chooses
    if (coretype_before.empty())
      unsetenv("OPENBLAS_CORETYPE");
    else
      setenv("OPENBLAS_CORETYPE", coretype_before.c_str(), 1);
    kernel_chosen_by = "OpenBLAS";  // its fallback for a name it lacks, whatever OPENBLAS_CORETYPE said before
    return "gpipe: this OpenBLAS has no " + asked + " kernel and runs its fallback, " + kernel.running +
           "; set GPIPE_BLAS_CORETYPE=keep to start without trying";
  }
  if (!blas_products_right()) {
    std::fprintf(stderr, "gpipe: OpenBLAS's %s kernel computes wrong products on this CPU; running with %s, as "
                 "OpenBLAS chose\n", asked.c_str(), before.c_str());
    if (coretype_before.empty())
      unsetenv("OPENBLAS_CORETYPE");
    else
      setenv("OPENBLAS_CORETYPE", coretype_before.c_str(), 1);
    setenv("GPIPE_BLAS_CORETYPE", "keep", 1);
    start_again(argv);
  }
  const bool named = same_name(environment_value("GPIPE_BLAS_CORETYPE"), asked);
  kernel_chosen_by = named ? "GPIPE_BLAS_CORETYPE" : "gpipe";
  if (named)
    return "gpipe: running with OpenBLAS's " + asked + " kernel (GPIPE_BLAS_CORETYPE), where it chose " + before;
  return "gpipe: OpenBLAS chose its generic " + before + " kernel on this CPU (" + kernel.vector_isa +
         "); running with OPENBLAS_CORETYPE=" + asked + " (export it to start so, or GPIPE_BLAS_CORETYPE=keep to "
         "leave OpenBLAS as it chooses)";
}

}  // namespace

std::string run_with_best_blas_kernel(char** argv) {
  const std::string setting = coretype_setting();
  const std::string from = environment_value(kStartedFrom);
  if (!from.empty()) {
    unsetenv(kStartedFrom);
    return started_again(argv, from);
  }
  if (setting == "keep") return "";
  const BlasKernel kernel = blas_kernel();
  if (kernel.running.empty()) return "";  // not OpenBLAS
  std::string wanted;
  if (!setting.empty() && setting != "auto")
    wanted = same_name(kernel.running, setting) ? "" : setting;
  else if (kernel.coretype.empty() && kernel.generic())
    wanted = kernel.best;
  if (wanted.empty()) return "";
  setenv(kStartedFrom, (kernel.running + "\n" + kernel.coretype).c_str(), 1);
  setenv("OPENBLAS_CORETYPE", wanted.c_str(), 1);
  start_again(argv);
}

std::string blas_warning() {
  const std::string setting = coretype_setting();
  if (!setting.empty() && setting != "auto" && setting != "keep") {
    const BlasKernel kernel = blas_kernel();
    if (same_name(kernel.running, setting) || kernel.running.empty()) return "";
    return "gpipe: GPIPE_BLAS_CORETYPE=" + setting + " changes the kernel of the gpipe program only: this process "
           "loaded OpenBLAS before gpipe, with " + kernel.running + "; export OPENBLAS_CORETYPE=" + setting +
           " before it starts";
  }
  if (setting == "keep" || !environment_value("OPENBLAS_CORETYPE").empty()) return "";
  return blas_kernel().advice();
}

bool set_blas_threads(int threads) {
  auto* set = openblas_symbol<void(int)>("openblas_set_num_threads");
  if (set == nullptr) return false;
  set(threads);
  return true;
}

std::string blas_info() {
  auto* config = openblas_symbol<char*()>("openblas_get_config");
  if (config == nullptr) return "not OpenBLAS (reference or other BLAS)";
  std::string info = config();
  if (auto* threads = openblas_symbol<int()>("openblas_get_num_threads"))
    info += " threads=" + std::to_string(threads());
  return info.rfind("OpenBLAS", 0) == 0 ? info : "OpenBLAS " + info;
}

}  // namespace gpipe
