// tensors.cc: one tensor or a tuple of them, and a layer run on either.
#include "gpipe/tensors.h"

#include <c10/util/Exception.h>
#include <c10/util/Type.h>

#include <algorithm>
#include <sstream>
#include <stdexcept>

namespace gpipe {
namespace {

std::string one_or_tuple(const Tensors& x) {
  return x.tuple ? "a tuple of " + std::to_string(x.size()) + " tensors (std::vector<torch::Tensor>)"
                 : std::string("one tensor (torch::Tensor)");
}

Tensors checked_tuple(std::vector<torch::Tensor> items, const std::string& name) {
  if (items.empty())
    throw std::invalid_argument(name + " returned an empty tuple; return at least one tensor");
  for (size_t k = 0; k < items.size(); ++k)
    if (!items[k].defined())
      throw std::invalid_argument(name + " returned a tuple whose tensor " + std::to_string(k) +
                                  " is undefined; return defined tensors only (a tensor of zeros, or leave it out)");
  return Tensors::tuple_of(std::move(items));
}

Tensors from_value(const torch::IValue& value, const std::string& name) {
  if (value.isTensor()) return value.toTensor();
  if (value.isTuple()) {
    std::vector<torch::Tensor> items;
    const auto& elements = value.toTupleRef().elements();
    for (size_t k = 0; k < elements.size(); ++k) {
      if (!elements[k].isTensor())
        throw std::invalid_argument(name + " returned a tuple whose item " + std::to_string(k) + " is " +
                                    elements[k].tagKind() + ", not a tensor; gpipe hands tensors from layer to "
                                    "layer: return that value as a tensor, or keep it inside the layer");
      items.push_back(elements[k].toTensor());
    }
    return checked_tuple(std::move(items), name);
  }
  throw std::invalid_argument(name + " returned " + value.tagKind() +
                              ", not a Tensor or a Tuple of Tensors; make its forward return one of those");
}

}  // namespace

Tensors Tensors::tuple_of(std::vector<torch::Tensor> items) {
  Tensors t;
  t.items = std::move(items);
  t.tuple = true;
  return t;
}

bool Tensors::any_defined() const {
  for (const auto& t : items)
    if (t.defined()) return true;
  return false;
}

torch::Tensor Tensors::only(const std::string& what, const std::string& fix) const {
  if (tuple)
    throw std::invalid_argument(what + " is a tuple of " + std::to_string(items.size()) +
                                " tensors where one tensor is needed" + (fix.empty() ? "" : "; " + fix));
  if (items.size() != 1) throw std::invalid_argument(what + " holds no tensor");
  return items.front();
}

Tensors Tensors::to(const torch::Device& device) const {
  Tensors out = *this;
  for (auto& t : out.items)
    if (t.defined()) t = t.to(device);
  return out;
}

int64_t Tensors::bytes() const {
  int64_t n = 0;
  for (const auto& t : items)
    if (t.defined()) n += static_cast<int64_t>(t.nbytes());
  return n;
}

std::string Tensors::shape() const {
  std::ostringstream out;
  auto one = [&out](const torch::Tensor& t) {
    if (!t.defined()) {
      out << "none";
      return;
    }
    out << t.sizes();
    if (!t.is_floating_point()) out << ' ' << t.scalar_type();
  };
  if (!tuple) {
    if (!items.empty()) one(items.front());
    return out.str();
  }
  out << '(';
  for (size_t k = 0; k < items.size(); ++k) {
    if (k > 0) out << ", ";
    one(items[k]);
  }
  out << ')';
  return out.str();
}

Tensors run_layer(torch::nn::AnyModule& layer, const Tensors& x, const std::string& name) {
  // What the layer is given is not what its forward takes: named, with what to change.
  auto not_taken = [&](const std::string& what) {
    return std::invalid_argument(
        name + " does not take " + one_or_tuple(x) + ", which it is given (libtorch: " +
        what.substr(0, what.find('\n')) + "); " +
        (x.tuple ? "a layer given several tensors takes them as its forward's one argument: "
                   "const std::vector<torch::Tensor>& in C++, a Tuple[Tensor, ...] in TorchScript"
                 : "a layer that takes several tensors needs a layer before it (or a model input) that returns them"));
  };
  if (auto* script = dynamic_cast<ValueLayer*>(layer.ptr().get())) {
    torch::IValue in = x.tuple ? torch::IValue(c10::ivalue::Tuple::create(std::vector<torch::IValue>(
                                     x.items.begin(), x.items.end())))
                               : torch::IValue(x.items.front());
    torch::IValue out;
    try {
      out = script->forward_value(std::move(in));
    } catch (const c10::Error& e) {
      const std::string what = e.what_without_backtrace();
      // TorchScript's words for an argument of another type than the forward declares.
      if (what.find("Expected a value of type") == std::string::npos || what.find("for argument") == std::string::npos)
        throw;
      throw not_taken(what);
    }
    return from_value(out, name);
  }
  torch::nn::AnyValue out = [&] {
    try {
      return x.tuple ? layer.any_forward(x.items) : layer.any_forward(x.items.front());
    } catch (const c10::Error& e) {
      const std::string what = e.what_without_backtrace();
      // AnyModule's words for an argument of another type than the forward takes.
      if (what.rfind("Expected argument #", 0) != 0 && what.rfind("Attempted to cast AnyValue to", 0) != 0) throw;
      throw not_taken(what);
    }
  }();
  if (const auto* t = out.try_get<torch::Tensor>()) return *t;
  if (auto* v = out.try_get<std::vector<torch::Tensor>>()) return checked_tuple(std::move(*v), name);
  throw std::invalid_argument(name + " returned " + c10::demangle(out.type_info().name()) +
                              ", not a torch::Tensor or a std::vector<torch::Tensor>; gpipe hands tensors from "
                              "layer to layer: make its forward return one of those");
}

std::string layer_name(const std::string& key) {
  const bool number = !key.empty() && std::all_of(key.begin(), key.end(), [](char c) { return c >= '0' && c <= '9'; });
  return number ? "layer " + key : "layer '" + key + "'";
}

std::vector<std::string> layer_names(const torch::nn::Sequential& layers) {
  std::vector<std::string> names;
  for (const auto& layer : layers->named_children()) names.push_back(layer_name(layer.key()));
  return names;
}

Tensors leaves_of(const Tensors& x, LeafGrad grad) {
  Tensors out = x;
  for (auto& t : out.items) {
    if (!t.defined()) continue;
    const bool required = t.requires_grad();
    t = t.detach();
    if (t.is_floating_point() && (grad == LeafGrad::kFloating || (grad == LeafGrad::kKept && required)))
      t.requires_grad_(true);
  }
  return out;
}

Tensors copy_of(const Tensors& x) {
  Tensors copy = x;
  for (auto& t : copy.items)
    if (t.defined()) t = t.clone();
  return copy;
}

bool shares_storage(const Tensors& a, const Tensors& b) {
  for (const auto& s : a.items)
    for (const auto& t : b.items)
      if (s.defined() && t.defined() && s.is_alias_of(t)) return true;
  return false;
}

std::vector<int64_t> versions_of(const Tensors& x) {
  std::vector<int64_t> versions;
  for (const auto& t : x.items) versions.push_back(t.defined() ? t._version() : 0);
  return versions;
}

std::string changed_in_place(const Tensors& x, const std::vector<int64_t>& versions) {
  for (size_t n = 0; n < x.size() && n < versions.size(); ++n)
    if (x.items[n].defined() && x.items[n]._version() != versions[n])
      return x.tuple ? "tensor " + std::to_string(n) + " of its input" : std::string("its input");
  return "";
}

bool requires_grad(const Tensors& x) {
  for (const auto& t : x.items)
    if (t.defined() && t.requires_grad()) return true;
  return false;
}

void add_roots(const Tensors& outputs, const std::vector<torch::Tensor>& grads, std::vector<torch::Tensor>& roots,
               std::vector<torch::Tensor>& root_grads) {
  if (grads.size() != outputs.size())
    throw std::invalid_argument("gpipe: a gradient of " + std::to_string(grads.size()) + " tensors for " +
                                std::to_string(outputs.size()) + " tensors");
  for (size_t n = 0; n < outputs.size(); ++n)
    if (outputs.items[n].defined() && outputs.items[n].requires_grad() && grads[n].defined()) {
      roots.push_back(outputs.items[n]);
      root_grads.push_back(grads[n]);
    }
}

}  // namespace gpipe
