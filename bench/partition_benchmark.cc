// partition_benchmark.cc: how long the exact min-max partition takes, up to L = 1000 layers into K = 128 stages.
//
//   build/bench/partition_benchmark --benchmark_out=bench/results/partition.json --benchmark_out_format=json
#include <gpipe/partition.h>

#include <benchmark/benchmark.h>

#include <random>

namespace {

// Random costs in [1, 1000], and the worst case for the variance pass: one
// costly layer among zeros, so every cut point keeps a stage within the bottleneck.
std::vector<double> costs(int layers, bool one_heavy) {
  std::mt19937 rng(7);
  std::vector<double> c(static_cast<size_t>(layers));
  for (double& x : c) x = one_heavy ? 0.0 : 1.0 + static_cast<double>(rng() % 1000);
  if (one_heavy) c[static_cast<size_t>(layers / 2)] = 1.0;
  return c;
}

void BM_BalanceByCost(benchmark::State& state) {
  const auto c = costs(static_cast<int>(state.range(0)), state.range(2) != 0);
  for (auto _ : state) benchmark::DoNotOptimize(gpipe::balance_by_cost(c, static_cast<int>(state.range(1))));
  state.SetLabel(state.range(2) ? "one costly layer among zeros" : "random costs");
}
BENCHMARK(BM_BalanceByCost)
    ->ArgNames({"L", "K", "one_heavy"})
    ->Args({100, 8, 0})
    ->Args({1000, 32, 0})
    ->Args({1000, 128, 0})
    ->Args({1000, 128, 1})
    ->Unit(benchmark::kMillisecond);

}  // namespace

BENCHMARK_MAIN();
