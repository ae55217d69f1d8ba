// backward_split_benchmark.cc: one layer's backward (B) against its split into I then W, the
// work zero-bubble schedules divide: the benchmark workloads' layers, one micro-batch each.
//
//   build/bench/backward_split_benchmark --benchmark_out=bench/results/backward-split.json --benchmark_out_format=json
#include "runtime/backward_split.h"

#include <gpipe/gpipe.h>
#include <torch/torch.h>

#include <benchmark/benchmark.h>

namespace {

struct Case {
  torch::nn::AnyModule layer;
  torch::Tensor input;
};

// 0: mlp's Linear(1024, 1024) on 8 rows (M = 32); 1: transformer's encoder block on 1 sequence of 64 tokens.
Case make_case(int which) {
  torch::manual_seed(0);
  at::set_num_threads(1);
  gpipe::set_blas_threads(1);
  gpipe::keep_freed_memory();  // as every pipeline does
  if (which == 0) {
    torch::nn::Linear linear(1024, 1024);
    return {torch::nn::AnyModule(linear), torch::randn({8, 1024})};
  }
  gpipe::EncoderBlock block(256, 8, 1024, 0.0);
  return {torch::nn::AnyModule(block), torch::randn({1, 64, 256})};
}

void Backward(benchmark::State& state) {
  Case c = make_case(static_cast<int>(state.range(0)));
  for (auto _ : state) {
    state.PauseTiming();  // the forward is not the backward's work
    const torch::Tensor x = c.input.detach().requires_grad_(true);
    const torch::Tensor y = c.layer.forward(x);
    const torch::Tensor g = torch::ones_like(y);
    state.ResumeTiming();
    y.backward(g);
    benchmark::DoNotOptimize(x.grad());
  }
}

void InputThenWeight(benchmark::State& state) {
  Case c = make_case(static_cast<int>(state.range(0)));
  for (auto _ : state) {
    state.PauseTiming();
    const torch::Tensor x = c.input.detach().requires_grad_(true);
    const torch::Tensor y = c.layer.forward(x);
    const torch::Tensor g = torch::ones_like(y);
    state.ResumeTiming();
    gpipe::detail::WeightBackward w;
    benchmark::DoNotOptimize(gpipe::detail::WeightBackward::input_backward(y, x, g, w));
    w.run();
  }
}

}  // namespace

BENCHMARK(Backward)->Arg(0)->Arg(1)->ArgName("layer(0=linear,1=encoder)")->Unit(benchmark::kMicrosecond);
BENCHMARK(InputThenWeight)->Arg(0)->Arg(1)->ArgName("layer(0=linear,1=encoder)")->Unit(benchmark::kMicrosecond);
BENCHMARK_MAIN();
