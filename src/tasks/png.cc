// png.cc: grayscale PNG encoding with libpng, into memory, then one atomic write (write_png, tasks.h).
#include "gpipe/tasks.h"

#include "gpipe/io.h"

#include <torch/torch.h>

#include <stdexcept>

#if defined(GPIPE_NO_PNG)
namespace gpipe {
void write_png(const std::string& path, const torch::Tensor& /*image*/) {
  throw std::invalid_argument("cannot write " + path + ": this gpipe was built without libpng; install libpng-dev "
                              "and configure again to write PNG samples");
}
}  // namespace gpipe
#else
#include <png.h>

namespace gpipe {
namespace {

void png_append(png_structp png, png_bytep data, png_size_t length) {
  static_cast<std::string*>(png_get_io_ptr(png))->append(reinterpret_cast<const char*>(data), length);
}

void png_flush(png_structp) {}

}  // namespace

void write_png(const std::string& path, const torch::Tensor& image) {
  if (image.dim() != 2 || image.scalar_type() != torch::kUInt8 || image.numel() == 0)
    throw std::invalid_argument("write_png takes a non-empty uint8 image [height, width]");
  const torch::Tensor pixels = image.contiguous();
  const auto height = static_cast<png_uint_32>(pixels.size(0)), width = static_cast<png_uint_32>(pixels.size(1));
  png_structp png = png_create_write_struct(PNG_LIBPNG_VER_STRING, nullptr, nullptr, nullptr);
  png_infop info = png == nullptr ? nullptr : png_create_info_struct(png);
  if (info == nullptr) {
    png_destroy_write_struct(&png, nullptr);
    throw std::runtime_error("cannot encode " + path + ": libpng could not start");
  }
  std::string bytes;
  if (setjmp(png_jmpbuf(png))) {  // libpng's errors come back here
    png_destroy_write_struct(&png, &info);
    throw std::runtime_error("cannot encode " + path + " as PNG");
  }
  png_set_write_fn(png, &bytes, png_append, png_flush);
  png_set_IHDR(png, info, width, height, 8, PNG_COLOR_TYPE_GRAY, PNG_INTERLACE_NONE, PNG_COMPRESSION_TYPE_DEFAULT,
               PNG_FILTER_TYPE_DEFAULT);
  png_write_info(png, info);
  const auto* data = pixels.data_ptr<uint8_t>();
  for (png_uint_32 y = 0; y < height; ++y) png_write_row(png, data + static_cast<size_t>(y) * width);
  png_write_end(png, nullptr);
  png_destroy_write_struct(&png, &info);
  write_file_atomically(path, bytes);
}

}  // namespace gpipe
#endif  // GPIPE_NO_PNG
