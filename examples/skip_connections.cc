// skip_connections.cc: a small U-Net whose long skip crosses stages: the encoder's features are
// stashed on stage 0 and popped on stage 2, sent there directly, not through stage 1.
#include <gpipe/gpipe.h>
#include <torch/torch.h>

#include <iostream>

namespace nn = torch::nn;

nn::Conv2d conv(int64_t in, int64_t out) { return nn::Conv2d(nn::Conv2dOptions(in, out, 3).padding(1)); }

int main() {
  torch::manual_seed(0);
  nn::Sequential unet(conv(1, 8), nn::ReLU(),                                 // stage 0
                      gpipe::Stash("full"),                                     //   keeps 8 x 16 x 16
                      nn::MaxPool2d(2), conv(8, 16), nn::ReLU(),                // stage 1: 16 x 8 x 8
                      nn::Upsample(nn::UpsampleOptions().scale_factor(std::vector<double>{2, 2})),
                      conv(16, 8), nn::ReLU(),                                  // stage 2
                      gpipe::Pop("full", gpipe::concat_skip),                   //   8 + 8 channels
                      nn::Conv2d(nn::Conv2dOptions(16, 1, 1)));

  gpipe::Pipeline pipe(unet, gpipe::PipelineOptions().balance({3, 4, 4}).micro_batches(4));
  std::cout << "skip connections between stages (from -> to):";
  for (const gpipe::SkipRoute& r : pipe.schedule().skips) std::cout << " " << r.from << " -> " << r.to;
  std::cout << "\n";

  // Denoising: the clean image is a smooth pattern, the input that plus noise.
  const torch::Tensor grid = torch::linspace(0, 3.14159, 16);
  const torch::Tensor clean = (torch::sin(grid).unsqueeze(1) * torch::cos(grid).unsqueeze(0)).expand({64, 1, 16, 16});
  torch::optim::Adam adam(pipe.parameters(), 0.01);
  for (int step = 1; step <= 100; ++step) {
    const torch::Tensor noisy = clean + 0.3 * torch::randn_like(clean);
    adam.zero_grad();
    const torch::Tensor loss = pipe.train_step(noisy, clean, gpipe::mse_loss);
    adam.step();
    if (step % 25 == 0) std::cout << "step " << step << "  mse " << loss.item<double>() << "\n";
  }
  std::cout << gpipe::format_grid(pipe.schedule());
  return 0;
}
