// planned.cc: a built-in task's model as the planner takes it (plan_model_of, tasks.h).
#include "gpipe/tasks.h"

#include <algorithm>

namespace gpipe {

PlannedModel plan_model_of(const Task& task, const TaskOptions& options, const PlanProfileOptions& profile) {
  const torch::nn::Sequential layers = task.model(options).build(LayerRange{});
  const Dataset batch = task.batch(options);
  const int64_t rows = std::min<int64_t>(kPlanProfileRows, batch.size());
  PlanProfileOptions o = profile;
  o.loss(task.loss).target(batch.target.narrow(0, 0, rows)).name((task.workload ? "workload " : "task ") + task.name);
  return plan_model_of(layers, batch.input.narrow(0, 0, rows), o);
}

}  // namespace gpipe
