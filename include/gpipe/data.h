// data.h: training data in memory, and the readers that fill it: Fashion-MNIST's gzipped IDX files,
// a dict of tensors saved in Python with torch.save, and text (Debian's fortunes) as bytes for a
// language model, with the two references its bits per byte are read against.
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <string>
#include <vector>

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

/// Reads an IDX file of unsigned bytes with `dims` dimensions (Fashion-MNIST's format), gzipped
/// or not, as a uint8 tensor of the sizes its header gives. Throws std::runtime_error naming the
/// file and what is wrong with it.
torch::Tensor read_idx(const std::string& path, int dims);

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

/// What torch.save (or torch::pickle_save) wrote into `bytes`: a zip archive. Throws
/// std::runtime_error for bytes that are not one (torch.save's old format among them), and
/// libtorch's error for an archive it cannot read.
torch::IValue load_torch_save(const std::string& bytes);

/// Where Debian's fortunes package installs its text files (quotations, jokes, poems).
inline constexpr const char* kFortunesDir = "/usr/share/games/fortunes";

/// Text split into a training and a test part, as bytes.
struct TextCorpus {
  std::string train;
  std::string test;
  std::vector<std::string> files;  ///< the files read, in the order their bytes were joined
};

/// Reads the fortune files of `dir`: every regular file whose name has no dot (not the .dat and
/// .u8 indexes, not links), in byte order of their names. Each file is split at the start of its
/// first fortune (a line after a "%" line) at or after 90% of its bytes: what comes before goes to
/// the training part, the rest to the test part; the parts are joined in file order. When that leaves
/// no test text (no file's last tenth begins a fortune: single long ones), each file of at least 20
/// bytes is split at its first line after 90% of its bytes instead (at 90% without a line break
/// there). Line ends CR LF (Windows) are read as LF. Throws
/// std::runtime_error naming the folder and the package to install when there is no such folder or
/// no text in it.
TextCorpus load_fortunes(const std::string& dir);

/// `text` as samples for a language model: the non-overlapping windows of `length` bytes, input
/// int64 [N, length] bytes text[k·length .. (k+1)·length) and target the same shifted by one byte,
/// N = (size - 1) / length (what is left at the end is dropped). Input and target are views of one
/// int64 tensor of the text's bytes (8 bytes per byte of text in all). Throws std::invalid_argument
/// when the text holds no window.
Dataset byte_windows(const std::string& text, int64_t length);

/// Bits per byte of a bigram model on `test`: each byte after the first predicted from the one
/// before it, with the pair counts of `train` and add-one smoothing,
/// P(b | a) = (count(a, b) + 1) / (count(a) + 256); the mean of -log2 P over the test bytes.
double bigram_bits_per_byte(const std::string& train, const std::string& test);

/// What zlib at level 9 (gzip -9's compression) makes of `text`: compressed bytes x 8 / bytes.
double gzip_bits_per_byte(const std::string& text);

}  // namespace gpipe
