// models.h: the built-in models of 28x28 grayscale images (Fashion-MNIST): a small CNN (gpipe
// train's default), and two whose skip connections cross stages: a residual network that
// classifies and a U-Net that denoises. Each is one flat
// Sequential: every BatchNorm a layer of its own (its running statistics deferred to the end
// of the step), every skip connection a Stash and a Pop (skip.h), so a pipeline may cut it
// anywhere, even inside a residual block.
#pragma once

#include "gpipe/layers.h"

#include <torch/nn/modules/container/sequential.h>

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

}  // namespace gpipe
