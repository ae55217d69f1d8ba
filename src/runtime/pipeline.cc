// pipeline.cc: the facade: builds the stages, runs a schedule over their threads, keeps steps atomic.
#include "gpipe/pipeline.h"

#include "gpipe/check.h"
#include "gpipe/microbatch.h"
#include "gpipe/partition.h"
#include "runtime/train_step.h"

#include <torch/torch.h>

#if defined(GPIPE_CUDA_MEMORY_STATS)
#include <c10/cuda/CUDACachingAllocator.h>
#endif

#include <algorithm>
#include <condition_variable>
#include <mutex>
#include <numeric>
#include <unordered_map>
#include <unordered_set>

namespace gpipe {

namespace {

// A CUDA stage's memory comes from the caching allocator's own statistics of
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

std::string shape_of(const torch::Tensor& t) {
  if (!t.defined()) return "undefined";
  std::ostringstream out;
  out << t.sizes();
  return out.str();
}

}  // namespace

Pipeline::Pipeline(torch::nn::Sequential model, PipelineOptions options)
    : model_(std::move(model)), options_(std::move(options)) {
  GPIPE_CHECK(!model_.is_empty() && model_->size() > 0,
              "the model is empty (0 layers); give the pipeline a torch::nn::Sequential with at "
              "least one layer");
  const int layers = static_cast<int>(model_->size());

  const int V = options_.virtual_stages();
  GPIPE_CHECK(V >= 1, "virtual_stages must be at least 1 (got ", V, ")");
  if (!options_.balance().empty()) {
    check_balance(options_.balance(), layers);
    GPIPE_CHECK(options_.stages() == 0 ||
                    options_.stages() * V == static_cast<int>(options_.balance().size()),
                "stages (", options_.stages(), V > 1 ? " devices × " + std::to_string(V) + " virtual stages" : "",
                ") and the balance (", options_.balance().size(), " stages) disagree; set only one of them");
    balance_ = options_.balance();
  } else {
    GPIPE_CHECK(options_.stages() >= 1, "the number of stages must be at least 1 (got ",
                options_.stages(), "); set stages(K) with 1 <= K·V <= ", layers,
                " or give a balance");
    balance_ = even_balance(layers, options_.stages() * V);
  }
  const int S = stages();
  GPIPE_CHECK(S % V == 0, "the balance has ", S, " stages, not a multiple of the ", V,
              " virtual stages per device; give K·V entries, or set stages(K) and let gpipe cut evenly");
  const int K = S / V;
  GPIPE_CHECK(options_.chunks() >= 1, "the number of micro-batches (chunks) must be at least 1 (got ",
              options_.chunks(), "); set chunks(M) with M >= 1");
  // The schedule first: a configuration it cannot run is refused before anything is built.
  const detail::SkipPlan skips = detail::plan_skips(skip_connections(model_), balance_);
  skip_routes_ = skips.routes;
  train_program_ = lower(make_schedule(options_.schedule(), K, options_.chunks(), V), options_.checkpoint(),
                         skip_routes_);
  validate(train_program_);
  forward_program_ = lower(forward_only(K, options_.chunks(), V), Checkpoint::kNever, skip_routes_);

  devices_ = options_.devices();
  if (devices_.empty()) {
    GPIPE_CHECK(options_.threads_per_stage() >= 1, "threads_per_stage must be at least 1 (got ",
                options_.threads_per_stage(), ")");
    devices_.assign(static_cast<size_t>(K), Device::cpu(options_.threads_per_stage()));
  }
  GPIPE_CHECK(static_cast<int>(devices_.size()) == K, "got ", devices_.size(), " devices for ", S, " stages",
              V > 1 ? " (" + std::to_string(K) + " devices × " + std::to_string(V) + " virtual stages)" : "",
              "; give ", K, " devices");
  for (const Device& device : devices_) check_device(device);

  const auto named = model_->named_parameters();
  for (const auto& group : options_.tied_parameters()) {
    GPIPE_CHECK(group.size() >= 2, "a group of tied parameters needs at least two names (got ", group.size(), ")");
    for (const std::string& name : group) {
      GPIPE_CHECK(named.contains(name), "tied_parameters: the model has no parameter ", name,
                  "; name parameters as model->named_parameters() does, e.g. ",
                  named.is_empty() ? std::string("0.weight") : named.keys().front());
      GPIPE_CHECK(named[name].is_same(named[group.front()]), "tied_parameters: ", group.front(), " and ", name,
                  " are different tensors; in one process tied layers share one tensor: register the first "
                  "layer's parameter in the other layer");
    }
  }

  // Cut the model: stage s gets layers [offsets[s], offsets[s+1]), sharing the modules.
  const std::vector<int> offsets = stage_offsets(balance_);
  const auto names = model_->named_children().keys();
  std::unordered_map<const void*, int> owner;         // parameter → first stage that uses it
  std::unordered_map<const void*, int> buffer_owner;  // buffer → stage that holds it
  transport_ = std::make_unique<InProcessTransport>(S);
  const bool track = options_.track_memory() ||
                     std::any_of(devices_.begin(), devices_.end(), [](const Device& d) { return d.memory_cap_bytes > 0; });
  if (track) enable_memory_tracking();
  std::vector<std::vector<std::unique_ptr<Stage>>> placed(static_cast<size_t>(K));
  for (int j = 0; j < S; ++j) {
    torch::nn::Sequential layers;
    for (int n = offsets[static_cast<size_t>(j)]; n < offsets[static_cast<size_t>(j) + 1]; ++n)
      layers->push_back(names[static_cast<size_t>(n)], *(model_->begin() + n));
    const int d = train_program_.placement[static_cast<size_t>(j)];
    for (const torch::Tensor& p : layers->parameters()) {
      // A tied weight stays one tensor: the stages' backwards add to its one gradient (autograd
      // serializes the additions), and the optimizer steps it once. One tensor lives on one device.
      auto [it, fresh] = owner.emplace(p.unsafeGetTensorImpl(), j);
      const Device& mine = devices_[static_cast<size_t>(d)];
      const Device& theirs = devices_[static_cast<size_t>(train_program_.placement[static_cast<size_t>(it->second)])];
      GPIPE_CHECK(fresh || mine.device == theirs.device, "a parameter is used by stage ", it->second, " on ",
                  theirs.str(), " and stage ", j, " on ", mine.str(), "; in one process a tied weight is one tensor "
                  "on one device: place both stages on one device, or run one stage per MPI rank with "
                  "tied_parameters");
    }
    for (const auto& b : layers->named_buffers()) {
      auto [it, fresh] = buffer_owner.emplace(b.value().unsafeGetTensorImpl(), j);
      GPIPE_CHECK(fresh || it->second == j, "buffer ", b.key(), " (a BatchNorm's running statistics, say) is used by "
                  "stages ", it->second, " and ", j, ", whose threads would update it at once; put the layers that "
                  "share it on one stage (change the balance), or give each its own");
    }
    detail::check_splittable(train_program_, layers);
    detail::check_batch_norm(layers, options_.deferred_batch_norm());
    const Device& device = devices_[static_cast<size_t>(d)];
    if (!device.is_cpu()) layers->to(device.device);
    placed[static_cast<size_t>(d)].push_back(std::make_unique<Stage>(j, S, layers, device, options_.deferred_batch_norm()));
    skips.connect(*placed[static_cast<size_t>(d)].back());
  }
  for (int d = 0; d < K; ++d) {
    const Device& device = devices_[static_cast<size_t>(d)];
    auto memory = track ? std::make_shared<MemoryCounter>("device " + std::to_string(d) + " (" + device.str() + ")",
                                                          device.memory_cap_bytes)
                        : nullptr;
    executors_.push_back(std::make_unique<Executor>(std::move(placed[static_cast<size_t>(d)]), device,
                                                    transport_.get(), memory));
  }

  int blas_threads = 1;
  for (const Device& device : devices_)
    if (device.is_cpu()) blas_threads = std::max(blas_threads, device.threads);
  set_blas_threads(blas_threads);
  keep_freed_memory();
  for (const Device& device : devices_) threads_.push_back(std::make_unique<DeviceThread>(device));
}

Pipeline::~Pipeline() = default;

std::vector<torch::Tensor> Pipeline::parameters() const { return unique_parameters(*model_); }

std::vector<Pipeline::StageMemory> Pipeline::memory() const {
  std::vector<StageMemory> out;
  for (size_t j = 0; j < executors_.size(); ++j) {
    const auto& e = executors_[j];
    if (!e->memory()) return {};
    StageMemory m;
    for (const auto& stage : e->stages())
      for (const auto& p : stage->layers()->parameters()) {
        m.parameter_bytes += p.numel() * static_cast<int64_t>(p.element_size());
        if (p.grad().defined()) m.parameter_bytes += p.grad().numel() * static_cast<int64_t>(p.grad().element_size());
      }
    m.peak_bytes = (e->device().is_cpu() ? e->memory()->peak_bytes() : cuda_allocated(e->device(), false).second) -
                   memory_at_start_[j];
    m.held_peak_bytes = e->device().is_cpu() ? e->memory()->held_peak_bytes() - memory_at_start_[j] : m.peak_bytes;
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

torch::nn::Sequential Pipeline::stage(int j) const {
  GPIPE_CHECK(j >= 0 && j < stages(), "stage ", j, " does not exist; stages are 0..", stages() - 1);
  const int d = train_program_.placement[static_cast<size_t>(j)];
  for (const auto& stage : executors_[static_cast<size_t>(d)]->stages())
    if (stage->index() == j) return stage->layers();
  return {};
}

std::vector<torch::Tensor> Pipeline::split(const torch::Tensor& tensor, int micro_batches, const char* what) const {
  GPIPE_CHECK(tensor.defined() && tensor.dim() >= 1, "the ", what,
              " has no batch dimension (shape ", shape_of(tensor),
              "); gpipe splits dim 0 into micro-batches: add one, e.g. x.unsqueeze(0)");
  return scatter(tensor, micro_batches);
}

const Schedule& Pipeline::training_program(int micro_batches) {
  if (micro_batches == options_.chunks()) return train_program_;
  auto it = short_programs_.find(micro_batches);
  if (it == short_programs_.end())
    it = short_programs_
             .emplace(micro_batches,
                      detail::short_batch_program(options_.schedule(), static_cast<int>(devices_.size()),
                                                  micro_batches, options_.virtual_stages(), options_.checkpoint(),
                                                  skip_routes_))
             .first;
  return it->second;
}

torch::Tensor Pipeline::train_step(const torch::Tensor& input, const torch::Tensor& target,
                                   const LossFn& loss) {
  GPIPE_CHECK(static_cast<bool>(loss), "train_step needs a loss function");
  GPIPE_CHECK(input.defined() && input.dim() >= 1, "the input has no batch dimension (shape ", shape_of(input),
              "); gpipe splits dim 0 into micro-batches: add one, e.g. x.unsqueeze(0)");
  GPIPE_CHECK(input.size(0) >= 1, "the input is an empty batch (shape ", shape_of(input), "); give at least one row");
  GPIPE_CHECK(target.defined() && target.dim() >= 1 && target.size(0) == input.size(0),
              "the target's batch size differs from the input's (input ", shape_of(input),
              ", target ", shape_of(target), "); give one target row per input sample");
  const int64_t N = input.size(0);
  const int M = static_cast<int>(std::min<int64_t>(options_.chunks(), N));  // a short batch: one row per micro-batch
  StepData step;
  step.training = true;
  step.inputs = split(input, M, "input");
  step.targets = split(target, M, "target");
  step.loss = loss;

  const bool stochastic = std::any_of(executors_.begin(), executors_.end(),
                                      [](const auto& e) { return e->stochastic(); });
  const bool tracked = executors_.front()->memory() != nullptr;
  const Schedule& program = training_program(M);
  detail::TrainStepScope scope(step, chunk_sizes(N, M), N, stochastic, parameters(), /*zero_grads=*/tracked);
  run(program, step);
  scope.commit();
  for (const auto& executor : executors_)
    for (const auto& stage : executor->stages()) stage->update_batch_norm(stage->batch_norm_statistics());
  return torch::tensor(std::accumulate(step.losses.begin(), step.losses.end(), 0.0),
                       torch::dtype(torch::kFloat64));
}

torch::Tensor Pipeline::forward(const torch::Tensor& input) {
  GPIPE_CHECK(input.defined() && input.dim() >= 1, "the input has no batch dimension (shape ",
              shape_of(input), "); add one, e.g. x.unsqueeze(0)");
  // A batch smaller than M (say the last one of a test set) runs in fewer micro-batches.
  const int M = static_cast<int>(std::min<int64_t>(options_.chunks(), input.size(0)));
  GPIPE_CHECK(M >= 1, "the input is an empty batch (shape ", shape_of(input), ")");
  StepData step;
  step.training = false;
  step.inputs = scatter(input, M);
  step.outputs.resize(static_cast<size_t>(M));
  const int K = static_cast<int>(devices_.size());
  run(M == options_.chunks() ? forward_program_
                             : lower(forward_only(K, M, options_.virtual_stages()), Checkpoint::kNever, skip_routes_),
      step);
  return gather(step.outputs);
}

void Pipeline::run(const Schedule& program, StepData& step) {
  const size_t K = executors_.size();
  transport_->reset();
  memory_at_start_.assign(K, 0);
  for (size_t j = 0; j < K; ++j)
    if (const auto& memory = executors_[j]->memory()) {
      memory->reset_peak();
      memory_at_start_[j] = executors_[j]->device().is_cpu() ? memory->current_bytes()
                                                              : cuda_allocated(executors_[j]->device(), true).first;
    }
  trace_ = StepTrace{};
  trace_.devices.assign(K, {});

  std::mutex mutex;
  std::condition_variable finished;
  size_t pending = K;
  std::exception_ptr first_error;

  trace_.begin_ns = now_ns();
  for (size_t j = 0; j < K; ++j) {
    threads_[j]->post([&, j] {
      try {
        executors_[j]->run(program.actions[j], step, &trace_.devices[j]);
      } catch (const Cancelled&) {
        // another stage failed first; its error is the one reported
      } catch (...) {
        {
          std::lock_guard<std::mutex> lock(mutex);
          if (!first_error) first_error = std::current_exception();
        }
        transport_->cancel();  // wakes every stage blocked in recv
      }
      std::lock_guard<std::mutex> lock(mutex);
      --pending;
      finished.notify_all();  // under the lock: the driver cannot return before this ends
    });
  }
  {
    std::unique_lock<std::mutex> lock(mutex);
    finished.wait(lock, [&] { return pending == 0; });
  }
  trace_.end_ns = now_ns();
  transport_->reset();
  if (first_error) std::rethrow_exception(first_error);
}

}  // namespace gpipe
