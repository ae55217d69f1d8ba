// snapshot.cc: a pickled dict of everything a run needs to continue, keyed by name, sealed with
// a digest, written whole or not at all.
#include "gpipe/snapshot.h"

#include "gpipe/check.h"
#include "gpipe/data.h"
#include "gpipe/io.h"
#include "train/optimizer_state.h"

#include <torch/torch.h>
#include <caffe2/serialize/inline_container.h>

#include <cmath>
#include <cstdio>
#include <limits>
#include <map>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <type_traits>

namespace gpipe {
namespace {

const char* kFormat = "gpipe-checkpoint-2";
const char* kExtraFile = "gpipe_checkpoint.pkl";  // inside a TorchScript file

using Dict = c10::impl::GenericDict;
using detail::state_key;

Dict new_dict() { return Dict(c10::StringType::get(), c10::AnyType::get()); }

// One parameter's optimizer state as a dict of its tensors and step count, or an empty dict.
Dict encode_state(torch::optim::Optimizer& optimizer, const torch::Tensor& p) {
  Dict out = new_dict();
  auto& states = optimizer.state();
  const auto it = states.find(state_key(states, p));
  if (it == states.end()) return out;
  const torch::optim::OptimizerParamState* state = it->second.get();
  auto put = [&](const char* name, const torch::Tensor& t) {
    if (t.defined()) out.insert(name, t.detach().clone());
  };
  auto put_adam = [&](const auto& a) {  // Adam's and AdamW's states: the same fields, two types
    out.insert("step", a.step());
    put("exp_avg", a.exp_avg());
    put("exp_avg_sq", a.exp_avg_sq());
    put("max_exp_avg_sq", a.max_exp_avg_sq());
  };
  if (const auto* s = dynamic_cast<const torch::optim::SGDParamState*>(state)) {
    put("momentum_buffer", s->momentum_buffer());
  } else if (const auto* a = dynamic_cast<const torch::optim::AdamParamState*>(state)) {
    put_adam(*a);
  } else if (const auto* w = dynamic_cast<const torch::optim::AdamWParamState*>(state)) {
    put_adam(*w);
  }
  return out;
}

torch::Tensor tensor_or_none(const Dict& d, const char* name) {
  // A copy of its own, contiguous: a stored tensor may alias itself (strides of 0), which in-place steps refuse
  return d.contains(name) ? d.at(name).toTensor().clone(at::MemoryFormat::Contiguous) : torch::Tensor();
}

// An Adam or AdamW state from the fields encode_state wrote.
template <typename AdamState>
std::unique_ptr<AdamState> adam_state(const Dict& saved) {
  auto a = std::make_unique<AdamState>();
  a->step(saved.at("step").toInt());
  a->exp_avg(tensor_or_none(saved, "exp_avg"));
  a->exp_avg_sq(tensor_or_none(saved, "exp_avg_sq"));
  a->max_exp_avg_sq(tensor_or_none(saved, "max_exp_avg_sq"));
  return a;
}

// Installs `saved` (encode_state's dict) as the optimizer's state of `p`.
void install_state(torch::optim::Optimizer& optimizer, const std::string& kind, const torch::Tensor& p,
                   const Dict& saved) {
  if (saved.size() == 0) return;
  std::unique_ptr<torch::optim::OptimizerParamState> state;
  if (kind == "sgd") {
    auto s = std::make_unique<torch::optim::SGDParamState>();
    s->momentum_buffer(tensor_or_none(saved, "momentum_buffer"));
    state = std::move(s);
  } else if (kind == "adam") {
    state = adam_state<torch::optim::AdamParamState>(saved);
  } else {
    state = adam_state<torch::optim::AdamWParamState>(saved);
  }
  auto& states = optimizer.state();
  states[state_key(states, p)] = std::move(state);
}

// A checkpoint file ends with a digest of everything before it (FNV-1a, 64 bits, in hex), so a
// corrupted byte anywhere is found before anything is restored.
const std::string kDigestTag = "gpipe-fnv1a64:";
constexpr size_t kDigestDigits = 16;

std::string digest_of(const std::string& bytes, size_t count) {
  uint64_t hash = 14695981039346656037ull;
  for (size_t n = 0; n < count; ++n) hash = (hash ^ static_cast<unsigned char>(bytes[n])) * 1099511628211ull;
  char hex[kDigestDigits + 1];
  std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(hash));
  return hex;
}

// Whether `bytes` end with the digest of what comes before them.
bool is_sealed(const std::string& bytes) {
  const size_t trailer = kDigestTag.size() + kDigestDigits;
  const size_t body = bytes.size() >= trailer ? bytes.size() - trailer : 0;
  return bytes.size() >= trailer && bytes.compare(body, kDigestTag.size(), kDigestTag) == 0 &&
         bytes.compare(body + kDigestTag.size(), kDigestDigits, digest_of(bytes, body)) == 0;
}

// Whether `bytes` are a TorchScript module that carries a checkpoint (that of a --model FILE run):
// an archive with the extra file, looked up without loading the module's code from bytes that
// failed their digest.
bool is_script_checkpoint(const std::string& bytes) {
  if (bytes.rfind("PK\x03\x04", 0) != 0) return false;
  try {
    std::istringstream in(bytes);
    caffe2::serialize::PyTorchStreamReader reader(&in);
    const std::string extra = std::string("extra/") + kExtraFile;
    return reader.hasRecord(extra);
  } catch (const std::exception&) {
    return false;
  }
}

// Whether `bytes`, without gpipe's digest, are a torch.save archive of a gpipe checkpoint's dict.
bool is_resaved_checkpoint(const std::string& bytes) {
  if (bytes.rfind("PK\x03\x04", 0) != 0 || bytes.find(kDigestTag) != std::string::npos) return false;
  try {
    const c10::IValue value = load_torch_save(bytes);
    if (!value.isGenericDict()) return false;
    const Dict dict = value.toGenericDict();
    return dict.contains("format") && dict.at("format").isString() && dict.at("format").toStringRef() == kFormat;
  } catch (const std::exception&) {
    return false;
  }
}

// The bytes without their digest; throws if it is missing or does not match.
std::string unsealed(const std::string& path, std::string bytes) {
  const size_t trailer = kDigestTag.size() + kDigestDigits;
  const size_t body = bytes.size() >= trailer ? bytes.size() - trailer : 0;
  if (!is_sealed(bytes) && is_script_checkpoint(bytes))
    throw std::runtime_error(path + " is the checkpoint file of a TorchScript model (`model` FILE.pt): "
                             "resume it with the model file it was trained from");
  if (!is_sealed(bytes) && is_resaved_checkpoint(bytes))
    throw std::runtime_error(path + " holds a gpipe checkpoint written again by another program (torch.save of what "
                             "torch.load read?), without the digest gpipe ends its files with, so it cannot be checked "
                             "whole; resume from the file gpipe wrote (`save`), which torch.load reads as it is");
  if (!is_sealed(bytes))
    throw std::runtime_error(path + " is truncated, corrupt or not a gpipe checkpoint file (its digest does not match "
                             "its contents); resume from a checkpoint file gpipe wrote (`save`)");
  bytes.resize(body);
  return bytes;
}

std::string pickle(const Dict& dict) {
  const std::vector<char> bytes = torch::pickle_save(dict);
  return std::string(bytes.begin(), bytes.end());
}

Dict unpickle(const std::string& bytes) { return load_torch_save(bytes).toGenericDict(); }

// name → tensor, from lists of names and values under `prefix`.
std::map<std::string, torch::Tensor> named(const Dict& d, const std::string& prefix) {
  std::map<std::string, torch::Tensor> out;
  const auto names = d.at(prefix + "_names").toList();
  const auto values = d.at(prefix + "s").toList();
  for (size_t n = 0; n < names.size(); ++n) out.emplace(names.get(n).toStringRef(), values.get(n).toTensor());
  return out;
}

void put_named(Dict& d, const std::string& prefix, const std::map<std::string, torch::Tensor>& tensors) {
  c10::List<std::string> names;
  c10::List<at::Tensor> values;
  for (const auto& [name, t] : tensors) {
    names.push_back(name);
    values.push_back(t);
  }
  d.insert(prefix + "_names", names);
  d.insert(prefix + "s", values);
}

// What restore_snapshot will install as `p`'s optimizer state, checked: a dict of the fields
// encode_state writes for `kind`, each a tensor of p's shape and dtype (and Adam's step a count),
// so that a file read_snapshot accepts restores and steps. Throws std::runtime_error naming the
// parameter and the field.
void check_state(const std::string& name, const torch::Tensor& p, const std::string& kind, const torch::IValue& saved) {
  if (!saved.isGenericDict()) throw std::runtime_error("the optimizer state of " + name + " is not a dict");
  const bool sgd = kind == "sgd";
  for (const auto& field : saved.toGenericDict()) {
    const std::string key = field.key().isString() ? field.key().toStringRef() : "?";
    if (key == "step" && !sgd) {
      if (!field.value().isInt() || field.value().toInt() < 0)
        throw std::runtime_error("the optimizer state of " + name + " has a step that is not a count");
      continue;
    }
    const bool known = sgd ? key == "momentum_buffer" : key == "exp_avg" || key == "exp_avg_sq" || key == "max_exp_avg_sq";
    if (!known) throw std::runtime_error("the optimizer state of " + name + " has a field '" + key + "' `optimizer` " +
                                         kind + " does not have");
    if (!field.value().isTensor() || field.value().toTensor().sizes() != p.sizes() ||
        field.value().toTensor().dtype() != p.dtype())
      throw std::runtime_error("the optimizer state " + key + " of " + name + " is not a tensor of its dtype and shape, " +
                               dtype_text(p) + " " + shape_text(p) +
                               (field.value().isTensor() ? " (it is " + dtype_text(field.value().toTensor()) + " " +
                                                               shape_text(field.value().toTensor()) + ")"
                                                         : ""));
    if (!torch::isfinite(field.value().toTensor()).all().item<bool>())
      throw std::runtime_error("the optimizer state " + key + " of " + name + " holds NaN or infinite values");
  }
  if (!sgd && saved.toGenericDict().size() > 0)
    for (const char* needed : {"step", "exp_avg", "exp_avg_sq"})
      if (!saved.toGenericDict().contains(needed))
        throw std::runtime_error("the optimizer state of " + name + " has no " + needed);
}

// A generator state saved by a run: one the CPU generator takes. libtorch reads the state's bytes
// as one contiguous block, whatever its strides say (fuzz/fuzz_checkpoint found the read past them).
void check_generator_state(const char* what, const torch::Tensor& state) {
  if (!state.defined() || !state.is_contiguous() || state.scalar_type() != torch::kByte)
    throw std::runtime_error(std::string("its ") + what + " state is not a generator's state");
  try {
    at::detail::createCPUGenerator().set_state(state);
  } catch (const std::exception&) {
    throw std::runtime_error(std::string("its ") + what + " state is not a generator's state");
  }
}

// The record of the pipeline a snapshot was saved by: its config's fields (fields_of) and the batch.
Dict encode_pipeline(const SavedPipeline& p) {
  Dict out = new_dict();
  for (const auto& [name, value] : fields_of(p.config)) {
    std::visit([&out, &name = name](const auto& v) { out.insert(name, v); }, value);
    if (name == "devices") out.insert("batch", p.batch);  // where files have always had it
  }
  return out;
}

// The loss scale's state (LossScaleState).
Dict encode_loss_scale(const LossScaleState& s) {
  Dict out = new_dict();
  out.insert("scale", s.scale);
  out.insert("growth_tracker", s.growth_tracker);
  out.insert("skipped", s.skipped);
  return out;
}

// Throws std::runtime_error saying what is wrong with a stored loss scale.
LossScaleState decode_loss_scale(const c10::IValue& value) {
  if (!value.isGenericDict()) throw std::runtime_error("its loss scale is not a dict");
  const auto dict = value.toGenericDict();
  for (const char* key : {"scale", "growth_tracker", "skipped"})
    if (!dict.contains(key)) throw std::runtime_error(std::string("its loss scale has no ") + key);
  const c10::IValue scale = dict.at("scale"), tracker = dict.at("growth_tracker"), skipped = dict.at("skipped");
  if (!scale.isDouble() || !tracker.isInt() || !skipped.isInt())
    throw std::runtime_error("its loss scale's fields are not a float and two whole numbers");
  const LossScaleState s{scale.toDouble(), tracker.toInt(), skipped.toInt()};
  try {
    LossScaler().set_state(s);  // the scaler's own check of a state it could have reached
  } catch (const std::invalid_argument& e) {
    throw std::runtime_error(std::string("its loss scale is no state a run reaches: ") + e.what());
  }
  return s;
}

// A list of whole numbers, or of numbers, as gpipe writes it (typed) or as Python writes it back
// (torch.save of a loaded file: a list of any); nullopt for anything else.
template <typename T>
std::optional<std::vector<T>> numbers_of(const c10::IValue& value) {
  if constexpr (std::is_same_v<T, int64_t>) {
    if (value.isIntList()) return value.toIntVector();
  } else {
    if (value.isDoubleList()) return value.toDoubleVector();
  }
  if (!value.isList()) return std::nullopt;
  std::vector<T> out;
  for (const c10::IValue& item : value.toList().vec()) {
    if (std::is_same_v<T, int64_t> ? !item.isInt() : !(item.isDouble() || item.isInt())) return std::nullopt;
    out.push_back(item.isInt() ? static_cast<T>(item.toInt()) : static_cast<T>(item.toDouble()));
  }
  return out;
}

// Throws std::runtime_error saying what is wrong with a stored pipeline.
SavedPipeline decode_pipeline(const c10::IValue& value) {
  if (!value.isGenericDict()) throw std::runtime_error("its pipeline is not a dict");
  Fields fields;
  for (const auto& item : value.toGenericDict()) {
    if (!item.key().isString()) continue;
    const std::string& name = item.key().toStringRef();
    const c10::IValue& v = item.value();
    if (v.isInt()) {
      fields.emplace_back(name, v.toInt());
    } else if (v.isDouble()) {
      fields.emplace_back(name, v.toDouble());
    } else if (v.isString()) {
      fields.emplace_back(name, v.toStringRef());
    } else if (const auto whole = numbers_of<int64_t>(v)) {
      fields.emplace_back(name, *whole);
    } else if (const auto real = numbers_of<double>(v)) {
      fields.emplace_back(name, *real);
    }
  }
  if (value.toGenericDict().contains("stage_times") && find_field(fields, "stage_times") == nullptr)
    throw std::runtime_error("its pipeline's stage_times is not a list of floats");
  SavedPipeline p;
  p.config = config_of(fields, "its pipeline");
  const FieldValue* batch = find_field(fields, "batch");
  if (batch == nullptr || !std::holds_alternative<int64_t>(*batch))
    throw std::runtime_error("its pipeline has no batch");
  p.batch = std::get<int64_t>(*batch);
  if (p.batch < 1) throw std::runtime_error("its pipeline's batch is " + std::to_string(p.batch));
  if (p.config.micro_batches > p.batch)
    throw std::runtime_error("its pipeline cannot have run: " + std::to_string(p.config.micro_batches) +
                             " micro-batches of a batch of " + std::to_string(p.batch));
  return p;
}

}  // namespace

