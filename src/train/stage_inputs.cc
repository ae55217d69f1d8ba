// stage_inputs.cc: what crosses each boundary of a cut under MPI, and a layer that begins a stage and
// changes its input in place only with a graph, found before any step.
#include "gpipe/train.h"

#include "gpipe/check.h"
#include "gpipe/partition.h"
#include "gpipe/skip.h"

#include <torch/torch.h>

#include <map>
#include <optional>
#include <string>

namespace gpipe {

namespace {

// Refuses layer `layer`, the first of stage `stage`, where it changes its input `x` in place when that
// input takes a gradient (as a stage's does).
void check_in_place_only_with_a_graph(torch::nn::AnyModule& module, const Tensors& x, const std::string& name,
                                      const std::string& key, int layer, int stage, const std::vector<int>& balance) {
  const Tensors input = leaves_of(copy_of(x), LeafGrad::kFloating);  // as a stage's input in training
  const std::vector<int64_t> versions = versions_of(input);
  std::string why;
  try {
    run_layer(module, input, name);
    if (const std::string changed = changed_in_place(input, versions); !changed.empty())
      why = "it changes " + changed + " in place";
  } catch (const std::exception& e) {
    why = short_error(e);
    if (why.find("in-place") == std::string::npos && why.find("inplace") == std::string::npos) throw;
  }
  while (!why.empty() && (why.back() == '.' || why.back() == ' ')) why.pop_back();
  GPIPE_CHECK(why.empty(), "layer " + std::to_string(layer) + " ('" + key +
              "') begins stage " + std::to_string(stage) + " of the cut " + format_balance(balance) +
              ", and where its input takes a gradient " + why + " (without one it does not, so gpipe cannot "
              "find it beforehand and run it on a copy); a stage keeps its input for the backward pass: make "
              "the layer return a new tensor, or cut elsewhere with `balance`");
}

}  // namespace

void check_stage_inputs(const Model& model, const Tensors& sample, const std::vector<int>& balance,
                        int most_boundary_tensors) {
  const std::vector<int> offsets = stage_offsets(balance);
  const RandomStateGuard guard;  // building the model draws random numbers
  torch::nn::Sequential whole = model.build(LayerRange{});
  whole->eval();
  const auto names = whole->named_children();
  std::map<std::string, torch::Tensor> tray;  // where the model's Stash and Pop meet (skip.h)
  const detail::SkipTrayScope scope(tray);
  Tensors x = sample;
  size_t next = 1;  // the next stage whose first layer is checked: stage 0's input needs no gradient
  for (int layer = 0; layer < static_cast<int>(whole->size()) && next + 1 < offsets.size(); ++layer) {
    auto module = *(whole->begin() + layer);
    const std::string name = layer_name(names[static_cast<size_t>(layer)].key());
    if (layer == offsets[next]) {
      ++next;
      GPIPE_CHECK(most_boundary_tensors <= 0 || static_cast<int>(x.size()) <= most_boundary_tensors, "layer ",
                  layer - 1, " ('", names[static_cast<size_t>(layer - 1)].key(), "') ends stage ", next - 2,
                  " of the cut ", format_balance(balance), " and passes ", x.size(), " tensors to stage ", next - 1,
                  ", more than one MPI message carries (", most_boundary_tensors, "); cut elsewhere with `balance`, "
                  "or pass fewer tensors from layer to layer (stack those of one shape into one)");
      // One that changes its input in place without a graph runs on a copy of it (the stage finds it so);
      // one that does so only with a graph, as the stage runs it, would fail in step 1.
      // (Each run on the tray as it was: a Pop takes what it pops.)
      const std::map<std::string, torch::Tensor> before = tray;
      const std::optional<std::vector<bool>> found =
          layers_changing_their_input(torch::nn::Sequential(module), x, {name});
      tray = before;
      if (!found || !found->front())
        check_in_place_only_with_a_graph(module, x, name, names[static_cast<size_t>(layer)].key(), layer,
                                         static_cast<int>(next) - 1, balance);
      tray = before;
    }
    torch::NoGradGuard no_grad;
    x = run_layer(module, copy_of(x), name);
  }
  whole->train();
}

}  // namespace gpipe
