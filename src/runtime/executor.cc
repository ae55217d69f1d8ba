// executor.cc: the executor: one device's program, dispatched action by action to one function per kind.
#include "gpipe/executor.h"

#include "gpipe/check.h"

#include <torch/torch.h>

#include <c10/core/DeviceGuard.h>
#include <c10/core/StreamGuard.h>

#include <algorithm>
#include <map>
#include <optional>
#include <set>
#include <sstream>
#include <tuple>

namespace gpipe {
namespace {

// How many actions either side of a failing one its report shows.
constexpr size_t kShownAround = 4;

// The program of device `device` as `gpipe schedule --program` prints it ("device 1 | 1RECV_F0<0 1F0
// ..."), cut to the actions around program[n], which ">>" marks: what a failure's report ends with.
std::string program_around(int device, const std::vector<Action>& program, size_t n) {
  const size_t first = n > kShownAround ? n - kShownAround : 0;
  const size_t last = std::min(program.size(), n + kShownAround + 1);
  std::ostringstream out;
  out << "device " << device << "'s program at its action " << n + 1 << " of " << program.size() << " (>>):\n"
      << "device " << device << " |" << (first > 0 ? " ..." : "");
  for (size_t k = first; k < last; ++k) out << (k == n ? " >> " : " ") << program[k].str();
  if (last < program.size()) out << " ...";
  return out.str();
}

// A failure's message with what causes it, where libtorch's message alone does not say.
std::string with_cause(std::string what) {
  if (what.find("a leaf Variable that requires grad is being used in an in-place operation") != std::string::npos)
    what += "; a layer changes a tensor the stage keeps (its input, or a layer's under a split backward) in "
            "place where gpipe's search did not see it do so (the search runs the stage's first micro-batch once, "
            "without a graph: a layer that changes its input only with a graph, or only on some data, escapes it), "
            "so it did not run on a copy: make the layer return a new tensor (or cut the model so that another "
            "layer starts the stage)";
  if (what.find("Expected more than 1 value per channel when training") != std::string::npos)
    what += "; BatchNorm normalizes each micro-batch by its own statistics, which one row per channel does "
            "not have: use fewer micro-batches or larger batches (`micro_batches`, `batch_size`, "
            "`drop_last` for a short last batch)";
  return what;
}

// `stream` as the stream a guard makes current; none on CPU (no stream).
c10::optional<c10::Stream> optional_stream(const DeviceStream& stream) {
  if (!stream.active()) return c10::nullopt;
  return stream.stream();
}

}  // namespace

// One run of a program. A receive leaves what it took in its stage's inbox (or, for a skip connection,
// with the stage by name), a compute action takes its input from the inbox and leaves its output in
// the outbox, a send takes it from there; a send to a stage of this device (the V's turn, or
// interleaving on one device) is handed over here, not through the transport.
class Executor::Run {
 public:
  Run(Executor& executor, const std::vector<Action>& program, StepData& step, std::vector<WorkSpan>* other);

  // step.before_stage for program[n]'s stage, the first time one of its actions comes (`other` gets its span).
  void enter_stage(size_t n);
  // program[n], on its stage's stream. Throws StageError for a failure, Cancelled as it came.
  void perform(size_t n);

 private:
  using Key = std::tuple<int, int, int>;  // (stage, channel, micro-batch)
  static Key key(int stage, Channel channel, int micro_batch) {
    return {stage, static_cast<int>(channel), micro_batch};
  }
  static Tensors take(std::map<Key, Tensors>& box, const Key& key);
  bool holds(int stage) const;
  // What a receive `a` gets: handed over by a stage of this device, or from the transport.
  Tensors message_for(const Action& a);

  void receive(const Action& a);
  void send(const Action& a);
  void forward(const Action& a);
  void backward(const Action& a);  // B, or I
  void weight_grad(const Action& a);

  // The StageError of program[n]: `what`, the shape it was given, libtorch's report, the program around it.
  StageError failure(size_t n, const std::string& what, const std::string& operand = "",
                     std::string report = "") const;

