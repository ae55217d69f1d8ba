// rank_group.h (internal): what every backend of several processes shares (gpipe/backend.h), one
// process per device: the processes' agreement on the configuration, where each sits (place), the
// skip connections and tied weights gathered from every process, the batch compared, the rows
// shared among the replicas, the step's timeline gathered. A backend derives from RankGroup and
// gives it the job's collectives (the primitives below): MPI (transport/mpi/group.h) and c10d
// (transport/c10d/c10d.h) do.
#pragma once

#include "gpipe/backend.h"
#include "gpipe/job.h"
#include "gpipe/transport.h"

#include <torch/types.h>

#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <utility>
#include <vector>

namespace gpipe::detail {

/// Prints each different message of `messages` (one per rank, in rank order) once: alone when every
/// rank gave it, else after the ranks that did ("[ranks 0, 2] ..."). What ending a job prints.
void print_by_message(const std::vector<std::string>& messages, const std::function<void(const std::string&)>& print);

/// Latency and bandwidth of `transport` between stage 0 on rank 0 and stage 1 on rank 1 (this
/// process is `rank`): job.h's time_link, for any backend.
std::vector<LinkTiming> time_transport(Transport& transport, int rank, int warmup);

/// The live groups of one backend in this process (its Group type), which the backend's leave()
/// tells the other processes about at exit. Never destroyed: leave() runs at exit.
template <typename Group>
class LiveGroups {
 public:
  static void add(Group* group) {
    const std::lock_guard<std::mutex> lock(mutex());
    groups().insert(group);
  }
  static void remove(Group* group) {
    const std::lock_guard<std::mutex> lock(mutex());
    groups().erase(group);
  }
  static size_t count() {
    const std::lock_guard<std::mutex> lock(mutex());
    return groups().size();
  }
  /// Every live group's leave(), then `then()`, under the lock.
  template <typename Then>
  static void leave_all(Then then) {
    const std::lock_guard<std::mutex> lock(mutex());
    for (Group* group : groups()) group->leave();
    then();
  }

 private:
  static std::mutex& mutex() {
    static auto* m = new std::mutex;
    return *m;
  }
  static std::set<Group*>& groups() {
    static auto* g = new std::set<Group*>;
    return *g;
  }
};

class RankGroup : public Backend {
 public:
  /// `name`: how describe() names the backend ("MPI").
  explicit RankGroup(std::string name) : name_(std::move(name)) {}
  /// With a plan make_plan made for the pipeline's options on every process alike: used as it is.
  RankGroup(std::string name, const PipelinePlan& plan) : RankGroup(std::move(name)) { made_plan(plan); }

  PipelinePlan plan(const torch::nn::Sequential& layers, const PipelineOptions& options,
                    const SkipUseFinder& skip_uses) override;
  std::vector<int> local_devices() const override { return {placement_.device}; }
  bool on_caller_thread() const override { return true; }
  void agree(std::exception_ptr failure) override;
  void connect(const PipelinePlan& plan, const torch::nn::Sequential& layers, const PipelineOptions& options) override;
  void begin_call() override;
  void fail(const std::string& why) override;

  std::string who() const override;
  std::pair<int64_t, int64_t> share(int64_t rows) const override;
  void check_same_batch(const Tensors& input, const torch::Tensor& target) override;
  void reduce_gradients(const std::vector<torch::Tensor>& params) override;
  void sum_over_replicas(const std::shared_ptr<torch::Tensor>& values) override;
  StepTrace gather_trace(const StepTrace& trace, const PipelinePlan& plan) override;
  bool counts(const torch::Tensor& parameter) const override;

  int replica() const override { return placement_.replica; }
  int device() const override { return placement_.device; }
  std::string describe() const override;

  const Placement& placement() const { return placement_; }

 protected:
  // ---- the job's collectives, which a backend gives

  /// Every process's `mine`, in rank order, on every process: the set-up's agreement (collective).
  virtual std::vector<std::string> all_gather_setup(const std::string& mine) = 0;
  /// `values` (float32 or float64, on the CPU) summed in place over the D processes that run this
  /// device, one per replica (collective over them); `what` names them in an error.
  virtual void sum_replicas(const std::shared_ptr<torch::Tensor>& values, const char* what) = 0;
  /// Over the processes of this replica that hold a copy of tied group `tie` (ties_[tie].devices),
  /// collective over them: `value` made the lowest device's; `values` summed in place.
  virtual void broadcast_tie(size_t tie, torch::Tensor& value) = 0;
  virtual void sum_tie(size_t tie, const std::shared_ptr<torch::Tensor>& values) = 0;

  // ---- the step's connections and the error channel, which a backend gives

  /// Fresh connections for the steps (the transport, what the collectives use) for plan_.
  virtual void open() = 0;
  /// The step's connections, left as they are after a failure: another process may still write
  /// into them (a fresh set comes with open()).
  virtual void abandon() = 0;
  /// Tells every other process that this one failed with `message` (their waits throw
  /// RemoteError), unless the transport's cancelled step told them already.
  virtual void tell_failure(const std::string& message) = 0;
  /// The rank and message of a process that left the job (leaving_message), or an empty message.
  virtual std::pair<int, std::string> heard_leaving() const = 0;

  // ---- for the backend's own use

  /// How describe() names the backend: the name given, or more that only the backend knows.
  virtual std::string backend_name() const { return name_; }
  /// How messages name rank `r`: "rank r", or more that only the backend knows.
  virtual std::string rank_name(int r) const { return "rank " + std::to_string(r); }

  /// Uses `plan`, one make_plan made for the pipeline's options on every process alike, as it is.
  void made_plan(const PipelinePlan& plan) {
    made_ = true;
    plan_ = plan;
  }

  /// Throws on every process if any process's `local_error` is not empty: its own message on that
  /// process, the first failing rank's on the others.
  void agree_on(const std::string& local_error);
  /// This process's copies of each tied group (options.tied_parameters()), checked against every
  /// process's; connect() calls it before the backend connects the holders, then share_tied_values.
  void find_tied_copies(const torch::nn::Sequential& layers, const PipelineOptions& options);
  void share_tied_values();
  /// What this process tells the others when it makes no more calls: that it let go of its pipeline
  /// or (`program_ended`) ended its program, and that every rank must end its loop together.
  std::string leaving_message(bool program_ended) const;

  struct Tie {
    std::vector<torch::Tensor> copies;  // this process's, one per distinct tensor; maybe none
    std::vector<int> devices;           // the devices of the replica that hold a copy, in order
  };
  std::vector<Tie> ties_;  // one per group of tied_parameters
  Placement placement_;
  PipelinePlan plan_;
  bool failed_ = false;  // a call failed: the next starts over (begin_call)
  bool left_ = false;    // this process left the job (its backend's leave()): no more calls

 private:
  // Every process's settings, checked alike on every process; sets placement_.
  void check_agreement(const torch::nn::Sequential& layers, const PipelineOptions& options, const PipelinePlan& plan);
  // Every Stash and Pop of the whole model, from replica 0's processes.
  std::vector<SkipUse> all_skip_uses(const torch::nn::Sequential& layers, const SkipUseFinder& skip_uses);
  // Every process's `mine`, a line per entry, as the lines of each of the first `count` processes
  // (replica 0's, which hold the whole model between them).
  std::vector<std::vector<std::string>> first_lines(const std::string& mine, int count);
  void sum_tied_gradients();

  std::string name_;
  bool made_ = false;  // plan_ was made by make_plan before the pipeline (make_pipeline's)
  std::set<const void*> uncounted_;  // tied copies another process counts
};

}  // namespace gpipe::detail
