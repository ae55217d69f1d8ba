// workloads.h: the benchmark models of docs/benchmarks.md (mlp, transformer, tiny, imbalanced, resnet, unet),
// a batch-first encoder block and a tied output projection.
#pragma once

#include "gpipe/layers.h"
#include "gpipe/plan.h"
#include "gpipe/stage.h"

#include <torch/nn/module.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/transformerlayer.h>
#include <torch/nn/pimpl.h>

#include <limits>
#include <string>
#include <vector>

namespace gpipe {

/// A TransformerEncoderLayer on batch-first input [batch, sequence, d_model]
/// (libtorch's C++ layer wants the sequence first), so a pipeline can split
/// dim 0 into micro-batches.
class EncoderBlockImpl : public torch::nn::Module {
 public:
  EncoderBlockImpl(int64_t d_model, int64_t heads, int64_t feed_forward, double dropout);
  torch::Tensor forward(const torch::Tensor& x);

 private:
  torch::nn::TransformerEncoderLayer layer_{nullptr};
};
TORCH_MODULE(EncoderBlock);

/// An output projection that reads another layer's weight: y = x·Wᵀ + b, with W
/// (out × in) registered here as the same tensor, e.g. a language model's input
/// embedding [vocab, d_model] reused as its output layer (tied embeddings). On
/// one stage or two in one process, W stays one tensor (Pipeline); across MPI
/// ranks, declare the pair in PipelineOptions::tied_parameters.
class TiedProjectionImpl : public torch::nn::Module {
 public:
  /// With `bias`, a bias of W.size(0) values drawn as torch::nn::Linear draws its own.
  explicit TiedProjectionImpl(torch::Tensor weight, bool bias = true);
  torch::Tensor forward(const torch::Tensor& x);
  torch::Tensor weight;
  torch::Tensor bias;
};
TORCH_MODULE(TiedProjection);

/// A model with a mini-batch and a loss to train it on.
struct Workload {
  std::string name;
  torch::nn::Sequential model;  ///< the layers kept (all of them by default)
  int layers = 0;               ///< layers of the whole model
  torch::Tensor input;
  torch::Tensor target;
  LossFn loss;
  /// The cut of its blocks (PipelineOptions::cut): blocks split evenly, anything before the first
  /// block (an embedding) rides with the first stage, the head with the last.
  CutRequest cut() const;
  /// That cut resolved for `stages` stages: cut().resolve(layers, stages).
  std::vector<int> balance(int stages) const;

  std::vector<int> block_layers;  ///< layers in each block, in order
  int lead_layers = 0;            ///< layers before the first block
  int tail_layers = 0;            ///< layers after the last block
  /// Parameters tied across layers, by name (PipelineOptions::tied_parameters).
  std::vector<std::vector<std::string>> tied;
};

/// The names make_workload knows: mlp, transformer, tiny, imbalanced, resnet, unet.
std::vector<std::string> workload_names();

/// Builds workload `name` as docs/benchmarks.md ("The workloads") defines it, with seed
/// `seed` (model, input and target), in float32, keeping the layers in `keep`.
/// With `tie_embeddings` (the transformer only), its output layer is a
/// TiedProjection of the embedding's weight. Throws std::invalid_argument for
/// an unknown name, or tie_embeddings for a workload without embeddings.
Workload make_workload(const std::string& name, uint64_t seed = 0, LayerRange keep = {}, bool tie_embeddings = false);

/// Workload `name`'s shape: its layer count, blocks, loss, tied names, and an input and a target of
/// the right shapes and types but no values; no layer is built and no random number drawn (what a
/// task list or a cut needs, at no cost).
Workload workload_shape(const std::string& name, bool tie_embeddings = false);

}  // namespace gpipe
