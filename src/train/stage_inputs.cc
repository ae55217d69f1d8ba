// stage_inputs.cc: a layer that begins a stage and changes its input in place, found before any step.
#include "gpipe/train.h"

#include "gpipe/check.h"
#include "gpipe/partition.h"

#include <torch/torch.h>

namespace gpipe {

void check_stage_inputs(const Model& model, const Tensors& sample, const std::vector<int>& balance,
                        int most_boundary_tensors) {
  const std::vector<int> offsets = stage_offsets(balance);
  const RandomStateGuard guard;  // building the model draws random numbers
  torch::nn::Sequential whole = model.build(LayerRange{});
  whole->eval();
  const auto names = whole->named_children();
  Tensors x = sample;
  size_t next = 1;  // the next stage whose first layer is checked: stage 0's input needs no gradient
  for (int layer = 0; layer < static_cast<int>(whole->size()) && next + 1 < offsets.size(); ++layer) {
    auto module = *(whole->begin() + layer);
    const std::string name = layer_name(names[static_cast<size_t>(layer)].key());
    if (layer != offsets[next]) {
      torch::NoGradGuard no_grad;
      x = run_layer(module, x, name);
      continue;
    }
    ++next;
    GPIPE_CHECK(most_boundary_tensors <= 0 || static_cast<int>(x.size()) <= most_boundary_tensors, "layer ",
                layer - 1, " ('", names[static_cast<size_t>(layer - 1)].key(), "') ends stage ", next - 2,
                " of the cut ", format_balance(balance), " and passes ", x.size(), " tensors to stage ", next - 1,
                ", more than one MPI message carries (", most_boundary_tensors, "); cut elsewhere with `balance`, "
                "or pass fewer tensors from layer to layer (stack those of one shape into one)");
    Tensors input = x;
    for (auto& t : input.items) t = t.detach().clone().requires_grad_(t.is_floating_point());
    const std::vector<int64_t> versions = versions_of(input);
    std::string why;
    try {
      x = leaves_of(run_layer(module, input, name), LeafGrad::kNone);
      if (const std::string changed = changed_in_place(input, versions); !changed.empty())
        why = "it changes " + changed + " in place";
    } catch (const std::exception& e) {
      why = short_error(e);
      if (why.find("in-place") == std::string::npos && why.find("inplace") == std::string::npos) throw;
    }
    while (!why.empty() && (why.back() == '.' || why.back() == ' ')) why.pop_back();
    if (!why.empty())
      GPIPE_CHECK(false, "layer " + std::to_string(layer) + " ('" + names[static_cast<size_t>(layer)].key() +
                  "') begins stage " + std::to_string(next - 1) + " of the cut " + format_balance(balance) +
                  ", and " + why + "; a stage keeps its input for the backward pass: make the layer return a new "
                  "tensor (e.g. ReLU(inplace=False))" + (next > 1 ? ", or cut elsewhere with `balance`" : ""));
  }
  whole->train();
}


}  // namespace gpipe
