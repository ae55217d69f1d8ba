// digest.cc: 64-bit digests of files and tensors (digest.h).
#include "gpipe/digest.h"

#include <cerrno>
#include <cstring>
#include <fstream>
#include <stdexcept>

namespace gpipe {

namespace {
// FNV-1a over 64-bit words (a byte at a time for the tail): fast, and a different byte gives a
// different digest but for chance.
uint64_t digest_more(uint64_t h, const unsigned char* bytes, size_t count) {
  constexpr uint64_t kPrime = 0x100000001b3ull;
  size_t n = 0;
  for (; n + 8 <= count; n += 8) {
    uint64_t word = 0;
    std::memcpy(&word, bytes + n, 8);
    h = (h ^ word) * kPrime;
    h ^= h >> 29;
  }
  for (; n < count; ++n) h = (h ^ bytes[n]) * kPrime;
  return h;
}
constexpr uint64_t kDigestStart = 0xcbf29ce484222325ull;
}  // namespace

uint64_t file_digest(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot read " + path + ": " + std::strerror(errno));
  uint64_t h = kDigestStart;
  std::vector<char> buffer(1 << 20);
  while (in) {
    in.read(buffer.data(), static_cast<std::streamsize>(buffer.size()));
    h = digest_more(h, reinterpret_cast<const unsigned char*>(buffer.data()), static_cast<size_t>(in.gcount()));
  }
  if (in.bad()) throw std::runtime_error("cannot read " + path + ": " + std::strerror(errno));
  return h;
}

uint64_t text_digest(const std::string& text) {
  return digest_more(kDigestStart, reinterpret_cast<const unsigned char*>(text.data()), text.size());
}

uint64_t tensors_digest(const std::vector<torch::Tensor>& tensors) {
  uint64_t h = kDigestStart;
  for (const torch::Tensor& t : tensors) {
    if (!t.defined()) continue;
    std::vector<int64_t> head{static_cast<int64_t>(t.scalar_type()), t.dim()};
    head.insert(head.end(), t.sizes().begin(), t.sizes().end());
    h = digest_more(h, reinterpret_cast<const unsigned char*>(head.data()), head.size() * sizeof(int64_t));
    const torch::Tensor bytes = t.detach().cpu().contiguous();
    h = digest_more(h, static_cast<const unsigned char*>(bytes.data_ptr()), bytes.nbytes());
  }
  return h;
}

}  // namespace gpipe
