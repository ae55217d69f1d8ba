// group.cc (c10d): the processes of a c10d job as one pipeline's backend: connections per generation,
// starting over after a failed call, the collectives RankGroup asks for; and c10d's entry in
// backends().
#include "transport/c10d/c10d.h"

#include "gpipe/check.h"

#include <torch/torch.h>

#include <atomic>

namespace gpipe::c10d {

namespace {

using Live = detail::LiveGroups<C10dGroup>;  // the groups leave() tells the other processes about

// Each pipeline's keys in the store: the n-th made over this job in this process, as on every other.
std::string next_scope() { return "pipeline" + std::to_string(world().pipelines_made++); }

}  // namespace

C10dGroup::C10dGroup() : RankGroup("c10d (Gloo)"), scope_(next_scope()) {
  world();  // throws, naming the fix, where no job is started
  links_ = std::make_unique<Links>(scope_, generation_++);  // the set-up's gathers, then the first calls
  Live::add(this);
}

C10dGroup::C10dGroup(const PipelinePlan& plan) : C10dGroup() {
  made_plan(plan);
}

C10dGroup::~C10dGroup() {
  Live::remove(this);
  if (failed_ || left_) {
    abandon();  // a failed call may have left messages no process will finish
  } else {
    // A process still using the pipeline (its loop longer than this one's) stops rather than waiting.
    if (links_) links_->leave(leaving_message(/*program_ended=*/false));
    transport_.reset();
    links_.reset();
  }
  try {
    pipeline_ended();
  } catch (...) {  // a destructor throws nothing; the store is then kept
  }
}

void C10dGroup::leave() {
  if (left_) return;
  left_ = true;
  if (links_ && !failed_)  // after a failure the others have heard of it already
    links_->leave(leaving_message(/*program_ended=*/true));
  abandon();
}

std::string C10dGroup::backend_name() const {
  const int peers = links_ ? links_->shared_memory_peers() : 0;
  if (peers == 0) return "c10d (Gloo)";
  const int others = world().size - 1;
  return "c10d (Gloo; shared memory with " + std::to_string(peers) + " of " + std::to_string(others) + " other rank" +
         (others == 1 ? ")" : "s)");
}

std::vector<std::string> C10dGroup::all_gather_setup(const std::string& mine) { return links_->all_gather(mine); }

void C10dGroup::open() {
  if (!links_) links_ = std::make_unique<Links>(scope_, generation_++);
  // This replica's stage s runs on the job's rank replica·K + its device.
  std::vector<int> rank_of_stage;
  for (int device : plan_.placement) rank_of_stage.push_back(placement_.replica * placement_.devices + device);
  transport_ = std::make_unique<C10dTransport>(links_.get(), rank_of_stage, plan_.micro_batches,
                                               static_cast<int>(plan_.skip_routes.size()));
}

void C10dGroup::abandon() {
  // Kept for good: Gloo may still write into a failed call's buffers, which its operations hold.
  if (transport_) {
    transport_->stop_receiving();
    new std::unique_ptr<C10dTransport>(std::move(transport_));
  }
  if (links_) {
    unwatch(links_.get());
    links_->release_shared_memory();  // no other process writes into this one's receives
    new std::unique_ptr<Links>(std::move(links_));
  }
}

void C10dGroup::tell_failure(const std::string& message) {
  if (links_ && transport_ && !transport_->cancelled()) links_->raise(message);
}

std::pair<int, std::string> C10dGroup::heard_leaving() const {
  if (!links_) return {-1, ""};
  return links_->left();
}

void C10dGroup::reduce(double* values, int count, bool largest) {
  torch::Tensor buffer = torch::from_blob(values, {count}, torch::kDouble).clone();
  std::vector<int> all(static_cast<size_t>(world().size));
  for (size_t r = 0; r < all.size(); ++r) all[r] = static_cast<int>(r);
  links_->combine(all, buffer, largest);
  std::memcpy(values, buffer.data_ptr(), static_cast<size_t>(count) * sizeof(double));
}

std::vector<std::string> C10dGroup::gather(const std::string& bytes) { return links_->gather(bytes); }

void C10dGroup::sum_replicas(const std::shared_ptr<torch::Tensor>& values, const char* /*what*/) {
  std::vector<int> ranks;
  for (int r = 0; r < placement_.replicas; ++r) ranks.push_back(r * placement_.devices + placement_.device);
  links_->combine(ranks, *values);
}

std::vector<int> C10dGroup::tie_ranks(size_t tie) const {
  std::vector<int> ranks;
  for (int d : ties_[tie].devices) ranks.push_back(placement_.replica * placement_.devices + d);
  return ranks;
}

void C10dGroup::broadcast_tie(size_t tie, torch::Tensor& value) { links_->broadcast(tie_ranks(tie), value); }

void C10dGroup::sum_tie(size_t tie, const std::shared_ptr<torch::Tensor>& values) {
  links_->combine(tie_ranks(tie), *values);
}

void leave() {
  Live::leave_all([] {});
}

size_t live_pipelines() { return Live::count(); }

std::pair<int, int> start_job() {
  bind_to_cores();
  const World& w = start();
  return {w.rank, w.size};
}

std::vector<LinkTiming> time_link(int warmup) {
  static int calls = 0;  // each call's keys its own
  Links links("link" + std::to_string(calls++), 0);
  C10dTransport transport(&links, {0, 1}, 1);  // stage r on rank r
  return detail::time_transport(transport, links.rank(), warmup);
}

BackendEntry backend_entry() {
  BackendEntry entry;
  entry.runtime = Runtime::kC10d;
  entry.name = "c10d";
  entry.built = true;
  entry.running = [] { return started() && world().size > 1; };
  entry.start = [](bool required) {
    if (required || launched()) start();
    return required || launched();
  };
  entry.process = [] {
    const World& w = world();
    return std::make_pair(w.rank, w.size);
  };
  entry.make = [](const PipelinePlan& plan) { return std::unique_ptr<Backend>(new C10dGroup(plan)); };
  entry.all_gather = [](const std::string& mine) {
    // The job's own connections, made at the first gather (every process gathers at the same points).
    World& w = world();
    if (!w.job) w.job = std::make_unique<Links>("job", 0);
    return w.job->all_gather(mine);
  };
  entry.abort = [](int status) { abort(status); };
  entry.leave = [] { leave(); };
  return entry;
}

}  // namespace gpipe::c10d
