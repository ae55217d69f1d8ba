// fashion_mnist.h: reads Fashion-MNIST from the gzipped IDX files of Debian's dataset-fashion-mnist.
#pragma once

#include <torch/types.h>

#include <string>

namespace gpipe::cli {

/// Fashion-MNIST's training-set mean and standard deviation of pixel values (0 black, 1 white),
/// by which the images are normalized.
constexpr float kFashionMean = 0.2860f;
constexpr float kFashionStd = 0.3530f;

/// Where Debian's dataset-fashion-mnist installs the data.
inline const char* kFashionMnistDir = "/usr/share/datasets/fashion-mnist";

struct Dataset {
  torch::Tensor images;  ///< float32 [N, 1, 28, 28], normalized to mean 0, std 1
  torch::Tensor labels;  ///< int64 [N], classes 0..9
};

/// Reads the training (60000) or test (10000) split from `dir`, keeping the
/// first `limit` samples when limit > 0. Throws std::runtime_error naming the
/// missing file and the package that provides it, or what is wrong with a file.
Dataset load_fashion_mnist(const std::string& dir, bool train, int64_t limit = 0);

}  // namespace gpipe::cli
