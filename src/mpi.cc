// mpi.cc: one stage per MPI rank: the tagged non-blocking transport, the error channel that
// keeps a failure from hanging the job, and the collective MpiPipeline with replica allreduce.
#include "gpipe/mpi.h"

#include "gpipe/check.h"
#include "gpipe/microbatch.h"
#include "gpipe/partition.h"
#include "train_step.h"

#include <torch/torch.h>

#include <climits>
#include <cstdio>
#include <cstdlib>
#include <numeric>

namespace gpipe::mpi {
namespace {

constexpr int kErrorTag = 1;

void check_mpi(int code, const char* what) {
  if (code == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  MPI_Error_string(code, text, &length);
  throw std::runtime_error(std::string("gpipe: ") + what + " failed: " + std::string(text, static_cast<size_t>(length)));
}

int rank_of(MPI_Comm comm) {
  int rank = 0;
  MPI_Comm_rank(comm, &rank);
  return rank;
}

int size_of(MPI_Comm comm) {
  int size = 0;
  MPI_Comm_size(comm, &size);
  return size;
}

}  // namespace

bool launched() {
  for (const char* name : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS"})
    if (std::getenv(name) != nullptr) return true;
  return false;
}

Environment::Environment(int* argc, char*** argv) {
  int initialized = 0;
  MPI_Initialized(&initialized);
  GPIPE_CHECK(!initialized, "MPI is already initialised; create one gpipe::mpi::Environment per process");
  int provided = 0;
  check_mpi(MPI_Init_thread(argc, argv, MPI_THREAD_FUNNELED, &provided), "MPI_Init_thread");
  rank_ = rank_of(MPI_COMM_WORLD);
  size_ = size_of(MPI_COMM_WORLD);
}

Environment::~Environment() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized) MPI_Finalize();
}

void abort(int status) {
  std::fflush(stdout);
  std::fflush(stderr);
  MPI_Abort(MPI_COMM_WORLD, status);
  std::_Exit(status);
}

Placement place(int world_rank, int world_size, int stages) {
  GPIPE_CHECK(stages >= 1, "the number of stages must be at least 1 (got ", stages, ")");
  GPIPE_CHECK(world_size % stages == 0, "the job has ", world_size, " ranks, not a multiple of the ", stages,
              " stages; start K·D ranks for K stages and D replicas (mpirun -np ", stages, ", ", 2 * stages,
              ", ...)");
  Placement p;
  p.stages = stages;
  p.replicas = world_size / stages;
  p.stage = world_rank % stages;
  p.replica = world_rank / stages;
  return p;
}

std::pair<int, int> stage_layers(const std::vector<int>& balance, int stage) {
  GPIPE_CHECK(stage >= 0 && stage < static_cast<int>(balance.size()), "stage ", stage,
              " does not exist; the balance ", format_balance(balance), " has stages 0..", balance.size() - 1);
  const int first = std::accumulate(balance.begin(), balance.begin() + stage, 0);
  return {first, first + balance[static_cast<size_t>(stage)]};
}

RemoteError::RemoteError(int rank, const std::string& message)
    : Cancelled("gpipe: stopped because rank " + std::to_string(rank) + " failed: " + message), rank_(rank) {}

// ---------------------------------------------------------------- errors

ErrorChannel::ErrorChannel(MPI_Comm world) : rank_(rank_of(world)), size_(size_of(world)) {
  check_mpi(MPI_Comm_dup(world, &comm_), "MPI_Comm_dup");  // its own, so no tag can meet another's
  post();
}

ErrorChannel::~ErrorChannel() {
  if (pending_ != MPI_REQUEST_NULL) {
    MPI_Cancel(&pending_);
    MPI_Wait(&pending_, MPI_STATUS_IGNORE);
  }
  MPI_Comm_free(&comm_);
}

void ErrorChannel::post() {
  check_mpi(MPI_Irecv(buffer_.data(), static_cast<int>(buffer_.size()), MPI_CHAR, MPI_ANY_SOURCE, kErrorTag,
                      comm_, &pending_),
            "posting the error receive");
}

void ErrorChannel::wait(MPI_Request& request) {
  while (request != MPI_REQUEST_NULL) {
    std::array<MPI_Request, 2> requests{request, pending_};
    int index = MPI_UNDEFINED;
    MPI_Status status;
    check_mpi(MPI_Waitany(2, requests.data(), &index, &status), "waiting for a message");
    request = requests[0];
    pending_ = requests[1];
    if (index == 1) {
      int length = 0;
      MPI_Get_count(&status, MPI_CHAR, &length);
      throw RemoteError(status.MPI_SOURCE, std::string(buffer_.data(), static_cast<size_t>(length)));
    }
  }
}

void ErrorChannel::raise(const std::string& message) {
  const std::string text = message.substr(0, buffer_.size());
  std::vector<MPI_Request> sends;
  for (int r = 0; r < size_; ++r) {
    if (r == rank_) continue;
    sends.emplace_back();
    MPI_Isend(text.data(), static_cast<int>(text.size()), MPI_CHAR, r, kErrorTag, comm_, &sends.back());
  }
  // Short messages leave eagerly; a rank that died is the launcher's to clean up.
  MPI_Waitall(static_cast<int>(sends.size()), sends.data(), MPI_STATUSES_IGNORE);
}

// ---------------------------------------------------------------- transport

MpiTransport::MpiTransport(MPI_Comm comm, ErrorChannel* errors, std::vector<int> rank_of_stage, int micro_batches)
    : comm_(comm), errors_(errors), rank_of_stage_(std::move(rank_of_stage)) {
  void* value = nullptr;
  int found = 0;
  MPI_Comm_get_attr(comm_, MPI_TAG_UB, &value, &found);
  const int64_t tag_ub = found ? *static_cast<int*>(value) : 32767;
  const int S = static_cast<int>(rank_of_stage_.size());
  const int64_t tags = int64_t{4} * S * S * micro_batches;
  GPIPE_CHECK(tags - 1 <= tag_ub, "M = ", micro_batches, " micro-batches over ", S,
              " stages need more message tags than this MPI offers (", tag_ub, "); use at most ",
              (tag_ub + 1) / (4 * S * S), " micro-batches");
}

MpiTransport::~MpiTransport() {
  for (auto& [key, pending] : receives_) {
    MPI_Cancel(&pending.request);
    MPI_Wait(&pending.request, MPI_STATUS_IGNORE);
  }
  // Sends still pending after a failed step may finish later: their buffers
  // must outlive them, so they are handed to MPI and deliberately kept.
  for (auto& pending : sends_)
    for (MPI_Request& request : pending.requests)
      if (request != MPI_REQUEST_NULL) MPI_Request_free(&request);
  if (!sends_.empty()) new std::vector<PendingSend>(std::move(sends_));
}

// A message's tag names both stages, so messages between two ranks that hold several stages never mix.
int MpiTransport::tag(const Key& key, bool data) const {
  const auto [from, to, channel, micro_batch] = key;
  const int S = static_cast<int>(rank_of_stage_.size());
  return (((micro_batch * S + to) * S + from) * 2 + channel) * 2 + (data ? 1 : 0);
}

int MpiTransport::rank(int stage) const {
  GPIPE_CHECK(stage >= 0 && stage < static_cast<int>(rank_of_stage_.size()), "stage ", stage,
              " does not exist; this pipeline has stages 0..", rank_of_stage_.size() - 1);
  return rank_of_stage_[static_cast<size_t>(stage)];
}

MpiTransport::PendingRecv MpiTransport::post_header(const Key& key) {
  PendingRecv pending;
  pending.header = std::make_unique<Header>();
  check_mpi(MPI_Irecv(pending.header->data(), static_cast<int>(pending.header->size()), MPI_INT64_T,
                      rank(std::get<0>(key)), tag(key, false), comm_, &pending.request),
            "posting a receive");
  return pending;
}

void MpiTransport::post_receives(const std::vector<Action>& program) {
  for (const Action& a : program) {
    if (a.kind != ActionKind::kRecv) continue;
    const Key key{a.peer, a.stage, static_cast<int>(a.channel), a.micro_batch};
    if (receives_.count(key) == 0) receives_.emplace(key, post_header(key));
  }
}

void MpiTransport::send(int from, int to, Channel channel, int micro_batch, torch::Tensor tensor) {
  const Key key{from, to, static_cast<int>(channel), micro_batch};
  PendingSend pending;
  pending.data = tensor.detach().to(torch::kCPU).contiguous();
  const torch::Tensor& data = pending.data;
  GPIPE_CHECK(data.dim() <= kMaxDims, "a boundary tensor has ", data.dim(), " dimensions; MPI messages carry at most ",
              kMaxDims);
  GPIPE_CHECK(data.nbytes() <= static_cast<size_t>(INT_MAX), "a boundary tensor of ", data.nbytes(),
              " bytes is larger than one MPI message (2 GiB); use more micro-batches");
  pending.header = std::make_unique<Header>();
  Header& h = *pending.header;
  h.fill(0);
  h[0] = static_cast<int64_t>(data.scalar_type());
  h[1] = data.dim();
  for (int64_t d = 0; d < data.dim(); ++d) h[static_cast<size_t>(2 + d)] = data.size(d);
  check_mpi(MPI_Isend(h.data(), static_cast<int>(h.size()), MPI_INT64_T, rank(to), tag(key, false), comm_,
                      &pending.requests[0]),
            "sending a header");
  check_mpi(MPI_Isend(data.data_ptr(), static_cast<int>(data.nbytes()), MPI_BYTE, rank(to), tag(key, true), comm_,
                      &pending.requests[1]),
            "sending a tensor");
  messages_sent_ += 1;
  bytes_sent_ += static_cast<int64_t>(data.nbytes());
  sends_.push_back(std::move(pending));
  reap_sends();
}

void MpiTransport::reap_sends() {
  size_t kept = 0;
  for (size_t n = 0; n < sends_.size(); ++n) {
    int done = 0;
    MPI_Testall(2, sends_[n].requests.data(), &done, MPI_STATUSES_IGNORE);
    if (!done) sends_[kept++] = std::move(sends_[n]);
  }
  sends_.resize(kept);
}

void MpiTransport::finish_sends() {
  for (PendingSend& pending : sends_)
    for (MPI_Request& request : pending.requests) errors_->wait(request);
  sends_.clear();
}

torch::Tensor MpiTransport::recv(int from, int to, Channel channel, int micro_batch) {
  const Key key{from, to, static_cast<int>(channel), micro_batch};
  auto it = receives_.find(key);
  if (it == receives_.end()) it = receives_.emplace(key, post_header(key)).first;
  errors_->wait(it->second.request);
  const Header h = *it->second.header;
  receives_.erase(it);

  std::vector<int64_t> sizes(h.begin() + 2, h.begin() + 2 + h[1]);
  torch::Tensor tensor = torch::empty(sizes, torch::TensorOptions().dtype(static_cast<c10::ScalarType>(h[0])));
  MPI_Request request = MPI_REQUEST_NULL;
  check_mpi(MPI_Irecv(tensor.data_ptr(), static_cast<int>(tensor.nbytes()), MPI_BYTE, rank(from), tag(key, true),
                      comm_, &request),
            "receiving a tensor");
  errors_->wait(request);
  return tensor;
}

void MpiTransport::reset() {
  GPIPE_CHECK(receives_.empty(), "the MPI transport still expects ", receives_.size(),
              " messages from the last step; a failed step cannot be followed by another");
  reap_sends();
}

// ---------------------------------------------------------------- pipeline

MpiPipeline::MpiPipeline(torch::nn::Sequential layers, MpiPipelineOptions options)
    : layers_(std::move(layers)), options_(std::move(options)) {
  const std::vector<int>& balance = options_.balance();
  GPIPE_CHECK(!balance.empty(), "an MPI pipeline needs the balance of the whole model (layers per stage, e.g. {3, 8})");
  GPIPE_CHECK(options_.virtual_stages() >= 1 && balance.size() % static_cast<size_t>(options_.virtual_stages()) == 0,
              "the balance has ", balance.size(), " stages, not a multiple of the ", options_.virtual_stages(),
              " virtual stages per rank; give K·V entries");
  check_balance(balance, std::accumulate(balance.begin(), balance.end(), 0));
  GPIPE_CHECK(options_.chunks() >= 1, "the number of micro-batches (chunks) must be at least 1 (got ",
              options_.chunks(), ")");
  if (layers_.is_empty()) layers_ = torch::nn::Sequential();  // reported by check_agreement on every rank
  check_device(options_.device());

  check_mpi(MPI_Comm_dup(options_.comm(), &world_), "MPI_Comm_dup");
  try {
    check_agreement();  // sets placement_
  } catch (...) {
    MPI_Comm_free(&world_);
    throw;
  }
  check_mpi(MPI_Comm_split(world_, placement_.replica, placement_.stage, &pipeline_), "MPI_Comm_split");
  check_mpi(MPI_Comm_split(world_, placement_.stage, placement_.replica, &stage_), "MPI_Comm_split");
  errors_ = std::make_unique<ErrorChannel>(world_);

  const Device& device = options_.device();
  if (!device.is_cpu()) layers_->to(device.device);
  const int K = placement_.stages, V = options_.virtual_stages();
  train_program_ = lower(make_schedule(options_.schedule(), K, options_.chunks(), V), options_.checkpoint());
  validate(train_program_);
  // This rank's stages, cut from its layers in stage order.
  std::vector<std::unique_ptr<Stage>> stages;
  auto next = layers_->begin();
  const auto names = layers_->named_children().keys();
  for (int s : train_program_.stages_of(placement_.stage)) {
    torch::nn::Sequential part;
    for (int n = 0; n < balance[static_cast<size_t>(s)]; ++n, ++next)
      part->push_back(names[static_cast<size_t>(next - layers_->begin())], *next);
    stages.push_back(std::make_unique<Stage>(s, K * V, part, device));
  }
  std::vector<int> rank_of_stage = train_program_.placement;  // in the replica's communicator, rank d is device d
  transport_ = std::make_unique<MpiTransport>(pipeline_, errors_.get(), rank_of_stage, options_.chunks());
  executor_ = std::make_unique<Executor>(std::move(stages), device, transport_.get());
  if (device.is_cpu()) set_blas_threads(device.threads);
  keep_freed_memory();
  bind_current_thread(device);
}

MpiPipeline::~MpiPipeline() {
  executor_.reset();
  transport_.reset();
  errors_.reset();
  for (MPI_Comm* comm : {&stage_, &pipeline_, &world_})
    if (*comm != MPI_COMM_NULL) MPI_Comm_free(comm);
}

// Every rank gathers every rank's settings and runs the same checks, so all
// ranks throw the same error or none does.
void MpiPipeline::check_agreement() {
  enum Field { kLayers, kStages, kChunks, kCheckpoint, kDtype, kSchedule, kVirtual, kGiven, kStochastic, kFields };
  const char* names[] = {"the model's layer count", "the number of stages K·V", "the number of micro-batches M",
                         "the checkpoint mode", "the parameters' dtype", "the schedule",
                         "the number of virtual stages V"};
  const std::vector<int>& balance = options_.balance();
  std::array<int64_t, kFields> mine{};
  mine[kLayers] = std::accumulate(balance.begin(), balance.end(), 0);
  mine[kStages] = static_cast<int64_t>(balance.size());
  mine[kChunks] = options_.chunks();
  mine[kCheckpoint] = static_cast<int64_t>(options_.checkpoint());
  mine[kDtype] = -1;
  for (const auto& p : layers_->parameters())
    if (p.is_floating_point()) {
      mine[kDtype] = static_cast<int64_t>(p.scalar_type());
      break;
    }
  mine[kSchedule] = static_cast<int64_t>(options_.schedule());
  mine[kVirtual] = options_.virtual_stages();
  mine[kGiven] = static_cast<int64_t>(layers_->size());
  mine[kStochastic] = draws_random_numbers(layers_) ? 1 : 0;
  const int size = size_of(world_);
  std::vector<int64_t> all(static_cast<size_t>(size) * kFields);
  check_mpi(MPI_Allgather(mine.data(), kFields, MPI_INT64_T, all.data(), kFields, MPI_INT64_T, world_),
            "exchanging the configuration");
  auto at = [&](int rank, int field) { return all[static_cast<size_t>(rank) * kFields + static_cast<size_t>(field)]; };
  auto describe = [&](int field, int64_t value) -> std::string {
    if (field == kCheckpoint) return to_string(static_cast<Checkpoint>(value));
    if (field == kDtype) return c10::toString(static_cast<c10::ScalarType>(value));
    if (field == kSchedule) return to_string(static_cast<ScheduleKind>(value));
    return std::to_string(value);
  };
  for (int field : {kStages, kVirtual, kLayers, kChunks, kCheckpoint, kDtype, kSchedule}) {
    int reference = -1;
    for (int r = 0; r < size; ++r) {
      if (field == kDtype && at(r, field) < 0) continue;  // a stage without parameters
      if (reference < 0) {
        reference = r;
        continue;
      }
      GPIPE_CHECK(at(r, field) == at(reference, field), "the ranks disagree on ", names[field], ": rank ", reference,
                  " has ", describe(field, at(reference, field)), ", rank ", r, " has ", describe(field, at(r, field)),
                  "; start every rank with the same model and settings");
    }
  }
  // K agrees now, so every rank reaches the same verdict on the world size.
  const int V = options_.virtual_stages();
  placement_ = place(rank_of(world_), size, static_cast<int>(balance.size()) / V);
  std::vector<int> balances(static_cast<size_t>(size) * balance.size());
  check_mpi(MPI_Allgather(balance.data(), static_cast<int>(balance.size()), MPI_INT, balances.data(),
                          static_cast<int>(balance.size()), MPI_INT, world_),
            "exchanging the balance");
  const std::vector<int> first(balances.begin(), balances.begin() + static_cast<int>(balance.size()));
  for (int r = 1; r < size; ++r) {
    const std::vector<int> theirs(balances.begin() + r * static_cast<int>(balance.size()),
                                  balances.begin() + (r + 1) * static_cast<int>(balance.size()));
    GPIPE_CHECK(theirs == first, "the ranks disagree on the balance: rank 0 has ", format_balance(first), ", rank ", r, " has ",
                format_balance(theirs), "; start every rank with the same cut");
  }
  for (int r = 0; r < size; ++r) {
    const int device = r % placement_.stages;
    int expected = 0;
    std::string which;
    for (int s = device; s < static_cast<int>(balance.size()); s += placement_.stages) {
      expected += balance[static_cast<size_t>(s)];
      which += (which.empty() ? "" : ", ") + std::to_string(s);
    }
    GPIPE_CHECK(at(r, kGiven) == expected, "rank ", r, " runs stage", V > 1 ? "s " : " ", which,
                ", which the balance ", format_balance(balance), " gives ", expected, " layers, but it was given ",
                at(r, kGiven), "; build each rank's layers with mpi::stage_layers");
  }
  for (int r = 0; r < size; ++r) stochastic_ = stochastic_ || at(r, kStochastic) != 0;
}

void MpiPipeline::check_usable() const {
  GPIPE_CHECK(!failed_, "an earlier step of this MPI pipeline failed, and MPI ranks cannot resume a broken "
                        "step; report the error and end the job (gpipe::mpi::abort)");
}

std::pair<int64_t, int64_t> MpiPipeline::share(int64_t batch_size) const {
  const int D = placement_.replicas;
  GPIPE_CHECK(batch_size >= D, "a batch of ", batch_size, " rows cannot be shared by ", D,
              " replicas; give every replica at least one row");
  const std::vector<int64_t> sizes = chunk_sizes(batch_size, D);
  const int64_t begin = std::accumulate(sizes.begin(), sizes.begin() + placement_.replica, int64_t{0});
  return {begin, sizes[static_cast<size_t>(placement_.replica)]};
}

void MpiPipeline::run(const Schedule& program, StepData& step) {
  const std::vector<Action>& actions = program.actions[static_cast<size_t>(placement_.stage)];
  transport_->reset();
  transport_->post_receives(actions);
  trace_ = StepTrace{};
  trace_.devices.assign(1, {});
  trace_.begin_ns = now_ns();
  try {
    executor_->run(actions, step, &trace_.devices[0]);
    transport_->finish_sends();
  } catch (const RemoteError&) {
    failed_ = true;
    throw;
  } catch (const std::exception& e) {
    failed_ = true;
    errors_->raise("rank " + std::to_string(rank_of(world_)) + " (device " + std::to_string(placement_.stage) +
                   ", replica " + std::to_string(placement_.replica) + "): " + e.what());
    throw;
  }
  trace_.end_ns = now_ns();
}

void MpiPipeline::allreduce_gradients() {
  const std::vector<torch::Tensor> params = parameters();
  if (params.empty()) return;
  torch::NoGradGuard no_grad;
  bool all_float = true;
  std::vector<torch::Tensor> flat;
  for (const auto& p : params) {
    all_float = all_float && p.scalar_type() == torch::kFloat;
    flat.push_back((p.grad().defined() ? p.grad() : torch::zeros_like(p)).reshape({-1}).to(torch::kCPU));
  }
  torch::Tensor buffer = torch::cat(flat).to(all_float ? torch::kFloat : torch::kDouble).contiguous();
  GPIPE_CHECK(buffer.numel() <= INT_MAX, "a stage's gradients have ", buffer.numel(),
              " elements, more than one MPI allreduce carries; use more stages");
  MPI_Request request = MPI_REQUEST_NULL;
  check_mpi(MPI_Iallreduce(MPI_IN_PLACE, buffer.data_ptr(), static_cast<int>(buffer.numel()),
                           all_float ? MPI_FLOAT : MPI_DOUBLE, MPI_SUM, stage_, &request),
            "MPI_Iallreduce");
  errors_->wait(request);
  int64_t at = 0;
  for (torch::Tensor p : params) {
    p.mutable_grad() = buffer.narrow(0, at, p.numel()).view(p.sizes()).to(p.options(), false, /*copy=*/true);
    at += p.numel();
  }
}

torch::Tensor MpiPipeline::train_step(const torch::Tensor& input, const torch::Tensor& target, const LossFn& loss) {
  check_usable();
  GPIPE_CHECK(static_cast<bool>(loss), "train_step needs a loss function");
  GPIPE_CHECK(input.defined() && input.dim() >= 1 && target.defined() && target.dim() >= 1 &&
                  target.size(0) == input.size(0),
              "train_step needs the whole mini-batch on every rank, input and target with the same number of rows");
  const int M = options_.chunks();
  const int64_t N = input.size(0);
  const auto [begin, count] = share(N);
  GPIPE_CHECK(count >= M, "replica ", placement_.replica, " gets ", count, " of the batch's ", N,
              " rows, fewer than the ", M, " micro-batches; use a larger batch or fewer micro-batches");

  StepData step;
  step.loss = loss;
  if (placement_.first()) step.inputs = scatter(input.narrow(0, begin, count), M);
  if (placement_.last()) step.targets = scatter(target.narrow(0, begin, count), M);
  // Every rank draws the same seed: their default generators have drawn the same numbers.
  detail::TrainStepScope scope(step, chunk_sizes(count, M), N, stochastic_, parameters());
  double total = 0;
  try {
    run(train_program_, step);
    if (placement_.replicas > 1) allreduce_gradients();
    total = sum(std::accumulate(step.losses.begin(), step.losses.end(), 0.0));
  } catch (...) {
    failed_ = true;
    throw;
  }
  scope.commit();
  return torch::tensor(total, torch::dtype(torch::kFloat64));
}

torch::Tensor MpiPipeline::forward(const torch::Tensor& input) {
  check_usable();
  GPIPE_CHECK(input.defined() && input.dim() >= 1, "forward needs the whole batch on every rank");
  const auto [begin, count] = share(input.size(0));
  const int M = static_cast<int>(std::min<int64_t>(options_.chunks(), count));
  StepData step;
  step.training = false;
  if (placement_.first()) step.inputs = scatter(input.narrow(0, begin, count), M);
  step.outputs.resize(static_cast<size_t>(M));
  run(lower(forward_only(placement_.stages, M, options_.virtual_stages()), Checkpoint::kNever), step);
  return placement_.last() ? gather(step.outputs) : torch::Tensor();
}

double MpiPipeline::sum(double value) {
  reduce(&value, 1, MPI_SUM);
  return value;
}

double MpiPipeline::max(double value) {
  reduce(&value, 1, MPI_MAX);
  return value;
}

StepTrace MpiPipeline::gather_trace() {
  // Per action: stage, phase, micro-batch, begin and end in ns from this rank's step start.
  std::vector<int64_t> mine;
  if (!trace_.devices.empty())
    for (const ActionSpan& span : trace_.devices[0])
      mine.insert(mine.end(), {span.action.stage, static_cast<int64_t>(span.action.kind), span.action.micro_batch,
                               span.begin_ns - trace_.begin_ns, span.end_ns - trace_.begin_ns});
  const int size = size_of(world_), rank = rank_of(world_);
  int count = placement_.replica == 0 ? static_cast<int>(mine.size()) : 0;
  std::vector<int> counts(static_cast<size_t>(size)), offsets(static_cast<size_t>(size), 0);
  check_mpi(MPI_Gather(&count, 1, MPI_INT, counts.data(), 1, MPI_INT, 0, world_), "MPI_Gather");
  for (int r = 1; r < size; ++r)
    offsets[static_cast<size_t>(r)] = offsets[static_cast<size_t>(r) - 1] + counts[static_cast<size_t>(r) - 1];
  std::vector<int64_t> all(rank == 0 ? static_cast<size_t>(offsets.back() + counts.back()) : 0);
  check_mpi(MPI_Gatherv(mine.data(), count, MPI_INT64_T, all.data(), counts.data(), offsets.data(), MPI_INT64_T, 0,
                        world_),
            "MPI_Gatherv");
  StepTrace out;
  if (rank != 0) return out;
  out.devices.assign(static_cast<size_t>(placement_.stages), {});
  for (size_t n = 0; n + 5 <= all.size(); n += 5) {
    ActionSpan span;
    span.action.stage = static_cast<int>(all[n]);
    span.action.kind = static_cast<ActionKind>(all[n + 1]);
    span.action.micro_batch = static_cast<int>(all[n + 2]);
    span.begin_ns = all[n + 3];
    span.end_ns = all[n + 4];
    out.end_ns = std::max(out.end_ns, span.end_ns);
    out.devices[static_cast<size_t>(train_program_.placement[static_cast<size_t>(span.action.stage)])].push_back(span);
  }
  return out;
}

void MpiPipeline::reduce(double* values, int count, MPI_Op op) {
  MPI_Request request = MPI_REQUEST_NULL;
  check_mpi(MPI_Iallreduce(MPI_IN_PLACE, values, count, MPI_DOUBLE, op, world_, &request), "MPI_Iallreduce");
  try {
    errors_->wait(request);
  } catch (...) {
    failed_ = true;
    throw;
  }
}

double MpiPipeline::bubble() {
  double busy_and_span[2] = {trace_.busy_seconds(0), trace_.seconds()};  // one collective for both
  reduce(busy_and_span, 2, MPI_SUM);
  return busy_and_span[1] > 0 ? 1.0 - busy_and_span[0] / busy_and_span[1] : 0.0;
}

}  // namespace gpipe::mpi
