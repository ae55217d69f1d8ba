// microbatch.cc: even splits along the batch dimension.
#include "gpipe/microbatch.h"

#include "gpipe/check.h"

#include <torch/torch.h>

#include <algorithm>

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

int64_t first_micro_batch_rows(int64_t batch, int micro_batches) {
  return micro_batch_sizes(batch, static_cast<int>(std::clamp<int64_t>(micro_batches, 1, batch))).front();
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

namespace {

bool is_whole(const std::vector<int>& whole, size_t k) {
  return std::find(whole.begin(), whole.end(), static_cast<int>(k)) != whole.end();
}

}  // namespace

int64_t batch_rows(const Tensors& batch, const std::vector<int>& whole) {
  GPIPE_CHECK(batch.size() > 0, "the input holds no tensor; give a tensor, or a tuple of tensors");
  for (size_t k = 0; k < batch.size(); ++k)
    GPIPE_CHECK(batch.items[k].defined(), batch.tuple ? "the input's tensor " + std::to_string(k) : std::string("the input"),
                " is undefined; give defined tensors");
  for (int k : whole)
    GPIPE_CHECK(batch.tuple && k >= 0 && static_cast<size_t>(k) < batch.size(), "whole_inputs names tensor ", k,
                " of the input, which ",
                batch.tuple ? "is a tuple of " + std::to_string(batch.size()) + " tensors" : std::string("is one tensor"),
                "; name positions of the input's tuple (0-based), or none");
  int64_t rows = -1;
  size_t first = 0;
  for (size_t k = 0; k < batch.size(); ++k) {
    if (is_whole(whole, k)) continue;
    const torch::Tensor& t = batch.items[k];
    const std::string name = batch.tuple ? "input's tensor " + std::to_string(k) : std::string("input");
    GPIPE_CHECK(t.defined() && t.dim() >= 1, "the ", name, " has no batch dimension (shape ", shape_text(t),
                "); gpipe splits dim 0 into micro-batches: add one (e.g. x.unsqueeze(0))",
                batch.tuple ? ", or pass it whole to every micro-batch with PipelineOptions::whole_inputs" : "");
    GPIPE_CHECK(t.size(0) >= 1, "the ", name, " is an empty batch (shape ", shape_text(t), "); give at least one row");
    if (rows < 0) {
      rows = t.size(0);
      first = k;
    }
    GPIPE_CHECK(t.size(0) == rows, "the input's tensor ", k, " has ", t.size(0), " rows but its tensor ", first,
                " has ", rows, "; every tensor with the batch dimension needs the same rows, and one that every "
                "micro-batch takes whole is named in PipelineOptions::whole_inputs");
  }
  GPIPE_CHECK(rows >= 1, "every tensor of the input is named in whole_inputs, so none has the batch dimension to "
              "split into micro-batches; leave at least one out");
  return rows;
}

Tensors narrow_rows(const Tensors& batch, int64_t first, int64_t count, const std::vector<int>& whole) {
  Tensors out = batch;
  for (size_t k = 0; k < out.size(); ++k)
    if (!is_whole(whole, k)) out.items[k] = out.items[k].narrow(0, first, count);
  return out;
}

std::vector<Tensors> scatter(const Tensors& batch, int micro_batches, const std::vector<int>& whole) {
  std::vector<Tensors> pieces(static_cast<size_t>(micro_batches), batch);
  for (size_t k = 0; k < batch.size(); ++k) {
    if (is_whole(whole, k)) continue;
    const std::vector<torch::Tensor> split = scatter(batch.items[k], micro_batches);
    for (size_t i = 0; i < pieces.size(); ++i) pieces[i].items[k] = split[i];
  }
  return pieces;
}

torch::Tensor gather(const std::vector<torch::Tensor>& micro_batches) {
  GPIPE_CHECK(!micro_batches.empty(), "gather needs at least one micro-batch");
  if (micro_batches.size() == 1) return micro_batches.front();
  return torch::cat(micro_batches, 0);
}

}  // namespace gpipe
