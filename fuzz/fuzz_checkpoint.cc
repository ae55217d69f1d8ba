// fuzz_checkpoint: the checkpoint reader behind gpipe train --resume: the digest, the pickled dict,
// names, shapes and dtypes, the generator states and the optimizer state. An input is a mode byte
// and a file. Mode bit 0 set: the file is sealed first (given the digest that matches it), so the
// mutations reach the dict behind the digest. Bits 1-2: the optimizer (sgd, adam, adamw).
// Promises: read_snapshot refuses a bad file with std::runtime_error, before anything changes; a file
// it accepts restores and the optimizer then takes a step.
//
// GPIPE_FUZZ_WRITE_SEEDS=DIR fuzz_checkpoint writes the seed corpus (real checkpoint files of the
// fuzzed model, one per optimizer, sealed and not) into DIR and exits.
#include "fuzz_input.h"

#include <gpipe/io.h>
#include <gpipe/snapshot.h>
#include <gpipe/train.h>

#include <torch/torch.h>

#include <stdexcept>

namespace {

const char* kOptimizers[] = {"sgd", "adam", "adamw"};

struct Model {
  torch::nn::Sequential layers{torch::nn::Linear(3, 4), torch::nn::BatchNorm1d(4), torch::nn::Linear(4, 2)};
  std::unique_ptr<torch::optim::Optimizer> optimizer;

  explicit Model(const std::string& kind) {
    optimizer = gpipe::make_optimizer(gpipe::OptimizerOptions().kind(gpipe::parse_optimizer(kind)).momentum(kind == "sgd" ? 0.9 : 0),
                                      layers->parameters());
  }
  void step() {
    optimizer->zero_grad();
    layers->forward(torch::linspace(-1, 1, 6).view({2, 3})).square().sum().backward();
    optimizer->step();
  }
};

gpipe::TrainState state() {
  gpipe::TrainState s;
  s.step = 1;
  s.shuffle_state = at::detail::createCPUGenerator(7).get_state();
  s.random_state = at::detail::createCPUGenerator(8).get_state();
  return s;
}

void write_seeds(const std::string& dir) {
  for (int k = 0; k < 3; ++k) {
    torch::manual_seed(0);
    Model m(kOptimizers[k]);
    m.step();
    const std::string file = dir + "/" + kOptimizers[k] + ".pt";
    gpipe::save_snapshot(file, {gpipe::encode_snapshot_part(m.layers, *m.optimizer)}, m.layers, std::nullopt,
                         kOptimizers[k], state());
    const std::string sealed = gpipe::read_file(file);
    const std::string body = sealed.substr(0, sealed.size() - gpipe::seal_snapshot("").size());
    std::ofstream(dir + "/" + kOptimizers[k] + "-whole", std::ios::binary) << char(2 * k) << sealed;
    std::ofstream(dir + "/" + kOptimizers[k] + "-body", std::ios::binary) << char(2 * k + 1) << body;
    std::remove(file.c_str());
  }
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  torch::set_num_threads(1);
  if (const char* dir = std::getenv("GPIPE_FUZZ_WRITE_SEEDS")) {
    write_seeds(dir);
    std::exit(0);
  }
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  std::string file = gpipe::fuzz::as_string(data + 1, size - 1);
  if (data[0] & 1) file = gpipe::seal_snapshot(std::move(file));
  const std::string optimizer = kOptimizers[(data[0] >> 1) % 3];
  Model m(optimizer);
  const torch::Tensor before = torch::cat({m.layers[0]->parameters()[0].flatten(), m.layers[2]->parameters()[1]});
  gpipe::Snapshot snapshot;
  try {
    snapshot = gpipe::read_snapshot(gpipe::fuzz::as_file(file), m.layers, optimizer, false);
  } catch (const std::runtime_error&) {
    const torch::Tensor after = torch::cat({m.layers[0]->parameters()[0].flatten(), m.layers[2]->parameters()[1]});
    gpipe::fuzz::promise(torch::equal(before, after), "a refused file changes nothing");
    return 0;
  }
  gpipe::restore_snapshot(snapshot, m.layers, *m.optimizer);
  at::detail::createCPUGenerator().set_state(snapshot.state.shuffle_state);
  at::detail::createCPUGenerator().set_state(snapshot.state.random_state);
  m.step();
  return 0;
}
