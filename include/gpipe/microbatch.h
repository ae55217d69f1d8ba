// microbatch.h: splitting a mini-batch into M micro-batches along dim 0, and gathering them back.
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <vector>

namespace gpipe {

/// Sizes of `micro_batches` micro-batches of a batch of `batch` samples, as even
/// as possible: the first `batch % micro_batches` hold one sample more.
/// Requires 1 <= micro_batches <= batch (throws std::invalid_argument otherwise).
///
///   micro_batch_sizes(10, 4) == {3, 3, 2, 2}
std::vector<int64_t> micro_batch_sizes(int64_t batch, int micro_batches);

/// Splits `batch` along dim 0 into micro-batches of micro_batch_sizes(batch.size(0), micro_batches).
/// The pieces are views: no data is copied.
std::vector<torch::Tensor> scatter(const torch::Tensor& batch, int micro_batches);

/// Concatenates micro-batch outputs back along dim 0 (the inverse of scatter).
torch::Tensor gather(const std::vector<torch::Tensor>& micro_batches);

}  // namespace gpipe
