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
  o.layers().loss(task.loss).target(batch.target.narrow(0, 0, rows));
  o.name((task.workload ? "workload " : "task ") + task.name);
  return plan_model_of(layers, batch.input.narrow(0, 0, rows), o);
}


PlannedModel plan_model_of(const std::string& model_file, const std::vector<int64_t>& input_shape,
                           const PlanProfileOptions& profile, int64_t input_tokens) {
  GPIPE_CHECK(!input_shape.empty(), "`model` needs `input_shape`, one sample's shape without the batch (e.g. "
              "1,28,28, or 128 tokens with `input_tokens`)");
  GPIPE_CHECK(input_tokens >= 0, "`input_tokens` must be the vocabulary of the model's first layer, 1 or more "
              "(or 0 for samples of random floats); got ", input_tokens);
  const torch::nn::Sequential layers = said_about("`model`", [&] { return load_script_model(model_file).layers; });
  std::vector<int64_t> shape{kPlanProfileRows};
  shape.insert(shape.end(), input_shape.begin(), input_shape.end());
  std::string given;  // the shape as the user wrote it
  for (const int64_t n : input_shape) given += (given.empty() ? "" : ",") + std::to_string(n);
  // The micro-batch is made and run here: one too large for this machine is refused, not allocated.
  double bytes = input_tokens > 0 ? sizeof(int64_t) : sizeof(float);
  for (const int64_t n : shape) bytes *= static_cast<double>(n);
  const double memory = static_cast<double>(sysconf(_SC_PHYS_PAGES)) * static_cast<double>(sysconf(_SC_PAGESIZE));
  if (bytes > memory / 4) {
    std::ostringstream text;
    text << "`input_shape` " << given << ": the model is profiled here on " << kPlanProfileRows
         << " samples of this shape, " << std::setprecision(3) << bytes / (1u << 30)
         << " GiB of " << (input_tokens > 0 ? "token ids" : "floats") << ", more than a quarter of this machine's memory (" << memory / (1u << 30)
         << " GiB); give one sample's shape without the batch, or plan a Transformer by shape (`layers`, `width`, ...)";
    detail::throw_invalid_argument(text.str());
  }
  const torch::Tensor sample = said_about("`input_shape`", [&] {
    if (input_tokens == 0) return torch::randn(shape);
    torch::Tensor ids = torch::randint(input_tokens, shape, torch::kLong);
    ids.view(-1)[0] = input_tokens - 1;  // the largest id always: a vocabulary too small fails every time
    return ids;
  });
  // A model that cannot train (no parameters, an argmax output, a layer that drops rows) fits nothing.
  // A first layer that fails names the samples made here.
  const std::string samples =
      "`input_shape` " + given + (input_tokens > 0 ? " `input_tokens` " + std::to_string(input_tokens) : std::string());
  said_about("`model` " + model_file + " " + samples, [&] {
    try {
      return check_layers_train(layers, sample);
    } catch (const std::invalid_argument& e) {
      // Token ids where the first layer takes them, and only there.
      const std::string what = without_program_name(what_of(e));
      if (input_tokens == 0 && what.find("'indices'") != std::string::npos)
        detail::throw_invalid_argument(what + "; a model that starts with an Embedding takes token ids: give "
                                       "`input_tokens`, its vocabulary");
      if (input_tokens > 0 && what.find("index out of range") != std::string::npos)
        detail::throw_invalid_argument(what + "; the samples hold token ids up to " + std::to_string(input_tokens - 1) +
                                       ": give `input_tokens` no more than the first Embedding's entries");
      if (input_tokens > 0)
        detail::throw_invalid_argument(what + "; the samples were token ids (`input_tokens`), for a model that "
                                       "starts with an Embedding: leave it out for a model that takes floats");
      throw;
    }
  });
  return said_about("`input_shape`", [&] { return plan_model_of(layers, sample, profile); });
}

}  // namespace gpipe
