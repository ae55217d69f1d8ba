// layers.h: building a model's layers by range, so that an MPI rank builds only its stages' and
// every rank's layers start from the same values as one process's.
#pragma once

#include <torch/nn/modules/container/any.h>
#include <torch/nn/modules/container/sequential.h>

#include <functional>
#include <limits>
#include <string>

namespace gpipe {

/// The layers [first, last) of a model that a builder keeps. An MPI rank keeps
/// only its stage's: the builder still creates every layer in order, so each
/// draws the same random numbers as in the whole model, but drops the others
/// at once, so a rank never holds more than its stage and one layer.
struct LayerRange {
  int first = 0;
  int last = std::numeric_limits<int>::max();
  bool contains(int layer) const { return layer >= first && layer < last; }
};

/// Appends `layer` (the model's layer number `index`) to `model`, named by
/// that number, if `keep` holds it.
inline void add_layer(torch::nn::Sequential& model, const torch::nn::AnyModule& layer, int index, LayerRange keep) {
  if (keep.contains(index)) model->push_back(std::to_string(index), layer);
}

/// Builds the layers of a model that `keep` holds, each named by its index in
/// the whole model (add_layer does both). It is called once for the whole
/// model in one process, and once per stage on an MPI rank, so it must build
/// the same layers with the same initial values whatever range it is asked
/// for: seed the generator first, create every layer in order, keep the range.
///
///   gpipe::LayerBuilder build = [](gpipe::LayerRange keep) {
///     torch::manual_seed(0);
///     torch::nn::Sequential model;
///     gpipe::add_layer(model, torch::nn::AnyModule(torch::nn::Linear(8, 8)), 0, keep);
///     gpipe::add_layer(model, torch::nn::AnyModule(torch::nn::ReLU()), 1, keep);
///     return model;
///   };
using LayerBuilder = std::function<torch::nn::Sequential(LayerRange keep)>;

}  // namespace gpipe
