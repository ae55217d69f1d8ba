// sources.cc: TorchScript models and torch.save'd datasets from Python.
#include "sources.h"

#include <torch/torch.h>
#include <torch/csrc/jit/runtime/graph_executor.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>

namespace gpipe::cli {

ScriptLayerImpl::ScriptLayerImpl(torch::jit::Module module) : module_(std::move(module)) {
  for (const auto& p : module_.named_parameters(/*recurse=*/true)) {
    std::string name = p.name;
    std::replace(name.begin(), name.end(), '.', '_');
    register_parameter(name, p.value, p.value.requires_grad());
  }
}

torch::Tensor ScriptLayerImpl::forward(const torch::Tensor& x) {
  return module_.forward({x}).toTensor();
}

void ScriptLayerImpl::train(bool on) {
  torch::nn::Module::train(on);
  module_.train(on);
}

std::string read_file(const std::string& path) {
  if (!std::filesystem::is_regular_file(path)) throw std::runtime_error("no such file: " + path);
  std::ifstream in(path, std::ios::binary);
  std::ostringstream bytes;
  bytes << in.rdbuf();
  if (!in && !in.eof()) throw std::runtime_error("cannot read " + path);
  return bytes.str();
}

ModelSource load_script_model(const std::string& path) {
  read_file(path);  // a clear error for a missing file
  ModelSource source;
  try {
    source.script = torch::jit::load(path);
  } catch (const std::exception& e) {
    throw std::runtime_error(path + " is not a TorchScript module (save one in Python with "
                             "torch.jit.script(torch.nn.Sequential(...)).save(path)): " +
                             std::string(e.what()).substr(0, 200));
  }
  // Plain autograd, as Python's eager modules run: no graph rewrites between runs.
  torch::jit::setGraphExecutorOptimize(false);
  for (const auto& child : source.script->named_children())
    source.layers->push_back(child.name, torch::nn::AnyModule(ScriptLayer(child.value)));
  if (source.layers->size() == 0)
    throw std::runtime_error(path + " has no top-level children to use as layers; save a "
                             "torch.nn.Sequential of layers");
  source.script->train();
  return source;
}

std::pair<torch::Tensor, torch::Tensor> load_tensor_data(const std::string& path) {
  const std::string bytes = read_file(path);
  torch::IValue value;
  try {
    value = torch::pickle_load(std::vector<char>(bytes.begin(), bytes.end()));
  } catch (const std::exception& e) {
    throw std::runtime_error(path + " is not a file written by torch.save: " +
                             std::string(e.what()).substr(0, 200));
  }
  if (!value.isGenericDict())
    throw std::runtime_error(path + " holds no dict; save it with torch.save({'input': X, 'target': Y}, path)");
  auto dict = value.toGenericDict();
  auto get = [&](const char* key) {
    if (!dict.contains(key) || !dict.at(key).isTensor())
      throw std::runtime_error(path + " has no tensor '" + key +
                               "'; save it with torch.save({'input': X, 'target': Y}, path)");
    return dict.at(key).toTensor();
  };
  torch::Tensor input = get("input"), target = get("target");
  if (input.dim() < 1 || target.dim() < 1 || input.size(0) != target.size(0))
    throw std::runtime_error(path + ": 'input' and 'target' need the same number of rows (dim 0)");
  return {input, target};
}

}  // namespace gpipe::cli
