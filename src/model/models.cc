// models.cc: the CNN, the residual network and the U-Net of models.h, as flat Sequentials with Stash and Pop.
#include "gpipe/models.h"

#include "gpipe/skip.h"

#include <torch/torch.h>

#include <string>

namespace gpipe {
namespace {

namespace nn = torch::nn;
using torch::indexing::None;
using torch::indexing::Slice;

nn::Conv2d conv3x3(int64_t in, int64_t out, int64_t stride, bool bias) {
  return nn::Conv2d(nn::Conv2dOptions(in, out, 3).stride(stride).padding(1).bias(bias));
}

// Appends layers in order, keeping those `keep` holds.
struct Builder {
  explicit Builder(LayerRange range) : keep(range) {}
  LayerRange keep;
  nn::Sequential model;
  int n = 0;
  template <typename Layer>
  void add(Layer layer) {
    add_layer(model, nn::AnyModule(layer), n++, keep);
  }
};

}  // namespace

nn::Sequential fashion_cnn(LayerRange keep) {
  Builder b(keep);
  b.add(nn::Conv2d(nn::Conv2dOptions(1, 32, 3).padding(1)));
  b.add(nn::ReLU());
  b.add(nn::MaxPool2d(2));
  b.add(nn::Conv2d(nn::Conv2dOptions(32, 64, 3).padding(1)));
  b.add(nn::ReLU());
  b.add(nn::MaxPool2d(2));
  b.add(nn::Flatten());
  b.add(nn::Linear(64 * 7 * 7, 256));
  b.add(nn::ReLU());
  b.add(nn::Dropout(0.3));
  b.add(nn::Linear(256, 10));
  return b.model;
}

torch::nn::Sequential fashion_resnet(LayerRange keep) {
  Builder b(keep);
  b.add(conv3x3(1, 16, 1, false));
  b.add(nn::BatchNorm2d(16));
  b.add(nn::ReLU());
  int64_t in = 16;
  for (const int64_t width : {32, 64, 128}) {
    const std::string name = "block" + std::to_string(width);
    // Each block halves the pixels (its first conv has stride 2) and doubles the channels; its
    // shortcut takes every other pixel and pads the new channels with zeros: no parameters, so
    // what crosses stages is the stashed tensor itself.
    const SkipMerge shortcut = [in, width](const torch::Tensor& x, const torch::Tensor& skip) {
      const torch::Tensor sampled = skip.index({Slice(), Slice(), Slice(None, None, 2), Slice(None, None, 2)});
      return x + torch::constant_pad_nd(sampled, {0, 0, 0, 0, 0, width - in});
    };
    b.add(Stash(name));
    b.add(conv3x3(in, width, 2, false));
    b.add(nn::BatchNorm2d(width));
    b.add(nn::ReLU());
    b.add(conv3x3(width, width, 1, false));
    b.add(nn::BatchNorm2d(width));
    b.add(Pop(name, shortcut));
    b.add(nn::ReLU());
    in = width;
  }
  b.add(nn::AdaptiveAvgPool2d(1));
  b.add(nn::Flatten());
  b.add(nn::Linear(128, 10));
  return b.model;
}

torch::nn::Sequential fashion_unet(LayerRange keep) {
  Builder b(keep);
  auto conv = [&b](int64_t in, int64_t out) {
    b.add(conv3x3(in, out, 1, true));
    b.add(nn::ReLU());
  };
  auto up = [&b] { b.add(nn::Upsample(nn::UpsampleOptions().scale_factor(std::vector<double>{2, 2}))); };
  conv(1, 16);
  conv(16, 16);
  b.add(Stash("28"));
  b.add(nn::MaxPool2d(2));
  conv(16, 32);
  conv(32, 32);
  b.add(Stash("14"));
  b.add(nn::MaxPool2d(2));
  conv(32, 64);
  conv(64, 64);
  up();
  conv(64, 32);
  b.add(Pop("14", concat_skip));
  conv(64, 32);
  up();
  conv(32, 16);
  b.add(Pop("28", concat_skip));
  conv(32, 16);
  b.add(nn::Conv2d(nn::Conv2dOptions(16, 1, 1)));
  return b.model;
}

}  // namespace gpipe
