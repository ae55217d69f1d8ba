// main.cc: a two-stage pipeline step through the installed package.
#include <gpipe/gpipe.h>
#include <torch/torch.h>

#include <iostream>

int main() {
  auto model = torch::nn::Sequential(torch::nn::Linear(4, 8), torch::nn::ReLU(), torch::nn::Linear(8, 2));
  gpipe::Pipeline pipe(model, gpipe::PipelineOptions().devices(2).micro_batches(2));
  auto loss = pipe.train_step(torch::randn({4, 4}), torch::randn({4, 2}), gpipe::mse_loss);
  std::cout << "installed gpipe ran a step, loss " << loss.item<double>() << "\n";
  return 0;
}
