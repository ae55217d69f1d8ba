// pipeline.cc: the one step driver: builds this process's stages from the plan, runs their
// devices' programs over the transport, keeps steps atomic; the same in one process and under MPI.
#include "gpipe/pipeline.h"

#include "gpipe/check.h"
#include "gpipe/microbatch.h"
#include "gpipe/skip.h"
#include "runtime/group.h"
#include "runtime/train_step.h"

#include <torch/torch.h>

#if defined(GPIPE_CUDA_MEMORY_STATS)
#include <c10/cuda/CUDACachingAllocator.h>
#endif

#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <mutex>
#include <numeric>
#include <set>
#include <unordered_map>

namespace gpipe {

namespace {

// A CUDA device's memory comes from the caching allocator's own statistics of
// its device (index 0 of allocated_bytes is the aggregate over pools): bytes
// allocated now, and at the peak since `reset`. Zeros without CUDA.
std::pair<int64_t, int64_t> cuda_allocated(const Device& device, bool reset) {
#if defined(GPIPE_CUDA_MEMORY_STATS)
  if (reset) c10::cuda::CUDACachingAllocator::resetPeakStats(device.device.index());
  const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(device.device.index());
  return {stats.allocated_bytes[0].current, stats.allocated_bytes[0].peak};
#else
  (void)device;
  (void)reset;
  return {0, 0};
#endif
}

// Σ x_k·(k mod 7 + 1) over the parameters, restarting k at each parameter's first element.
double local_checksum(const std::vector<torch::Tensor>& params) {
  double sum = 0;
  for (const auto& p : params) {
    const torch::Tensor flat = p.detach().to(torch::kDouble).flatten();
    sum += (flat * (torch::arange(flat.numel(), torch::kDouble).remainder(7) + 1)).sum().item<double>();
  }
  return sum;
}

// What the other processes (and this one's other devices) are told of a failure here: a StageError's
// message without the program around the failing action, which this process reports itself.
std::string told_of(const std::exception& e) {
  const auto* stage_error = dynamic_cast<const StageError*>(&e);
  return stage_error != nullptr ? stage_error->message() : std::string(e.what());
}

}  // namespace

Pipeline::Pipeline(torch::nn::Sequential model, PipelineOptions options)
    : Pipeline(detail::local_group(), std::move(model), std::move(options)) {}

Pipeline::Pipeline(torch::nn::Sequential model, const PipelinePlan& plan, PipelineOptions options)
    : Pipeline(detail::local_group(plan), std::move(model), std::move(options)) {}

Pipeline::Pipeline(std::unique_ptr<Backend> group, torch::nn::Sequential layers, PipelineOptions options)
    : group_(std::move(group)), layers_(std::move(layers)), whole_inputs_(options.whole_inputs()) {
  if (layers_.is_empty()) layers_ = torch::nn::Sequential();
  plan_ = group_->plan(layers_, options, [](const torch::nn::Sequential& layers, bool named_by_index) {
    return skip_uses(layers, named_by_index);
  });
  local_ = group_->local_devices();
  const int S = plan_.stages();

  // This process's stages, cut from its layers: those of its devices' stages, in stage order.
  const std::vector<int> mine = stages_here();
  const bool track = options.track_memory() ||
                     std::any_of(plan_.device_list.begin(), plan_.device_list.end(),
                                 [](const Device& d) { return d.memory_cap_bytes > 0; });
  std::exception_ptr failure;
  try {
    std::map<int, std::vector<std::unique_ptr<Stage>>> placed;  // by device
    std::unordered_map<const void*, int> owner;                 // parameter → first stage that uses it
    std::unordered_map<const void*, int> buffer_owner;          // buffer → stage that holds it
    const auto names = layers_->named_children().keys();
    size_t next = 0;
    for (int s : mine) {
      torch::nn::Sequential part;
      const LayerRange range = plan_.layers_of(s);
      for (int n = range.first; n < range.last; ++n, ++next)
        part->push_back(names[next], *(layers_->begin() + static_cast<std::ptrdiff_t>(next)));
      const int d = plan_.placement[static_cast<size_t>(s)];
      const Device& device = plan_.device_list[static_cast<size_t>(d)];
      for (const torch::Tensor& p : part->parameters()) {
        // A tied weight stays one tensor: the stages' backwards add to its one gradient (autograd
        // serializes the additions), and the optimizer steps it once. One tensor lives on one device.
        auto [it, fresh] = owner.emplace(p.unsafeGetTensorImpl(), s);
        const Device& theirs = plan_.device_list[static_cast<size_t>(plan_.placement[static_cast<size_t>(it->second)])];
        GPIPE_CHECK(fresh || device.device == theirs.device, "a parameter is used by stage ", it->second, " on ",
                    theirs.str(), " and stage ", s, " on ", device.str(), "; in one process a tied weight is one "
                    "tensor on one device: place both stages on one device, or run one device per MPI rank with "
                    "tied_parameters");
      }
      for (const auto& b : part->named_buffers()) {
        auto [it, fresh] = buffer_owner.emplace(b.value().unsafeGetTensorImpl(), s);
        GPIPE_CHECK(fresh || it->second == s, "buffer ", b.key(), " (a BatchNorm's running statistics, say) is used "
                    "by stages ", it->second, " and ", s, ", which would update it at once; put the layers that share "
                    "it on one stage (change the balance), or give each its own");
      }
      if (options.deferred_batch_norm())
        for (const auto& layer : part->children())
          if (auto* holder = dynamic_cast<BatchNormLayer*>(layer.get())) holder->defer_batch_norms_inside();
      detail::check_batch_norm(part, options.deferred_batch_norm());
      if (!device.is_cpu()) part->to(device.device);
      auto stage = std::make_unique<Stage>(s, S, part, device, options.deferred_batch_norm());
      check_precision_runs(options.precision(), device.device.type());
      stage->set_precision(options.precision());
      std::vector<std::pair<int, std::string>> stashed, popped;  // the skip routes that leave or enter it
      for (size_t k = 0; k < plan_.skip_routes.size(); ++k) {
        if (plan_.skip_routes[k].from == s) stashed.emplace_back(static_cast<int>(k), plan_.skip_names[k]);
        if (plan_.skip_routes[k].to == s) popped.emplace_back(static_cast<int>(k), plan_.skip_names[k]);
      }
      stage->set_skips(std::move(stashed), std::move(popped));
      placed[d].push_back(std::move(stage));
    }
    GPIPE_CHECK(next == layers_->size(), "this process was given ", layers_->size(), " layers, but its stages hold ",
                next, "; give each process the layers of its devices' stages (plan().device_layers)");
    if (track) enable_memory_tracking();
    for (int d : local_) {
      const Device& device = plan_.device_list[static_cast<size_t>(d)];
      auto memory = track ? std::make_shared<MemoryCounter>("device " + std::to_string(d) + " (" + device.str() + ")",
                                                            device.memory_cap_bytes)
                          : nullptr;
      executors_.push_back(std::make_unique<Executor>(d, std::move(placed[d]), device, memory));
    }
  } catch (...) {  // a bad layer, or no memory on the device: every process stops
    failure = std::current_exception();
  }
  group_->agree(failure);
  group_->connect(plan_, layers_, options);
  double stochastic = draws_random_numbers(layers_) ? 1 : 0;  // whether any stage of the whole model draws
  group_->reduce(&stochastic, 1, /*largest=*/true);
  stochastic_ = stochastic > 0;
  deferred_batch_norm_ = options.deferred_batch_norm();

  int blas_threads = 1;
  for (int d : local_) {
    const Device& device = plan_.device_list[static_cast<size_t>(d)];
    if (device.is_cpu()) blas_threads = std::max(blas_threads, device.threads);
  }
  set_blas_threads(blas_threads);
  keep_freed_memory();
  if (group_->on_caller_thread())
    bind_current_thread(plan_.device_list[static_cast<size_t>(local_.front())]);
  else
    for (int d : local_) threads_.push_back(std::make_unique<DeviceThread>(plan_.device_list[static_cast<size_t>(d)]));
}

Pipeline::~Pipeline() = default;  // the device threads end first, then the stages, then the group and its transport

std::vector<torch::Tensor> Pipeline::parameters() const { return unique_parameters(*layers_); }

std::vector<torch::Tensor> Pipeline::counted_parameters() const {
  std::vector<torch::Tensor> out;
  for (const auto& p : parameters())
    if (group_->counts(p)) out.push_back(p);
  return out;
}

torch::nn::Sequential Pipeline::stage(int j) const {
  GPIPE_CHECK(j >= 0 && j < stages(), "stage ", j, " does not exist; stages are 0..", stages() - 1);
  for (const auto& e : executors_)
    for (const auto& stage : e->stages())
      if (stage->index() == j) return stage->layers();
  GPIPE_CHECK(false, "stage ", j, " runs on device ", plan_.placement[static_cast<size_t>(j)],
              ", which another process holds");
  return {};
}

std::vector<Pipeline::DeviceMemory> Pipeline::memory() const {
  std::vector<DeviceMemory> out;
  for (size_t j = 0; j < executors_.size(); ++j) {
    const auto& e = executors_[j];
    if (!e->memory()) return {};
    DeviceMemory m;
    std::set<const void*> held;  // a weight tied across stages of the device, once
    for (const auto& stage : e->stages())
      for (const auto& p : stage->layers()->parameters()) {
        if (!held.insert(p.unsafeGetTensorImpl()).second) continue;
        m.parameter_bytes += p.numel() * static_cast<int64_t>(p.element_size());
        if (p.grad().defined()) m.parameter_bytes += p.grad().numel() * static_cast<int64_t>(p.grad().element_size());
      }
    const int64_t at_start = j < memory_at_start_.size() ? memory_at_start_[j] : 0;
    m.peak_bytes = (e->device().is_cpu() ? e->memory()->peak_bytes() : cuda_allocated(e->device(), false).second) -
                   at_start;
    m.held_peak_bytes = e->device().is_cpu() ? e->memory()->held_peak_bytes() - at_start : m.peak_bytes;
    out.push_back(m);
  }
  return out;
}

int64_t Pipeline::skip_bytes() const {
  int64_t bytes = 0;
  for (const auto& e : executors_)
    for (const auto& stage : e->stages()) bytes += stage->skip_bytes();
  return bytes;
}

int64_t Pipeline::bytes_sent() const { return group_->transport().bytes_sent(); }

const Schedule& Pipeline::training_program(int m) {
  if (m == plan_.micro_batches) return plan_.training;
  auto it = training_programs_.find(m);
  if (it == training_programs_.end()) it = training_programs_.emplace(m, plan_.training_program(m)).first;
  return it->second;
}

const Schedule& Pipeline::inference_program(int m) {
  if (m == plan_.micro_batches) return plan_.inference;
  auto it = inference_programs_.find(m);
  if (it == inference_programs_.end()) it = inference_programs_.emplace(m, plan_.inference_program(m)).first;
  return it->second;
}

std::pair<int64_t, int64_t> Pipeline::output_rows(int64_t rows) const {
  return holds(plan_.last_device()) ? group_->share(rows) : std::pair<int64_t, int64_t>{0, 0};
}

template <typename Work>
auto Pipeline::collective(Work&& work) {
  group_->begin_call();
  try {
    return work();
  } catch (const Cancelled&) {  // another process's failure, or an interrupt: nothing to tell the others
    group_->fail("");
    throw;
  } catch (const std::exception& e) {
    group_->fail(told_of(e));
    throw;
  } catch (...) {
    group_->fail("an unknown exception");
    throw;
  }
}

torch::Tensor Pipeline::train_step(const Tensors& input, const torch::Tensor& target, const LossFn& loss,
                                   double loss_scale) {
  return collective([&] {
    GPIPE_CHECK(static_cast<bool>(loss), "train_step needs a loss function");
    GPIPE_CHECK(std::isfinite(loss_scale) && loss_scale > 0, "the loss scale must be a finite number above 0 (got ",
                loss_scale, ")");
    const int64_t N = batch_rows(input, whole_inputs_);
    GPIPE_CHECK(target.defined() && target.dim() >= 1 && target.size(0) == N,
                "the target's batch size differs from the input's (input ", input.shape(), ", target ",
                shape_text(target), "); give one target row per input sample");
    group_->check_same_batch(input, target);
    // A BatchNorm nested in a layer that was in evaluation when the pipeline was made, trained now.
    for (const auto& e : executors_)
      for (const auto& stage : e->stages()) detail::check_batch_norm(stage->layers(), deferred_batch_norm_);
    const auto [first, count] = group_->share(N);
    // A short batch runs one row per micro-batch; a replica without rows only joins the sums.
    const int M = static_cast<int>(std::min<int64_t>(plan_.micro_batches, count));
    StepData step;
    step.loss = loss;
    step.before_stage = before_stage_;
    if (M > 0 && holds(plan_.first_device()))
      step.inputs = scatter(narrow_rows(input, first, count, whole_inputs_), M, whole_inputs_);
    if (M > 0 && holds(plan_.last_device())) step.targets = scatter(target.narrow(0, first, count), M);
    const bool tracked = !executors_.empty() && executors_.front()->memory() != nullptr;
    // Every process draws the same seed: their default generators have drawn the same numbers.
    const std::vector<int64_t> sizes = M > 0 ? micro_batch_sizes(count, M) : std::vector<int64_t>{};
    detail::TrainStepScope scope(step, sizes, N, stochastic_, parameters(), /*zero_grads=*/tracked);
    detail::weigh_by_counted_targets(step, target, first, sizes);  // by the loss function given
    // Each micro-batch's loss times the scale, in float at least (a float16 loss times 65536 would overflow).
    if (loss_scale != 1.0)
      step.loss = [loss, loss_scale](const torch::Tensor& output, const torch::Tensor& y) {
        const torch::Tensor value = loss(output, y);
        return value.to(torch::promote_types(value.scalar_type(), torch::kFloat)) * loss_scale;
      };
    // An input that requires grad gets its gradient, as loss.backward() gives it (on the first device).
    step.keep_input_gradients = !step.inputs.empty() && detail::wants_input_gradient(input, whole_inputs_);
    step.input_gradients.assign(step.keep_input_gradients ? static_cast<size_t>(M) : 0, Tensors());
    for (const auto& e : executors_)
      for (const auto& stage : e->stages()) stage->begin_step();  // a replica without rows runs nothing
    if (M > 0) run(training_program(M), step);
    group_->reduce_gradients(parameters());
    const torch::Tensor statistics = batch_norm_statistics();
    double total = std::accumulate(step.losses.begin(), step.losses.end(), 0.0);
    group_->reduce(&total, 1, /*largest=*/false);
    scope.commit(1.0 / loss_scale);  // the step's gradients unscaled
    update_batch_norms(statistics);
    if (step.keep_input_gradients) {
      if (loss_scale != 1.0) {
        torch::NoGradGuard no_grad;
        for (Tensors& gradients : step.input_gradients)
          for (torch::Tensor& g : gradients.items)
            if (g.defined()) g = g * (1.0 / loss_scale);  // as the parameters' (commit)
      }
      detail::add_input_gradients(input, step, first, whole_inputs_);
    }
    return torch::tensor(total / loss_scale, torch::dtype(torch::kFloat64));
  });
}

torch::Tensor Pipeline::forward(const Tensors& input) {
  return collective([&] {
    const int64_t N = batch_rows(input, whole_inputs_);
    group_->check_same_batch(input, torch::Tensor());
    const auto [first, count] = group_->share(N);
    // A batch smaller than M (say the last one of a test set) runs in fewer micro-batches.
    const int M = static_cast<int>(std::min<int64_t>(plan_.micro_batches, count));
    StepData step;
    step.training = false;
    for (const auto& e : executors_)
      for (const auto& stage : e->stages()) stage->begin_step();
    if (M > 0) {  // a replica without rows runs nothing, but takes part in the statistics' sum
      if (holds(plan_.first_device()))
        step.inputs = scatter(narrow_rows(input, first, count, whole_inputs_), M, whole_inputs_);
      step.outputs.resize(static_cast<size_t>(M));
      run(inference_program(M), step);
    }
    // Training-mode BatchNorm, deferred: the running statistics once, from every row, as one device's.
    update_batch_norms(batch_norm_statistics());
    return M > 0 && holds(plan_.last_device()) ? gpipe::gather(step.outputs) : torch::Tensor();
  });
}

torch::Tensor Pipeline::batch_norm_statistics() {
  std::vector<torch::Tensor> parts;  // every stage's here, in stage order
  for (const auto& e : executors_)
    for (const auto& stage : e->stages())
      if (torch::Tensor s = stage->batch_norm_statistics(); s.defined()) parts.push_back(s);
  if (parts.empty()) return {};
  auto summed = std::make_shared<torch::Tensor>(torch::cat(parts).contiguous());
  group_->sum_over_replicas(summed);
  return *summed;
}

void Pipeline::update_batch_norms(const torch::Tensor& statistics) {
  int64_t at = 0;  // each stage's share of the summed statistics, in stage order
  for (const auto& e : executors_)
    for (const auto& stage : e->stages()) {
      const torch::Tensor own = stage->batch_norm_statistics();
      const int64_t n = own.defined() ? own.numel() : 0;
      if (n > 0) stage->update_batch_norm(statistics.narrow(0, at, n));
      at += n;
    }
}

std::vector<int> Pipeline::stages_here() const {
  std::vector<int> out;
  for (int d : local_)
    for (int s : plan_.stages_of(d)) out.push_back(s);
  std::sort(out.begin(), out.end());
  return out;
}

bool Pipeline::holds(int device) const { return std::count(local_.begin(), local_.end(), device) > 0; }

void Pipeline::reset_memory_peaks() {
  memory_at_start_.assign(executors_.size(), 0);
  for (size_t j = 0; j < executors_.size(); ++j)
    if (const auto& memory = executors_[j]->memory()) {
      memory->reset_peak();
      memory_at_start_[j] = executors_[j]->device().is_cpu() ? memory->current_bytes()
                                                              : cuda_allocated(executors_[j]->device(), true).first;
    }
}

void Pipeline::run(const Schedule& program, StepData& step) {
  Transport& transport = group_->transport();
  std::vector<const std::vector<Action>*> rows;
  for (int d : local_) rows.push_back(&program.actions[static_cast<size_t>(d)]);
  transport.begin(rows);
  for (const auto& e : executors_) {
    e->set_transport(&transport);  // a fresh one after a failed step
    // On a GPU the stages' streams wait (on the device) for what this thread queued before the step.
    e->set_start(record_current_stream(e->device().device));
  }
  reset_memory_peaks();
  trace_ = StepTrace{};
  trace_.devices.assign(static_cast<size_t>(plan_.devices), {});
  trace_.other.assign(static_cast<size_t>(plan_.devices), {});

  std::mutex mutex;
  std::condition_variable finished;
  size_t pending = local_.size();
  std::exception_ptr first_error;  // the first failure of a stage here
  std::exception_ptr cancelled;    // else the first cancellation (another process's failure, an interrupt)
  auto run_device = [&](size_t j) {
    try {
      const int d = local_[j];
      executors_[j]->run(program.actions[static_cast<size_t>(d)], step, &trace_.devices[static_cast<size_t>(d)],
                         &trace_.other[static_cast<size_t>(d)]);
    } catch (const Cancelled&) {
      std::lock_guard<std::mutex> lock(mutex);
      if (!cancelled) cancelled = std::current_exception();
    } catch (const std::exception& e) {
      {
        std::lock_guard<std::mutex> lock(mutex);
        if (!first_error) first_error = std::current_exception();
      }
      transport.cancel(group_->who() + told_of(e));  // wakes every stage blocked in recv, here and elsewhere
    } catch (...) {
      {
        std::lock_guard<std::mutex> lock(mutex);
        if (!first_error) first_error = std::current_exception();
      }
      transport.cancel(group_->who() + "an unknown exception");
    }
    std::lock_guard<std::mutex> lock(mutex);
    --pending;
    finished.notify_all();  // under the lock: the driver cannot return before this ends
  };

  trace_.begin_ns = now_ns();
  if (threads_.empty()) {
    for (size_t j = 0; j < local_.size(); ++j) run_device(j);
  } else {
    bool interrupted = false;
    std::exception_ptr own_error;  // a failure here, on the calling thread: rethrown once every device has stopped
    for (size_t j = 0; j < local_.size(); ++j) {
      try {
        threads_[j]->post([&run_device, j] { run_device(j); });
      } catch (...) {  // not posted: those devices will not count down
        own_error = std::current_exception();
        {
          std::lock_guard<std::mutex> lock(mutex);
          pending -= local_.size() - j;
        }
        transport.cancel("gpipe: a device's program could not be started");
        break;
      }
    }
    std::unique_lock<std::mutex> lock(mutex);
    while (!finished.wait_for(lock, std::chrono::milliseconds(100), [&] { return pending == 0; })) {
      if (!interrupted_ || interrupted || own_error) continue;
      lock.unlock();  // the check may take a front end's lock (Python's GIL), which no device thread holds
      try {
        interrupted = interrupted_();
      } catch (...) {
        own_error = std::current_exception();
      }
      if (interrupted || own_error) transport.cancel("gpipe: the step was interrupted");
      lock.lock();
    }
    if (own_error) std::rethrow_exception(own_error);
    if (interrupted && !first_error) cancelled = std::make_exception_ptr(Interrupted());
  }
  trace_.end_ns = now_ns();
  if (first_error) std::rethrow_exception(first_error);
  if (cancelled) std::rethrow_exception(cancelled);
  transport.finish();
}

Evaluation Pipeline::evaluate(const torch::Tensor& input, const torch::Tensor& target, const LossFn& loss,
                              bool classification, int64_t batch) {
  GPIPE_CHECK(batch >= 1, "evaluate needs a batch of at least 1 row (got ", batch, ")");
  GPIPE_CHECK(input.defined() && target.defined() && input.dim() >= 1 && target.dim() >= 1 &&
                  input.size(0) == target.size(0) && input.size(0) >= 1,
              "evaluate needs input and target with the same number of rows, at least one");
  double loss_sum = 0, correct = 0;
  const int64_t N = input.size(0);
  {
    const EvalScope eval(layers_);
    for (int64_t at = 0; at < N; at += batch) {
      const int64_t n = std::min(batch, N - at);
      // Each process scores the rows whose output it holds (under MPI: the last stage of each replica).
      const torch::Tensor out = forward(input.narrow(0, at, n));
      if (!out.defined()) continue;
      collective([&] {  // a loss that fails here stops the other processes too
        const torch::Tensor rows = target.narrow(0, at + output_rows(n).first, out.size(0));
        loss_sum += loss(out, rows).item<double>() * static_cast<double>(out.size(0));
        if (classification) correct += static_cast<double>(out.argmax(-1).eq(rows).sum().item<int64_t>());
        return 0;
      });
    }
  }
  const double rows = static_cast<double>(N);
  return {sum(loss_sum) / rows, classification ? sum(correct) / rows : 0.0};
}

StepTrace Pipeline::trace() {
  return collective([&] { return group_->gather_trace(trace_, plan_); });
}

double Pipeline::bubble() {
  double busy_and_span[2] = {0, 0};  // Σ busy and Σ step time over the devices held here
  for (int d : local_) {
    busy_and_span[0] += trace_.busy_seconds(d);
    busy_and_span[1] += trace_.seconds();
  }
  collective([&] {
    group_->reduce(busy_and_span, 2, /*largest=*/false);
    return 0;
  });
  return busy_and_span[1] > 0 ? 1.0 - busy_and_span[0] / busy_and_span[1] : 0.0;
}

double Pipeline::sum(double value) {
  collective([&] {
    group_->reduce(&value, 1, /*largest=*/false);
    return 0;
  });
  return value;
}

double Pipeline::max(double value) {
  collective([&] {
    group_->reduce(&value, 1, /*largest=*/true);
    return 0;
  });
  return value;
}

std::vector<std::string> Pipeline::gather(const std::string& bytes) {
  return collective([&] { return group_->gather(bytes); });
}

double Pipeline::checksum() { return sum(replica() == 0 ? local_checksum(counted_parameters()) : 0.0); }

double Pipeline::gradient_norm() {
  double squares = 0;
  if (replica() == 0)
    for (const auto& p : counted_parameters())
      if (p.grad().defined()) {
        const double norm = p.grad().detach().norm().item<double>();
        squares += norm * norm;
      }
  return std::sqrt(sum(squares));
}

double Pipeline::clip_gradients(double max_norm) {
  GPIPE_CHECK(max_norm > 0 && std::isfinite(max_norm), "the largest gradient norm must be a positive number (got ",
              max_norm, ")");
  const double norm = gradient_norm();
  const double scale = max_norm / (norm + 1e-6);
  if (scale < 1) {
    torch::NoGradGuard no_grad;
    for (auto p : parameters())
      if (p.grad().defined()) p.mutable_grad().mul_(scale);
  }
  return norm;
}

bool Pipeline::all_finite(bool buffers) {
  bool finite = true;
  for (const auto& p : parameters()) finite = finite && torch::isfinite(p.detach()).all().item<bool>();
  if (buffers)
    for (const auto& b : layers_->buffers())
      if (b.is_floating_point()) finite = finite && torch::isfinite(b).all().item<bool>();
  return max(finite ? 0.0 : 1.0) == 0.0;
}

bool Pipeline::root() const { return group_->rank() == 0; }
int Pipeline::replica() const { return group_->replica(); }
int Pipeline::device() const { return group_->device(); }
int Pipeline::rank() const { return group_->rank(); }
std::string Pipeline::describe() const { return group_->describe(); }

}  // namespace gpipe
