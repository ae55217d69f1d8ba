// unet.cc: a U-Net (models.h) that denoises Fashion-MNIST images, its long skips crossing stages.
#include "tasks/builtin.h"

#include "gpipe/models.h"

#include <torch/torch.h>

namespace gpipe::tasks {

namespace {
// The task: images with Gaussian noise of this standard deviation in pixel values (0 black,
// 1 white), to be made clean again.
constexpr double kUnetNoise = 0.3;
}  // namespace

Task unet() {
  Task t;
  t.name = "unet";
  t.title = "U-Net";
  t.summary = "a U-Net that denoises Fashion-MNIST images (noise of standard deviation 0.3), 29 layers; PSNR";
  t.layers = kFashionUnetLayers;
  t.scoring = psnr_scoring();
  t.denoises = true;
  t.loss = mse_loss;
  t.loss_name = "mse";
  t.data_dir = kFashionMnistDir;
  t.defaults.epochs = 2;
  t.model = [](const TaskOptions& o) { return seeded_model("U-Net", kFashionUnetLayers, o.seed(), fashion_unet); };
  t.data = [](const TaskOptions& o) {
    TaskData d = fashion_data(o);
    // Noisy images in, the clean ones out; the noise fixed by the seed.
    d.train = {add_noise(d.train.input, kUnetNoise, o.seed() ^ 0x6e6f697365ull), d.train.input};
    d.test = {add_noise(d.test.input, kUnetNoise, o.seed() ^ 0x74657374ull), d.test.input};
    d.noisy_psnr_db = psnr_db(torch::mse_loss(d.test.input, d.test.target).item<double>());
    return d;
  };
  t.batch = workload_batch("unet");
  return t;
}

}  // namespace gpipe::tasks
