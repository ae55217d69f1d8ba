// models.cc: the CNN, the residual network and the U-Net of models.h, as flat Sequentials with Stash and Pop;
// the byte-level GPT, its head tied to its embedding.
#include "gpipe/models.h"

#include "gpipe/check.h"
#include "gpipe/skip.h"
#include "gpipe/workloads.h"

#include <torch/torch.h>

#include <cmath>
#include <limits>
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

// ---------------------------------------------------------------- the byte-level GPT

namespace {

// Layer 0: a byte's vector plus its position's.
class GptEmbeddingImpl : public nn::Module {
 public:
  GptEmbeddingImpl(int64_t context, int64_t width) {
    bytes = register_module("bytes", nn::Embedding(256, width));
    positions = register_parameter("positions", torch::empty({context, width}));
    torch::NoGradGuard no_grad;
    nn::init::normal_(bytes->weight, 0.0, 0.02);
    nn::init::normal_(positions, 0.0, 0.02);
  }
  torch::Tensor forward(const torch::Tensor& x) {
    GPIPE_CHECK(x.dim() == 2 && x.size(1) <= positions.size(0), "the GPT takes bytes [N, t] with t at most its ",
                "context of ", positions.size(0), " (got ", x.sizes(), ")");
    return bytes->forward(x) + positions.narrow(0, 0, x.size(1));
  }
  nn::Embedding bytes{nullptr};
  torch::Tensor positions;
};
TORCH_MODULE(GptEmbedding);

nn::Linear gpt_linear(int64_t in, int64_t out, double stddev) {
  nn::Linear l(in, out);
  torch::NoGradGuard no_grad;
  nn::init::normal_(l->weight, 0.0, stddev);
  nn::init::zeros_(l->bias);
  return l;
}

// A pre-LayerNorm block: x + attention(LN(x)), then x + MLP(LN(x)).
class GptBlockImpl : public nn::Module {
 public:
  explicit GptBlockImpl(const GptOptions& o) : heads_(o.heads), dropout_(o.dropout) {
    const double residual = 0.02 / std::sqrt(2.0 * static_cast<double>(o.blocks));
    ln1_ = register_module("ln1", nn::LayerNorm(nn::LayerNormOptions({o.width})));
    qkv_ = register_module("qkv", gpt_linear(o.width, 3 * o.width, 0.02));
    proj_ = register_module("proj", gpt_linear(o.width, o.width, residual));
    ln2_ = register_module("ln2", nn::LayerNorm(nn::LayerNormOptions({o.width})));
    up_ = register_module("up", gpt_linear(o.width, o.feed_forward, 0.02));
    down_ = register_module("down", gpt_linear(o.feed_forward, o.width, residual));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    const int64_t N = x.size(0), t = x.size(1), d = x.size(2), h = heads_;
    // [N, t, 3d] -> q, k, v of [N, h, t, d/h]
    const auto qkv = qkv_->forward(ln1_->forward(x)).view({N, t, 3, h, d / h}).permute({2, 0, 3, 1, 4});
    const torch::Tensor q = qkv[0], k = qkv[1], v = qkv[2];
    torch::Tensor scores = torch::matmul(q, k.transpose(-2, -1)) / std::sqrt(static_cast<double>(d / h));
    const torch::Tensor future = torch::ones({t, t}, torch::TensorOptions().dtype(torch::kBool)).triu(1);
    scores = scores.masked_fill(future, -std::numeric_limits<float>::infinity());
    torch::Tensor weights = torch::softmax(scores, -1);
    weights = nn::functional::dropout(weights, nn::functional::DropoutFuncOptions().p(dropout_).training(is_training()));
    const torch::Tensor heads = torch::matmul(weights, v).transpose(1, 2).reshape({N, t, d});
    torch::Tensor y = x + drop(proj_->forward(heads));
    return y + drop(down_->forward(torch::gelu(up_->forward(ln2_->forward(y)))));
  }

 private:
  torch::Tensor drop(const torch::Tensor& x) {
    return dropout_ > 0 ? nn::functional::dropout(x, nn::functional::DropoutFuncOptions().p(dropout_).training(is_training()))
                        : x;
  }
  int64_t heads_;
  double dropout_;
  nn::LayerNorm ln1_{nullptr}, ln2_{nullptr};
  nn::Linear qkv_{nullptr}, proj_{nullptr}, up_{nullptr}, down_{nullptr};
};
TORCH_MODULE(GptBlock);

}  // namespace

void GptOptions::check() const {
  GPIPE_CHECK(context >= 1 && width >= 1 && heads >= 1 && blocks >= 1 && feed_forward >= 1,
              "the GPT's sizes must be at least 1 (context ", context, ", width ", width, ", heads ", heads,
              ", blocks ", blocks, ", feed-forward ", feed_forward, ")");
  GPIPE_CHECK(width % heads == 0, "the GPT's width ", width, " is not a multiple of its ", heads, " heads");
  GPIPE_CHECK(dropout >= 0 && dropout < 1, "the GPT's dropout must be in [0, 1) (got ", dropout, ")");
}

std::vector<std::vector<std::string>> GptOptions::tied() const {
  return {{"0.bytes.weight", std::to_string(layers() - 1) + ".weight"}};
}

torch::nn::Sequential byte_gpt(const GptOptions& o, LayerRange keep) {
  o.check();
  Builder b(keep);
  const GptEmbedding embedding(o.context, o.width);
  b.add(embedding);
  for (int64_t n = 0; n < o.blocks; ++n) b.add(GptBlock(o));
  b.add(nn::LayerNorm(nn::LayerNormOptions({o.width})));
  const TiedProjection head(embedding->bytes->weight);
  {
    torch::NoGradGuard no_grad;
    head->bias.zero_();
  }
  b.add(head);
  return b.model;
}

}  // namespace gpipe
