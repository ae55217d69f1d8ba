// memory_claim.cc: the paper's memory claim, measured against predicted.
//
// GPipe (Huang et al., 2018): with re-materialization a stage's peak activation
// memory is O(N + (L/K)·(N/M)) — the boundary tensors of all N samples, plus one
// micro-batch's activations of the stage's L/K layers while its forward is
// recomputed — instead of O(N·L/K) per stage (O(N·L) for the model) without it.
//
// This program measures, with gpipe's tracking allocator, the peak bytes each
// stage allocates in a training step (gradients are allocated before the step
// and count with the parameters; see Pipeline::DeviceMemory), and compares the largest stage with the formula, whose
// constants are measured once per stage on a probe of 64 samples:
//
//   always: out·N·[not last stage] + a_stage · ⌈N/M⌉
//   never:  a_stage · N
//
// a_stage: bytes per sample that the stage's forward keeps for backward (what
// autograd saved, and the output), which grows with its L/K layers; out: bytes
// per sample of the stage's output, which the next stage keeps as its input (and
// which the stage that allocated it is charged for). Buffers that backward needs
// for one micro-batch at a time are not in the formula: they are O(N/M) too.
//
// Usage: memory_claim [RESULTS.json]   (default bench/results/memory-claim.json)
#include <gpipe/gpipe.h>
#include <torch/torch.h>

#include <nlohmann/json.hpp>

#include <cmath>
#include <iomanip>
#include <iostream>

namespace {

constexpr int64_t kWidth = 128, kBlocks = 16, kBatch = 4096;

torch::nn::Sequential make_model() {
  torch::manual_seed(0);
  torch::nn::Sequential model;
  for (int b = 0; b < kBlocks; ++b) {
    model->push_back(torch::nn::Linear(kWidth, kWidth));
    model->push_back(torch::nn::ReLU());
  }
  return model;
}

double mib(double bytes) { return bytes / (1 << 20); }

// Bytes per sample that layers [first, last) keep after their forward on `probe`.
double kept_per_sample(torch::nn::Sequential model, int first, int last, const torch::Tensor& probe) {
  auto counter = std::make_shared<gpipe::MemoryCounter>("probe");
  torch::Tensor h = probe;
  int64_t kept = 0;
  {
    gpipe::MemoryScope scope(counter);
    const int64_t before = counter->current_bytes();
    for (int l = first; l < last; ++l) h = (*(model->begin() + l)).forward(h);
    kept = counter->current_bytes() - before;  // h, the output, is still alive
  }
  return static_cast<double>(kept) / static_cast<double>(probe.size(0));
}

}  // namespace

int main(int argc, char** argv) {
  const std::string results = argc > 1 ? argv[1] : "bench/results/memory-claim.json";
  at::set_num_threads(1);
  gpipe::enable_memory_tracking();
  torch::manual_seed(1);
  const torch::Tensor x = torch::randn({kBatch, kWidth}), y = torch::randn({kBatch, kWidth});

  const torch::nn::Sequential probe_model = make_model();
  const torch::Tensor probe = x.narrow(0, 0, 64);
  const double out_per_sample = kWidth * 4.0;
  const int L = static_cast<int>(probe_model->size());
  const double whole = kept_per_sample(probe_model, 0, L, probe);

  std::cout << "memory_claim: " << kBlocks << " x [Linear(" << kWidth << ", " << kWidth << "), ReLU] = " << L
            << " layers, N = " << kBatch << "; the whole model keeps " << whole << " B per sample ("
            << whole / L << " per layer)\n"
            << "peak activation MiB of the largest stage\n"
            << std::setw(3) << "K" << std::setw(5) << "M" << std::setw(9) << "mode" << std::setw(11) << "measured"
            << std::setw(11) << "predicted" << std::setw(8) << "ratio" << std::setw(14) << "N term" << std::setw(18)
            << "(L/K)(N/M) term" << "\n";
  nlohmann::json rows_json = nlohmann::json::array();
  for (int K : {1, 2, 4})
    for (const char* mode_name : {"never", "always"})
      for (int M : {1, 2, 4, 8, 16, 32}) {
        const gpipe::Checkpoint mode = gpipe::parse_checkpoint(mode_name);
        if (mode == gpipe::Checkpoint::kNever && M != 1 && M != 16) continue;  // never does not depend on M
        torch::nn::Sequential model = make_model();
        gpipe::Pipeline pipe(model, gpipe::PipelineOptions().devices(K).micro_batches(M).checkpoint(mode).track_memory(true));
        double measured = 0, predicted = 0, n_term = 0, lk_term = 0;
        for (int step = 0; step < 2; ++step) {  // the second step is measured
          for (auto p : pipe.parameters()) p.mutable_grad() = torch::Tensor();
          pipe.train_step(x, y, gpipe::mse_loss);
        }
        const auto memory = pipe.memory();
        const std::vector<int> offsets = gpipe::stage_offsets(pipe.balance());
        const double micro = std::ceil(static_cast<double>(kBatch) / M);
        for (int j = 0; j < K; ++j) {
          const double got = static_cast<double>(memory[static_cast<size_t>(j)].peak_bytes);
          const double layers =
              kept_per_sample(probe_model, offsets[static_cast<size_t>(j)], offsets[static_cast<size_t>(j) + 1], probe);
          const double boundary = j < K - 1 ? out_per_sample * kBatch : 0.0;
          const double expect = mode == gpipe::Checkpoint::kAlways ? boundary + layers * micro : layers * kBatch;
          if (got > measured) {
            measured = got;
            predicted = expect;
            n_term = mode == gpipe::Checkpoint::kAlways ? boundary : 0.0;
            lk_term = mode == gpipe::Checkpoint::kAlways ? layers * micro : layers * kBatch;
          }
        }
        std::cout << std::setw(3) << K << std::setw(5) << M << std::setw(9) << mode_name << std::fixed
                  << std::setprecision(2) << std::setw(11) << mib(measured) << std::setw(11) << mib(predicted)
                  << std::setw(8) << measured / predicted << std::setw(14) << mib(n_term) << std::setw(18)
                  << mib(lk_term) << std::endl;
        rows_json.push_back({{"stages", K},
                             {"micro_batches", M},
                             {"checkpoint", mode_name},
                             {"measured_bytes", measured},
                             {"predicted_bytes", predicted},
                             {"ratio", measured / predicted},
                             {"n_term_bytes", n_term},
                             {"layers_term_bytes", lk_term}});
      }
  const nlohmann::json doc = {{"command", "memory_claim"},
                              {"model", std::to_string(kBlocks) + " x [Linear(" + std::to_string(kWidth) + "), ReLU]"},
                              {"batch", kBatch},
                              {"kept_bytes_per_sample", whole},
                              {"blas", gpipe::blas_info()},
                              {"libtorch", TORCH_VERSION},
                              {"results", rows_json}};
  gpipe::write_file_atomically(results, doc.dump(2) + "\n");
  std::cerr << "results written to " << results << "\n";
  return 0;
}
