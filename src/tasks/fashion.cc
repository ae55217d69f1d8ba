// fashion.cc: what the Fashion-MNIST tasks share: the data, a random batch of its shape, a seeded model.
#include "tasks/builtin.h"

#include <torch/torch.h>

namespace gpipe::tasks {

TaskData fashion_data(const TaskOptions& options) {
  const std::string dir = options.data_dir().empty() ? kFashionMnistDir : options.data_dir();
  TaskData d;
  d.train = load_fashion_mnist(dir, true, options.train_samples());
  d.test = load_fashion_mnist(dir, false, options.test_samples());
  d.source = "Fashion-MNIST";
  return d;
}

Dataset random_images(int64_t rows, uint64_t seed) {
  torch::manual_seed(seed);
  Dataset batch;
  batch.input = torch::randn({rows, 1, 28, 28});
  batch.target = torch::randint(10, {rows}, torch::kLong);
  return batch;
}

Model seeded_model(const std::string& title, int layers, uint64_t seed,
                   std::function<torch::nn::Sequential(LayerRange)> build) {
  return Model::of(title, layers, [seed, build = std::move(build)](LayerRange keep) {
    torch::manual_seed(seed);  // every range starts from the same draws: a rank's layers equal one process's
    return build(keep);
  });
}

}  // namespace gpipe::tasks
