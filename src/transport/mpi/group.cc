// group.cc: the ranks of an MPI job as one pipeline: agreement on the configuration before any work,
// the communicators of the steps, starting over after a failed step, sums and gathers over the job.
#include "transport/mpi/group.h"

#include "gpipe/check.h"
#include "gpipe/partition.h"

#include <torch/torch.h>

#include <array>
#include <cmath>
#include <limits>
#include <mutex>
#include <set>
#include <numeric>
#include <sstream>

namespace gpipe::mpi {
namespace detail {

namespace {

// The live groups of this process, which mpi::leave tells the other ranks about.
std::mutex live_mutex;
std::set<MpiGroup*>& live_groups() {
  static auto* groups = new std::set<MpiGroup*>;  // never destroyed: leave() runs at exit
  return *groups;
}

}  // namespace

MpiGroup::MpiGroup(MPI_Comm comm) : control_(Communicator::duplicate(comm)) {
  const std::lock_guard<std::mutex> lock(live_mutex);
  live_groups().insert(this);
}

MpiGroup::MpiGroup(MPI_Comm comm, const PipelinePlan& plan) : MpiGroup(comm) {
  made_ = true;
  plan_ = plan;
}

MpiGroup::~MpiGroup() {
  {
    const std::lock_guard<std::mutex> lock(live_mutex);
    live_groups().erase(this);
  }
  transport_.reset();
  if (failed_ || left_) {
    abandon();  // a failed step may have left messages and operations no rank will finish
    return;
  }
  // A rank still using the pipeline (its loop longer than this one's) stops rather than waiting.
  // The others' notices may still come: the channel's communicator goes once they all have (retire),
  // so that no later communicator, given its context, receives them.
  if (tell_leaving("let go of its pipeline (its Pipeline or Python GPipe was deleted, or its program ended)"))
    ErrorChannel::retire(std::move(errors_));
}

bool MpiGroup::tell_leaving(const std::string& what) {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized || !errors_) return false;
  errors_->leave(who() + what + " while this rank still called into gpipe; every rank makes the same calls (the "
                 "same number of train_step, forward, save, sum...), so end every rank's loop together");
  return true;
}

void MpiGroup::leave() {
  if (left_) return;
  left_ = true;
  transport_.reset();
  tell_leaving("ended its program (the end of main or of the script, exit, sys.exit)");
  abandon();  // its messages may still arrive: nothing here is freed
}

// Throws on every rank if any rank's `local_error` is not empty: its own
// message on that rank, the first failing rank's on the others.
void MpiGroup::agree_on(const std::string& local_error) {
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

void MpiGroup::agree(std::exception_ptr failure) {
  std::string error;
  if (failure) {
    try {
      std::rethrow_exception(failure);
    } catch (const std::exception& e) {
      error = e.what();
    } catch (...) {
      error = "gpipe: an unknown exception while building the stages";
    }
    try {  // the others hear of it; this rank throws what it caught
      agree_on(error);
    } catch (const std::invalid_argument&) {
    }
    std::rethrow_exception(failure);
  }
  agree_on(error);
}

PipelinePlan MpiGroup::plan(const torch::nn::Sequential& layers, const PipelineOptions& options,
                            const SkipUseFinder& skip_uses) {
  // What a rank can judge alone is agreed on, so every rank throws or none does.
  std::string error;
  PipelinePlan cut;  // the plan without skip connections: K, V and the balance
  try {
    GPIPE_CHECK(!options.balance().empty(), "an MPI pipeline needs the balance of the whole model (layers per stage, "
                "e.g. {3, 8}); make_pipeline finds it for you");
    const int layer_count = std::accumulate(options.balance().begin(), options.balance().end(), 0);
    if (made_) check_plan_of(plan_, layer_count, options);  // the plan made once: not resolved again
    cut = made_ ? plan_ : make_plan(layer_count, options);
  } catch (const std::exception& e) {
    error = e.what();
  }
  agree_on(error);
  check_agreement(layers, options, cut);  // sets placement_
  const std::vector<SkipUse> uses = all_skip_uses(layers, skip_uses);
  try {
    plan_ = cut;
    route_skips(plan_, connect_skips(uses));
  } catch (const std::exception& e) {
    error = e.what();
  }
  agree_on(error);
  return plan_;
}

// Every rank gathers every rank's settings and runs the same checks, so all
// ranks throw the same error or none does.
void MpiGroup::check_agreement(const torch::nn::Sequential& layers, const PipelineOptions& options,
                               const PipelinePlan& plan) {
  enum Field { kLayers, kStages, kMicroBatches, kCheckpoint, kDtype, kSchedule, kVirtual, kBatchNorm, kGiven, kFields };
  const char* names[] = {"the model's layer count", "the number of stages K·V", "the number of micro-batches M",
                         "the checkpoint mode", "the parameters' dtype", "the schedule",
                         "the number of stages per device V", "deferred BatchNorm statistics (deferred_batch_norm)"};
  std::array<int64_t, kFields> mine{};
  mine[kLayers] = plan.layers;
  mine[kStages] = plan.stages();
  mine[kMicroBatches] = plan.micro_batches;
  mine[kCheckpoint] = static_cast<int64_t>(plan.checkpoint);
  mine[kDtype] = -1;
  for (const auto& p : layers->parameters())
    if (p.is_floating_point()) {
      mine[kDtype] = static_cast<int64_t>(p.scalar_type());
      break;
    }
  mine[kSchedule] = static_cast<int64_t>(plan.schedule);
  mine[kVirtual] = plan.virtual_stages;
  mine[kBatchNorm] = options.deferred_batch_norm() ? 1 : 0;
  mine[kGiven] = static_cast<int64_t>(layers->size());
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
  for (int field : {kStages, kVirtual, kLayers, kMicroBatches, kCheckpoint, kDtype, kSchedule, kBatchNorm}) {
    int reference = -1;
    for (int r = 0; r < size; ++r) {
      if (field == kDtype && at(r, field) < 0) continue;  // a device without parameters
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
  placement_ = place(rank_of(control_.get()), size, plan.devices);
  const std::vector<int>& balance = plan.balance;
  std::vector<int> balances(static_cast<size_t>(size) * balance.size());
  check_mpi(MPI_Allgather(balance.data(), static_cast<int>(balance.size()), MPI_INT, balances.data(),
                          static_cast<int>(balance.size()), MPI_INT, control_.get()),
            "exchanging the balance");
  const std::vector<int> first(balances.begin(), balances.begin() + static_cast<int>(balance.size()));
  for (int r = 1; r < size; ++r) {
    const std::vector<int> theirs(balances.begin() + r * static_cast<int>(balance.size()),
                                  balances.begin() + (r + 1) * static_cast<int>(balance.size()));
    GPIPE_CHECK(theirs == first, "the ranks disagree on the balance: rank 0 has ", format_balance(first), ", rank ", r,
                " has ", format_balance(theirs), "; start every rank with the same cut");
  }
  for (int r = 0; r < size; ++r) {
    const int device = place(r, size, plan.devices).device;
    int expected = 0;
    std::string which;
    for (int s : plan.stages_of(device)) {
      expected += balance[static_cast<size_t>(s)];
      which += (which.empty() ? "" : ", ") + std::to_string(s);
    }
    GPIPE_CHECK(at(r, kGiven) == expected, "rank ", r, " runs stage", plan.virtual_stages > 1 ? "s " : " ", which,
                ", which the balance ", format_balance(balance), " gives ", expected, " layers, but it was given ",
                at(r, kGiven), "; build each rank's layers with mpi::device_layers");
  }
}

std::vector<SkipUse> MpiGroup::all_skip_uses(const torch::nn::Sequential& layers, const SkipUseFinder& skip_uses) {
  // A line "pop|stash <layer> <name>" per use; the layers are named by their index in the whole model.
  std::string mine, error;
  try {
    for (const SkipUse& u : skip_uses(layers, /*named_by_index=*/true))
      mine += std::string(u.pop ? "pop " : "stash ") + std::to_string(u.layer) + " " + u.name + "\n";
  } catch (const std::exception& e) {
    error = e.what();
  }
  agree_on(error);
  std::vector<SkipUse> uses;
  for (const auto& lines : first_ranks_lines(control_.get(), mine, placement_.devices))
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

void MpiGroup::connect(const PipelinePlan& plan, const torch::nn::Sequential& layers, const PipelineOptions& options) {
  plan_ = plan;
  find_tied_copies(layers, options);
  open();
  share_tied_values();
}

// Fresh communicators for everything a step does (control_ is used for nothing else).
void MpiGroup::open() {
  world_ = Communicator::duplicate(control_.get());
  pipeline_ = Communicator::split(world_.get(), placement_.replica, placement_.device);
  replicas_ = Communicator::split(world_.get(), placement_.device, placement_.replica);
  for (Tie& tie : ties_)
    tie.comm = Communicator::split(pipeline_.get(), tie.copies.empty() ? MPI_UNDEFINED : 0, placement_.device);
  errors_ = std::make_unique<ErrorChannel>(world_.get());
  // In the replica's communicator, rank d is device d.
  transport_ = std::make_unique<MpiTransport>(pipeline_.get(), errors_.get(), plan_.placement, plan_.micro_batches,
                                              static_cast<int>(plan_.skip_routes.size()));
}

void MpiGroup::abandon() {
  transport_.reset();
  if (errors_) errors_->abandon();
  errors_.reset();
  world_.abandon();
  pipeline_.abandon();
  replicas_.abandon();
  for (Tie& tie : ties_) tie.comm.abandon();
}

// After a failed step every rank has thrown (StageError where it failed,
// RemoteError elsewhere), but messages of that step may still be in flight, a
// rank may have heard of more than one failure, and a collective may have been
// started by some ranks only. Starting over on new communicators leaves all of
// that behind. The old ones are abandoned, not freed: MPI would give a freed
// communicator's context to a new one, where the old step's stray messages
// would then arrive.
void MpiGroup::begin_call() {
  GPIPE_CHECK(!left_, "this rank left the MPI job (mpi::leave, at its exit): its pipelines take no more calls");
  if (errors_ && !errors_->left().empty()) {
    failed_ = true;  // the next call cannot start over: the communicators need every rank
    throw RemoteError(errors_->left_rank(), errors_->left());
  }
  if (!failed_) return;
  abandon();
  open();
  failed_ = false;
}

void MpiGroup::fail(const std::string& why) {
  // A failure outside the transport's steps (a sum, the gradients' reduction, a loss in evaluation)
  // is told here; one the transport cancelled was told already.
  if (!failed_ && !why.empty() && errors_ && transport_ && !transport_->cancelled()) errors_->raise(who() + why);
  failed_ = true;
}

std::string MpiGroup::who() const {
  return "rank " + std::to_string(rank()) + " (device " + std::to_string(placement_.device) + ", replica " +
         std::to_string(placement_.replica) + "): ";
}

std::string MpiGroup::describe() const {
  return "MPI: " + std::to_string(placement_.devices * placement_.replicas) + " ranks = " +
         std::to_string(placement_.devices) + " devices x " + std::to_string(placement_.replicas) + " replicas";
}

void MpiGroup::check_same_batch(const Tensors& input, const torch::Tensor& target) {
  auto name = [&](size_t n) {
    return n == input.size() ? std::string("target") : input.tuple ? "input's tensor " + std::to_string(n) : std::string("input");
  };
  const std::string fix = "; every rank calls with the same whole mini-batch: draw the data in the same order on every "
                          "rank (seed the generator that shuffles it, e.g. torch.manual_seed before building a "
                          "DataLoader)";
  // The count first: the sums below are one reduction of that many values on every rank.
  const double count = static_cast<double>(input.size());
  double counts[2] = {count, -count};
  reduce(counts, 2, /*largest=*/true);
  if (counts[0] != -counts[1]) failed_ = true;
  GPIPE_CHECK(counts[0] == -counts[1], "the ranks were given inputs of different numbers of tensors", fix);
  std::vector<torch::Tensor> tensors = input.items;
  if (target.defined()) tensors.push_back(target);
  // Per tensor its size and the sum of its values, each with its negation: one maximum gives both
  // the largest and the smallest over the ranks.
  std::vector<double> values;
  for (const torch::Tensor& t : tensors) {
    const double size = static_cast<double>(t.numel());
    double sum = t.numel() > 0 ? t.detach().sum(torch::kDouble).item<double>() : 0.0;
    if (std::isnan(sum)) sum = std::numeric_limits<double>::max();  // NaN compares with nothing
    if (std::isinf(sum)) sum = sum > 0 ? std::numeric_limits<double>::max() : std::numeric_limits<double>::lowest();
    values.insert(values.end(), {size, -size, sum, -sum});
  }
  reduce(values.data(), static_cast<int>(values.size()), /*largest=*/true);
  for (size_t n = 0; n < values.size(); n += 2) {
    // Every rank reaches the same verdict from the same sums, so nothing is told: a rank told first
    // would stop the others with its message before they reach their own.
    if (values[n] != -values[n + 1]) failed_ = true;
    GPIPE_CHECK(values[n] == -values[n + 1], "the ranks were given different batches (", n % 4 == 0 ? "sizes" : "values",
                " of the ", name(n / 4), " differ)", fix);
  }
}

std::pair<int64_t, int64_t> MpiGroup::share(int64_t rows) const {
  // As micro_batch_sizes: the first rows % D replicas take one row more; with fewer rows than
  // replicas, the last replicas take none.
  const int64_t D = placement_.replicas, r = placement_.replica;
  const int64_t base = rows / D, extra = rows % D;
  return {r * base + std::min(r, extra), base + (r < extra ? 1 : 0)};
}

void MpiGroup::reduce(double* values, int count, bool largest) {
  auto buffer = std::make_shared<std::vector<double>>(values, values + count);
  MPI_Request request = MPI_REQUEST_NULL;
  check_mpi(MPI_Iallreduce(MPI_IN_PLACE, buffer->data(), count, MPI_DOUBLE, largest ? MPI_MAX : MPI_SUM, world_.get(),
                           &request),
            "MPI_Iallreduce");
  wait_or_keep(*errors_, request, buffer);
  std::copy(buffer->begin(), buffer->end(), values);
}

std::vector<std::string> MpiGroup::gather(const std::string& bytes) {
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
  check_mpi(MPI_Iallgather(&b->length, 1, MPI_INT64_T, b->sizes.data(), 1, MPI_INT64_T, world_.get(), &request),
            "MPI_Iallgather");
  wait_or_keep(*errors_, request, b);
  b->layout = layout_of(b->sizes);  // every rank refuses a gather too large, or none
  b->all.assign(rank == 0 ? static_cast<size_t>(b->layout.total) : 0, '\0');
  check_mpi(MPI_Igatherv(b->mine.data(), static_cast<int>(b->length), MPI_CHAR, b->all.data(),
                         b->layout.lengths.data(), b->layout.offsets.data(), MPI_CHAR, 0, world_.get(), &request),
            "MPI_Igatherv");
  wait_or_keep(*errors_, request, b);
  std::vector<std::string> out;
  if (rank == 0)
    for (int r = 0; r < size; ++r)
      out.push_back(b->all.substr(static_cast<size_t>(b->layout.offsets[static_cast<size_t>(r)]),
                                  static_cast<size_t>(b->layout.lengths[static_cast<size_t>(r)])));
  return out;
}

}  // namespace detail

void leave() {
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (!initialized || finalized) return;
  const std::lock_guard<std::mutex> lock(detail::live_mutex);
  for (detail::MpiGroup* group : detail::live_groups()) group->leave();
  ErrorChannel::retire(nullptr);  // the deleted pipelines' channels whose notices have all come: freed
}

}  // namespace gpipe::mpi
