// script_model.cc: a TorchScript nn.Sequential saved in Python, as layers a pipeline can cut.
#include "gpipe/script_model.h"

#include "gpipe/check.h"
#include "gpipe/io.h"
#include "gpipe/skip.h"

#include <torch/torch.h>
#include <torch/csrc/jit/api/function_impl.h>
#include <torch/csrc/jit/frontend/schema_matching.h>
#include <torch/csrc/jit/ir/ir.h>
#include <torch/csrc/jit/passes/inliner.h>
#include <torch/csrc/jit/runtime/graph_executor.h>

#include <cctype>
#include <filesystem>
#include <fstream>
#include <regex>
#include <set>
#include <sstream>
#include <stdexcept>

namespace gpipe {

namespace {

// What `value` is, when the module's code fixes it: a constant, an attribute of `self` (the
// graph's first input) or of its submodules; std::nullopt when it is computed.
std::optional<torch::IValue> known_value(const torch::jit::Value* value, const torch::jit::Module& self) {
  const torch::jit::Node* node = value->node();
  if (node->kind() == torch::jit::prim::Param && value->offset() == 0) return torch::IValue(self._ivalue());
  if (node->kind() == torch::jit::prim::Constant) return torch::jit::toIValue(value);
  if (node->kind() == torch::jit::prim::GetAttr) {
    const std::optional<torch::IValue> owner = known_value(node->input(0), self);
    if (owner && owner->isObject()) return owner->toObject()->getAttr(node->s(torch::jit::attr::name));
  }
  return std::nullopt;
}

// The largest number `value` can be: known_value, or for the result of an if, the larger of its
// branches' (MultiheadAttention's dropout_p is 0.0 outside training, its attribute inside).
std::optional<double> largest_number(const torch::jit::Value* value, const torch::jit::Module& self) {
  const torch::jit::Node* node = value->node();
  if (node->kind() == torch::jit::prim::If) {
    std::optional<double> largest;
    for (const torch::jit::Block* branch : node->blocks()) {
      const std::optional<double> v = largest_number(branch->outputs()[value->offset()], self);
      if (!v) return std::nullopt;
      largest = std::max(largest.value_or(*v), *v);
    }
    return largest;
  }
  const std::optional<torch::IValue> known = known_value(value, self);
  if (known && (known->isDouble() || known->isInt())) return known->toDouble();
  return std::nullopt;
}

// Whether a TorchScript block of `self`'s code draws random numbers in training: a dropout whose
// probability is not known to be 0 (torch.nn's Dropout(0.0), a TransformerEncoderLayer built with
// dropout=0.0 draw none), bernoulli, rand*, normal, uniform, multinomial, rrelu; in nested blocks too.
bool calls_random(const torch::jit::Block* block, const torch::jit::Module& self) {
  for (const torch::jit::Node* node : block->nodes()) {
    const std::string kind = node->kind().toQualString();
    if (kind.rfind("aten::", 0) == 0) {
      if (kind.find("dropout") != std::string::npos) {
        const std::optional<double> p = node->inputs().size() > 1 ? largest_number(node->input(1), self) : std::nullopt;
        if (!p || *p > 0) return true;
      }
      for (const char* word : {"bernoulli", "rand", "normal", "uniform", "multinomial", "rrelu"})
        if (kind.find(word) != std::string::npos) return true;
    }
    for (const torch::jit::Block* inner : node->blocks())
      if (calls_random(inner, self)) return true;
  }
  return false;
}

// Whether a TorchScript module was compiled from one of torch.nn's BatchNorm classes.
bool is_batch_norm(const torch::jit::Module& module) {
  static const std::regex batch_norm(R"(^__torch__\.torch\.nn\.modules\.batchnorm\.(___torch_mangle_\d+\.)?BatchNorm[123]d$)");
  return std::regex_match(module.type()->name()->qualifiedName(), batch_norm);
}

// Whether a layer's return type is a Tensor, or a Tuple of Tensors.
bool tensor_or_tuple(const c10::TypePtr& type) {
  if (type->kind() == c10::TypeKind::TensorType) return true;
  if (type->kind() != c10::TypeKind::TupleType || type->containedTypes().empty()) return false;
  for (const auto& element : type->containedTypes())
    if (element->kind() != c10::TypeKind::TensorType) return false;
  return true;
}

}  // namespace

ScriptLayerImpl::ScriptLayerImpl(torch::jit::Module module) : module_(std::move(module)) {
  // Its methods with every function and method they call inlined (torch.nn.functional.dropout
  // is a call in the graph of a scripted nn.Dropout).
  for (const auto& method : module_.get_methods()) {
    const std::shared_ptr<torch::jit::Graph> graph = method.graph()->copy();
    torch::jit::Inline(*graph);
    random_ = random_ || calls_random(graph->block(), module_);
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

// A scripted BatchNorm's running statistics. torch.nn's declares momentum a constant; gpipe's
// DeferredBatchNorm an attribute.
static RunningStatistics statistics_of(const torch::jit::Module& norm) {
  const torch::IValue momentum = norm.type()->hasConstant("momentum") ? norm.type()->getConstant("momentum")
                                 : norm.hasattr("momentum")           ? norm.attr("momentum")
                                                                      : torch::IValue(0.1);
  return RunningStatistics{norm.attr("running_mean").toTensor(), norm.attr("running_var").toTensor(),
                           norm.attr("num_batches_tracked").toTensor(),
                           momentum.isNone() ? std::nullopt : std::optional<double>(momentum.toDouble())};
}

std::optional<RunningStatistics> ScriptLayerImpl::running_statistics() {
  if (!is_batch_norm(module_) || !module_.attr("running_mean").isTensor()) return std::nullopt;  // track_running_stats=False
  return statistics_of(module_);
}

std::vector<RunningStatistics> ScriptLayerImpl::deferring_norms_inside() const {
  static const std::regex deferred(R"(^__torch__\.gpipe\.norm\.(___torch_mangle_\d+\.)?DeferredBatchNorm$)");
  std::vector<RunningStatistics> found;
  for (const auto& inner : module_.named_modules()) {
    const bool rewritten = rewritten_ && !inner.name.empty() && is_batch_norm(inner.value) &&
                           inner.value.attr("running_mean").isTensor();
    if (rewritten || std::regex_match(inner.value.type()->name()->qualifiedName(), deferred))
      found.push_back(statistics_of(inner.value));
  }
  return found;
}

namespace {

// Whether `type` is a torch.nn BatchNorm's that tracks running statistics.
bool tracking_batch_norm(const c10::ClassType* type) {
  static const std::regex batch_norm(R"(^__torch__\.torch\.nn\.modules\.batchnorm\.(___torch_mangle_\d+\.)?BatchNorm[123]d$)");
  return type && std::regex_match(type->name()->qualifiedName(), batch_norm) && type->hasAttribute("running_mean") &&
         type->getAttribute("running_mean")->kind() == c10::TypeKind::TensorType;
}

// A BatchNorm setting: the type's constant (torch.nn's momentum and eps), else its attribute.
torch::jit::Value* setting(torch::jit::Graph& graph, torch::jit::Value* norm, const c10::ClassType* type,
                           const std::string& name) {
  if (type->hasConstant(name)) return graph.insertConstant(type->getConstant(name));
  return graph.insertGetAttr(norm, name);
}

// Replaces each call of a tracking BatchNorm's forward in `block` (and the blocks inside it) by its
// input check and the op gpipe::batch_norm over that BatchNorm's own tensors and settings; the
// BatchNorm types whose calls it replaced go into `rewritten`.
void call_deferred_batch_norm(torch::jit::Block* block, std::set<std::string>& rewritten) {
  for (auto it = block->nodes().begin(); it != block->nodes().end();) {
    torch::jit::Node* node = *it++;
    for (torch::jit::Block* inner : node->blocks()) call_deferred_batch_norm(inner, rewritten);
    if (node->kind() != torch::jit::prim::CallMethod || node->s(torch::jit::attr::name) != "forward") continue;
    // By kind, not cast<>: libtorch's cast<> reads DynamicType's typeinfo, which it does not export.
    const c10::Type& called = *node->input(0)->type();
    const auto* type = called.kind() == c10::TypeKind::ClassType ? static_cast<const c10::ClassType*>(&called) : nullptr;
    if (!tracking_batch_norm(type) || node->inputs().size() != 2) continue;
    torch::jit::Graph& graph = *node->owningGraph();
    const torch::jit::WithInsertPoint here(node);
    torch::jit::Value* norm = node->input(0);
    if (type->findMethod("_check_input_dim") != nullptr)  // BatchNorm2d's "expected 4D input", kept
      graph.insertMethodCall("_check_input_dim",
                             torch::jit::MatchedSchema{{norm, node->input(1)}, {c10::NoneType::get()}, {}, ""});
    torch::jit::Value* out = graph.insert(
        c10::Symbol::fromQualString("gpipe::batch_norm"),
        {node->input(1), graph.insertGetAttr(norm, "weight"), graph.insertGetAttr(norm, "bias"),
         graph.insertGetAttr(norm, "running_mean"), graph.insertGetAttr(norm, "running_var"),
         graph.insertGetAttr(norm, "num_batches_tracked"), graph.insertGetAttr(norm, "training"),
         setting(graph, norm, type, "momentum"), setting(graph, norm, type, "eps")});
    node->output()->replaceAllUsesWith(out);
    node->destroy();
    rewritten.insert(type->name()->qualifiedName());
  }
}

}  // namespace

void ScriptLayerImpl::defer_batch_norms_inside() {
  if (inner_batch_norm_.empty() || rewritten_) return;
  // A copy of the module with types of its own, over the same tensors: the code rewritten is not
  // the one the module has run already (TorchScript keeps what it compiled), nor the caller's,
  // whose modes the copy takes before each forward.
  original_ = module_;
  module_ = module_.clone(/*inplace=*/true);
  std::set<const torch::jit::Function*> done;  // a method of a type that several submodules share: once
  std::set<std::string> rewritten;
  for (const auto& inner : module_.named_modules())
    for (const torch::jit::Method& method : inner.value.get_methods()) {
      torch::jit::Function& function = method.function();
      if (done.insert(&function).second)
        call_deferred_batch_norm(torch::jit::toGraphFunction(function).graph()->block(), rewritten);
    }
  rewritten_ = true;
  // One whose calls were not all found (through an interface, in a fork) stays refused.
  inner_batch_norm_.clear();
  for (const auto& inner : module_.named_modules())
    if (!inner.name.empty() && is_batch_norm(inner.value) && inner.value.attr("running_mean").isTensor() &&
        !rewritten.count(inner.value.type()->name()->qualifiedName())) {
      inner_batch_norm_ = inner.name;
      break;
    }
}

void ScriptLayerImpl::take_modes() {
  if (!rewritten_) return;
  std::vector<torch::jit::Module> theirs;
  for (const torch::jit::Module& m : original_.modules()) theirs.push_back(m);
  size_t n = 0;
  for (torch::jit::Module ours : module_.modules())
    if (n < theirs.size()) ours.setattr("training", theirs[n++].attr("training"));
}

torch::Tensor ScriptLayerImpl::forward(const torch::Tensor& x) {
  take_modes();
  const torch::IValue y = module_.forward({x});
  GPIPE_CHECK(y.isTensor(), "this TorchScript layer returns ", y.tagKind(),
              ", not one tensor: run it with gpipe::run_layer (tensors.h), which passes tuples on");
  return y.toTensor();
}

torch::IValue ScriptLayerImpl::forward_value(torch::IValue x) {
  take_modes();
  return module_.forward({std::move(x)});
}

void ScriptLayerImpl::train(bool on) {
  torch::nn::Module::train(on);
  module_.train(on);
  if (rewritten_) original_.train(on);
}

namespace {

// TorchScript names the second and later classes compiled from one Python class
// `prefix.___torch_mangle_<n>.Class`; the class is the same.
std::string unmangled(const std::string& qualified) {
  static const std::regex mangle(R"(___torch_mangle_\d+\.)");
  return std::regex_replace(qualified, mangle, "");
}

}  // namespace

ScriptModel load_script_model(const std::string& path) {
  read_file(path);  // a clear error for a missing file
  torch::jit::Module module;
  try {
    module = torch::jit::load(path);
  } catch (const std::exception& e) {
    throw std::runtime_error(path + " is not a TorchScript module (save one in Python with "
                             "torch.jit.script(torch.nn.Sequential(...)).save(path)): " +
                             what_of(e).substr(0, 300));
  }
  ScriptModel model = script_model(std::move(module), path);
  model.script.train();  // a saved model is trained, whatever mode it was saved in
  return model;
}

ScriptModel script_model(torch::jit::Module module, const std::string& origin) {
  ScriptModel source;
  source.script = std::move(module);
  // gpipe runs the top-level children in order: only right for an nn.Sequential, whose forward is that chain.
  const auto type = source.script.type()->name();
  const std::string name = type ? type->qualifiedName() : std::string("an unnamed module");
  if (unmangled(name) != "__torch__.torch.nn.modules.container.Sequential")
    throw std::runtime_error(origin + " holds " + name + ", not a torch.nn.Sequential: gpipe cuts a model into its "
                             "top-level children and runs them in order, which for another module is another "
                             "function than its forward; save a torch.nn.Sequential of the layers instead");
  // Plain autograd, as Python's eager modules run: no graph rewrites between runs.
  torch::jit::setGraphExecutorOptimize(false);
  for (const auto& child : source.script.named_children()) {
    // gpipe's Python Stash and Pop (python/gpipe/skip.py) become the native layers, so that the
    // pipeline routes their skip connections between stages.
    const std::string kind = unmangled(child.value.type()->name()->qualifiedName());
    if (kind == "__torch__.gpipe.skip.Stash") {
      source.layers->push_back(child.name, torch::nn::AnyModule(Stash(child.value.attr("name").toStringRef())));
    } else if (kind == "__torch__.gpipe.skip.Pop") {
      torch::jit::Module merger = child.value.attr("merger").toModule();
      const std::string merge = unmangled(merger.type()->name()->qualifiedName());
      GPIPE_CHECK(merger.parameters().size() == 0, "the merge module of Pop(\"", child.value.attr("name").toStringRef(),
                  "\") has parameters; put them in a layer of the Sequential after the Pop");
      const SkipMerge by_module = [merger](const torch::Tensor& x, const torch::Tensor& skip) mutable {
        return merger.forward({x, skip}).toTensor();
      };
      source.layers->push_back(child.name, torch::nn::AnyModule(Pop(child.value.attr("name").toStringRef(),
                                                                     merge == "__torch__.gpipe.skip.Add"      ? add_skip
                                                                     : merge == "__torch__.gpipe.skip.Concat" ? concat_skip
                                                                                                              : by_module)));
    } else {
      // A layer hands a tensor or a tuple of tensors to the next: anything else (a dict, a list, a
      // tuple holding an int) is refused here, before any work.
      const auto method = child.value.find_method("forward");
      if (method) {
        const auto& returns = method->function().getSchema().returns();
        const std::string type = returns.size() == 1 ? returns[0].type()->annotation_str() : "several values";
        if (returns.size() != 1 || !tensor_or_tuple(returns[0].type()))
          throw std::runtime_error(origin + ": layer " + std::to_string(source.layers->size()) + " ('" + child.name +
                                   "', " + unmangled(kind) + ") returns " + type +
                                   ", not a Tensor or a Tuple of Tensors; gpipe hands tensors from each layer to "
                                   "the next: make the layer's forward return one tensor, or a tuple of tensors");
      }
      source.layers->push_back(child.name, torch::nn::AnyModule(ScriptLayer(child.value)));
    }
  }
  if (source.layers->size() == 0)
    throw std::runtime_error(origin + " has no top-level children to use as layers; save a "
                             "torch.nn.Sequential of layers");
  return source;
}

}  // namespace gpipe
