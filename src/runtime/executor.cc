// executor.cc: the executor: one device's program, dispatched action by action.
#include "gpipe/executor.h"

#include "gpipe/check.h"

#include <torch/torch.h>

#include <c10/core/DeviceGuard.h>
#include <c10/core/StreamGuard.h>

#include <map>
#include <optional>
#include <set>
#include <sstream>
#include <tuple>

namespace gpipe {

Executor::Executor(std::vector<std::unique_ptr<Stage>> stages, Device device, std::shared_ptr<MemoryCounter> memory)
    : stages_(std::move(stages)), device_(std::move(device)), memory_(std::move(memory)) {}

Stage& Executor::stage(int index) {
  for (const auto& s : stages_)
    if (s->index() == index) return *s;
  GPIPE_CHECK(false, "stage ", index, " is not placed on this device (", device_.str(), ")");
  return *stages_.front();
}

const DeviceStream& Executor::copy_stream(const torch::Device& device) {
  auto it = copy_streams_.find(device.index());
  if (it == copy_streams_.end()) it = copy_streams_.emplace(device.index(), DeviceStream(device)).first;
  return it->second;
}

Tensors Executor::arrive(Tensors message, const Stage& to) {
  const std::shared_ptr<c10::Event> ready = std::move(message.ready);
  message.ready = nullptr;
  const DeviceStream& stream = to.stream();
  const torch::Device& here = device_.device;
  bool waited = false;
  for (torch::Tensor& t : message.items) {
    if (!t.defined()) continue;
    if (t.device() == here) {  // made on this GPU, by another stage's stream: wait for it, then use it in place
      if (!stream.active()) continue;
      if (ready && !waited) stream.wait(*ready);
      waited = true;
      stream.keep_alive(t);  // the producer may drop it while this stream still reads it
      continue;
    }
    // From another device (the current stream of this device is the stage's: the action runs under it). A
    // GPU's tensor is copied on a copy stream of that GPU after its producer's event: libtorch copies on the
    // source's current stream and makes the destination's current stream wait for the copy, so a GPU stage's
    // stream waits on the device and a CPU stage's thread for the copy alone. A host tensor is copied on
    // this stage's stream.
    if (t.is_cuda()) {
      const DeviceStream& copy = copy_stream(t.device());
      if (ready) copy.wait(*ready);
      const c10::StreamGuard on_copy(copy.stream());
      torch::Tensor moved = t.to(here);
      copy.keep_alive(t);
      t = std::move(moved);
    } else {
      t = t.to(here);
    }
  }
  return message;
}

void Executor::synchronize() {
  for (const auto& s : stages_) s->stream().synchronize();
  for (const auto& [index, copy] : copy_streams_) copy.synchronize();
}

void Executor::run(const std::vector<Action>& program, StepData& step, std::vector<ActionSpan>* trace,
                   std::vector<WorkSpan>* other) {
  c10::DeviceGuard device_guard(device_.device);
  torch::AutoGradMode grad_mode(step.training);
  std::optional<MemoryScope> memory_scope;
  if (memory_) memory_scope.emplace(memory_);
  if (trace != nullptr) trace->reserve(program.size());

  // Which forwards record their layers for a split backward: those whose backward is an I.
  std::set<std::pair<int, int>> split;
  for (const Action& a : program)
    if (a.kind == ActionKind::kInputGrad) split.insert({a.stage, a.micro_batch});

  using Key = std::tuple<int, int, int>;  // (stage, channel, micro-batch)
  std::map<Key, Tensors> inbox, outbox;
  // A send to a stage of this device (the V's turn, or interleaving on one device) is handed over
  // here, not through the transport: (receiving stage, channel, micro-batch) -> its tensors.
  std::map<Key, Tensors> local;
  auto holds = [&](int index) {
    for (const auto& s : stages_)
      if (s->index() == index) return true;
    return false;
  };
  auto take = [](std::map<Key, Tensors>& box, const Key& key) {
    auto it = box.find(key);
    if (it == box.end()) return Tensors();
    Tensors t = std::move(it->second);
    box.erase(it);
    return t;
  };
  auto clear = [&] {
    for (const auto& s : stages_) s->clear();
  };
  // The stages' streams start after what the caller queued before the step; what begin_step
  // resets is then reset on the stage's own stream.
  if (start_)
    for (const auto& s : stages_) s->stream().wait(*start_);
  start_ = nullptr;
  for (const auto& s : stages_) {
    c10::OptionalStreamGuard on_stream;
    if (s->stream().active()) on_stream.reset_stream(s->stream().stream());
    s->begin_step();
  }

  try {
    if (transport_ == nullptr) throw std::logic_error("gpipe: the executor of " + device_.str() + " has no transport");
    // step.before_stage: for every stage at once where the program starts with a receive (the device
    // waits for its input in the fill), else for each stage before its first action.
    std::set<int> entered;  // the stages whose before_stage has run
    auto before = [&](const Action& a) {  // `a`: the stage's first action, named by a failure
      if (!step.before_stage || !entered.insert(a.stage).second) return;
      if (transport_->cancelled()) throw Cancelled();
      const int64_t begin = now_ns();
      try {
        c10::OptionalStreamGuard on_stream;
        if (const DeviceStream& own = stage(a.stage).stream(); own.active()) on_stream.reset_stream(own.stream());
        step.before_stage(a.stage);
      } catch (const std::exception& e) {
        throw StageError(a, e.what());
      }
      if (other != nullptr) other->push_back({a.stage, begin, now_ns()});
    };
    if (!program.empty() && program.front().kind == ActionKind::kRecv)
      for (const Action& a : program) before(a);
    for (const Action& a : program) {
      // Another device failed (or the step was interrupted): stop before the next piece of work.
      if (a.is_compute() && transport_->cancelled()) throw Cancelled();
      before(a);
      const int64_t begin = now_ns();
      std::string operand;  // the shape of what the action was given, for its error message
      auto name_operand = [&operand](const char* what, const Tensors& t) {
        if (t.any_defined()) operand = std::string(what) + ' ' + t.shape();
      };
      try {
        // The action's work, its sends' events and receives' waits on its stage's stream (none on CPU).
        c10::OptionalStreamGuard on_stream;
        if (const DeviceStream& own = stage(a.stage).stream(); own.active()) on_stream.reset_stream(own.stream());
        const int i = a.micro_batch;
        const int act = static_cast<int>(Channel::kActivation), grad = static_cast<int>(Channel::kGradient);
        switch (a.kind) {
          case ActionKind::kRecv: {
            Tensors t;
            if (holds(a.peer)) {
              const Key key{a.stage, static_cast<int>(a.channel), i};
              GPIPE_CHECK(local.count(key) > 0, "nothing to receive: stage ", a.peer,
                          " of this device has not sent it yet");
              t = take(local, key);
            } else {
              t = transport_->recv(a.peer, a.stage, a.channel, i);
            }
            t = arrive(std::move(t), stage(a.stage));
            if (skip_of(a.channel) >= 0)  // a skip connection's: the stage keeps it by name
              stage(a.stage).receive_skip(i, a.channel, t.only("a skip connection's tensor"));
            else
              inbox[{a.stage, static_cast<int>(a.channel), i}] = std::move(t);
            continue;
          }
          case ActionKind::kSend: {
            const Key key{a.stage, static_cast<int>(a.channel), i};
            GPIPE_CHECK(skip_of(a.channel) >= 0 || outbox.count(key) > 0,
                        "nothing to send: no earlier action of this device produced it");
            Tensors t = skip_of(a.channel) >= 0 ? Tensors(stage(a.stage).take_skip(i, a.channel)) : take(outbox, key);
            t.ready = stage(a.stage).stream().record();  // on a GPU: ready once this stage's work so far has run
            if (holds(a.peer))
              local[{a.peer, static_cast<int>(a.channel), i}] = std::move(t);
            else
              transport_->send(a.stage, a.peer, a.channel, i, std::move(t));
            continue;
          }
          case ActionKind::kForward: {
            Stage& s = stage(a.stage);
            Tensors x = take(inbox, {a.stage, act, i});
            name_operand("input", s.first() && static_cast<size_t>(i) < step.inputs.size() ? step.inputs[static_cast<size_t>(i)] : x);
            Tensors y = s.forward(i, std::move(x), a.recompute, split.count({a.stage, i}) > 0, step);
            if (!s.last()) outbox[{a.stage, act, i}] = std::move(y);
            break;
          }
          case ActionKind::kBackward:
          case ActionKind::kInputGrad: {
            Stage& s = stage(a.stage);
            Tensors g = take(inbox, {a.stage, grad, i});
            name_operand("output gradient", g);
            Tensors x = a.kind == ActionKind::kBackward ? s.backward(i, g, step) : s.input_grad(i, g, step);
            if (!s.first()) outbox[{a.stage, grad, i}] = std::move(x);
            break;
          }
          case ActionKind::kWeightGrad:
            stage(a.stage).weight_grad(i);
            break;
        }
      } catch (const Cancelled&) {
        throw;
      } catch (const std::exception& e) {  // libtorch's message; its C++ stack or TorchScript's traceback kept apart
        std::string report;
        std::string what = short_error(e, &report);
        if (what.find("a leaf Variable that requires grad is being used in an in-place operation") != std::string::npos)
          what += "; the stage's first layer works in place on the stage's input: build it with inplace=False "
                  "(or cut the model so that another layer starts the stage)";
        if (what.find("Expected more than 1 value per channel when training") != std::string::npos)
          what += "; BatchNorm normalizes each micro-batch by its own statistics, which one row per channel does "
                  "not have: use fewer micro-batches or larger batches (`micro_batches`, `batch_size`, "
                  "`drop_last` for a short last batch)";
        throw StageError(a, what, operand, report);
      }
      if (trace != nullptr) trace->push_back({a, begin, now_ns()});
      if (memory_) memory_->note_held();
    }
  } catch (...) {
    try {
      synchronize();  // nothing of this step still queued when its tensors go
    } catch (...) {     // the first error is the one to report
    }
    clear();
    throw;
  }
  synchronize();  // the step's results (outputs, losses, gradients, statistics) ready for the caller
  for (const auto& s : stages_) s->finish_step(step);
  clear();
}

}  // namespace gpipe