std::string seal_snapshot(std::string bytes) {
  const std::string digest = digest_of(bytes, bytes.size());
  return bytes + kDigestTag + digest;
}

bool is_sealed_snapshot(const std::string& path) {
  try {
    return is_sealed(read_file(path));
  } catch (const std::exception&) {
    return false;
  }
}

std::string encode_snapshot_part(const torch::nn::Sequential& layers, torch::optim::Optimizer& optimizer) {
  std::map<std::string, torch::Tensor> parameters, buffers;
  Dict states = new_dict();
  for (const auto& p : layers->named_parameters()) {
    parameters.emplace(p.key(), p.value().detach());
    states.insert(p.key(), encode_state(optimizer, p.value()));
  }
  for (const auto& b : layers->named_buffers()) buffers.emplace(b.key(), b.value().detach());
  Dict part = new_dict();
  put_named(part, "parameter", parameters);
  put_named(part, "buffer", buffers);
  part.insert("optimizer_states", states);
  return pickle(part);
}

void save_snapshot(const std::string& path, const std::vector<std::string>& parts, const torch::nn::Sequential& layers,
                     const std::optional<torch::jit::Module>& script, const std::string& optimizer_name,
                     const TrainState& state) {
  std::map<std::string, torch::Tensor> parameters, buffers;
  Dict states = new_dict();
  for (const std::string& bytes : parts) {
    if (bytes.empty()) continue;  // a process that holds nothing to save (a replica)
    const Dict part = unpickle(bytes);
    for (auto& [name, t] : named(part, "parameter")) parameters.emplace(name, t);
    for (auto& [name, t] : named(part, "buffer")) buffers.emplace(name, t);
    for (const auto& entry : part.at("optimizer_states").toGenericDict()) states.insert(entry.key(), entry.value());
  }
  Dict dict = new_dict();
  dict.insert("format", std::string(kFormat));
  put_named(dict, "parameter", parameters);
  put_named(dict, "buffer", buffers);
  dict.insert("optimizer_name", optimizer_name);
  dict.insert("optimizer_states", states);
  dict.insert("step", state.step);
  dict.insert("shuffle_state", state.shuffle_state);
  dict.insert("random_state", state.random_state);
  if (state.pipeline) dict.insert("pipeline", encode_pipeline(*state.pipeline));
  if (state.loss_scale) dict.insert("loss_scale", encode_loss_scale(*state.loss_scale));
  const std::string payload = seal_snapshot(pickle(dict));
  if (!script) {
    write_file_atomically(path, payload);
    return;
  }
  // The script module's own tensors take the saved values (layers share them), then it is written.
  torch::NoGradGuard no_grad;
  for (auto& p : layers->named_parameters())
    if (parameters.count(p.key())) p.value().copy_(parameters.at(p.key()));
  for (auto& b : layers->named_buffers())
    if (buffers.count(b.key())) b.value().copy_(buffers.at(b.key()));
  std::ostringstream module_bytes;
  script->save(module_bytes, {{kExtraFile, payload}});
  write_file_atomically(path, module_bytes.str());
}

