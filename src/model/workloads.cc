// workloads.cc: the benchmark models, built exactly as docs/benchmarks.md ("The workloads") defines them.
#include "gpipe/workloads.h"

#include "gpipe/check.h"
#include "gpipe/models.h"
#include "gpipe/plan.h"

#include <torch/torch.h>

#include <cmath>

namespace gpipe {

EncoderBlockImpl::EncoderBlockImpl(int64_t d_model, int64_t heads, int64_t feed_forward,
                                   double dropout) {
  layer_ = register_module(
      "layer", torch::nn::TransformerEncoderLayer(torch::nn::TransformerEncoderLayerOptions(d_model, heads)
                                                      .dim_feedforward(feed_forward)
                                                      .dropout(dropout)));
}

torch::Tensor EncoderBlockImpl::forward(const torch::Tensor& x) {
  return layer_->forward(x.transpose(0, 1)).transpose(0, 1);
}

CutRequest Workload::cut() const { return CutRequest::blocks(block_layers, lead_layers, tail_layers); }

std::vector<int> Workload::balance(int stages) const { return cut().resolve(layers, stages); }

std::vector<std::string> workload_names() { return {"mlp", "transformer", "tiny", "imbalanced", "resnet", "unet"}; }

namespace {

// What a build makes: the layers `keep` holds, the input and the target from the seed; or, for
// workload_shape, nothing but the counts and an uninitialised input and target of the right shapes.
struct Build {
  LayerRange keep;
  bool values = true;

  // Appends the layer make() returns (as layer w.layers); for a shape, only counts it.
  template <typename Make>
  void add(Workload& w, Make make) const {
    if (values) add_layer(w.model, torch::nn::AnyModule(make()), w.layers, keep);
    ++w.layers;
  }
  torch::Tensor normal(at::IntArrayRef shape) const { return values ? torch::randn(shape) : torch::empty(shape); }
  torch::Tensor classes(int64_t n, at::IntArrayRef shape) const {
    return values ? torch::randint(n, shape, torch::kLong) : torch::empty(shape, torch::kLong);
  }
};

// widths.size()-1 blocks of [Linear(w_i, w_{i+1}), ReLU].
Workload linear_relu(const std::string& name, const std::vector<int64_t>& widths, int64_t batch, const Build& build) {
  Workload w;
  w.name = name;
  for (size_t i = 0; i + 1 < widths.size(); ++i) {
    build.add(w, [&] { return torch::nn::Linear(widths[i], widths[i + 1]); });
    build.add(w, [] { return torch::nn::ReLU(); });
    w.block_layers.push_back(2);
  }
  w.input = build.normal({batch, widths.front()});
  w.target = build.normal({batch, widths.back()});
  w.loss = mse_loss;
  return w;
}

}  // namespace

TiedProjectionImpl::TiedProjectionImpl(torch::Tensor weight_, bool with_bias) {
  GPIPE_CHECK(weight_.defined() && weight_.dim() == 2, "a tied projection needs a 2-D weight [out, in] (got ",
              weight_.defined() ? weight_.sizes() : c10::IntArrayRef{}, ")");
  weight = register_parameter("weight", weight_);
  if (with_bias) {
    const double bound = 1.0 / std::sqrt(static_cast<double>(weight.size(1)));
    bias = register_parameter("bias", torch::empty({weight.size(0)}, weight.options()).uniform_(-bound, bound));
  }
}

torch::Tensor TiedProjectionImpl::forward(const torch::Tensor& x) {
  return torch::nn::functional::linear(x, weight, bias);
}

namespace {

Workload build_workload(const std::string& name, uint64_t seed, const Build& build, bool tie_embeddings) {
  GPIPE_CHECK(!tie_embeddings || name == "transformer", "workload ", name, " has no embedding to tie; "
              "`tie_embeddings` is for the transformer workload");
  if (build.values) torch::manual_seed(seed);
  if (name == "mlp") return linear_relu(name, std::vector<int64_t>(17, 1024), 256, build);
  if (name == "tiny") return linear_relu(name, std::vector<int64_t>(9, 64), 256, build);
  if (name == "imbalanced")
    return linear_relu(name, {256, 512, 768, 1024, 1280, 1536, 1792, 2048, 2048}, 128, build);
  if (name == "transformer") {
    const int64_t vocab = 2048, d_model = 256, batch = 32, tokens = 64;
    Workload w;
    w.name = name;
    torch::nn::Embedding embedding{nullptr};
    build.add(w, [&] { return embedding = torch::nn::Embedding(vocab, d_model); });
    for (int b = 0; b < 8; ++b) {
      build.add(w, [&] { return EncoderBlock(d_model, 8, 1024, 0.0); });
      w.block_layers.push_back(1);
    }
    if (tie_embeddings) {
      w.tied = {{"0.weight", std::to_string(w.layers) + ".weight"}};
      build.add(w, [&] { return TiedProjection(embedding->weight); });
    } else {
      build.add(w, [&] { return torch::nn::Linear(d_model, vocab); });
    }
    w.lead_layers = 1;
    w.tail_layers = 1;
    w.input = build.classes(vocab, {batch, tokens});
    w.target = build.classes(vocab, {batch, tokens});
    w.loss = cross_entropy_loss;
    return w;
  }
  if (name == "resnet" || name == "unet") {  // models.h, on a batch of random 28x28 images; a layer a block
    const bool resnet = name == "resnet";
    Workload w;
    w.name = name;
    if (build.values) w.model = resnet ? fashion_resnet(build.keep) : fashion_unet(build.keep);
    w.layers = resnet ? kFashionResnetLayers : kFashionUnetLayers;
    w.block_layers.assign(static_cast<size_t>(w.layers), 1);
    const int64_t batch = resnet ? 128 : 64;
    w.input = build.normal({batch, 1, 28, 28});
    w.target = resnet ? build.classes(10, {batch}) : build.normal({batch, 1, 28, 28});
    w.loss = resnet ? LossFn(cross_entropy_loss) : LossFn(mse_loss);
    return w;
  }
  std::string known;
  for (const auto& n : workload_names()) known += (known.empty() ? "" : ", ") + n;
  GPIPE_CHECK(false, "unknown workload \"", name, "\"; choose one of ", known);
  return {};
}

}  // namespace

Workload make_workload(const std::string& name, uint64_t seed, LayerRange keep, bool tie_embeddings) {
  return build_workload(name, seed, Build{keep, true}, tie_embeddings);
}

Workload workload_shape(const std::string& name, bool tie_embeddings) {
  return build_workload(name, 0, Build{LayerRange{0, 0}, false}, tie_embeddings);
}

}  // namespace gpipe
