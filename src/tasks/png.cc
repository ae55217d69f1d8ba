// png.cc: grayscale PNG encoding with zlib, into memory, then one atomic write (write_png, tasks.h).
// A PNG is its signature and chunks (length, type, data, CRC-32 of type and data): IHDR, one IDAT
// holding the zlib stream of the rows (each led by filter byte 0), IEND.
#include "gpipe/tasks.h"

#include "gpipe/io.h"

#include <torch/torch.h>

#include <zlib.h>

#include <cstdint>
#include <stdexcept>
#include <string>

namespace gpipe {
namespace {

void append_u32(std::string& out, uint32_t v) {
  for (int shift = 24; shift >= 0; shift -= 8) out.push_back(static_cast<char>((v >> shift) & 0xff));
}

void append_chunk(std::string& out, const char* type, const std::string& data) {
  append_u32(out, static_cast<uint32_t>(data.size()));
  const std::string body = std::string(type, 4) + data;
  out += body;
  append_u32(out, static_cast<uint32_t>(::crc32(0, reinterpret_cast<const Bytef*>(body.data()),
                                                static_cast<uInt>(body.size()))));
}

}  // namespace

void write_png(const std::string& path, const torch::Tensor& image) {
  if (image.dim() != 2 || image.scalar_type() != torch::kUInt8 || image.numel() == 0)
    throw std::invalid_argument("write_png takes a non-empty uint8 image [height, width]");
  const torch::Tensor pixels = image.contiguous();
  const auto height = static_cast<uint32_t>(pixels.size(0)), width = static_cast<uint32_t>(pixels.size(1));
  std::string rows;
  rows.reserve(static_cast<size_t>(height) * (width + 1));
  const auto* data = reinterpret_cast<const char*>(pixels.data_ptr<uint8_t>());
  for (uint32_t y = 0; y < height; ++y) {
    rows.push_back('\0');  // filter: none
    rows.append(data + static_cast<size_t>(y) * width, width);
  }
  uLongf packed_size = ::compressBound(static_cast<uLong>(rows.size()));
  std::string packed(packed_size, '\0');
  if (::compress2(reinterpret_cast<Bytef*>(packed.data()), &packed_size, reinterpret_cast<const Bytef*>(rows.data()),
                  static_cast<uLong>(rows.size()), Z_DEFAULT_COMPRESSION) != Z_OK)
    throw std::runtime_error("cannot encode " + path + " as PNG: zlib could not compress its rows");
  packed.resize(packed_size);
  std::string header;
  append_u32(header, width);
  append_u32(header, height);
  header += std::string("\x08\x00\x00\x00\x00", 5);  // 8 bits, grayscale, deflate, adaptive filters, no interlace
  std::string bytes("\x89PNG\r\n\x1a\n", 8);
  append_chunk(bytes, "IHDR", header);
  append_chunk(bytes, "IDAT", packed);
  append_chunk(bytes, "IEND", "");
  write_file_atomically(path, bytes);
}

}  // namespace gpipe
