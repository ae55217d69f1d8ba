// fashion_mnist.cc: a reader for gzipped IDX files (images and labels).
#include "fashion_mnist.h"

#include <torch/torch.h>

#include <zlib.h>

#include <filesystem>
#include <stdexcept>
#include <vector>

namespace gpipe::cli {
namespace {

std::vector<uint8_t> read_gzip(const std::string& path) {
  if (!std::filesystem::exists(path))
    throw std::runtime_error("missing " + path +
                             ": install Fashion-MNIST with `apt-get install dataset-fashion-mnist` "
                             "(scripts/install-deps.sh does), or pass --data-dir");
  gzFile file = gzopen(path.c_str(), "rb");
  if (file == nullptr) throw std::runtime_error("cannot open " + path);
  std::vector<uint8_t> bytes;
  uint8_t buffer[1 << 16];
  int n = 0;
  while ((n = gzread(file, buffer, sizeof buffer)) > 0) bytes.insert(bytes.end(), buffer, buffer + n);
  const bool failed = n < 0;
  gzclose(file);
  if (failed) throw std::runtime_error(path + " is not a readable gzip file");
  return bytes;
}

uint32_t big_endian(const std::vector<uint8_t>& b, size_t at) {
  return (uint32_t{b[at]} << 24) | (uint32_t{b[at + 1]} << 16) | (uint32_t{b[at + 2]} << 8) | b[at + 3];
}

// An IDX file of unsigned bytes: magic 0x0000 08 <dims>, then the sizes, then the data.
torch::Tensor read_idx(const std::string& path, int dims) {
  std::vector<uint8_t> b = read_gzip(path);
  const size_t header = 4 + 4 * static_cast<size_t>(dims);
  if (b.size() < header || big_endian(b, 0) != (0x0800u | static_cast<uint32_t>(dims)))
    throw std::runtime_error(path + " is not an IDX file of " + std::to_string(dims) + "-d bytes");
  std::vector<int64_t> sizes;
  int64_t count = 1;
  for (int d = 0; d < dims; ++d) {
    sizes.push_back(big_endian(b, 4 + 4 * static_cast<size_t>(d)));
    count *= sizes.back();
  }
  if (b.size() != header + static_cast<size_t>(count))
    throw std::runtime_error(path + " is truncated or corrupt: expected " + std::to_string(count) +
                             " data bytes, found " + std::to_string(b.size() - header));
  return torch::from_blob(b.data() + header, sizes, torch::kUInt8).clone();
}

}  // namespace

Dataset load_fashion_mnist(const std::string& dir, bool train, int64_t limit) {
  const std::string prefix = dir + "/" + (train ? "train" : "t10k");
  torch::Tensor images = read_idx(prefix + "-images-idx3-ubyte.gz", 3);
  torch::Tensor labels = read_idx(prefix + "-labels-idx1-ubyte.gz", 1);
  if (images.size(0) != labels.size(0))
    throw std::runtime_error(prefix + ": " + std::to_string(images.size(0)) + " images but " +
                             std::to_string(labels.size(0)) + " labels");
  if (limit > 0 && limit < images.size(0)) {
    images = images.narrow(0, 0, limit);
    labels = labels.narrow(0, 0, limit);
  }
  images = (images.to(torch::kFloat).div_(255.0f).sub_(kFashionMean).div_(kFashionStd)).unsqueeze(1).contiguous();
  return {images, labels.to(torch::kLong)};
}

}  // namespace gpipe::cli
