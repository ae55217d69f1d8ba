// mpi.cc: one stage per MPI rank: the tagged non-blocking transport, the error channel that
// keeps a failure from hanging the job, and the collective MpiPipeline with replica allreduce.
#include "gpipe/mpi.h"

#include "gpipe/check.h"
#include "gpipe/microbatch.h"
#include "gpipe/partition.h"
#include "runtime/train_step.h"

#include <torch/torch.h>

#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <numeric>
#include <sstream>

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

// Waits for `request` through `errors`. If another rank fails first, the
// operation may still write into its buffers later (a collective cannot be
// cancelled; a matched receive completes), so `buffers` are kept for good:
// deliberately leaked, as a failed step's pending sends are.
template <typename Buffers>
void wait_or_keep(ErrorChannel& errors, MPI_Request& request, std::shared_ptr<Buffers> buffers) {
  try {
    errors.wait(request);
  } catch (...) {
    new std::shared_ptr<Buffers>(std::move(buffers));
    throw;
  }
}

// Sums `buffer` (float32 or float64, on the CPU) over the ranks of `comm`, in place, through `errors`.
void allreduce_sum(ErrorChannel& errors, MPI_Comm comm, std::shared_ptr<torch::Tensor> buffer, const char* what) {
  GPIPE_CHECK(buffer->numel() <= INT_MAX, what, " has ", buffer->numel(),
              " elements, more than one MPI allreduce carries; use more stages");
  MPI_Request request = MPI_REQUEST_NULL;
  check_mpi(MPI_Iallreduce(MPI_IN_PLACE, buffer->data_ptr(), static_cast<int>(buffer->numel()),
                           buffer->scalar_type() == torch::kFloat ? MPI_FLOAT : MPI_DOUBLE, MPI_SUM, comm, &request),
            "MPI_Iallreduce");
  wait_or_keep(errors, request, std::move(buffer));
}

