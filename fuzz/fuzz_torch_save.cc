// fuzz_torch_save: the reader of data files written by Python's torch.save({'input': X, 'target': Y})
// (gpipe train --data): a zip archive (the old format is refused). Promises: a bad file is refused with
// std::runtime_error naming it; an accepted one has as many input as target rows, at least one.
#include "fuzz_input.h"

#include <gpipe/data.h>

#include <torch/torch.h>

#include <stdexcept>

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  torch::set_num_threads(1);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    const gpipe::Dataset d = gpipe::load_tensor_data(gpipe::fuzz::as_file(gpipe::fuzz::as_string(data, size)));
    gpipe::fuzz::promise(d.size() >= 1 && d.input.size(0) == d.target.size(0), "as many input as target rows");
  } catch (const std::runtime_error&) {
  }
  return 0;
}
