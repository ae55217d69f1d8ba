// quickstart.cc: train a model through a 2-stage GPipe pipeline and check it matches one device.
#include <gpipe/gpipe.h>
#include <torch/torch.h>

#include <iostream>

int main() {
  torch::manual_seed(0);
  auto model = torch::nn::Sequential(torch::nn::Linear(32, 64), torch::nn::ReLU(), torch::nn::Linear(64, 64),
                                     torch::nn::ReLU(), torch::nn::Linear(64, 1));

  // 2 devices (one CPU core each, a stage each), every mini-batch split into 4 micro-batches,
  // activations re-materialized in backward except for the last micro-batch.
  gpipe::Pipeline pipe(model, gpipe::PipelineOptions().devices(2).micro_batches(4).checkpoint(
                                  gpipe::Checkpoint::kExceptLast));
  torch::optim::SGD sgd(pipe.parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));

  const torch::Tensor x = torch::randn({256, 32});
  const torch::Tensor y = x.sum(1, /*keepdim=*/true).sin();
  for (int step = 1; step <= 200; ++step) {
    sgd.zero_grad();
    torch::Tensor loss = pipe.train_step(x, y, gpipe::mse_loss);  // grads of the whole batch
    sgd.step();
    if (step % 50 == 0)
      std::cout << "step " << step << "  loss " << loss.item<double>() << "  bubble "
                << pipe.last_trace().bubble() << "\n";
  }
  std::cout << gpipe::format_grid(pipe.schedule());
  return 0;
}
