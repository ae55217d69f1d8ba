// microbatch.cc: even splits along the batch dimension.
#include "gpipe/microbatch.h"

#include "gpipe/check.h"

#include <torch/torch.h>

namespace gpipe {

std::vector<int64_t> micro_batch_sizes(int64_t batch, int micro_batches) {
  GPIPE_CHECK(micro_batches >= 1, "the number of micro-batches must be at least 1 (got ", micro_batches,
              "); give M >= 1");
  GPIPE_CHECK(micro_batches <= batch, "the number of micro-batches (", micro_batches,
              ") is larger than the batch size (", batch,
              "): every micro-batch needs at least one sample; use at most ", batch,
              " micro-batches or a larger batch");
  std::vector<int64_t> sizes(static_cast<size_t>(micro_batches), batch / micro_batches);
  for (int64_t i = 0; i < batch % micro_batches; ++i) sizes[static_cast<size_t>(i)] += 1;
  return sizes;
}

std::vector<torch::Tensor> scatter(const torch::Tensor& batch, int micro_batches) {
  GPIPE_CHECK(batch.defined() && batch.dim() >= 1,
              "a batch must be a tensor with a batch dimension (dim 0); got ",
              batch.defined() ? std::to_string(batch.dim()) + "-dimensional tensor"
                              : std::string("an undefined tensor"),
              "; add a batch dimension, e.g. x.unsqueeze(0)");
  std::vector<torch::Tensor> pieces;
  pieces.reserve(static_cast<size_t>(micro_batches));
  int64_t offset = 0;
  for (int64_t size : micro_batch_sizes(batch.size(0), micro_batches)) {
    pieces.push_back(batch.narrow(0, offset, size));
    offset += size;
  }
  return pieces;
}

torch::Tensor gather(const std::vector<torch::Tensor>& micro_batches) {
  GPIPE_CHECK(!micro_batches.empty(), "gather needs at least one micro-batch");
  if (micro_batches.size() == 1) return micro_batches.front();
  return torch::cat(micro_batches, 0);
}

}  // namespace gpipe
