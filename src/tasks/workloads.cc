// workloads.cc: the benchmark workloads of docs/benchmarks.md as tasks: their model, one batch of
// random data (trained and scored on), their loss, and their cut (blocks evenly).
#include "tasks/builtin.h"

#include "gpipe/workloads.h"

namespace gpipe::tasks {

std::function<Dataset(const TaskOptions&)> workload_batch(const std::string& name) {
  return [name](const TaskOptions& o) {
    const Workload w = make_workload(name, o.seed(), LayerRange{0, 0}, o.tie_embeddings());  // no layers kept
    return Dataset{w.input, w.target};
  };
}

namespace {
// Each workload's line for a help text.
const std::vector<std::pair<std::string, std::string>>& workload_summaries() {
  static const std::vector<std::pair<std::string, std::string>> all = {
      {"mlp", "16 blocks of Linear(1024, 1024) and ReLU on a batch of 256"},
      {"transformer", "an embedding, 8 encoder blocks of width 256 and a 2048-class head on 32 sequences of 64"},
      {"tiny", "8 blocks of Linear(64, 64) and ReLU on a batch of 256: all overhead"},
      {"imbalanced", "8 blocks of Linear and ReLU growing from 256 to 2048 wide on a batch of 128"}};
  return all;
}
}  // namespace

std::vector<std::string> workload_task_names() {
  std::vector<std::string> names;
  for (const auto& entry : workload_summaries()) names.push_back(entry.first);
  return names;
}

Task workload(const std::string& name) {
  std::string summary;
  for (const auto& entry : workload_summaries())
    if (entry.first == name) summary = entry.second;
  const Workload shape = workload_shape(name);
  Task t;
  t.name = name;
  t.title = name;
  t.summary = summary;
  t.workload = true;
  t.layers = shape.layers;
  t.scoring = loss_scoring();
  t.loss = shape.loss;
  t.loss_name = shape.target.scalar_type() == torch::kLong ? "cross_entropy" : "mse";
  t.model = [name](const TaskOptions& o) {
    const Workload w = workload_shape(name, o.tie_embeddings());
    Model m = Model::of(name, w.layers, [name, o](LayerRange keep) {
      return make_workload(name, o.seed(), keep, o.tie_embeddings()).model;
    });
    m.tied = w.tied;
    return m;
  };
  t.batch = workload_batch(name);
  t.data = [batch = t.batch](const TaskOptions& o) {
    TaskData d;
    d.train = batch(o);
    d.test = d.train;
    d.test_name = "training";
    d.source = "a random batch";
    return d;
  };
  t.cut = [shape](int devices, ScheduleKind, int V) {
    return static_cast<int>(shape.block_layers.size()) >= devices * V ? shape.cut() : CutRequest::even();
  };
  return t;
}

}  // namespace gpipe::tasks
