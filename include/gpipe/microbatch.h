// microbatch.h: splitting a mini-batch into M micro-batches along dim 0, and gathering them back.
#pragma once

#include "gpipe/tensors.h"

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

/// The rows of the first (the largest) of `micro_batches` micro-batches of a batch of `batch` rows, M
/// taken within [1, batch] (a batch of fewer rows than M runs one row per micro-batch). `batch` >= 1.
int64_t first_micro_batch_rows(int64_t batch, int micro_batches);

/// Splits `batch` along dim 0 into micro-batches of micro_batch_sizes(batch.size(0), micro_batches).
/// The pieces are views: no data is copied.
std::vector<torch::Tensor> scatter(const torch::Tensor& batch, int micro_batches);

/// The rows of a model's input (one tensor, or a tuple): the size of dim 0 of every tensor not
/// at a position in `whole`, which must agree. Throws std::invalid_argument naming the tensor
/// and the fix for a tensor without dim 0, an empty batch, rows that differ, or a position in
/// `whole` outside the tuple.
int64_t batch_rows(const Tensors& batch, const std::vector<int>& whole = {});

/// Rows [first, first + count) of every tensor of `batch` not at a position in `whole`; those whole.
Tensors narrow_rows(const Tensors& batch, int64_t first, int64_t count, const std::vector<int>& whole = {});

/// Splits `batch` into micro-batches: every tensor along dim 0 as scatter does, except those at
/// the positions in `whole`, which every micro-batch holds whole.
std::vector<Tensors> scatter(const Tensors& batch, int micro_batches, const std::vector<int>& whole);

/// Concatenates micro-batch outputs back along dim 0 (the inverse of scatter).
torch::Tensor gather(const std::vector<torch::Tensor>& micro_batches);

}  // namespace gpipe
