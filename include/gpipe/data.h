// data.h: training data in memory, and the readers that fill it: Fashion-MNIST's gzipped IDX files,
// and a dict of tensors saved in Python with torch.save.
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <string>

namespace gpipe {

/// Samples to train or evaluate on: row n of `input` goes with row n of `target`.
struct Dataset {
  torch::Tensor input;
  torch::Tensor target;
  /// Rows in the data set.
  int64_t size() const { return input.defined() ? input.size(0) : 0; }
  /// The first `count` rows (all of them when count is 0 or more than there are).
  Dataset first(int64_t count) const;
};

/// Fashion-MNIST's training-set mean and standard deviation of pixel values (0 black, 1 white),
/// by which the images are normalized.
constexpr float kFashionMean = 0.2860f;
constexpr float kFashionStd = 0.3530f;

/// Where Debian's dataset-fashion-mnist installs the data.
inline constexpr const char* kFashionMnistDir = "/usr/share/datasets/fashion-mnist";

/// Reads the training (60000) or test (10000) split of Fashion-MNIST from
/// `dir`: input float32 [N, 1, 28, 28] normalized to mean 0 and standard
/// deviation 1, target int64 [N] classes 0..9; the first `limit` samples when
/// limit > 0. Throws std::runtime_error naming the missing file and the
/// package that provides it, or what is wrong with a file.
Dataset load_fashion_mnist(const std::string& dir, bool train, int64_t limit = 0);

/// `images` (normalized Fashion-MNIST, [N, 1, H, W]) mirrored left to right
/// where the hash of (row, epoch, seed) says, about half of them: image row r
/// in epoch e when bit 13 of r·2654435761 + e·40503 + (seed mod 1000003) is
/// set. `rows` are the images' rows in the data set; a function of (r, e,
/// seed) alone, so a resumed run mirrors the same images as an unbroken one.
torch::Tensor mirrored(const torch::Tensor& images, const torch::Tensor& rows, int epoch, uint64_t seed);

/// `clean` normalized Fashion-MNIST images with Gaussian noise of standard
/// deviation `sigma` in pixel values (0 black, 1 white), drawn from `seed`.
torch::Tensor add_noise(const torch::Tensor& clean, double sigma, uint64_t seed);

/// Peak signal-to-noise ratio, in dB, of images with mean squared error `mse`
/// in normalized Fashion-MNIST units (pixel values 0..1).
double psnr_db(double mse);

/// Reads a dataset saved in Python with `torch.save({'input': X, 'target': Y}, path)`.
/// Throws std::runtime_error naming the file and the problem: missing keys,
/// different row counts, no rows, NaN or infinite values.
Dataset load_tensor_data(const std::string& path);

/// What torch.save (or torch::pickle_save) wrote into `bytes`.
torch::IValue load_torch_save(const std::string& bytes);

}  // namespace gpipe
