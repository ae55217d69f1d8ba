// checkpoint.cc: a pickled dict of everything a run needs to continue, written whole or not at all.
#include "checkpoint.h"

#include <gpipe/io.h>
#include <torch/torch.h>

#include <sstream>
#include <stdexcept>

namespace gpipe::cli {
namespace {

const char* kFormat = "gpipe-checkpoint-1";
const char* kExtraFile = "gpipe_checkpoint.pkl";  // inside a TorchScript file

torch::Tensor to_bytes_tensor(const std::string& bytes) {
  return torch::from_blob(const_cast<char*>(bytes.data()), {static_cast<int64_t>(bytes.size())}, torch::kUInt8)
      .clone();
}

std::string from_bytes_tensor(const torch::Tensor& t) {
  return std::string(reinterpret_cast<const char*>(t.data_ptr<uint8_t>()), static_cast<size_t>(t.numel()));
}

std::string shape(const torch::Tensor& t) {
  std::ostringstream out;
  out << t.sizes();
  return out.str();
}

// The tensors a checkpoint holds: parameters (of the layers, as the optimizer
// sees them) and buffers (of the script module, or of the layers).
torch::OrderedDict<std::string, torch::Tensor> buffers_of(const ModelSource& model) {
  torch::OrderedDict<std::string, torch::Tensor> out;
  if (model.script) {
    for (const auto& b : model.script->named_buffers(/*recurse=*/true)) out.insert(b.name, b.value);
  } else {
    for (const auto& b : model.layers->named_buffers()) out.insert(b.key(), b.value());
  }
  return out;
}

void put(c10::impl::GenericDict& dict, const std::string& prefix,
         const torch::OrderedDict<std::string, torch::Tensor>& tensors) {
  c10::List<std::string> names;
  c10::List<at::Tensor> values;
  for (const auto& t : tensors) {
    names.push_back(t.key());
    values.push_back(t.value().detach());
  }
  dict.insert(prefix + "_names", names);
  dict.insert(prefix + "s", values);
}

std::string encode(const ModelSource& model, torch::optim::Optimizer& optimizer,
                   const std::string& optimizer_name, const TrainState& state) {
  c10::impl::GenericDict dict(c10::StringType::get(), c10::AnyType::get());
  dict.insert("format", std::string(kFormat));
  put(dict, "parameter", model.layers->named_parameters());
  put(dict, "buffer", buffers_of(model));
  torch::serialize::OutputArchive archive;
  optimizer.save(archive);
  std::ostringstream optimizer_bytes;
  archive.save_to(optimizer_bytes);
  dict.insert("optimizer_name", optimizer_name);
  dict.insert("optimizer", to_bytes_tensor(optimizer_bytes.str()));
  dict.insert("step", state.step);
  dict.insert("shuffle_state", state.shuffle_state);
  dict.insert("random_state", state.random_state);
  const std::vector<char> bytes = torch::pickle_save(dict);
  return std::string(bytes.begin(), bytes.end());
}

// Checks that `dict` holds tensors named and shaped as `expected`; returns them in order.
std::vector<torch::Tensor> matching(const c10::impl::GenericDict& dict, const std::string& prefix,
                                    const torch::OrderedDict<std::string, torch::Tensor>& expected,
                                    const std::string& path) {
  const auto names = dict.at(prefix + "_names").toList();
  const auto values = dict.at(prefix + "s").toList();
  if (names.size() != expected.size() || values.size() != expected.size())
    throw std::runtime_error(path + " is a checkpoint of another model: it has " + std::to_string(names.size()) +
                             " " + prefix + "s, this model " + std::to_string(expected.size()));
  std::vector<torch::Tensor> out;
  size_t n = 0;
  for (const auto& e : expected) {
    const std::string name = names.get(n).toStringRef();
    const torch::Tensor value = values.get(n).toTensor();
    ++n;
    if (name != e.key() || value.sizes() != e.value().sizes() || value.dtype() != e.value().dtype())
      throw std::runtime_error(path + " is a checkpoint of another model: its " + prefix + " " + name + " " +
                               shape(value) + " is this model's " + e.key() + " " + shape(e.value()));
    out.push_back(value);
  }
  return out;
}

}  // namespace

void save_checkpoint(const std::string& path, const ModelSource& model, torch::optim::Optimizer& optimizer,
                     const std::string& optimizer_name, const TrainState& state) {
  const std::string payload = encode(model, optimizer, optimizer_name, state);
  if (!model.script) {
    write_file_atomically(path, payload);
    return;
  }
  std::ostringstream module_bytes;
  model.script->save(module_bytes, {{kExtraFile, payload}});
  write_file_atomically(path, module_bytes.str());
}

TrainState load_checkpoint(const std::string& path, const ModelSource& model, torch::optim::Optimizer& optimizer,
                           const std::string& optimizer_name) {
  const std::string bytes = read_file(path);
  std::string payload = bytes;
  if (model.script) {
    torch::jit::ExtraFilesMap extra{{kExtraFile, ""}};
    std::istringstream in(bytes);
    try {
      torch::jit::load(in, c10::nullopt, extra);
    } catch (const std::exception&) {
      throw std::runtime_error(path + " is truncated or not a TorchScript checkpoint written by gpipe train --save");
    }
    payload = extra[kExtraFile];
    if (payload.empty())
      throw std::runtime_error(path + " holds no gpipe checkpoint; resume from a file written by gpipe train --save");
  }

  c10::impl::GenericDict dict(c10::StringType::get(), c10::AnyType::get());
  try {
    const torch::IValue value = torch::pickle_load(std::vector<char>(payload.begin(), payload.end()));
    dict = value.toGenericDict();
    if (!dict.contains("format") || dict.at("format").toStringRef() != kFormat) throw std::runtime_error("format");
    for (const char* key : {"parameter_names", "parameters", "buffer_names", "buffers", "optimizer_name",
                            "optimizer", "step", "shuffle_state", "random_state"})
      if (!dict.contains(key)) throw std::runtime_error(key);
  } catch (const std::exception&) {
    throw std::runtime_error(path + " is truncated, corrupt or not a gpipe checkpoint; resume from a file "
                             "written by gpipe train --save");
  }
  const std::vector<torch::Tensor> parameters =
      matching(dict, "parameter", model.layers->named_parameters(), path);
  const auto buffer_targets = buffers_of(model);
  const std::vector<torch::Tensor> buffers = matching(dict, "buffer", buffer_targets, path);
  if (dict.at("optimizer_name").toStringRef() != optimizer_name)
    throw std::runtime_error(path + " was trained with --optimizer " + dict.at("optimizer_name").toStringRef() +
                             "; resume with the same optimizer");
  torch::serialize::InputArchive archive;
  std::istringstream optimizer_bytes(from_bytes_tensor(dict.at("optimizer").toTensor()));
  archive.load_from(optimizer_bytes);

  // Everything is read and checked: now restore.
  torch::NoGradGuard no_grad;
  size_t n = 0;
  for (auto& p : model.layers->named_parameters()) p.value().copy_(parameters[n++]);
  n = 0;
  for (const auto& b : buffer_targets) b.value().copy_(buffers[n++]);
  optimizer.load(archive);
  TrainState state;
  state.step = dict.at("step").toInt();
  state.shuffle_state = dict.at("shuffle_state").toTensor();
  state.random_state = dict.at("random_state").toTensor();
  return state;
}

}  // namespace gpipe::cli
