// fuzz_idx: the IDX reader behind Fashion-MNIST (gzipped or plain files). An input is a byte that
// picks the dimensions (1 to 3), then the file. Promises: a bad file is refused with
// std::runtime_error; an accepted one is a uint8 tensor with exactly the file's data bytes.
#include "fuzz_input.h"

#include <gpipe/data.h>

#include <torch/torch.h>

#include <stdexcept>

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  torch::set_num_threads(1);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const int dims = 1 + data[0] % 3;
  try {
    const torch::Tensor t = gpipe::read_idx(gpipe::fuzz::as_file(gpipe::fuzz::as_string(data + 1, size - 1)), dims);
    gpipe::fuzz::promise(t.dim() == dims && t.scalar_type() == torch::kUInt8, "a uint8 tensor of the header's dims");
    const size_t header = 4 + 4 * static_cast<size_t>(dims);  // the magic number and the sizes
    gpipe::fuzz::promise(static_cast<size_t>(t.numel()) + header == size - 1 || size - 1 < 2 ||
                             (data[1] == 0x1f && data[2] == 0x8b),  // gzipped: the bytes are not the data
                         "exactly the file's data bytes");
  } catch (const std::runtime_error&) {
  }
  return 0;
}
