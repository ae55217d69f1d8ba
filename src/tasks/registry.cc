// registry.cc: the built-in tasks by name, a task of one's own (a TorchScript model and a data
// file), and what every task shares: its trainer options.
#include "tasks/builtin.h"

#include "gpipe/check.h"
#include "gpipe/script_model.h"
#include "gpipe/snapshot.h"

#include <torch/torch.h>

#include <algorithm>
#include <map>
#include <mutex>

namespace gpipe {
namespace tasks {  // each defined in its own file
Task cnn();     // cnn.cc: the Fashion-MNIST CNN, gpipe train's default
Task resnet();  // resnet.cc: a residual network with BatchNorm on Fashion-MNIST
Task unet();    // unet.cc: a U-Net that denoises Fashion-MNIST images
Task gpt();     // gpt.cc: a byte-level GPT on Debian's fortunes
// workloads.cc: the benchmark workloads of docs/benchmarks.md (mlp, transformer, tiny, imbalanced).
Task workload(const std::string& name);
std::vector<std::string> workload_task_names();
}  // namespace tasks

namespace {

// The registry: a task's name and the function that makes it (only the task asked for is made).
const std::vector<std::pair<std::string, std::function<Task()>>>& registry() {
  static const std::vector<std::pair<std::string, std::function<Task()>>> all = [] {
    std::vector<std::pair<std::string, std::function<Task()>>> r = {
        {"cnn", tasks::cnn}, {"resnet", tasks::resnet}, {"unet", tasks::unet}, {"gpt", tasks::gpt}};
    for (const std::string& name : tasks::workload_task_names())
      r.emplace_back(name, [name] { return tasks::workload(name); });
    return r;
  }();
  return all;
}

}  // namespace

std::vector<std::string> task_names(bool workloads) {
  std::vector<std::string> names;
  const std::vector<std::string> benchmarks = tasks::workload_task_names();
  for (const auto& [name, make] : registry())
    if (workloads || std::find(benchmarks.begin(), benchmarks.end(), name) == benchmarks.end()) names.push_back(name);
  return names;
}

const Task& find_task(const std::string& name) {
  static std::mutex lock;
  static std::map<std::string, Task> made;
  const std::lock_guard<std::mutex> hold(lock);
  if (const auto found = made.find(name); found != made.end()) return found->second;
  for (const auto& [known, make] : registry())
    if (known == name) return made.emplace(name, make()).first->second;
  std::string names;
  for (const std::string& n : task_names(true)) names += (names.empty() ? "" : ", ") + n;
  GPIPE_CHECK(false, "no task named \"", name, "\"; the built-in tasks are ", names);
  return made.begin()->second;  // not reached
}

TrainerOptions Task::trainer_options() const {
  TrainerOptions options;
  options.optimizer(OptimizerOptions().lr(defaults.lr))
      .lr_schedule(LrScheduleOptions().kind(defaults.lr_schedule))
      .batch_size(defaults.batch_size)
      .epochs(defaults.epochs)
      .loss(loss)
      .classification(scoring.classification);
  return options;
}

Task script_task(const std::string& model_file, const std::string& data_file, const std::string& loss) {
  GPIPE_CHECK(!data_file.empty() || loss == "cross_entropy", "`loss` ", loss, " needs a data file with real-valued "
              "targets; Fashion-MNIST has class labels");
  Task t = tasks::cnn();  // Fashion-MNIST and the CNN's run, another model
  t.name = model_file;
  t.title = model_file;
  t.summary = "a TorchScript nn.Sequential of one's own";
  t.cut = nullptr;
  t.schedule = nullptr;
  t.batch = nullptr;
  ScriptModel source;
  try {
    source = load_script_model(model_file);
  } catch (const std::runtime_error&) {
    GPIPE_CHECK(!is_sealed_snapshot(model_file), model_file, " is a checkpoint file gpipe wrote (`save`), not a "
                "model: resume it with `resume` ", model_file, " and the `model` that saved it");
    throw;
  }
  t.layers = static_cast<int>(source.layers->size());
  t.model = [model_file, source](const TaskOptions& o) {
    torch::manual_seed(o.seed());  // the stream each step's Dropout seed is drawn from, as a built-in model's
    return Model::of(model_file, source);
  };
  return data_file.empty() ? t : with_data_file(std::move(t), data_file, loss);
}

Task with_data_file(Task t, const std::string& data_file, const std::string& loss) {
  GPIPE_CHECK(loss == "cross_entropy" || loss == "mse", "unknown `loss` \"", loss, "\"; use cross_entropy (integer "
              "class targets) or mse (real-valued targets)");
  const bool classes = loss == "cross_entropy";
  t.scoring = classes ? accuracy_scoring() : tasks::loss_scoring();
  t.context = 0;  // a data file of one's own is no text to sample
  t.denoises = false;
  t.loss = classes ? LossFn(cross_entropy_loss) : LossFn(mse_loss);
  t.loss_name = loss;
  t.data_dir = "";
  t.defaults.flip = false;
  t.data = [data_file, classes](const TaskOptions& o) {
    TaskData d;
    d.train = load_tensor_data(data_file).first(o.train_samples());
    d.test = d.train;
    d.test_name = "training";
    d.source = data_file;
    const torch::Tensor& target = d.train.target;
    const std::string type = c10::toString(target.scalar_type());
    if (classes) {
      GPIPE_CHECK(!target.is_floating_point(), "`loss` cross_entropy needs integer class targets, but the targets "
                  "of ", d.source, " are ", type, "; use `loss` mse");
      d.train.target = d.train.target.to(torch::kLong);
      d.test.target = d.test.target.to(torch::kLong);
    } else {
      GPIPE_CHECK(target.is_floating_point(), "`loss` mse needs real-valued targets, but the targets of ", d.source,
                  " are ", type, "; use `loss` cross_entropy for class indices, or save the targets as floats");
    }
    GPIPE_CHECK(d.train.size() > 0, "the training data of ", d.source, " has no samples");
    return d;
  };
  return t;
}

}  // namespace gpipe