  Executor& executor_;
  const std::vector<Action>& program_;
  StepData& step_;
  std::vector<WorkSpan>* other_;
  std::set<std::pair<int, int>> split_;  // (stage, micro-batch): forwards that record their layers for an I
  std::map<Key, Tensors> inbox_, outbox_;
  std::map<Key, Tensors> local_;  // sent to a stage of this device: (receiving stage, channel, micro-batch)
  std::set<int> entered_;         // the stages whose before_stage has run
  std::string operand_;           // the shape of what the action at hand was given, for its error message
};

Executor::Run::Run(Executor& executor, const std::vector<Action>& program, StepData& step,
                   std::vector<WorkSpan>* other)
    : executor_(executor), program_(program), step_(step), other_(other) {
  // Which forwards record their layers for a split backward: those whose backward is an I.
  for (const Action& a : program)
    if (a.kind == ActionKind::kInputGrad) split_.insert({a.stage, a.micro_batch});
}

Tensors Executor::Run::take(std::map<Key, Tensors>& box, const Key& key) {
  auto it = box.find(key);
  if (it == box.end()) return Tensors();
  Tensors t = std::move(it->second);
  box.erase(it);
  return t;
}

bool Executor::Run::holds(int stage) const {
  for (const auto& s : executor_.stages_)
    if (s->index() == stage) return true;
  return false;
}

void Executor::Run::enter_stage(size_t n) {
  const Action& a = program_[n];  // the stage's first action, named by a failure
  if (!step_.before_stage || !entered_.insert(a.stage).second) return;
  if (executor_.transport_->cancelled()) throw Cancelled();
  const int64_t begin = now_ns();
  try {
    const c10::OptionalStreamGuard on_stream(optional_stream(executor_.stage(a.stage).stream()));
    step_.before_stage(a.stage);
  } catch (const std::exception& e) {
    throw failure(n, e.what());
  }
  if (other_ != nullptr) other_->push_back({a.stage, begin, now_ns()});
}

void Executor::Run::perform(size_t n) {
  const Action& a = program_[n];
  operand_.clear();
  try {
    // The action's work, its sends' events and receives' waits on its stage's stream (none on CPU).
    const c10::OptionalStreamGuard on_stream(optional_stream(executor_.stage(a.stage).stream()));
    switch (a.kind) {
      case ActionKind::kRecv: return receive(a);
      case ActionKind::kSend: return send(a);
      case ActionKind::kForward: return forward(a);
      case ActionKind::kBackward:
      case ActionKind::kInputGrad: return backward(a);
      case ActionKind::kWeightGrad: return weight_grad(a);
    }
  } catch (const Cancelled&) {
    throw;
  } catch (const std::exception& e) {  // libtorch's message; its C++ stack or TorchScript's traceback kept apart
    std::string report;
    const std::string what = with_cause(short_error(e, &report));
    throw failure(n, what, operand_, report);
  }
}

StageError Executor::Run::failure(size_t n, const std::string& what, const std::string& operand,
                                  std::string report) const {
  return StageError(program_[n], what, operand, std::move(report), program_around(executor_.index_, program_, n));
}

Tensors Executor::Run::message_for(const Action& a) {
  if (!holds(a.peer)) return executor_.transport_->recv(a.peer, a.stage, a.channel, a.micro_batch);
  const Key k = key(a.stage, a.channel, a.micro_batch);
  GPIPE_CHECK(local_.count(k) > 0, "nothing to receive: stage ", a.peer, " of this device has not sent it yet");
  return take(local_, k);
}

void Executor::Run::receive(const Action& a) {
  Tensors t = message_for(a);
  Stage& s = executor_.stage(a.stage);
  t = executor_.arrive(std::move(t), s);
  if (skip_of(a.channel) >= 0)  // a skip connection's: the stage keeps it by name
    s.receive_skip(a.micro_batch, a.channel, t.only("a skip connection's tensor"));
  else
    inbox_[key(a.stage, a.channel, a.micro_batch)] = std::move(t);
}

void Executor::Run::send(const Action& a) {
  const Key k = key(a.stage, a.channel, a.micro_batch);
  const bool skip = skip_of(a.channel) >= 0;  // a skip connection's: the stage kept it by name
  GPIPE_CHECK(skip || outbox_.count(k) > 0, "nothing to send: no earlier action of this device produced it");
  Stage& s = executor_.stage(a.stage);
  Tensors t = skip ? Tensors(s.take_skip(a.micro_batch, a.channel)) : take(outbox_, k);
  t.ready = s.stream().record();  // on a GPU: ready once this stage's work so far has run
  if (holds(a.peer))
    local_[key(a.peer, a.channel, a.micro_batch)] = std::move(t);
  else
    executor_.transport_->send(a.stage, a.peer, a.channel, a.micro_batch, std::move(t));
}

void Executor::Run::forward(const Action& a) {
  Stage& s = executor_.stage(a.stage);
  const int i = a.micro_batch;
  Tensors x = take(inbox_, key(a.stage, Channel::kActivation, i));
  const Tensors& given = s.first() && static_cast<size_t>(i) < step_.inputs.size() ? step_.inputs[static_cast<size_t>(i)] : x;
  if (given.any_defined()) operand_ = "input " + given.shape();
  Tensors y = s.forward(i, std::move(x), a.recompute, split_.count({a.stage, i}) > 0, step_);
  if (!s.last()) outbox_[key(a.stage, Channel::kActivation, i)] = std::move(y);
}

void Executor::Run::backward(const Action& a) {
  Stage& s = executor_.stage(a.stage);
  const int i = a.micro_batch;
  Tensors g = take(inbox_, key(a.stage, Channel::kGradient, i));
  if (g.any_defined()) operand_ = "output gradient " + g.shape();
  Tensors x = a.kind == ActionKind::kBackward ? s.backward(i, g, step_) : s.input_grad(i, g, step_);
  if (!s.first()) outbox_[key(a.stage, Channel::kGradient, i)] = std::move(x);
}

void Executor::Run::weight_grad(const Action& a) { executor_.stage(a.stage).weight_grad(a.micro_batch); }

Executor::Executor(int index, std::vector<std::unique_ptr<Stage>> stages, Device device,
                   std::shared_ptr<MemoryCounter> memory)
    : stages_(std::move(stages)), index_(index), device_(std::move(device)), memory_(std::move(memory)) {}

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

void Executor::begin_step() {
  // The stages' streams start after what the caller queued before the step; what begin_step
  // resets is then reset on the stage's own stream.
  if (start_)
    for (const auto& s : stages_) s->stream().wait(*start_);
  start_ = nullptr;
  for (const auto& s : stages_) {
    const c10::OptionalStreamGuard on_stream(optional_stream(s->stream()));
    s->begin_step();
  }
}

void Executor::clear_stages() {
  for (const auto& s : stages_) s->clear();
}

void Executor::run(const std::vector<Action>& program, StepData& step, std::vector<ActionSpan>* trace,
                   std::vector<WorkSpan>* other) {
  c10::DeviceGuard device_guard(device_.device);
  torch::AutoGradMode grad_mode(step.training);
  std::optional<MemoryScope> memory_scope;
  if (memory_) memory_scope.emplace(memory_);
  if (trace != nullptr) trace->reserve(program.size());
  Run run(*this, program, step, other);  // its tensors outlive the streams' work, waited for below
  begin_step();
  try {
    if (transport_ == nullptr) throw std::logic_error("gpipe: the executor of " + device_.str() + " has no transport");
    // step.before_stage: for every stage at once where the program starts with a receive (the device
    // waits for its input in the fill), else for each stage before its first action.
    if (!program.empty() && program.front().kind == ActionKind::kRecv)
      for (size_t n = 0; n < program.size(); ++n) run.enter_stage(n);
    for (size_t n = 0; n < program.size(); ++n) {
      const Action& a = program[n];
      // Another device failed (or the step was interrupted): stop before the next piece of work.
      if (a.is_compute() && transport_->cancelled()) throw Cancelled();
      run.enter_stage(n);
      const int64_t begin = now_ns();
      run.perform(n);
      if (!a.is_compute()) continue;  // a trace's span and the memory held are the compute actions'
      if (trace != nullptr) trace->push_back({a, begin, now_ns()});
      if (memory_) memory_->note_held();
    }
  } catch (...) {
    try {
      synchronize();  // nothing of this step still queued when its tensors go
    } catch (...) {     // the first error is the one to report
    }
    clear_stages();
    throw;
  }
  synchronize();  // the step's results (outputs, losses, gradients, statistics) ready for the caller
  for (const auto& s : stages_) s->finish_step(step);
  clear_stages();
}

}  // namespace gpipe