Snapshot read_snapshot(const std::string& path, const torch::nn::Sequential& layers,
                       const std::string& optimizer_name, bool script) {
  std::string payload = read_file(path);
  if (script) {  // the saved state rides in the TorchScript file as an extra file
    torch::jit::ExtraFilesMap extra{{kExtraFile, ""}};
    std::istringstream in(std::move(payload));
    try {
      torch::jit::load(in, c10::nullopt, extra);
    } catch (const std::exception&) {
      if (is_sealed(in.str()))
        throw std::runtime_error(path + " is the checkpoint file of a built-in model (`model` cnn, resnet, unet or "
                                 "gpt) or a per-device file, not of a TorchScript model: resume it with the model "
                                 "that saved it");
      throw std::runtime_error(path + " is truncated or not a TorchScript checkpoint file gpipe wrote (`save`)");
    }
    payload = extra[kExtraFile];
    if (payload.empty())
      throw std::runtime_error(path + " holds no gpipe checkpoint file; resume from a checkpoint file gpipe wrote (`save`)");
  }
  payload = unsealed(path, std::move(payload));
  Dict dict = new_dict();
  Snapshot out;
  try {
    dict = unpickle(payload);
    if (!dict.contains("format") || dict.at("format").toStringRef() != kFormat) throw std::runtime_error("format");
    for (const char* key : {"parameter_names", "parameters", "buffer_names", "buffers", "optimizer_name",
                            "optimizer_states", "step", "shuffle_state", "random_state"})
      if (!dict.contains(key)) throw std::runtime_error(key);
    out.parameters = named(dict, "parameter");
    out.buffers = named(dict, "buffer");
    out.optimizer_name = dict.at("optimizer_name").toStringRef();
    out.optimizer_states = dict.at("optimizer_states").toGenericDict();
    out.state.step = dict.at("step").toInt();
    out.state.shuffle_state = dict.at("shuffle_state").toTensor();
    out.state.random_state = dict.at("random_state").toTensor();
  } catch (const std::exception&) {
    throw std::runtime_error(path + " is truncated, corrupt or not a gpipe checkpoint file; resume from a checkpoint "
                             "file gpipe wrote (`save`)");
  }
  // Every tensor this process holds must be in the file, with its shape and dtype.
  auto check = [&](const std::string& what, const std::string& name, const torch::Tensor& mine,
                   const std::map<std::string, torch::Tensor>& saved) {
    const auto it = saved.find(name);
    if (it == saved.end())
      throw std::runtime_error(path + " is a checkpoint file of another model: it has no " + what + " " + name);
    if (it->second.sizes() != mine.sizes())
      throw std::runtime_error(path + " is a checkpoint file of another model: its " + what + " " + name + " is " +
                               shape_text(it->second) + ", this model's " + shape_text(mine));
    if (it->second.dtype() != mine.dtype())
      throw std::runtime_error(path + " is corrupt: its " + what + " " + name + " is " + dtype_text(it->second) + " " +
                               shape_text(it->second) + ", this model's " + dtype_text(mine) + " " + shape_text(mine) +
                               "; resume from a checkpoint file gpipe wrote (`save`)");
    // A value no step could have made: caught here, not as a loss that became NaN with advice on `lr`.
    if (it->second.is_floating_point() && !torch::isfinite(it->second).all().item<bool>())
      throw std::runtime_error(path + " is corrupt: its " + what + " " + name + " holds NaN or infinite values, which "
                               "gpipe never saves; resume from a checkpoint file gpipe wrote (`save`)");
  };
  for (const auto& p : layers->named_parameters()) check("parameter", p.key(), p.value(), out.parameters);
  for (const auto& b : layers->named_buffers()) check("buffer", b.key(), b.value(), out.buffers);
  if (out.optimizer_name != optimizer_name)
    throw std::runtime_error(path + " was trained with `optimizer` " + out.optimizer_name +
                             "; resume with the same optimizer");
  try {
    if (out.state.step < 0) throw std::runtime_error("its step count is negative");
    check_generator_state("shuffling", out.state.shuffle_state);
    check_generator_state("random", out.state.random_state);
    if (dict.contains("pipeline")) out.state.pipeline = decode_pipeline(dict.at("pipeline"));
    if (dict.contains("loss_scale")) out.state.loss_scale = decode_loss_scale(dict.at("loss_scale"));
    for (const auto& p : layers->named_parameters()) {  // gpipe writes one (empty before a step) for each
      if (!out.optimizer_states.contains(p.key())) throw std::runtime_error("it has no optimizer state for " + p.key());
      check_state(p.key(), p.value(), optimizer_name, out.optimizer_states.at(p.key()));
    }
  } catch (const std::runtime_error& e) {
    throw std::runtime_error(path + " is corrupt: " + e.what() + "; resume from a checkpoint file gpipe wrote (`save`)");
  }
  out.parameters_taken = static_cast<int64_t>(layers->named_parameters().size());
  out.parameters_in_file = static_cast<int64_t>(out.parameters.size());
  return out;
}

void restore_snapshot(const Snapshot& snapshot, const torch::nn::Sequential& layers,
                      torch::optim::Optimizer& optimizer) {
  torch::NoGradGuard no_grad;
  for (auto& p : layers->named_parameters()) {
    p.value().copy_(snapshot.parameters.at(p.key()));
    if (snapshot.optimizer_states.contains(p.key()))
      install_state(optimizer, snapshot.optimizer_name, p.value(),
                    snapshot.optimizer_states.at(p.key()).toGenericDict());
  }
  for (auto& b : layers->named_buffers()) b.value().copy_(snapshot.buffers.at(b.key()));
}

}  // namespace gpipe
