// group.cc: one process running every device of a pipeline, a thread each.
#include "runtime/group.h"

#include "gpipe/check.h"

#include <torch/torch.h>

namespace gpipe::detail {
namespace {

class LocalGroup : public Backend {
 public:
  LocalGroup() = default;
  explicit LocalGroup(const PipelinePlan& plan) : made_(true), plan_(plan) {}

  PipelinePlan plan(const torch::nn::Sequential& layers, const PipelineOptions& options,
                    const SkipUseFinder& skip_uses) override {
    const std::vector<SkipConnection> skips = connect_skips(skip_uses(layers, false));
    if (!made_) {
      plan_ = make_plan(static_cast<int>(layers->size()), options, skips);
      return plan_;
    }
    check_plan_of(plan_, static_cast<int>(layers->size()), options);
    route_skips(plan_, skips);  // the plan as it was made: K, V, M and the cut are not resolved again
    return plan_;
  }

  std::vector<int> local_devices() const override {
    std::vector<int> all;
    for (int d = 0; d < plan_.devices; ++d) all.push_back(d);
    return all;
  }

  bool on_caller_thread() const override { return false; }

  void agree(std::exception_ptr failure) override {
    if (failure) std::rethrow_exception(failure);
  }

  void connect(const PipelinePlan& plan, const torch::nn::Sequential& layers,
               const PipelineOptions& options) override {
    // In one process a tied weight is one tensor, which is what ties it: a declared group must be one.
    const auto named = layers->named_parameters();
    for (const auto& group : options.tied_parameters()) {
      for (const std::string& name : group) {
        GPIPE_CHECK(named.contains(name), "tied_parameters: the model has no parameter ", name,
                    "; name parameters as model->named_parameters() does, e.g. ",
                    named.is_empty() ? std::string("0.weight") : named.keys().front());
        GPIPE_CHECK(named[name].is_same(named[group.front()]), "tied_parameters: ", group.front(), " and ", name,
                    " are different tensors; in one process tied layers share one tensor: register the first "
                    "layer's parameter in the other layer");
      }
    }
    stages_ = plan.stages();
    transport_ = std::make_unique<InProcessTransport>(stages_);
  }

  // A cancelled transport takes no further step (transport.h): the call after a failed step gets a new one.
  void begin_call() override {
    if (transport_ && transport_->cancelled()) transport_ = std::make_unique<InProcessTransport>(stages_);
  }

  Transport& transport() override { return *transport_; }

  std::string describe() const override {
    const int K = plan_.devices;
    return "one process, " + std::to_string(K) + (K == 1 ? " device thread" : " device threads");
  }

 private:
  bool made_ = false;  // plan_ was made by make_plan before the pipeline (make_pipeline's, a caller's)
  PipelinePlan plan_;
  int stages_ = 1;
  std::unique_ptr<InProcessTransport> transport_;
};

}  // namespace

std::unique_ptr<Backend> local_group() { return std::make_unique<LocalGroup>(); }
std::unique_ptr<Backend> local_group(const PipelinePlan& plan) { return std::make_unique<LocalGroup>(plan); }

}  // namespace gpipe::detail
