// planned.cc: a built-in task's model, or a TorchScript file's, as the planner takes it (plan_model_of,
// tasks.h).
#include "gpipe/tasks.h"

#include "tasks/builtin.h"

#include "gpipe/check.h"
#include "gpipe/script_model.h"

#include <torch/torch.h>

#include <unistd.h>

#include <algorithm>
#include <iomanip>
#include <sstream>

namespace gpipe {

using tasks::said_about;

PlannedModel plan_model_of(const Task& task, const TaskOptions& options, const PlanProfileOptions& profile) {
  const torch::nn::Sequential layers = task.model(options).build(LayerRange{});
  const Dataset batch = task.batch(options);
  const int64_t rows = std::min<int64_t>(kPlanProfileRows, batch.size());
  PlanProfileOptions o = profile;
  o.loss(task.loss).target(batch.target.narrow(0, 0, rows)).name((task.workload ? "workload " : "task ") + task.name);
  return plan_model_of(layers, batch.input.narrow(0, 0, rows), o);
}


PlannedModel plan_model_of(const std::string& model_file, const std::vector<int64_t>& input_shape,
                           const PlanProfileOptions& profile) {
  GPIPE_CHECK(!input_shape.empty(), "`model` needs `input_shape`, one sample's shape without the batch (e.g. "
              "1,28,28); the sample is random floats, so a model that starts with an Embedding is planned with "
              "`workload` or by shape");
  const torch::nn::Sequential layers = said_about("`model`", [&] { return load_script_model(model_file).layers; });
  std::vector<int64_t> shape{kPlanProfileRows};
  shape.insert(shape.end(), input_shape.begin(), input_shape.end());
  std::string given;  // the shape as the user wrote it
  for (const int64_t n : input_shape) given += (given.empty() ? "" : ",") + std::to_string(n);
  // The micro-batch is made and run here: one too large for this machine is refused, not allocated.
  double bytes = sizeof(float);
  for (const int64_t n : shape) bytes *= static_cast<double>(n);
  const double memory = static_cast<double>(sysconf(_SC_PHYS_PAGES)) * static_cast<double>(sysconf(_SC_PAGESIZE));
  if (bytes > memory / 4) {
    std::ostringstream text;
    text << "`input_shape` " << given << ": the model is profiled here on " << kPlanProfileRows
         << " samples of this shape, " << std::setprecision(3) << bytes / (1u << 30)
         << " GiB of floats, more than a quarter of this machine's memory (" << memory / (1u << 30)
         << " GiB); give one sample's shape without the batch, or plan a Transformer by shape (`layers`, `width`, ...)";
    detail::throw_invalid_argument(text.str());
  }
  const torch::Tensor sample = said_about("`input_shape`", [&] { return torch::randn(shape); });
  // A model that cannot train (no parameters, an argmax output, a layer that drops rows) fits nothing.
  // A first layer that fails names the shape the samples are made of here.
  said_about("`model` " + model_file + " `input_shape` " + given, [&] { return check_layers_train(layers, sample); });
  return said_about("`input_shape`", [&] { return plan_model_of(layers, sample, profile); });
}

}  // namespace gpipe
