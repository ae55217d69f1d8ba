// train_fashion_mnist.cc: what `gpipe train` does, with the library alone: the CNN trained on
// Fashion-MNIST over 2 pipeline stages, saved after its first epoch, resumed by a new trainer, and
// compared with a run that never stopped: the parameters are the same, bit for bit.
//
//   build/examples/example_train_fashion_mnist [TRAINING_SAMPLES [DATA_DIR]]   (default: all 60000)
#include <gpipe/gpipe.h>
#include <torch/torch.h>

#include <cstdio>
#include <iostream>
#include <string>

namespace {

// Trains with `options`, resuming from `resume` if given; prints each epoch's test accuracy.
torch::nn::Sequential train(const gpipe::TrainerOptions& options, const gpipe::Dataset& data,
                            const gpipe::Dataset& test, const std::string& resume = "") {
  // The model: every build draws the same initial values (seed 0).
  const gpipe::Model cnn = gpipe::Model::of("CNN", gpipe::kFashionCnnLayers, [](gpipe::LayerRange keep) {
    torch::manual_seed(0);
    return gpipe::fashion_cnn(keep);
  });
  // 2 devices (a thread and a core each), layers {0-2} and {3-10}, 4 micro-batches per batch.
  const auto pipeline = gpipe::PipelineOptions().balance({3, 8}).micro_batches(4).checkpoint(gpipe::Checkpoint::kNever);
  gpipe::Trainer trainer(cnn, pipeline, options, data);
  if (!resume.empty()) {
    trainer.resume(resume);
    std::cout << "  resumed at step " << trainer.step() << "\n";
  }
  gpipe::TrainerCallbacks callbacks;
  callbacks.after_epoch = [&](int epoch) {
    const gpipe::Evaluation e = trainer.evaluate(test);
    std::printf("  epoch %d: loss %.4f, test accuracy %.2f%%\n", epoch, trainer.stats().last_loss,
                100 * e.accuracy);
  };
  trainer.fit(callbacks);
  return trainer.pipeline().layers();
}

}  // namespace

int main(int argc, char** argv) {
  const int64_t samples = argc > 1 ? std::stoll(argv[1]) : 0;
  const std::string dir = argc > 2 ? argv[2] : gpipe::kFashionMnistDir;
  const gpipe::Dataset data = gpipe::load_fashion_mnist(dir, /*train=*/true, samples);
  const gpipe::Dataset test = gpipe::load_fashion_mnist(dir, /*train=*/false, 2000);

  // Adam at 1e-3, batches of 128 shuffled each epoch, 2 epochs.
  const auto options = gpipe::TrainerOptions()
                           .optimizer(gpipe::OptimizerOptions().kind(gpipe::OptimizerKind::kAdam).lr(1e-3))
                           .batch_size(128)
                           .epochs(2);
  std::cout << "an unbroken run of 2 epochs on " << data.size() << " samples:\n";
  const torch::nn::Sequential unbroken = train(options, data, test);

  const std::string path = "train_fashion_mnist_example.pt";
  std::cout << "a run stopped after epoch 1 (saved to " << path << "), then resumed:\n";
  train(gpipe::TrainerOptions(options).epochs(1).save(path), data, test);
  const torch::nn::Sequential resumed = train(gpipe::TrainerOptions(options).save(path), data, test, path);
  std::remove(path.c_str());

  // Parameter by parameter, the resumed run against the unbroken one.
  const auto a = unbroken->named_parameters(), b = resumed->named_parameters();
  int differ = 0;
  for (const auto& p : a) {
    const torch::Tensor& q = b[p.key()];
    if (!torch::equal(p.value(), q)) {
      ++differ;
      std::cout << "  " << p.key() << " differs by up to " << (p.value() - q).abs().max().item<double>() << "\n";
    }
  }
  std::cout << (differ == 0 ? "the resumed run ends with the unbroken run's parameters, bit for bit ("
                            : "FAILED: parameters differ (")
            << a.size() << " tensors compared)\n";
  return differ == 0 ? 0 : 1;
}
