// partition.cc (plan/): even cuts and the checks every balance must pass, the exact min-max cut by
// per-layer cost, and what a cut means for a schedule's step.
#include "gpipe/partition.h"

#include "gpipe/check.h"

#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <functional>
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
              "e.g. {", layers - layers / 2, ", ", layers / 2, "}, or give the devices (K) instead for an even cut");
  for (size_t j = 0; j < balance.size(); ++j)
    GPIPE_CHECK(balance[j] >= 1, "stage ", j, " of balance ", format_balance(balance), " has ", balance[j],
                " layers; every stage needs at least one layer");
  const int sum = std::accumulate(balance.begin(), balance.end(), 0);
  GPIPE_CHECK(sum == layers, "the model and the sum of the balance differ (model: ", layers,
              " layers, sum of balance ", format_balance(balance), ": ", sum,
              "); make the balance add up to ", layers, " or give the devices (K) instead for an even cut");
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

std::vector<int> balance_devices_by_cost(const std::vector<double>& costs, const std::vector<int>& placement) {
  const int S = static_cast<int>(placement.size());
  const int L = static_cast<int>(costs.size());
  // The cut that balances stages: a valid cut (the checks of costs and S are its), and the bound to beat.
  std::vector<int> best = balance_by_cost(costs, S);
  GPIPE_CHECK(*std::min_element(placement.begin(), placement.end()) >= 0, "a placement names devices from 0 up; ",
              "got ", *std::min_element(placement.begin(), placement.end()));
  const int K = *std::max_element(placement.begin(), placement.end()) + 1;
  std::vector<int> stages_on(static_cast<size_t>(K), 0);
  for (int d : placement) ++stages_on[static_cast<size_t>(d)];
  for (int d = 0; d < K; ++d)
    GPIPE_CHECK(stages_on[static_cast<size_t>(d)] > 0, "device ", d, " of the placement runs no stage; give every "
                "device from 0 to ", K - 1, " at least one");
  if (K == S) return best;  // a stage per device: the devices' loads are the stages'

  std::vector<double> P(static_cast<size_t>(L) + 1, 0.0);
  for (int l = 0; l < L; ++l) P[static_cast<size_t>(l) + 1] = P[static_cast<size_t>(l)] + costs[static_cast<size_t>(l)];
  auto cost = [&](int j, int i) { return P[static_cast<size_t>(i)] - P[static_cast<size_t>(j)]; };
  // The devices' loads of a cut, its largest and its sum of squares (the sum is fixed, so the least
  // sum of squares is the least variance): the objective, compared in that order.
  auto score = [&](const std::vector<int>& balance) {
    std::vector<double> load(static_cast<size_t>(K), 0.0);
    for (int s = 0, at = 0; s < S; at += balance[static_cast<size_t>(s)], ++s)
      load[static_cast<size_t>(placement[static_cast<size_t>(s)])] += cost(at, at + balance[static_cast<size_t>(s)]);
    double squares = 0;
    for (double x : load) squares += x * x;
    return std::make_pair(*std::max_element(load.begin(), load.end()), squares);
  };
  std::pair<double, double> bound = score(best);
  // later[s]: whether device d runs a stage after stage s (bit d), to bound what the rest can hold.
  std::vector<std::vector<char>> later(static_cast<size_t>(S), std::vector<char>(static_cast<size_t>(K), 0));
  for (int s = S - 2; s >= 0; --s) {
    later[static_cast<size_t>(s)] = later[static_cast<size_t>(s) + 1];
    later[static_cast<size_t>(s)][static_cast<size_t>(placement[static_cast<size_t>(s) + 1])] = 1;
  }

  // Branch and bound over the cut points, stage by stage: a stage that takes a device past the best
  // cut's largest load ends the branch (a longer stage only costs more), and so does a rest that the
  // devices still to run a stage cannot hold within it. Exact: every cut not visited is no better,
  // unless the budget of branches runs out first (models of hundreds of layers cut in many stages of
  // near-equal cost), which leaves the best cut found.
  std::vector<double> load(static_cast<size_t>(K), 0.0);
  std::vector<int> cut(static_cast<size_t>(S));
  int64_t budget = kDeviceCutBranches;
  std::function<void(int, int)> visit = [&](int s, int at) {
    if (--budget < 0) return;
    const size_t d = static_cast<size_t>(placement[static_cast<size_t>(s)]);
    const int last = s == S - 1 ? L : L - (S - 1 - s);  // leave a layer for each stage after it
    for (int end = s == S - 1 ? L : at + 1; end <= last; ++end) {
      const double mine = load[d] + cost(at, end);
      if (mine > bound.first) break;
      cut[static_cast<size_t>(s)] = end - at;
      if (s == S - 1) {
        load[d] = mine;
        const std::pair<double, double> now = score(cut);
        if (now < bound) {
          bound = now;
          best = cut;
        }
        load[d] = mine - cost(at, end);
        continue;
      }
      double room = 0;
      for (int e = 0; e < K; ++e)
        if (later[static_cast<size_t>(s)][static_cast<size_t>(e)])
          room += bound.first - (static_cast<size_t>(e) == d ? mine : load[static_cast<size_t>(e)]);
      if (room < cost(end, L)) continue;  // a longer stage leaves less: it may yet fit
      const double before = load[d];
      load[d] = mine;
      visit(s + 1, end);
      load[d] = before;
    }
  };
  visit(0, 0);
  return best;
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

PartitionPlan plan_partition(const std::vector<double>& costs, const std::vector<int>& balance,
                             const Schedule& schedule) {
  GPIPE_CHECK(static_cast<int>(balance.size()) == schedule.stages, "the balance ", format_balance(balance), " has ",
              balance.size(), " stages but the schedule runs ", schedule.stages);
  PartitionPlan plan;
  plan.balance = balance;
  plan.stage_costs = stage_costs(costs, balance);
  plan.schedule = schedule.name;
  plan.micro_batches = schedule.micro_batches;
  const auto slowest = std::max_element(plan.stage_costs.begin(), plan.stage_costs.end());
  plan.bottleneck_stage = static_cast<int>(slowest - plan.stage_costs.begin());
  plan.bottleneck = *slowest;
  // A stage's F takes a third of its cost and its B the rest (I and W a third each), as balanced_cost.
  const CostFn cost = [&](const Action& a) {
    const double c = plan.stage_costs[static_cast<size_t>(a.stage)], third = c / 3;
    switch (a.kind) {
      case ActionKind::kForward: return third;
      case ActionKind::kBackward: return c - third;
      case ActionKind::kInputGrad: return third;
      case ActionKind::kWeightGrad: return c - 2 * third;
      default: return 0.0;
    }
  };
  plan.predicted_step = simulate(schedule, cost).makespan;
  const double K = schedule.devices, M = schedule.micro_batches;
  const double total = std::accumulate(plan.stage_costs.begin(), plan.stage_costs.end(), 0.0);
  plan.predicted_efficiency = plan.predicted_step > 0 ? M * total / (K * plan.predicted_step) : 0.0;
  plan.balanced_efficiency = ideal_speedup(schedule) / K;
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
  out << "bottleneck: stage " << plan.bottleneck_stage << ", " << show(plan.bottleneck);
  if (unit != "s") return out.str() + "\n";  // a step prediction needs costs in time
  out << " per micro-batch\npredicted step: " << show(plan.predicted_step) << " for M=" << plan.micro_batches
      << " (" << plan.schedule << " simulated, F 1/3 and B 2/3 of a stage), pipeline efficiency " << std::fixed
      << std::setprecision(1) << 100 * plan.predicted_efficiency << "% (balanced stages: "
      << 100 * plan.balanced_efficiency << "%)\n";
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
