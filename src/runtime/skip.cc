// skip.cc: Stash and Pop, the tray they meet in, and finding them in a model (connecting them: src/plan/skip_connections.cc).
#include "gpipe/skip.h"

#include "gpipe/check.h"

#include <torch/library.h>
#include <torch/torch.h>

#include <algorithm>
#include <cctype>

namespace gpipe {
namespace {

// The tray of the thread: a stage's while it runs a micro-batch, else the thread's own.
thread_local std::map<std::string, torch::Tensor> own_tray;
thread_local std::map<std::string, torch::Tensor>* current_tray = nullptr;

std::map<std::string, torch::Tensor>& tray() { return current_tray != nullptr ? *current_tray : own_tray; }

std::string quoted(const std::string& name) { return "\"" + name + "\""; }

}  // namespace

torch::Tensor add_skip(const torch::Tensor& x, const torch::Tensor& skip) { return x + skip; }

torch::Tensor concat_skip(const torch::Tensor& x, const torch::Tensor& skip) { return torch::cat({x, skip}, 1); }

StashImpl::StashImpl(std::string name) : name_(std::move(name)) {
  GPIPE_CHECK(!name_.empty(), "a Stash needs a name, the one its Pop takes");
}

torch::Tensor stash_tensor(const std::string& name, const torch::Tensor& x) {
  tray()[name] = x;
  return x;
}

torch::Tensor pop_tensor(const std::string& name) {
  auto& t = tray();
  auto it = t.find(name);
  GPIPE_CHECK(it != t.end(), "Pop(", quoted(name), ") found nothing stashed under that name: a Stash(",
              quoted(name), ") must run before it in the same forward");
  const torch::Tensor skip = std::move(it->second);
  t.erase(it);
  return skip;
}

torch::Tensor StashImpl::forward(const torch::Tensor& x) { return stash_tensor(name_, x); }

PopImpl::PopImpl(std::string name, SkipMerge merge) : name_(std::move(name)), merge_(std::move(merge)) {
  GPIPE_CHECK(!name_.empty(), "a Pop needs a name, the one its Stash took");
  GPIPE_CHECK(static_cast<bool>(merge_), "Pop(", quoted(name_), ") needs a merge function, e.g. gpipe::add_skip");
}

torch::Tensor PopImpl::forward(const torch::Tensor& x) { return merge_(x, pop_tensor(name_)); }

namespace detail {

SkipTrayScope::SkipTrayScope(std::map<std::string, torch::Tensor>& tray) : previous_(current_tray) {
  current_tray = &tray;
}

SkipTrayScope::~SkipTrayScope() { current_tray = previous_; }

}  // namespace detail

std::vector<SkipUse> skip_uses(const torch::nn::Sequential& layers, bool named_by_index) {
  std::vector<SkipUse> uses;
  int index = 0;
  for (const auto& layer : layers->named_children()) {
    const std::string& key = layer.key();
    const bool numbered = !key.empty() && key.size() < 10 &&
                          std::all_of(key.begin(), key.end(), [](unsigned char c) { return std::isdigit(c); });
    GPIPE_CHECK(!named_by_index || numbered, "layer ", index, " is named \"", key, "\", not by its index in the whole "
                "model; build each rank's layers with gpipe::add_layer (or mpi::device_layers), which names them so");
    const int at = named_by_index ? std::stoi(key) : index;
    for (const auto& m : layer.value()->modules(/*include_self=*/true)) {
      if (const auto* stash = m->as<StashImpl>()) uses.push_back({stash->name(), false, at});
      if (const auto* pop = m->as<PopImpl>()) uses.push_back({pop->name(), true, at});
    }
    ++index;
  }
  return uses;
}

std::vector<SkipConnection> skip_connections(const torch::nn::Sequential& model) {
  return connect_skips(skip_uses(model));
}

}  // namespace gpipe

// gpipe's Python Stash and Pop (python/gpipe/skip.py) call these ops, so that TorchScript compiles
// them, and a TorchScript file holding them (a model saved from Python) loads wherever the library
// is linked; in a pipeline they are replaced by the native layers (script_model).
TORCH_LIBRARY(gpipe, ops) {
  ops.def("stash(str name, Tensor x) -> Tensor",
          [](std::string name, torch::Tensor x) { return gpipe::stash_tensor(name, x); });
  ops.def("pop(str name) -> Tensor", [](std::string name) { return gpipe::pop_tensor(name); });
}