// Every rank's `mine`, a line per entry, as the lines of each of the first `stages` ranks: replica
// 0's, which hold the whole model between them (collective over `comm`).
std::vector<std::vector<std::string>> replica_zero_lines(MPI_Comm comm, const std::string& mine, int stages) {
  const std::vector<std::string> all = all_gather(comm, mine);
  std::vector<std::vector<std::string>> lines(static_cast<size_t>(stages));
  for (int r = 0; r < stages; ++r) {
    std::istringstream text(all[static_cast<size_t>(r)]);
    for (std::string line; std::getline(text, line);) lines[static_cast<size_t>(r)].push_back(line);
  }
  return lines;
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
  // Open MPI over TCP: a send above the eager limit (64 KiB) leaves only after the receiver's
  // answer, handled in the sender's next MPI call, so a boundary tensor waits for its stage's
  // next action. 4 MiB sends it whole into the socket buffer (docs/mpi.md: 40% across two
  // hosts). Set before MPI_Init, which reads them; what the user set wins.
  for (const char* name : {"OMPI_MCA_btl_tcp_eager_limit", "OMPI_MCA_btl_tcp_rndv_eager_limit",
                           "OMPI_MCA_btl_tcp_max_send_size"})
    setenv(name, "4194304", /*overwrite=*/0);
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

Communicator::~Communicator() {
  if (comm_ != MPI_COMM_NULL) MPI_Comm_free(&comm_);
}

Communicator& Communicator::operator=(Communicator&& other) noexcept {
  if (this != &other) {
    if (comm_ != MPI_COMM_NULL) MPI_Comm_free(&comm_);
    comm_ = other.comm_;
    other.comm_ = MPI_COMM_NULL;
  }
  return *this;
}

Communicator Communicator::duplicate(MPI_Comm comm) {
  Communicator c;
  check_mpi(MPI_Comm_dup(comm, &c.comm_), "MPI_Comm_dup");
  return c;
}

Communicator Communicator::split(MPI_Comm comm, int color, int key) {
  Communicator c;
  check_mpi(MPI_Comm_split(comm, color, key, &c.comm_), "MPI_Comm_split");
  return c;
}

namespace {

// Where each rank's part of a gather lies in the whole.
struct Layout {
  std::vector<int> lengths, offsets;
  int64_t total = 0;
};

Layout layout_of(const std::vector<int64_t>& sizes) {
  Layout out;
  int64_t total = 0;
  for (int64_t n : sizes) {
    out.lengths.push_back(static_cast<int>(std::min<int64_t>(n, INT_MAX)));
    out.offsets.push_back(static_cast<int>(std::min<int64_t>(total, INT_MAX)));
    total += n;
  }
  // Every rank knows every size, so all of them refuse together.
  if (total > INT_MAX)
    throw std::runtime_error("gpipe: the ranks' parts add up to " + std::to_string(total) +
                             " bytes, more than the 2 GiB that one MPI gather carries");
  out.total = total;
  return out;
}

}  // namespace

std::vector<std::string> all_gather(MPI_Comm comm, const std::string& mine) {
  const int size = size_of(comm);
  int64_t length = static_cast<int64_t>(mine.size());
  std::vector<int64_t> sizes(static_cast<size_t>(size));
  check_mpi(MPI_Allgather(&length, 1, MPI_INT64_T, sizes.data(), 1, MPI_INT64_T, comm), "MPI_Allgather");
  const Layout l = layout_of(sizes);
  const std::vector<int>& lengths = l.lengths;
  const std::vector<int>& offsets = l.offsets;
  std::string all(static_cast<size_t>(l.total), '\0');
  check_mpi(MPI_Allgatherv(mine.data(), static_cast<int>(length), MPI_CHAR, all.data(), lengths.data(), offsets.data(),
                           MPI_CHAR, comm),
            "MPI_Allgatherv");
  std::vector<std::string> out;
  for (int r = 0; r < size; ++r)
    out.push_back(all.substr(static_cast<size_t>(offsets[static_cast<size_t>(r)]),
                             static_cast<size_t>(lengths[static_cast<size_t>(r)])));
  return out;
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

torch::nn::Sequential device_layers(const LayerBuilder& build, const std::vector<int>& balance, int devices,
                                    int device) {
  torch::nn::Sequential mine;
  for (int s = device; s < static_cast<int>(balance.size()); s += devices) {
    const auto [first, last] = stage_layers(balance, s);
    const torch::nn::Sequential part = build(LayerRange{first, last});
    GPIPE_CHECK(static_cast<int>(part->size()) == last - first, "the layer builder made ", part->size(),
                " layers for layers ", first, "..", last - 1, "; build the whole model and keep the range (add_layer)");
    const auto names = part->named_children().keys();
    size_t n = 0;
    for (auto it = part->begin(); it != part->end(); ++it, ++n) mine->push_back(names[n], *it);
  }
  return mine;
}

RemoteError::RemoteError(int rank, const std::string& message)
    : Cancelled("gpipe: stopped because rank " + std::to_string(rank) + " failed: " + message), rank_(rank) {}

// ---------------------------------------------------------------- errors

ErrorChannel::ErrorChannel(MPI_Comm world) : rank_(rank_of(world)), size_(size_of(world)) {
  check_mpi(MPI_Comm_dup(world, &comm_), "MPI_Comm_dup");  // its own, so no tag can meet another's
  post();
}

ErrorChannel::~ErrorChannel() {
  if (pending_ != MPI_REQUEST_NULL) {  // before buffer_ goes: a short message, done or cancelled at once
    MPI_Cancel(&pending_);
    MPI_Wait(&pending_, MPI_STATUS_IGNORE);
  }
  if (!abandoned_) MPI_Comm_free(&comm_);  // see abandon()
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

MpiTransport::MpiTransport(MPI_Comm comm, ErrorChannel* errors, std::vector<int> rank_of_stage, int micro_batches,
                           int skips)
    : comm_(comm), errors_(errors), rank_of_stage_(std::move(rank_of_stage)), channels_(2 + 2 * skips) {
  void* value = nullptr;
  int found = 0;
  MPI_Comm_get_attr(comm_, MPI_TAG_UB, &value, &found);
  const int64_t tag_ub = found ? *static_cast<int*>(value) : 32767;
  const int S = static_cast<int>(rank_of_stage_.size());
  const int64_t per_micro_batch = int64_t{2} * channels_ * S * S;
  GPIPE_CHECK(per_micro_batch * micro_batches - 1 <= tag_ub, "M = ", micro_batches, " micro-batches over ", S,
              " stages", skips > 0 ? " with " + std::to_string(skips) + " skip connections between them" : "",
              " need more message tags than this MPI offers (", tag_ub, "); use at most ",
              std::max<int64_t>(1, (tag_ub + 1) / per_micro_batch), " micro-batches");
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
  return (((micro_batch * S + to) * S + from) * channels_ + channel) * 2 + (data ? 1 : 0);
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
  auto tensor = std::make_shared<torch::Tensor>(
      torch::empty(sizes, torch::TensorOptions().dtype(static_cast<c10::ScalarType>(h[0]))));
  MPI_Request request = MPI_REQUEST_NULL;
  check_mpi(MPI_Irecv(tensor->data_ptr(), static_cast<int>(tensor->nbytes()), MPI_BYTE, rank(from), tag(key, true),
                      comm_, &request),
            "receiving a tensor");
  wait_or_keep(*errors_, request, tensor);
  return *tensor;
}

void MpiTransport::reset() {
  GPIPE_CHECK(receives_.empty(), "the MPI transport still expects ", receives_.size(),
              " messages from the last step; a failed step cannot be followed by another");
  reap_sends();
}

// ---------------------------------------------------------------- pipeline

MpiPipeline::MpiPipeline(torch::nn::Sequential layers, MpiPipelineOptions options)
    : layers_(std::move(layers)), options_(std::move(options)) {
  if (layers_.is_empty()) layers_ = torch::nn::Sequential();  // reported by check_agreement on every rank
  control_ = Communicator::duplicate(options_.comm());
  // What a rank can judge alone is agreed on, so every rank throws or none does.
  std::string error;
  try {
    const std::vector<int>& balance = options_.balance();
    GPIPE_CHECK(!balance.empty(), "an MPI pipeline needs the balance of the whole model (layers per stage, e.g. {3, 8})");
    GPIPE_CHECK(options_.virtual_stages() >= 1 &&
                    balance.size() % static_cast<size_t>(options_.virtual_stages()) == 0,
                "the balance has ", balance.size(), " stages, not a multiple of the ", options_.virtual_stages(),
                " virtual stages per rank; give K·V entries");
    check_balance(balance, std::accumulate(balance.begin(), balance.end(), 0));
    GPIPE_CHECK(options_.chunks() >= 1, "the number of micro-batches (chunks) must be at least 1 (got ",
                options_.chunks(), ")");
    check_device(options_.device());
  } catch (const std::exception& e) {
    error = e.what();
  }
  agree_on(error);
  check_agreement();  // sets placement_
  const std::vector<SkipUse> uses = all_skip_uses();

  const std::vector<int>& balance = options_.balance();
  const Device& device = options_.device();
  const int K = placement_.stages, V = options_.virtual_stages();
  std::vector<std::unique_ptr<Stage>> stages;
  std::exception_ptr failure;
  try {
    const detail::SkipPlan skips = detail::plan_skips(connect_skips(uses), balance);
    train_program_ = lower(make_schedule(options_.schedule(), K, options_.chunks(), V), options_.checkpoint(),
                           skips.routes);
    validate(train_program_);
    forward_program_ = lower(forward_only(K, options_.chunks(), V), Checkpoint::kNever, skips.routes);
    if (!device.is_cpu()) layers_->to(device.device);
    // This rank's stages, cut from its layers in stage order.
    auto next = layers_->begin();
    const auto names = layers_->named_children().keys();
    for (int s : train_program_.stages_of(placement_.stage)) {
      torch::nn::Sequential part;
      for (int n = 0; n < balance[static_cast<size_t>(s)]; ++n, ++next)
        part->push_back(names[static_cast<size_t>(next - layers_->begin())], *next);
      detail::check_splittable(train_program_, part);
      detail::check_batch_norm(part, options_.deferred_batch_norm());
      stages.push_back(std::make_unique<Stage>(s, K * V, part, device, options_.deferred_batch_norm()));
      skips.connect(*stages.back());
    }
  } catch (const std::exception& e) {  // a bad schedule, or no memory on the device: every rank stops
    error = e.what();
    failure = std::current_exception();
  }
  if (failure) {  // the others hear of it; this rank throws what it caught
    try {
      agree_on(error);
    } catch (const std::invalid_argument&) {
    }
    std::rethrow_exception(failure);
  }
  agree_on(error);
  find_tied_copies();
  connect();
  // Every copy of a tied weight starts as the first stage's.
  for (Tie& tie : ties_) {
    if (tie.copies.empty()) continue;
    torch::NoGradGuard no_grad;
    torch::Tensor first = tie.copies.front().detach().to(torch::kCPU, /*non_blocking=*/false, /*copy=*/true).contiguous();
    GPIPE_CHECK(first.numel() * first.element_size() <= INT_MAX, "a tied parameter has ",
                first.numel() * first.element_size(), " bytes, more than one MPI broadcast carries");
    check_mpi(MPI_Bcast(first.data_ptr(), static_cast<int>(first.numel() * first.element_size()), MPI_BYTE, 0,
                        tie.comm.get()),
              "MPI_Bcast");
    for (torch::Tensor& copy : tie.copies) copy.copy_(first);
  }
  executor_ = std::make_unique<Executor>(std::move(stages), device, transport_.get());
  if (device.is_cpu()) set_blas_threads(device.threads);
  keep_freed_memory();
  bind_current_thread(device);
}

MpiPipeline::~MpiPipeline() {
  executor_.reset();
  transport_.reset();
  if (failed_) {  // a failed step may have left messages and operations on these that no rank will finish
    if (errors_) errors_->abandon();
    world_.abandon();
    pipeline_.abandon();
    stage_.abandon();
    for (Tie& tie : ties_) tie.comm.abandon();
  }
}

// Throws on every rank if any rank's `local_error` is not empty: its own
// message on that rank, the first failing rank's on the others.
void MpiPipeline::agree_on(const std::string& local_error) {
  const std::vector<std::string> errors = all_gather(control_.get(), local_error);
  if (!local_error.empty()) throw std::invalid_argument(local_error);
  for (size_t r = 0; r < errors.size(); ++r)
    if (!errors[r].empty()) {
      const std::string prefix = "gpipe: ";
      const std::string& what = errors[r];
      throw std::invalid_argument("gpipe: rank " + std::to_string(r) + " refused the configuration: " +
                                  (what.rfind(prefix, 0) == 0 ? what.substr(prefix.size()) : what));
    }
}

// Fresh communicators for everything a step does (control_ is used for nothing else).
void MpiPipeline::connect() {
  world_ = Communicator::duplicate(control_.get());
  pipeline_ = Communicator::split(world_.get(), placement_.replica, placement_.stage);
  stage_ = Communicator::split(world_.get(), placement_.stage, placement_.replica);
  for (Tie& tie : ties_)
    tie.comm = Communicator::split(pipeline_.get(), tie.copies.empty() ? MPI_UNDEFINED : 0, placement_.stage);
  errors_ = std::make_unique<ErrorChannel>(world_.get());
  // In the replica's communicator, rank d is device d.
  transport_ = std::make_unique<MpiTransport>(pipeline_.get(), errors_.get(), train_program_.placement,
                                              options_.chunks(), static_cast<int>(train_program_.skips.size()));
}

// After a failed step every rank has thrown (StageError where it failed,
// RemoteError elsewhere), but messages of that step may still be in flight, a
// rank may have heard of more than one failure, and a collective may have been
// started by some ranks only. Starting over on new communicators leaves all of
// that behind. The old ones are abandoned, not freed: MPI would give a freed
// communicator's context to a new one, where the old step's stray messages
// would then arrive.
void MpiPipeline::ready() {
  if (!failed_) return;
  if (executor_) executor_->set_transport(nullptr);
  transport_.reset();
  errors_->abandon();
  errors_.reset();
  world_.abandon();
  pipeline_.abandon();
  stage_.abandon();
  for (Tie& tie : ties_) tie.comm.abandon();
  connect();
  if (executor_) executor_->set_transport(transport_.get());
  failed_ = false;
}

// Every rank gathers every rank's settings and runs the same checks, so all
// ranks throw the same error or none does.
void MpiPipeline::check_agreement() {
  enum Field { kLayers, kStages, kChunks, kCheckpoint, kDtype, kSchedule, kVirtual, kBatchNorm, kGiven, kStochastic,
               kFields };
  const char* names[] = {"the model's layer count", "the number of stages K·V", "the number of micro-batches M",
                         "the checkpoint mode", "the parameters' dtype", "the schedule",
                         "the number of virtual stages V", "deferred BatchNorm statistics (deferred_batch_norm)"};
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
  mine[kBatchNorm] = options_.deferred_batch_norm() ? 1 : 0;
  mine[kGiven] = static_cast<int64_t>(layers_->size());
  mine[kStochastic] = draws_random_numbers(layers_) ? 1 : 0;
  const int size = size_of(control_.get());
  std::vector<int64_t> all(static_cast<size_t>(size) * kFields);
  check_mpi(MPI_Allgather(mine.data(), kFields, MPI_INT64_T, all.data(), kFields, MPI_INT64_T, control_.get()),
            "exchanging the configuration");
  auto at = [&](int rank, int field) { return all[static_cast<size_t>(rank) * kFields + static_cast<size_t>(field)]; };
  auto describe = [&](int field, int64_t value) -> std::string {
    if (field == kCheckpoint) return to_string(static_cast<Checkpoint>(value));
    if (field == kDtype) return c10::toString(static_cast<c10::ScalarType>(value));
    if (field == kSchedule) return to_string(static_cast<ScheduleKind>(value));
    return std::to_string(value);
  };
  for (int field : {kStages, kVirtual, kLayers, kChunks, kCheckpoint, kDtype, kSchedule, kBatchNorm}) {
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
  placement_ = place(rank_of(control_.get()), size, static_cast<int>(balance.size()) / V);
  std::vector<int> balances(static_cast<size_t>(size) * balance.size());
  check_mpi(MPI_Allgather(balance.data(), static_cast<int>(balance.size()), MPI_INT, balances.data(),
                          static_cast<int>(balance.size()), MPI_INT, control_.get()),
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

std::pair<int64_t, int64_t> MpiPipeline::share(int64_t batch_size) const {
  // As chunk_sizes: the first batch_size % D replicas take one row more; with fewer rows than
  // replicas, the last replicas take none.
  const int64_t D = placement_.replicas, r = placement_.replica;
  const int64_t base = batch_size / D, extra = batch_size % D;
  return {r * base + std::min(r, extra), base + (r < extra ? 1 : 0)};
}

const Schedule& MpiPipeline::training_program(int micro_batches) {
  if (micro_batches == options_.chunks()) return train_program_;
  auto it = short_programs_.find(micro_batches);
  if (it == short_programs_.end())
    it = short_programs_
             .emplace(micro_batches, detail::short_batch_program(options_.schedule(), placement_.stages, micro_batches,
                                                                 options_.virtual_stages(), options_.checkpoint(),
                                                                 train_program_.skips))
             .first;
  return it->second;
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
    errors_->raise("rank " + std::to_string(rank_of(world_.get())) + " (device " + std::to_string(placement_.stage) +
                   ", replica " + std::to_string(placement_.replica) + "): " + e.what());
    throw;
  }
  trace_.end_ns = now_ns();
}

std::vector<SkipUse> MpiPipeline::all_skip_uses() {
  // A line "pop|stash <layer> <name>" per use; the layers are named by their index in the whole model.
  std::string mine, error;
  try {
    for (const SkipUse& u : skip_uses(layers_, /*named_by_index=*/true))
      mine += std::string(u.pop ? "pop " : "stash ") + std::to_string(u.layer) + " " + u.name + "\n";
  } catch (const std::exception& e) {
    error = e.what();
  }
  agree_on(error);
  std::vector<SkipUse> uses;
  for (const auto& lines : replica_zero_lines(control_.get(), mine, placement_.stages))
    for (const std::string& line : lines) {
      std::istringstream fields(line);
      std::string kind;
      SkipUse use;
      fields >> kind >> use.layer;
      fields.get();  // the space before the name
      std::getline(fields, use.name);
      use.pop = kind == "pop";
      uses.push_back(use);
    }
  return uses;
}

void MpiPipeline::find_tied_copies() {
  const auto named = layers_->named_parameters();
  // What each rank holds of each group, a line "group name numel dtype" per copy; every rank
  // judges the same lines alike, so all throw the same error or none does.
  std::string mine;
  const auto& groups = options_.tied_parameters();
  for (size_t g = 0; g < groups.size(); ++g)
    for (const std::string& name : groups[g])
      if (named.contains(name)) {
        std::ostringstream line;
        line << g << " " << name << " " << named[name].sizes() << " " << c10::toString(named[name].scalar_type());
        mine += line.str() + "\n";
      }
  const auto held = replica_zero_lines(control_.get(), mine, placement_.stages);
  for (size_t g = 0; g < groups.size(); ++g) {
    GPIPE_CHECK(groups[g].size() >= 2, "a group of tied parameters needs at least two names (got ", groups[g].size(),
                ")");
    std::string shape;  // "[sizes] dtype" of the group's first copy
    for (const std::string& name : groups[g]) {
      const std::string key = std::to_string(g) + " " + name + " ";
      std::string found;
      for (const auto& lines : held)
        for (const std::string& line : lines)
          if (found.empty() && line.rfind(key, 0) == 0) found = line.substr(key.size());
      GPIPE_CHECK(!found.empty(), "tied_parameters: no rank holds a parameter ", name, "; name parameters as in the "
                  "whole model (the layer's index in it, then the parameter's name, e.g. 0.weight)");
      if (shape.empty()) shape = found;
      GPIPE_CHECK(found == shape, "tied parameters ", groups[g].front(), " and ", name, " differ: ", shape, " against ",
                  found, "; tie parameters of one shape and dtype");
      GPIPE_CHECK(found.find(" Float") != std::string::npos || found.find(" Double") != std::string::npos,
                  "tied parameter ", name, " is ", found, "; tied parameters are float32 or float64");
    }
    Tie tie;
    for (const std::string& name : groups[g]) {
      if (!named.contains(name)) continue;
      const torch::Tensor& p = named[name];
      bool seen = false;
      for (const auto& c : tie.copies) seen = seen || c.is_same(p);
      if (!seen) tie.copies.push_back(p);
    }
    // Sums over the whole model count the group once: the first copy of the lowest device holding one.
    int owner = -1;
    for (int r = 0; r < placement_.stages && owner < 0; ++r)
      for (const std::string& line : held[static_cast<size_t>(r)])
        if (line.rfind(std::to_string(g) + " ", 0) == 0) owner = r;
    for (size_t c = 0; c < tie.copies.size(); ++c)
      if (placement_.stage != owner || c > 0) uncounted_.insert(tie.copies[c].unsafeGetTensorImpl());
    ties_.push_back(std::move(tie));
  }
}

void MpiPipeline::sum_tied_gradients() {
  torch::NoGradGuard no_grad;
  for (Tie& tie : ties_) {
    if (tie.copies.empty()) continue;
    torch::Tensor sum;
    for (const torch::Tensor& p : tie.copies) {
      const torch::Tensor g = p.grad().defined() ? p.grad() : torch::zeros_like(p);
      sum = sum.defined() ? sum + g : g.clone();
    }
    auto kept = std::make_shared<torch::Tensor>(sum.to(torch::kCPU).contiguous());
    const torch::Tensor total = *kept;
    allreduce_sum(*errors_, tie.comm.get(), kept, "a tied parameter");
    for (torch::Tensor p : tie.copies) p.mutable_grad() = total.to(p.device(), /*non_blocking=*/false, /*copy=*/true);
  }
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
  auto kept = std::make_shared<torch::Tensor>(torch::cat(flat).to(all_float ? torch::kFloat : torch::kDouble).contiguous());
  const torch::Tensor buffer = *kept;
  allreduce_sum(*errors_, stage_.get(), kept, "a stage's gradients");
  int64_t at = 0;
  for (torch::Tensor p : params) {
    p.mutable_grad() = buffer.narrow(0, at, p.numel()).view(p.sizes()).to(p.options(), false, /*copy=*/true);
    at += p.numel();
  }
}

std::vector<torch::Tensor> MpiPipeline::counted_parameters() const {
  std::vector<torch::Tensor> out;
  for (const auto& p : parameters())
    if (uncounted_.count(p.unsafeGetTensorImpl()) == 0) out.push_back(p);
  return out;
}

int64_t MpiPipeline::skip_bytes() const {
  int64_t bytes = 0;
  for (const auto& stage : executor_->stages()) bytes += stage->skip_bytes();
  return bytes;
}

torch::Tensor MpiPipeline::batch_norm_statistics() {
  std::vector<torch::Tensor> parts;
  for (const auto& stage : executor_->stages())
    if (torch::Tensor s = stage->batch_norm_statistics(); s.defined()) parts.push_back(s);
  if (parts.empty()) return {};
  auto kept = std::make_shared<torch::Tensor>(torch::cat(parts).contiguous());
  const torch::Tensor statistics = *kept;
  if (placement_.replicas > 1) allreduce_sum(*errors_, stage_.get(), kept, "a stage's BatchNorm statistics");
  return statistics;
}

torch::Tensor MpiPipeline::train_step(const torch::Tensor& input, const torch::Tensor& target, const LossFn& loss) {
  ready();
  GPIPE_CHECK(static_cast<bool>(loss), "train_step needs a loss function");
  GPIPE_CHECK(input.defined() && input.dim() >= 1 && target.defined() && target.dim() >= 1 &&
                  target.size(0) == input.size(0),
              "train_step needs the whole mini-batch on every rank, input and target with the same number of rows");
  const int64_t N = input.size(0);
  GPIPE_CHECK(N >= 1, "train_step needs at least one row (got an empty batch)");
  const auto [begin, count] = share(N);
  // A short batch runs one row per micro-batch; a replica without rows only joins the sums.
  const int M = static_cast<int>(std::min<int64_t>(options_.chunks(), count));

  StepData step;
  step.loss = loss;
  if (M > 0 && placement_.first()) step.inputs = scatter(input.narrow(0, begin, count), M);
  if (M > 0 && placement_.last()) step.targets = scatter(target.narrow(0, begin, count), M);
  // Every rank draws the same seed: their default generators have drawn the same numbers.
  detail::TrainStepScope scope(step, M > 0 ? chunk_sizes(count, M) : std::vector<int64_t>{}, N, stochastic_,
                               parameters());
  double total = 0;
  torch::Tensor statistics;
  for (const auto& stage : executor_->stages()) stage->begin_step();  // a replica without rows runs nothing
  try {
    if (M > 0) run(training_program(M), step);
    if (placement_.replicas > 1) allreduce_gradients();
    sum_tied_gradients();
    statistics = batch_norm_statistics();
    total = sum(std::accumulate(step.losses.begin(), step.losses.end(), 0.0));
  } catch (...) {
    failed_ = true;
    throw;
  }
  scope.commit();
  int64_t at = 0;  // each stage's share of the summed statistics, in stage order
  for (const auto& stage : executor_->stages()) {
    const torch::Tensor mine = stage->batch_norm_statistics();
    const int64_t n = mine.defined() ? mine.numel() : 0;
    if (n > 0) stage->update_batch_norm(statistics.narrow(0, at, n));
    at += n;
  }
  return torch::tensor(total, torch::dtype(torch::kFloat64));
}

torch::Tensor MpiPipeline::forward(const torch::Tensor& input) {
  ready();
  GPIPE_CHECK(input.defined() && input.dim() >= 1, "forward needs the whole batch on every rank");
  const auto [begin, count] = share(input.size(0));
  const int M = static_cast<int>(std::min<int64_t>(options_.chunks(), count));
  if (M == 0) return {};  // no rows for this replica
  StepData step;
  step.training = false;
  if (placement_.first()) step.inputs = scatter(input.narrow(0, begin, count), M);
  step.outputs.resize(static_cast<size_t>(M));
  run(M == options_.chunks() ? forward_program_
                             : lower(forward_only(placement_.stages, M, options_.virtual_stages()), Checkpoint::kNever,
                                     train_program_.skips),
      step);
  return placement_.last() ? gpipe::gather(step.outputs) : torch::Tensor();
}

double MpiPipeline::sum(double value) {
  reduce(&value, 1, MPI_SUM);
  return value;
}

std::vector<std::string> MpiPipeline::gather(const std::string& bytes) {
  ready();
  const int size = size_of(world_.get()), rank = rank_of(world_.get());
  struct Buffers {  // kept alive by wait_or_keep if the gather is abandoned
    std::string mine;
    int64_t length = 0;
    std::vector<int64_t> sizes;
    Layout layout;
    std::string all;
  };
  auto b = std::make_shared<Buffers>();
  b->mine = bytes;
  b->length = static_cast<int64_t>(bytes.size());
  b->sizes.assign(static_cast<size_t>(size), 0);
  MPI_Request request = MPI_REQUEST_NULL;
  try {
    check_mpi(MPI_Iallgather(&b->length, 1, MPI_INT64_T, b->sizes.data(), 1, MPI_INT64_T, world_.get(), &request),
              "MPI_Iallgather");
    wait_or_keep(*errors_, request, b);
    b->layout = layout_of(b->sizes);  // every rank refuses a gather too large, or none
    b->all.assign(rank == 0 ? static_cast<size_t>(b->layout.total) : 0, '\0');
    check_mpi(MPI_Igatherv(b->mine.data(), static_cast<int>(b->length), MPI_CHAR, b->all.data(),
                           b->layout.lengths.data(), b->layout.offsets.data(), MPI_CHAR, 0, world_.get(), &request),
              "MPI_Igatherv");
    wait_or_keep(*errors_, request, b);
  } catch (...) {
    failed_ = true;
    throw;
  }
  std::vector<std::string> out;
  if (rank == 0)
    for (int r = 0; r < size; ++r)
      out.push_back(b->all.substr(static_cast<size_t>(b->layout.offsets[static_cast<size_t>(r)]),
                                  static_cast<size_t>(b->layout.lengths[static_cast<size_t>(r)])));
  return out;
}

double MpiPipeline::max(double value) {
  reduce(&value, 1, MPI_MAX);
  return value;
}

StepTrace MpiPipeline::gather_trace() {
  // Per action: stage, kind, micro-batch, recompute flag, begin and end in ns from this rank's step start.
  constexpr size_t kFields = 6;
  std::vector<int64_t> mine;
  if (placement_.replica == 0 && !trace_.devices.empty())
    for (const ActionSpan& span : trace_.devices[0])
      mine.insert(mine.end(), {span.action.stage, static_cast<int64_t>(span.action.kind), span.action.micro_batch,
                               span.action.recompute ? 1 : 0, span.begin_ns - trace_.begin_ns,
                               span.end_ns - trace_.begin_ns});
  const std::vector<std::string> parts =
      gather(std::string(reinterpret_cast<const char*>(mine.data()), mine.size() * sizeof(int64_t)));
  StepTrace out;
  if (parts.empty()) return out;  // not the first rank
  out.devices.assign(static_cast<size_t>(placement_.stages), {});
  for (const std::string& part : parts) {
    std::vector<int64_t> all(part.size() / sizeof(int64_t));
    std::memcpy(all.data(), part.data(), all.size() * sizeof(int64_t));
    for (size_t n = 0; n + kFields <= all.size(); n += kFields) {
      ActionSpan span;
      span.action.stage = static_cast<int>(all[n]);
      span.action.kind = static_cast<ActionKind>(all[n + 1]);
      span.action.micro_batch = static_cast<int>(all[n + 2]);
      span.action.recompute = all[n + 3] != 0;
      span.begin_ns = all[n + 4];
      span.end_ns = all[n + 5];
      out.end_ns = std::max(out.end_ns, span.end_ns);
      out.devices[static_cast<size_t>(train_program_.placement[static_cast<size_t>(span.action.stage)])].push_back(
          span);
    }
  }
  return out;
}

void MpiPipeline::reduce(double* values, int count, MPI_Op op) {
  ready();
  auto buffer = std::make_shared<std::vector<double>>(values, values + count);
  MPI_Request request = MPI_REQUEST_NULL;
  check_mpi(MPI_Iallreduce(MPI_IN_PLACE, buffer->data(), count, MPI_DOUBLE, op, world_.get(), &request),
            "MPI_Iallreduce");
  try {
    wait_or_keep(*errors_, request, buffer);
  } catch (...) {
    failed_ = true;
    throw;
  }
  std::copy(buffer->begin(), buffer->end(), values);
}

double MpiPipeline::bubble() {
  double busy_and_span[2] = {trace_.busy_seconds(0), trace_.seconds()};  // one collective for both
  reduce(busy_and_span, 2, MPI_SUM);
  return busy_and_span[1] > 0 ? 1.0 - busy_and_span[0] / busy_and_span[1] : 0.0;
}

}  // namespace gpipe::mpi
