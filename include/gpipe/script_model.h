// script_model.h: a model saved in Python as a TorchScript nn.Sequential, as layers a pipeline can cut.
#pragma once

#include "gpipe/stage.h"
#include "gpipe/tensors.h"

#include <torch/nn/module.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/pimpl.h>
#include <torch/script.h>

#include <optional>
#include <string>

namespace gpipe {

/// One top-level child of a TorchScript module, as a layer a pipeline can cut.
/// Its parameters are the script module's own tensors (registered with '.'
/// written '_'), so optimizers step what the script module computes with.
/// A BatchNorm child (torch.nn.BatchNorm1d/2d/3d scripted) shows its running
/// statistics, so that the pipeline can update them once per mini-batch.
/// It may take and return a tuple of tensors (tensors.h): the pipeline calls it with
/// forward_value.
class ScriptLayerImpl : public torch::nn::Module, public RandomLayer, public BatchNormLayer, public ValueLayer {
 public:
  explicit ScriptLayerImpl(torch::jit::Module module);
  /// For a layer that takes and returns one tensor (torch::nn::Sequential's own forward).
  torch::Tensor forward(const torch::Tensor& x);
  torch::IValue forward_value(torch::IValue x) override;
  void train(bool on = true) override;
  /// The script module's own mode (a layer the Python model left in eval mode stays so).
  bool is_training() const noexcept override { return (rewritten_ ? original_ : module_).is_training(); }
  /// Whether its code (or its submodules') calls dropout or draws random numbers otherwise.
  bool draws_random_numbers() const override { return random_; }
  std::optional<RunningStatistics> running_statistics() override;
  std::string inner_batch_norm() const override { return inner_batch_norm_; }
  std::vector<RunningStatistics> deferring_norms_inside() const override;
  /// Its code's calls of torch.nn BatchNorms' forwards become the op gpipe::batch_norm: it runs a
  /// copy of its module, with types of its own, over the same parameters and buffers.
  void defer_batch_norms_inside() override;

 private:
  // Its submodules' modes as the module given has them (the caller may change one's).
  void take_modes();

  torch::jit::Module module_;
  torch::jit::Module original_;   // rewritten: the module given, whose copy module_ is
  bool random_ = false;
  bool rewritten_ = false;        // defer_batch_norms_inside has run
  std::string inner_batch_norm_;  // the first BatchNorm among its submodules (none once rewritten)
};
TORCH_MODULE(ScriptLayer);

/// A TorchScript model's layers, and the module they came from (whose tensors
/// they share: training the layers trains the module).
struct ScriptModel {
  torch::nn::Sequential layers;
  torch::jit::Module script;
};

/// Loads a module saved in Python with
/// `torch.jit.script(torch.nn.Sequential(...)).save(path)`; its top-level
/// children become the layers. Throws std::runtime_error naming the file and
/// the problem, also for a module that is not an nn.Sequential (its own
/// forward would not be the chain of its children).
ScriptModel load_script_model(const std::string& path);

/// The same for a module already loaded (or scripted in this process);
/// `origin` names it in errors ("model.pt", "the scripted model").
ScriptModel script_model(torch::jit::Module module, const std::string& origin);

}  // namespace gpipe
