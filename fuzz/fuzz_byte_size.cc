// fuzz_byte_size: byte sizes as users write them (--memory 16GiB, --max-memory 1.5e9). Promises:
// malformed text is refused with std::invalid_argument; accepted text is a size from 1 byte to
// below 9e18, the same for the same text.
#include "fuzz_input.h"

#include <gpipe/cost_model.h>

#include <stdexcept>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text = gpipe::fuzz::as_string(data, size);
  try {
    const int64_t bytes = gpipe::parse_bytes(text);
    gpipe::fuzz::promise(bytes >= 1 && static_cast<double>(bytes) < 9.0e18, "1 <= parse_bytes(text) < 9e18");
    gpipe::fuzz::promise(gpipe::parse_bytes(text) == bytes, "parse_bytes is a function of its text");
  } catch (const std::invalid_argument&) {
  }
  return 0;
}
