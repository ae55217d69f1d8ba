// png_image.h: grayscale images written as PNG files (libpng), whole or not at all.
#pragma once

#include <torch/types.h>

#include <string>

namespace gpipe::cli {

/// Writes `image`, uint8 [height, width] (0 black, 255 white), to `path` as a
/// grayscale PNG, whole or not at all. Throws std::runtime_error naming the
/// path and the problem.
void write_png(const std::string& path, const torch::Tensor& image);

}  // namespace gpipe::cli
