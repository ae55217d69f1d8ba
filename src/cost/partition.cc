// partition.cc: even cuts and the checks every balance must pass.
#include "gpipe/partition.h"

#include "gpipe/check.h"
#include "gpipe/memory.h"

#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <iomanip>
#include <limits>
#include <numeric>
#include <sstream>

namespace gpipe {

std::string format_balance(const std::vector<int>& balance) {
  std::ostringstream out;
  out << '{';
  for (size_t j = 0; j < balance.size(); ++j) out << (j ? ", " : "") << balance[j];
  out << '}';
  return out.str();
}

std::vector<int> even_balance(int layers, int stages) {
  GPIPE_CHECK(layers >= 1, "the model is empty (0 layers); give the pipeline a torch::nn::Sequential "
              "with at least one layer");
  GPIPE_CHECK(stages >= 1, "the number of stages must be at least 1 (got ", stages, ")");
  GPIPE_CHECK(stages <= layers, "cannot cut ", layers, " layers into ", stages,
              " stages: every stage needs at least one layer; use at most ", layers, " stages");
  std::vector<int> balance(static_cast<size_t>(stages), layers / stages);
  for (int j = 0; j < layers % stages; ++j) balance[static_cast<size_t>(j)] += 1;
  return balance;
}

void check_balance(const std::vector<int>& balance, int layers) {
  GPIPE_CHECK(!balance.empty(), "the balance is empty; give the number of layers of each stage, "
              "e.g. {", layers - layers / 2, ", ", layers / 2, "}, or set stages instead");
  for (size_t j = 0; j < balance.size(); ++j)
    GPIPE_CHECK(balance[j] >= 1, "stage ", j, " of balance ", format_balance(balance), " has ", balance[j],
                " layers; every stage needs at least one layer");
  const int sum = std::accumulate(balance.begin(), balance.end(), 0);
  GPIPE_CHECK(sum == layers, "the model and the sum of the balance differ (model: ", layers,
              " layers, sum of balance ", format_balance(balance), ": ", sum,
              "); make the balance add up to ", layers, " or set stages to split evenly");
}

std::vector<int> balance_by_cost(const std::vector<double>& costs, int stages) {
  const int L = static_cast<int>(costs.size());
  const int K = stages;
  GPIPE_CHECK(L >= 1, "no layer costs given; give one cost per layer");
  GPIPE_CHECK(K >= 1, "the number of stages must be at least 1 (got ", K, ")");
  GPIPE_CHECK(K <= L, "cannot cut ", L, " layers into ", K,
              " stages: every stage needs at least one layer; use at most ", L, " stages");
  for (int l = 0; l < L; ++l)
    GPIPE_CHECK(std::isfinite(costs[static_cast<size_t>(l)]) && costs[static_cast<size_t>(l)] >= 0,
                "the cost of layer ", l, " is ", costs[static_cast<size_t>(l)],
                "; costs must be finite and not negative");

  // P[i]: the cost of the first i layers. A stage of layers [j, i) costs P[i] - P[j];
  // both passes compute it the same way, so the bound below compares exactly.
  std::vector<double> P(static_cast<size_t>(L) + 1, 0.0);
  for (int l = 0; l < L; ++l) P[static_cast<size_t>(l) + 1] = P[static_cast<size_t>(l)] + costs[static_cast<size_t>(l)];
  auto cost = [&](int j, int i) { return P[static_cast<size_t>(i)] - P[static_cast<size_t>(j)]; };
  const double inf = std::numeric_limits<double>::infinity();
  auto at = [L](int k, int i) { return static_cast<size_t>(k) * (static_cast<size_t>(L) + 1) + static_cast<size_t>(i); };

  // Pass 1, the bottleneck: B[k][i] = the least largest stage cost of the first
  // i layers in k stages. B[k-1][j] grows with j and cost(j, i) shrinks, so the
  // best j is where they cross: a binary search.
  std::vector<double> B(static_cast<size_t>(K + 1) * (static_cast<size_t>(L) + 1), inf);
  for (int i = 1; i <= L; ++i) B[at(1, i)] = cost(0, i);
  for (int k = 2; k <= K; ++k)
    for (int i = k; i <= L; ++i) {
      int lo = k - 1, hi = i - 1;  // first j in [lo, hi] with B[k-1][j] >= cost(j, i)
      while (lo < hi) {
        const int mid = (lo + hi) / 2;
        if (B[at(k - 1, mid)] >= cost(mid, i)) hi = mid; else lo = mid + 1;
      }
      double best = std::max(B[at(k - 1, lo)], cost(lo, i));
      if (lo > k - 1) best = std::min(best, std::max(B[at(k - 1, lo - 1)], cost(lo - 1, i)));
      B[at(k, i)] = best;
    }
  const double bottleneck = B[at(K, L)];

  // Pass 2, the variance: among cuts whose every stage is within the
  // bottleneck, the least sum of squared stage costs (the sum is fixed, so this
  // is the least variance). S[k][i] as B, with the chosen cut in from[k][i].
  std::vector<double> S(B.size(), inf);
  std::vector<int> from(B.size(), -1);
  for (int i = 1; i <= L; ++i)
    if (cost(0, i) <= bottleneck) S[at(1, i)] = cost(0, i) * cost(0, i);
  for (int k = 2; k <= K; ++k)
    for (int i = k; i <= L; ++i)
      for (int j = i - 1; j >= k - 1 && cost(j, i) <= bottleneck; --j) {
        const double s = S[at(k - 1, j)] + cost(j, i) * cost(j, i);
        if (s < S[at(k, i)]) {
          S[at(k, i)] = s;
          from[at(k, i)] = j;
        }
      }

  std::vector<int> balance(static_cast<size_t>(K));
  for (int k = K, i = L; k >= 1; --k) {
    const int j = k == 1 ? 0 : from[at(k, i)];
    balance[static_cast<size_t>(k) - 1] = i - j;
    i = j;
  }
  return balance;
}

std::vector<double> stage_costs(const std::vector<double>& costs, const std::vector<int>& balance) {
  check_balance(balance, static_cast<int>(costs.size()));
  std::vector<double> out;
  size_t l = 0;
  for (int n : balance) {
    double sum = 0;
    for (int m = 0; m < n; ++m) sum += costs[l++];
    out.push_back(sum);
  }
  return out;
}

PartitionPlan plan_partition(const std::vector<double>& costs, const std::vector<int>& balance, int micro_batches) {
  GPIPE_CHECK(micro_batches >= 1, "micro_batches must be at least 1 (got ", micro_batches, ")");
  PartitionPlan plan;
  plan.balance = balance;
  plan.stage_costs = stage_costs(costs, balance);
  plan.micro_batches = micro_batches;
  const auto slowest = std::max_element(plan.stage_costs.begin(), plan.stage_costs.end());
  plan.bottleneck_stage = static_cast<int>(slowest - plan.stage_costs.begin());
  plan.bottleneck = *slowest;
  const double K = static_cast<double>(balance.size()), M = micro_batches;
  const double total = std::accumulate(plan.stage_costs.begin(), plan.stage_costs.end(), 0.0);
  plan.predicted_step = (M + K - 1) * plan.bottleneck;
  plan.predicted_efficiency = plan.predicted_step > 0 ? M * total / (K * plan.predicted_step) : 0.0;
  return plan;
}

std::string format_plan(const PartitionPlan& plan, const std::string& unit) {
  auto show = [&unit](double cost) {
    std::ostringstream out;
    out << std::fixed << std::setprecision(2);
    if (unit == "s")
      out << cost * 1e3 << " ms";
    else if (unit == "bytes")
      out << cost / (1 << 20) << " MiB";
    else
      out << std::setprecision(0) << cost << " " << unit;
    return out.str();
  };
  const double total = std::accumulate(plan.stage_costs.begin(), plan.stage_costs.end(), 0.0);
  std::ostringstream out;
  out << "stage  " << std::left << std::setw(12) << "layers" << std::right << std::setw(12) << "cost" << std::setw(9)
      << "share" << "\n";
  int first = 0;
  for (size_t j = 0; j < plan.balance.size(); ++j) {
    const int n = plan.balance[j];
    std::ostringstream layers;
    layers << first << "-" << first + n - 1 << " (" << n << ")";
    out << std::setw(5) << j << "  " << std::left << std::setw(12) << layers.str() << std::right << std::setw(12)
        << show(plan.stage_costs[j]) << std::fixed << std::setprecision(1) << std::setw(8)
        << (total > 0 ? 100 * plan.stage_costs[j] / total : 0.0) << "%"
        << (static_cast<int>(j) == plan.bottleneck_stage ? "  <- bottleneck" : "") << "\n";
    first += n;
  }
  const int K = static_cast<int>(plan.balance.size()), M = plan.micro_batches;
  out << "bottleneck: stage " << plan.bottleneck_stage << ", " << show(plan.bottleneck);
  if (unit != "s") return out.str() + "\n";  // a step prediction needs costs in time
  out << " per micro-batch\npredicted step: " << show(plan.predicted_step) << " for M=" << M
      << " ((M+K-1) x bottleneck), pipeline efficiency " << std::fixed << std::setprecision(1)
      << 100 * plan.predicted_efficiency << "% (balanced stages: " << 100.0 * M / (M + K - 1) << "%)\n";
  return out.str();
}

std::vector<double> parameter_costs(const torch::nn::Sequential& model) {
  std::vector<double> costs;
  for (const auto& layer : model->children()) {
    int64_t count = 0;
    for (const auto& p : layer->parameters()) count += p.numel();
    costs.push_back(static_cast<double>(count));
  }
  return costs;
}

std::vector<double> time_costs(const torch::nn::Sequential& model, const torch::Tensor& sample,
                               int threads, int warmup, int repetitions) {
  GPIPE_CHECK(repetitions >= 1, "time_costs needs at least 1 repetition (got ", repetitions, ")");
  GPIPE_CHECK(threads >= 1, "time_costs needs at least 1 thread (got ", threads, ")");
  const int previous_threads = at::get_num_threads();
  at::set_num_threads(threads);
  const size_t L = model->size();
  std::vector<std::vector<double>> seconds(L);
  using clock = std::chrono::steady_clock;
  torch::nn::Sequential layers = model;  // a handle to the same modules, to call them
  for (int rep = 0; rep < warmup + repetitions; ++rep) {
    torch::Tensor x = sample;
    size_t l = 0;
    for (auto it = layers->begin(); it != layers->end(); ++it, ++l) {
      torch::Tensor in = x.detach();
      if (in.is_floating_point()) in.requires_grad_(true);
      const auto begin = clock::now();
      torch::Tensor out = it->forward(in);
      if (out.requires_grad()) out.backward(torch::ones_like(out));
      const auto end = clock::now();
      if (rep >= warmup) seconds[l].push_back(std::chrono::duration<double>(end - begin).count());
      x = out.detach();
    }
  }
  for (const auto& p : model->parameters()) p.mutable_grad() = torch::Tensor();  // profiling leaves no grads
  at::set_num_threads(previous_threads);
  std::vector<double> costs;
  for (auto& s : seconds) {
    std::sort(s.begin(), s.end());
    costs.push_back(s[s.size() / 2]);
  }
  return costs;
}

std::vector<double> memory_costs(const torch::nn::Sequential& model, const torch::Tensor& sample,
                                 double state_scale) {
  GPIPE_CHECK(state_scale >= 0 && std::isfinite(state_scale), "state_scale must be finite and not negative (got ",
              state_scale, "); use 1 for SGD, 2 for SGD with momentum, 3 for Adam");
  enable_memory_tracking();
  auto counter = std::make_shared<MemoryCounter>("memory_costs");
  std::vector<double> costs;
  torch::Tensor x = sample;
  torch::nn::Sequential layers = model;  // a handle to the same modules, to call them
  for (auto it = layers->begin(); it != layers->end(); ++it) {
    torch::Tensor in = x.detach();
    if (in.is_floating_point()) in.requires_grad_(true);
    int64_t kept = 0;
    {
      MemoryScope scope(counter);
      const int64_t before = counter->current_bytes();
      torch::Tensor out = it->forward(in);
      kept = counter->current_bytes() - before;  // the output and what its graph saved
      x = out.detach();
    }
    int64_t parameter_bytes = 0;
    for (const auto& p : it->ptr()->parameters())
      parameter_bytes += p.numel() * static_cast<int64_t>(p.element_size());
    costs.push_back(static_cast<double>(kept) + static_cast<double>(parameter_bytes) * (1.0 + state_scale));
  }
  return costs;
}

std::vector<double> costs_from(const torch::nn::Sequential& model,
                               const std::function<double(size_t, torch::nn::Module&)>& cost) {
  std::vector<double> costs;
  size_t index = 0;
  for (const auto& layer : model->children()) costs.push_back(cost(index++, *layer));
  return costs;
}

std::vector<int> stage_offsets(const std::vector<int>& balance) {
  std::vector<int> offsets{0};
  for (int n : balance) offsets.push_back(offsets.back() + n);
  return offsets;
}

}  // namespace gpipe
