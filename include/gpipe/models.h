// models.h: the built-in models of 28x28 grayscale images (Fashion-MNIST): a small CNN (gpipe
// train's default), and two whose skip connections cross stages: a residual network that
// classifies and a U-Net that denoises; and a byte-level language model, a decoder-only
// Transformer whose output layer is tied to its embedding. Each is one flat
// Sequential: every BatchNorm a layer of its own (its running statistics deferred to the end
// of the step), every skip connection a Stash and a Pop (skip.h), so a pipeline may cut it
// anywhere, even inside a residual block.
#pragma once

#include "gpipe/layers.h"

#include <torch/nn/modules/container/sequential.h>

#include <cstdint>
#include <string>
#include <vector>

namespace gpipe {

/// A small CNN for [N, 1, 28, 28] images, scores for 10 classes: two
/// convolution blocks and a classifier, 11 layers:
///
///   conv 3x3 (32) · ReLU · pool · conv 3x3 (64) · ReLU · pool · Flatten ·
///   Linear(3136, 256) · ReLU · Dropout(0.3) · Linear(256, 10)
///
/// Built as LayerBuilder wants: every layer created in order, those in `keep` kept.
torch::nn::Sequential fashion_cnn(LayerRange keep = {});
constexpr int kFashionCnnLayers = 11;

/// A residual network for [N, 1, 28, 28] images, scores for 10 classes:
///
///   stem   conv 3x3 (16 channels) · BatchNorm · ReLU                              28 x 28
///   3 residual blocks of 32, 64 and 128 channels, at 14 x 14, 7 x 7 and 4 x 4, each
///          Stash · conv 3x3 stride 2 · BatchNorm · ReLU · conv 3x3 · BatchNorm · Pop(+) · ReLU
///          (the shortcut takes every other pixel and pads the new channels with zeros)
///   head   global average pool · Flatten · Linear(128, 10)
///
/// 30 layers, 0.29M parameters, the convolutions without bias (BatchNorm follows).
/// Built as LayerBuilder wants: every layer created in order, those in `keep` kept.
torch::nn::Sequential fashion_resnet(LayerRange keep = {});
constexpr int kFashionResnetLayers = 30;

/// A U-Net for [N, 1, 28, 28] images to images of the same shape:
///
///   conv 16 · conv 16 · Stash("28") · pool · conv 32 · conv 32 · Stash("14") · pool   encoder
///   conv 64 · conv 64                                                                  7 x 7
///   up · conv 32 · Pop("14", concat) · conv 32 · up · conv 16 · Pop("28", concat) · conv 16 · conv 1x1
///
/// Each conv 3x3 followed by ReLU, every pop a concatenation of channels (the
/// long skips), 29 layers.
torch::nn::Sequential fashion_unet(LayerRange keep = {});
constexpr int kFashionUnetLayers = 29;

/// The shape of byte_gpt's language model.
struct GptOptions {
  int64_t context = 128;     ///< T: bytes a sample holds, and the most the model looks back
  int64_t width = 128;       ///< d_model: the width of the embedding and of every block
  int64_t heads = 4;         ///< attention heads (width a multiple of them)
  int64_t blocks = 4;        ///< Transformer blocks
  int64_t feed_forward = 512;  ///< the hidden width of each block's MLP
  double dropout = 0;        ///< after attention weights and each residual branch
  /// Layers of the Sequential: the embedding, the blocks, the final LayerNorm, the head.
  int layers() const { return static_cast<int>(blocks) + 3; }
  /// The parameters the head shares with the embedding, by name (PipelineOptions::tied_parameters).
  std::vector<std::vector<std::string>> tied() const;
  /// Throws std::invalid_argument for a size below 1, a width that the heads do not divide, or a
  /// dropout outside [0, 1).
  void check() const;
};

/// A decoder-only Transformer over bytes (vocabulary 256): int64 [N, t] bytes (t <= context) to
/// scores [N, t, 256] for the byte after each, causal (position p sees positions 0..p):
///
///   0          embedding: a byte's vector (256 x width) + a learned vector per position
///   1..blocks  pre-LayerNorm blocks: x + attention(LN(x)), then x + MLP(LN(x)) (GELU)
///   blocks+1   LayerNorm
///   blocks+2   the head: scores = x · Eᵀ + b, E the embedding's byte vectors (tied: one tensor)
///
/// Between any two layers one tensor, the hidden states [N, t, width]. Weights drawn as GPT-2's
/// (normal, standard deviation 0.02; the residual projections 0.02/√(2·blocks)), biases zero.
/// Built as LayerBuilder wants: every layer created in order, those in `keep` kept; the head
/// reads the embedding's tensor even when the embedding is not kept (MPI ranks tie the copies).
torch::nn::Sequential byte_gpt(const GptOptions& options = {}, LayerRange keep = {});

}  // namespace gpipe
