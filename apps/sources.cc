// sources.cc: TorchScript models and torch.save'd datasets from Python.
#include "sources.h"

#include <gpipe/stage.h>

#include <torch/torch.h>
#include <torch/csrc/jit/ir/ir.h>
#include <torch/csrc/jit/passes/inliner.h>
#include <torch/csrc/jit/runtime/graph_executor.h>
#include <torch/csrc/jit/serialization/import_read.h>
#include <caffe2/serialize/inline_container.h>

#include <cctype>
#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>
#include <stdexcept>

namespace gpipe::cli {

namespace {

// Whether a TorchScript block calls an operator that draws random numbers (dropout,
// bernoulli, rand*, normal, uniform, multinomial, rrelu), in nested blocks too.
bool calls_random(const torch::jit::Block* block) {
  for (const torch::jit::Node* node : block->nodes()) {
    const std::string kind = node->kind().toQualString();
    if (kind.rfind("aten::", 0) == 0)
      for (const char* word : {"dropout", "bernoulli", "rand", "normal", "uniform", "multinomial", "rrelu"})
        if (kind.find(word) != std::string::npos) return true;
    for (const torch::jit::Block* inner : node->blocks())
      if (calls_random(inner)) return true;
  }
  return false;
}

// Whether a TorchScript module was compiled from one of torch.nn's BatchNorm classes.
bool is_batch_norm(const torch::jit::Module& module) {
  static const std::regex batch_norm(R"(^__torch__\.torch\.nn\.modules\.batchnorm\.(___torch_mangle_\d+\.)?BatchNorm[123]d$)");
  return std::regex_match(module.type()->name()->qualifiedName(), batch_norm);
}

}  // namespace

ScriptLayerImpl::ScriptLayerImpl(torch::jit::Module module) : module_(std::move(module)) {
  // Its methods with every function and method they call inlined (torch.nn.functional.dropout
  // is a call in the graph of a scripted nn.Dropout).
  for (const auto& method : module_.get_methods()) {
    const std::shared_ptr<torch::jit::Graph> graph = method.graph()->copy();
    torch::jit::Inline(*graph);
    random_ = random_ || calls_random(graph->block());
  }
  for (const auto& p : module_.named_parameters(/*recurse=*/true)) {
    std::string name = p.name;
    std::replace(name.begin(), name.end(), '.', '_');
    register_parameter(name, p.value, p.value.requires_grad());
  }
  // Buffers too (a BatchNorm's running statistics): the script module updates them in place.
  for (const auto& b : module_.named_buffers(/*recurse=*/true)) {
    std::string name = b.name;
    std::replace(name.begin(), name.end(), '.', '_');
    register_buffer(name, b.value);
  }
  for (const auto& inner : module_.named_modules())
    if (!inner.name.empty() && is_batch_norm(inner.value) && inner.value.attr("running_mean").isTensor()) {
      inner_batch_norm_ = inner.name;
      break;
    }
}

std::optional<gpipe::RunningStatistics> ScriptLayerImpl::running_statistics() {
  if (!is_batch_norm(module_) || !module_.attr("running_mean").isTensor()) return std::nullopt;  // track_running_stats=False
  // torch.nn's BatchNorm declares momentum a constant; read it as an attribute where it is one.
  const torch::IValue momentum = module_.type()->hasConstant("momentum") ? module_.type()->getConstant("momentum")
                                 : module_.hasattr("momentum")           ? module_.attr("momentum")
                                                                         : torch::IValue(0.1);
  return gpipe::RunningStatistics{module_.attr("running_mean").toTensor(), module_.attr("running_var").toTensor(),
                                  module_.attr("num_batches_tracked").toTensor(),
                                  momentum.isNone() ? std::nullopt : std::optional<double>(momentum.toDouble())};
}

torch::Tensor ScriptLayerImpl::forward(const torch::Tensor& x) {
  return module_.forward({x}).toTensor();
}

void ScriptLayerImpl::train(bool on) {
  torch::nn::Module::train(on);
  module_.train(on);
}

std::string shape_text(const torch::Tensor& t) {
  std::ostringstream out;
  out << t.sizes();
  return out.str();
}

bool& verbose_errors() {
  static bool verbose = false;
  return verbose;
}

std::string what_of(const std::exception& e) {
  std::string report;
  const std::string what = short_error(e, &report);
  if (verbose_errors() && !report.empty()) return report;
  return what + (report.find("Traceback of TorchScript") != std::string::npos
                     ? " (--verbose shows TorchScript's traceback)" : "");
}

std::string read_file(const std::string& path) {
  if (std::filesystem::is_directory(path)) throw std::runtime_error(path + " is a folder, not a file");
  if (!std::filesystem::is_regular_file(path)) throw std::runtime_error("no such file: " + path);
  std::ifstream in(path, std::ios::binary);
  std::ostringstream bytes;
  bytes << in.rdbuf();
  if (!in && !in.eof()) throw std::runtime_error("cannot read " + path);
  return bytes.str();
}

namespace {

// TorchScript names the second and later classes compiled from one Python class
// `prefix.___torch_mangle_<n>.Class`; the class is the same.
std::string unmangled(const std::string& qualified) {
  static const std::regex mangle(R"(___torch_mangle_\d+\.)");
  return std::regex_replace(qualified, mangle, "");
}

}  // namespace

ModelSource load_script_model(const std::string& path) {
  read_file(path);  // a clear error for a missing file
  ModelSource source;
  try {
    source.script = torch::jit::load(path);
  } catch (const std::exception& e) {
    throw std::runtime_error(path + " is not a TorchScript module (save one in Python with "
                             "torch.jit.script(torch.nn.Sequential(...)).save(path)): " +
                             what_of(e).substr(0, 300));
  }
  // gpipe runs the top-level children in order: only right for an nn.Sequential, whose forward is that chain.
  const auto type = source.script->type()->name();
  const std::string name = type ? type->qualifiedName() : std::string("an unnamed module");
  if (unmangled(name) != "__torch__.torch.nn.modules.container.Sequential")
    throw std::runtime_error(path + " holds " + name + ", not a torch.nn.Sequential: gpipe cuts a model into its "
                             "top-level children and runs them in order, which for another module is another "
                             "function than its forward; save a torch.nn.Sequential of the layers instead");
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

torch::IValue load_torch_save(const std::string& bytes) {
  // torch.save writes a zip archive; torch::pickle_load of libtorch 1.13 fails on one that holds
  // a single tensor, so the archive is read as torch::jit does.
  if (bytes.rfind("PK", 0) == 0) {
    std::istringstream in(bytes);
    caffe2::serialize::PyTorchStreamReader reader(&in);
    return torch::jit::readArchiveAndTensors("data", "", "", c10::nullopt, c10::nullopt, torch::Device(torch::kCPU),
                                             reader);
  }
  return torch::pickle_load(std::vector<char>(bytes.begin(), bytes.end()));  // the legacy format
}

std::pair<torch::Tensor, torch::Tensor> load_tensor_data(const std::string& path) {
  const std::string bytes = read_file(path);
  torch::IValue value;
  try {
    value = load_torch_save(bytes);
  } catch (const std::exception& e) {
    const std::string what = what_of(e);
    // libtorch's unpickler has no SETITEM, which Python writes for a dict of one entry.
    if (what.find("Unknown opcode for unpickling at 0x73") != std::string::npos)
      throw std::runtime_error(path + " holds a dict of one entry; gpipe needs both: save it with "
                               "torch.save({'input': X, 'target': Y}, path)");
    throw std::runtime_error(path + " is not a file written by torch.save: " + what.substr(0, 300));
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
    throw std::runtime_error(path + ": 'input' and 'target' need the same number of rows (dim 0); they have shapes " +
                             shape_text(input) + " and " + shape_text(target));
  if (input.size(0) == 0) throw std::runtime_error(path + " holds no samples ('input' has 0 rows)");
  for (const auto& [name, t] : {std::pair<const char*, torch::Tensor>{"input", input}, {"target", target}})
    if (t.is_floating_point()) {
      const torch::Tensor bad = torch::logical_not(torch::isfinite(t)).reshape({t.size(0), -1}).any(1);
      const int64_t rows = bad.sum().item<int64_t>();
      if (rows > 0)
        throw std::runtime_error(path + ": '" + name + "' holds NaN or infinite values in " + std::to_string(rows) +
                                 " rows, the first at row " + std::to_string(bad.nonzero()[0].item<int64_t>()) +
                                 "; clean the data before training");
    }
  return {input, target};
}

}  // namespace gpipe::cli
