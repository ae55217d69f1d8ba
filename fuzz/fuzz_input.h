// fuzz_input.h: what the fuzz targets share: the input as a file (the readers take paths) and the
// one-line check that turns a broken promise into a crash libFuzzer reports.
#pragma once

#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>

namespace gpipe::fuzz {

inline std::string as_string(const uint8_t* data, size_t size) {
  return std::string(reinterpret_cast<const char*>(data), size);
}

/// Writes `bytes` to this process's scratch file (under $TMPDIR, or /tmp) and returns its path.
inline std::string as_file(const std::string& bytes, const std::string& suffix = "") {
  const char* dir = std::getenv("TMPDIR");
  const std::string path = std::string(dir && *dir ? dir : "/tmp") + "/gpipe-fuzz-" + std::to_string(getpid()) + suffix;
  std::ofstream(path, std::ios::binary | std::ios::trunc).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  return path;
}

/// Aborts (a finding) with `what` when `ok` is false.
inline void promise(bool ok, const char* what) {
  if (ok) return;
  std::fprintf(stderr, "broken promise: %s\n", what);
  std::abort();
}

}  // namespace gpipe::fuzz
