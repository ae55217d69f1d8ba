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

// widths.size()-1 blocks of [Linear(w_i, w_{i+1}), ReLU].
Workload linear_relu(const std::string& name, const std::vector<int64_t>& widths, int64_t batch, LayerRange keep) {
  Workload w;
  w.name = name;
  for (size_t i = 0; i + 1 < widths.size(); ++i) {
    add_layer(w.model, torch::nn::AnyModule(torch::nn::Linear(widths[i], widths[i + 1])), w.layers++, keep);
    add_layer(w.model, torch::nn::AnyModule(torch::nn::ReLU()), w.layers++, keep);
    w.block_layers.push_back(2);
  }
  w.input = torch::randn({batch, widths.front()});
  w.target = torch::randn({batch, widths.back()});
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

Workload make_workload(const std::string& name, uint64_t seed, LayerRange keep, bool tie_embeddings) {
  GPIPE_CHECK(!tie_embeddings || name == "transformer", "workload ", name, " has no embedding to tie; "
              "`tie_embeddings` is for the transformer workload");
  torch::manual_seed(seed);
  if (name == "mlp") return linear_relu(name, std::vector<int64_t>(17, 1024), 256, keep);
  if (name == "tiny") return linear_relu(name, std::vector<int64_t>(9, 64), 256, keep);
  if (name == "imbalanced")
    return linear_relu(name, {256, 512, 768, 1024, 1280, 1536, 1792, 2048, 2048}, 128, keep);
  if (name == "transformer") {
    const int64_t vocab = 2048, d_model = 256, batch = 32, tokens = 64;
    Workload w;
    w.name = name;
    const torch::nn::Embedding embedding(vocab, d_model);
    add_layer(w.model, torch::nn::AnyModule(embedding), w.layers++, keep);
    for (int b = 0; b < 8; ++b) {
      add_layer(w.model, torch::nn::AnyModule(EncoderBlock(d_model, 8, 1024, 0.0)), w.layers++, keep);
      w.block_layers.push_back(1);
    }
    if (tie_embeddings) {
      w.tied = {{"0.weight", std::to_string(w.layers) + ".weight"}};
      add_layer(w.model, torch::nn::AnyModule(TiedProjection(embedding->weight)), w.layers++, keep);
    } else {
      add_layer(w.model, torch::nn::AnyModule(torch::nn::Linear(d_model, vocab)), w.layers++, keep);
    }
    w.lead_layers = 1;
    w.tail_layers = 1;
    w.input = torch::randint(vocab, {batch, tokens}, torch::kLong);
    w.target = torch::randint(vocab, {batch, tokens}, torch::kLong);
    w.loss = cross_entropy_loss;
    return w;
  }
  if (name == "resnet" || name == "unet") {  // models.h, on a batch of random 28x28 images; a layer a block
    const bool resnet = name == "resnet";
    Workload w;
    w.name = name;
    w.model = resnet ? fashion_resnet(keep) : fashion_unet(keep);
    w.layers = resnet ? kFashionResnetLayers : kFashionUnetLayers;
    w.block_layers.assign(static_cast<size_t>(w.layers), 1);
    const int64_t batch = resnet ? 128 : 64;
    w.input = torch::randn({batch, 1, 28, 28});
    w.target = resnet ? torch::randint(10, {batch}, torch::kLong) : torch::randn({batch, 1, 28, 28});
    w.loss = resnet ? LossFn(cross_entropy_loss) : LossFn(mse_loss);
    return w;
  }
  std::string known;
  for (const auto& n : workload_names()) known += (known.empty() ? "" : ", ") + n;
  GPIPE_CHECK(false, "unknown workload \"", name, "\"; choose one of ", known);
  return {};
}

}  // namespace gpipe
