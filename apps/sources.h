// sources.h: where `gpipe train` gets its model and data: built in, or saved from Python.
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/pimpl.h>
#include <torch/script.h>

#include <gpipe/stage.h>

#include <optional>
#include <string>

namespace gpipe::cli {

/// One top-level child of a TorchScript module, as a layer a pipeline can cut.
/// Its parameters are the script module's own tensors (registered with '.'
/// written '_'), so optimizers step what the script module computes with.
/// A BatchNorm child (torch.nn.BatchNorm1d/2d/3d scripted) shows its running
/// statistics, so that the pipeline can update them once per mini-batch.
class ScriptLayerImpl : public torch::nn::Module, public gpipe::RandomLayer, public gpipe::BatchNormLayer {
 public:
  explicit ScriptLayerImpl(torch::jit::Module module);
  torch::Tensor forward(const torch::Tensor& x);
  void train(bool on = true) override;
  /// Whether its code (or its submodules') calls dropout or draws random numbers otherwise.
  bool draws_random_numbers() const override { return random_; }
  std::optional<gpipe::RunningStatistics> running_statistics() override;
  std::string inner_batch_norm() const override { return inner_batch_norm_; }

 private:
  torch::jit::Module module_;
  bool random_ = false;
  std::string inner_batch_norm_;  // the first BatchNorm among its submodules
};
TORCH_MODULE(ScriptLayer);

/// A model to train: layers for the pipeline, and the TorchScript module they
/// came from, if any (it is what --save writes then).
struct ModelSource {
  torch::nn::Sequential layers;
  std::optional<torch::jit::Module> script;
};

/// Loads a module saved in Python with
/// `torch.jit.script(torch.nn.Sequential(...)).save(path)`; its top-level
/// children become the layers. Throws std::runtime_error naming the file and
/// the problem, also for a module that is not an nn.Sequential (its own
/// forward would not be the chain of its children).
ModelSource load_script_model(const std::string& path);

/// Reads a dataset saved in Python with `torch.save({'input': X, 'target': Y}, path)`.
/// Throws std::runtime_error naming the file and the problem: missing keys,
/// different row counts, no rows, NaN or infinite values.
std::pair<torch::Tensor, torch::Tensor> load_tensor_data(const std::string& path);

/// The file's bytes; throws std::runtime_error naming a missing or unreadable file, or a folder.
std::string read_file(const std::string& path);

/// What torch.save (or torch::pickle_save) wrote into `bytes`.
torch::IValue load_torch_save(const std::string& bytes);

/// An exception's message, without libtorch's C++ stack frames.
std::string what_of(const std::exception& e);

/// gpipe --verbose: libtorch's and TorchScript's whole reports in error messages.
bool& verbose_errors();

/// "[2, 3]".
std::string shape_text(const torch::Tensor& t);

}  // namespace gpipe::cli
