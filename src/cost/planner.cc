// planner.cc: search_plans: every configuration of a cluster, cut, planned, predicted and sorted.
#include "gpipe/planner.h"

#include "gpipe/check.h"
#include "gpipe/microbatch.h"
#include "gpipe/partition.h"
#include "gpipe/plan.h"
#include "gpipe/transport.h"

#include <algorithm>
#include <functional>
#include <limits>
#include <numeric>
#include <stdexcept>

namespace gpipe {
namespace {

// The cut of the model: blocks evenly (lead layers with the first stage, tail layers with the
// last), or the min-max cut of layer times.
CutRequest search_cut(const CostModel& costs, const PlanSearch& search) {
  if (search.given_cut) return search.cut;
  if (search.blocks > 0) return CutRequest::blocks(std::vector<int>(static_cast<size_t>(search.blocks), 1), search.lead, search.tail);
  std::vector<double> time;
  for (const LayerCost& c : costs.layers) time.push_back(c.forward_s + c.backward_s);
  return CutRequest::by_cost(time);
}

// The layers after which no stage may end: their output passes more tensors than a boundary's
// message carries (kMostBoundaryTensors).
std::vector<bool> uncuttable_after(const CostModel& costs) {
  std::vector<bool> out;
  for (const LayerCost& c : costs.layers) out.push_back(c.output_tensors > kMostBoundaryTensors);
  return out;
}

// Whether no stage of `balance` ends after an uncuttable layer (the model's last layer ends none).
bool cuttable(const std::vector<int>& balance, const std::vector<bool>& uncuttable) {
  const std::vector<int> offsets = stage_offsets(balance);
  for (size_t s = 1; s + 1 < offsets.size(); ++s)
    if (uncuttable[static_cast<size_t>(offsets[s] - 1)]) return false;
  return true;
}

// The skip connections of the model `costs` profiled: simulated where they cross stages (their
// transfers and memory).
std::vector<SkipConnection> skip_connections_of(const CostModel& costs) {
  std::vector<SkipConnection> skips;
  for (const SkipCost& skip : costs.skips) skips.push_back(skip.connection);
  return skips;
}

// The min-max cut by `cost` into `stages` stages that ends no stage after an uncuttable layer: the
// layers joined across those boundaries are cut as one; empty when too few such groups remain.
std::vector<int> cut_around(const std::vector<double>& cost, const std::vector<bool>& uncuttable, int stages) {
  std::vector<double> group_cost;
  std::vector<int> group_layers;
  for (size_t l = 0; l < cost.size(); ++l) {
    if (l == 0 || !uncuttable[l - 1]) group_cost.push_back(0), group_layers.push_back(0);  // a stage may begin here
    group_cost.back() += cost[l];
    group_layers.back() += 1;
  }
  if (static_cast<int>(group_cost.size()) < stages) return {};
  std::vector<int> balance;
  size_t next = 0;
  for (int groups : balance_by_cost(group_cost, stages)) {
    int layers = 0;
    for (int g = 0; g < groups; ++g) layers += group_layers[next++];
    balance.push_back(layers);
  }
  return balance;
}

// Cuts of `layers` layers into `stages` stages of at least one layer each, or `most` where that many or more.
int64_t cut_count(int layers, int stages, int64_t most) {
  // C(layers - 1, stages - 1), computed while it stays below `most`.
  const int64_t n = layers - 1, k = std::min(stages - 1, layers - stages);
  if (k < 0) return 0;
  int64_t count = 1;
  for (int64_t i = 1; i <= k; ++i) {
    count = count * (n - k + i) / i;
    if (count >= most) return most;
  }
  return count;
}

// Calls `visit` with every cut of `layers` layers into `stages` stages that ends no stage after an
// uncuttable layer.
void for_each_cut(int layers, int stages, const std::vector<bool>& uncuttable,
                  const std::function<void(const std::vector<int>&)>& visit) {
  std::vector<int> balance;
  std::function<void(int, int)> place = [&](int first, int left) {  // stages from layer `first` on
    if (left == 1) {
      balance.push_back(layers - first);
      visit(balance);
      balance.pop_back();
      return;
    }
    for (int last = first + 1; last <= layers - (left - 1); ++last) {  // this stage ends before `last`
      if (uncuttable[static_cast<size_t>(last - 1)]) continue;
      balance.push_back(last - first);
      place(last, left - 1);
      balance.pop_back();
    }
  };
  place(0, stages);
}

// The stages' times in `costs` at micro-batches of `rows` rows that `schedule` orders its actions by
// on the cut `balance` (zbv, v-half: as the pipeline runs once the plan is chosen); none for another.
std::vector<ActionTimes> v_order_times(const CostModel& costs, ScheduleKind schedule, const std::vector<int>& balance,
                                     int64_t rows, Checkpoint mode) {
  if (!schedule_traits(schedule).orders_by_times) return {};
  return stage_action_times(costs, balance, rows, mode);
}

// `plan` ordered by v_order_times, where its cut was made with it.
PipelinePlan with_profiled_stage_times(PipelinePlan plan, const CostModel& costs, int64_t rows) {
  std::vector<ActionTimes> times = v_order_times(costs, plan.schedule, plan.balance, rows, plan.checkpoint);
  if (times.empty()) return plan;
  return with_stage_times(std::move(plan), std::move(times));
}

// Most stage x micro-batch pairs one configuration's cut may take to predict every cut of the model
// (each charged its K·V·M): the main job's 11 layers in 4 stages, 120 cuts, up to M=8.
constexpr int64_t kMostExhaustivePairs = int64_t{1} << 12;

// A cut improved by the simulation itself. The min-max cut balances the sums of the devices' layer
// times; the simulation also counts what those sums leave out: the order in which the schedule runs
// each device's stages (a V's first stage holds back the other device at every turn), the transfers
// over the links, the skip tensors that cross stages, tied weights, and the update. Where every cut
// can be predicted within kMostExhaustivePairs (and the `budget`), every one is, and the shortest
// step taken. Otherwise a stage boundary moves by one layer at a time, the move that shortens the
// predicted step most taken, until none does: from the cut given, then from the even cut (a V's
// devices balanced by time can still wait at every turn on a stage of many layers), the better kept.
// Every prediction is charged its K·V·M to the `budget` of stage x micro-batch pairs; when it is
// spent, the best found so far is taken. No stage ends after an uncuttable layer, and a
// configuration that fit stays within `memory_per_device` (one that did not needs no more than it
// did). `step_of` is the step a prediction stands for; `plan` and `predicted` are the cut's, replaced
// by the better one's.
void refine_cut(const CostModel& costs, const std::vector<SkipConnection>& skips, const std::vector<bool>& uncuttable,
                const std::vector<int64_t>& rows, int64_t memory_per_device,
                const std::function<double(const Prediction&)>& step_of, int64_t& budget, PipelinePlan& plan,
                Prediction& predicted) {
  const int64_t most = predicted.largest_total_bytes() <= memory_per_device ? memory_per_device
                                                                            : predicted.largest_total_bytes();
  const int64_t cost = static_cast<int64_t>(plan.balance.size()) * plan.micro_batches;  // of one prediction
  const PipelineOptions options = PipelineOptions()
                                      .devices(plan.devices)
                                      .virtual_stages(plan.virtual_stages)
                                      .micro_batches(plan.micro_batches)
                                      .schedule(plan.schedule)
                                      .checkpoint(plan.checkpoint);
  // A start that ends a stage after an uncuttable layer gives way to any cut that does not.
  double step = cuttable(plan.balance, uncuttable) ? step_of(predicted) : std::numeric_limits<double>::infinity();
  bool spent = false;
  // Predicts `balance`; true when it is shorter than the best so far by more than rounding (within
  // the memory), which it then becomes.
  auto try_cut = [&](const std::vector<int>& balance, PipelinePlan& best_plan, Prediction& best, double& best_step) {
    if (budget < cost) {
      spent = true;
      return false;
    }
    budget -= cost;
    PipelinePlan moved;
    try {
      moved = make_plan(plan.layers,
                        PipelineOptions(options)
                            .cut(CutRequest::given(balance))
                            .stage_times(v_order_times(costs, plan.schedule, balance, rows.front(), plan.checkpoint)),
                        skips);
    } catch (const std::invalid_argument&) {
      return false;
    }
    Prediction p = predict(costs, moved, rows);
    const double moved_step = step_of(p);
    if (moved_step >= best_step * (1 - 1e-9) || p.largest_total_bytes() > most) return false;
    best_step = moved_step;
    best_plan = std::move(moved);
    best = std::move(p);
    return true;
  };
  const int S = static_cast<int>(plan.balance.size());
  if (cut_count(plan.layers, S, kMostExhaustivePairs) * cost <= std::min(budget, kMostExhaustivePairs)) {
    for_each_cut(plan.layers, S, uncuttable, [&](const std::vector<int>& balance) {
      if (balance != plan.balance) try_cut(balance, plan, predicted, step);
    });
    return;
  }
  // From a cut, the best single moves while they shorten the step: no cut is visited twice.
  auto climb = [&](PipelinePlan& from, Prediction& from_predicted, double& from_step) {
    for (bool moved = true; moved && !spent;) {
      moved = false;
      const std::vector<int> at = from.balance;
      for (size_t b = 0; b + 1 < at.size() && !spent; ++b)
        for (int shift : {-1, 1}) {  // the boundary after stage b one layer earlier, or later
          std::vector<int> balance = at;
          balance[b] += shift;
          balance[b + 1] -= shift;
          if (balance[b] < 1 || balance[b + 1] < 1 || !cuttable(balance, uncuttable)) continue;
          moved = try_cut(balance, from, from_predicted, from_step) || moved;
          if (spent) break;
        }
    }
  };
  climb(plan, predicted, step);
  const std::vector<int> even = even_balance(plan.layers, S);
  if (spent || !cuttable(even, uncuttable) || even == plan.balance) return;
  PipelinePlan other = plan;
  Prediction other_predicted;
  double other_step = std::numeric_limits<double>::infinity();
  if (!try_cut(even, other, other_predicted, other_step)) return;
  climb(other, other_predicted, other_step);
  if (other_step < step * (1 - 1e-9)) {
    plan = std::move(other);
    predicted = std::move(other_predicted);
  }
}

bool considered(const std::vector<int>& list, int value) {
  return list.empty() || std::find(list.begin(), list.end(), value) != list.end();
}

}  // namespace

PipelinePlan refined_plan(const CostModel& costs, const PipelineOptions& options,
                          const std::vector<int64_t>& micro_batch_rows, int64_t memory_per_device) {
  GPIPE_CHECK(!micro_batch_rows.empty() && *std::min_element(micro_batch_rows.begin(), micro_batch_rows.end()) >= 1,
              "refined_plan needs each micro-batch's rows, each at least 1 (got ", micro_batch_rows.size(),
              " row counts)");
  const std::vector<SkipConnection> skips = skip_connections_of(costs);
  PipelinePlan plan =
      with_profiled_stage_times(make_plan(costs.layer_count(), options, skips), costs, micro_batch_rows.front());
  Prediction predicted = predict(costs, plan, micro_batch_rows);
  int64_t budget = kMostRefinedPairs;
  refine_cut(costs, skips, uncuttable_after(costs), micro_batch_rows, memory_per_device,
             [](const Prediction& p) { return p.step_s; }, budget, plan, predicted);
  return plan;
}

std::vector<int> default_micro_batch_counts(int K, int64_t rows, int64_t least_rows) {
  std::vector<int> out;
  for (int64_t M = 1; M * least_rows <= rows && M <= std::max(8, 4 * K) && 2 * K * M <= kMostPlannedPairs; M *= 2)
    out.push_back(static_cast<int>(M));
  return out;
}

void PlanSearch::check() const {
  GPIPE_CHECK(devices >= 1, "the cluster needs at least 1 device (got ", devices, ")");
  GPIPE_CHECK(memory_per_device >= 1, "a device needs at least 1 byte of memory (got ", memory_per_device, ")");
  GPIPE_CHECK(batch >= 1, "the batch needs at least 1 row (got ", batch, ")");
  GPIPE_CHECK(least_micro_batch_rows >= 1, "a micro-batch needs at least 1 row (got ", least_micro_batch_rows, ")");
  GPIPE_CHECK(blocks >= 0 && lead >= 0 && tail >= 0, "lead, blocks and tail must be 0 or more (got ", lead, ", ",
              blocks, ", ", tail, ")");
  for (int K : stages)
    GPIPE_CHECK(K >= 1 && devices % K == 0, "`stages` ", K, ": K = ", K, " devices per pipeline does not divide the ",
                devices, " devices; the cluster must be a whole number of K-device pipelines");
  for (int M : micro_batches) GPIPE_CHECK(M >= 1, "M must be at least 1 (got ", M, ")");
  check_listed_once(stages, "stages");
  check_listed_once(micro_batches, "micro_batches");
  std::vector<std::string> names;
  for (ScheduleKind kind : schedules) names.push_back(to_string(kind));
  check_listed_once(names, "schedule");
  names.clear();
  for (Checkpoint mode : checkpoints) names.push_back(to_string(mode));
  check_listed_once(names, "checkpoint");
}

namespace {

// One (K, M, schedule) of a search, before its checkpoint modes are planned.
struct Shape {
  int K, D, M, V;
  int64_t rows;
  ScheduleKind kind;
};

// What a stage of a model of L layers must have at least one of: a block, or a layer.
int stage_units_of(const PlanSearch& search, int L) { return search.blocks > 0 ? search.blocks : L; }

// Every (K, M, schedule) `search` considers for a model of L layers.
std::vector<Shape> shapes_of(const PlanSearch& search, int L) {
  const int stage_units = stage_units_of(search, L);
  std::vector<Shape> out;
  for (int K = 1; K <= search.devices; ++K) {
    if (search.devices % K != 0 || K > stage_units || !considered(search.stages, K)) continue;
    const int D = search.devices / K;
    if (search.batch < D) continue;  // every replica needs a row
    const int64_t rows = micro_batch_sizes(search.batch, D).front();
    const int64_t least = search.least_micro_batch_rows;
    if (rows < least) continue;  // not even one micro-batch of enough rows
    std::vector<int> micro;
    if (search.micro_batches.empty()) {
      micro = default_micro_batch_counts(K, rows, least);
    } else {
      for (int M : search.micro_batches) {
        // A K the search was left to choose (no `stages` given) is passed over where an M asked for
        // does not fit its replicas' rows; a K asked for is refused with the reason.
        if (search.stages.empty() && (M > rows || rows / M < least)) continue;
        GPIPE_CHECK(M <= rows, "M = ", M, " micro-batches is more than the ", rows, " rows a replica gets at K=", K,
                    " (", D, D == 1 ? " replica" : " replicas", "); every micro-batch needs a row");
        GPIPE_CHECK(rows / M >= least, "M = ", M, " micro-batches of the ", rows, " rows a replica gets at K=", K,
                    " (", D, D == 1 ? " replica" : " replicas", ") leaves micro-batches of ", rows / M, " row", rows / M == 1 ? "" : "s",
                    ", but the model needs at least ", least, " (BatchNorm in training normalizes each micro-batch "
                    "by its own statistics); ask for fewer micro-batches or a larger batch");
        micro.push_back(M);
      }
    }
    // On one device every schedule runs the micro-batches one after another: those that split the
    // backward (zb1p) or run V stages per device are left out where a plain one (gpipe, 1f1b) is
    // considered, and planned when they alone are asked for, as gpipe train runs them.
    auto is_plain = [](ScheduleKind kind) {
      const ScheduleTraits& traits = schedule_traits(kind);
      return !traits.splits_backward && traits.default_virtual_stages == 1;
    };
    auto taken = [&](ScheduleKind kind) {
      return search.virtual_stages == 0 || takes_virtual_stages(kind, search.virtual_stages);
    };
    const bool plain = std::any_of(search.schedules.begin(), search.schedules.end(),
                                   [&](ScheduleKind kind) { return is_plain(kind) && taken(kind); });
    for (ScheduleKind kind : search.schedules)
      for (int M : micro) {
        if (!taken(kind)) continue;
        const int V = search.virtual_stages > 0 ? search.virtual_stages : default_virtual_stages(kind);
        if (K * V > stage_units) continue;
        if (K == 1 && plain && !is_plain(kind)) continue;
        out.push_back({K, D, M, V, rows, kind});
      }
  }
  return out;
}

// The stage x micro-batch pairs the search simulates for `shape`: K·V·M per checkpoint mode.
int64_t searched_pairs(const Shape& shape, const PlanSearch& search) {
  return int64_t{shape.K} * shape.V * shape.M * static_cast<int64_t>(search.checkpoints.size());
}

}  // namespace

bool ranks_before(const PlanCandidate& a, const PlanCandidate& b) {
  if (a.fits != b.fits) return a.fits;
  return a.fits ? a.samples_per_s > b.samples_per_s : a.largest_total_bytes < b.largest_total_bytes;
}

namespace {

// One search_plans: the candidates of each shape it is given, then their cuts refined and ranked.
class SearchRun {
 public:
  SearchRun(const CostModel& costs, const PlanSearch& search)
      : costs_(costs),
        search_(search),
        cut_(search_cut(costs, search)),
        // The search's own min-max cut is then improved by the simulation (refine_cut); a cut given, or
        // of blocks, is taken as it is.
        refined_(!search.given_cut && search.blocks == 0),
        skips_(skip_connections_of(costs)),
        // A boundary after a layer whose output is a tuple of more tensors than one message carries is
        // never proposed: the min-max cut goes around it, and a cut by blocks that ends a stage there is
        // left out.
        uncuttable_(uncuttable_after(costs)),
        any_uncuttable_(std::find(uncuttable_.begin(), uncuttable_.end(), true) != uncuttable_.end()) {}

  // A candidate of `shape` for each checkpoint mode its schedule takes, planned and predicted.
  void plan_shape(const Shape& shape) {
    const int K = shape.K, M = shape.M, V = shape.V;
    CutRequest shape_cut = cut_;
    if (any_uncuttable_ && cut_.kind == CutKind::kByCost) {
      const std::vector<int> around = cut_around(cut_.layer_costs, uncuttable_, K * V);
      if (around.empty()) {
        left_out_for_tensors_ += static_cast<int64_t>(search_.checkpoints.size());
        return;
      }
      shape_cut = CutRequest::given(around);
    }
    for (Checkpoint checkpoint : search_.checkpoints) {
      PipelinePlan plan;
      try {
        plan = make_plan(costs_.layer_count(), PipelineOptions().devices(K).virtual_stages(V).cut(shape_cut)
                                                   .micro_batches(M).schedule(shape.kind).checkpoint(checkpoint), skips_);
      } catch (const std::invalid_argument&) {
        break;  // a shape this schedule does not take (interleaved with M not a multiple of K, say)
      }
      plan = with_profiled_stage_times(std::move(plan), costs_, micro_batch_sizes(shape.rows, M).front());
      if (!cuttable(plan.balance, uncuttable_)) {
        ++left_out_for_tensors_;
        continue;
      }
      PlanCandidate c;
      c.config = plan.config();
      c.replicas = shape.D;
      c.predicted = predict(costs_, plan, micro_batch_sizes(shape.rows, M));
      complete(c);
      found_.push_back(std::move(c));
      if (refined_) plans_.push_back(std::move(plan));
    }
  }

  // Throws std::invalid_argument, naming what each configuration lacked, where no shape gave a candidate.
  void check_found() const {
    // Where every schedule asked for runs several stages per device, a model of fewer blocks fits none.
    int least_V = std::numeric_limits<int>::max();
    for (ScheduleKind kind : search_.schedules) least_V = std::min(least_V, default_virtual_stages(kind));
    const int stage_units = stage_units_of(search_, costs_.layer_count());
    GPIPE_CHECK(!found_.empty(), "no configuration of ", search_.devices, " devices takes a batch of ", search_.batch,
                " rows", search_.stages.empty() ? "" : " with the K given",
                search_.micro_batches.empty() ? "" : " and the M given",
                least_V > stage_units ? "; the schedules asked for run " + std::to_string(least_V) +
                                       " stages per device, each of at least one block, and this model has " +
                                       std::to_string(stage_units) + ": give it more layers, or add `schedule` gpipe or 1f1b"
                                 : std::string(),
                "; every stage needs a layer (a block), every replica a row and every micro-batch ",
                search_.least_micro_batch_rows > 1 ? std::to_string(search_.least_micro_batch_rows) +
                                                         " rows (this model's BatchNorm)"
                                                   : std::string("a row"),
                ", interleaved M a multiple of K, and a schedule at most 2^21 stage x micro-batch pairs",
                left_out_for_tensors_ > 0 ? "; and no stage may end after a layer whose output passes more than " +
                                                std::to_string(kMostBoundaryTensors) + " tensors (" +
                                                std::to_string(left_out_for_tensors_) + " configurations were left out "
                                                "for that: one MPI message carries at most that many)"
                                          : std::string());
  }

  // The candidates, their cuts refined where the search made them, ranked (ranks_before).
  std::vector<PlanCandidate> ranked() {
    if (refined_) {
      // The cuts refined in the order the search ranks them, the fastest first, while the budget lasts.
      std::vector<size_t> order(found_.size());
      std::iota(order.begin(), order.end(), size_t{0});
      std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return ranks_before(found_[a], found_[b]); });
      int64_t budget = kMostRefinedPairs;
      for (size_t n : order) {
        PlanCandidate& c = found_[n];
        const auto step = [&](const Prediction& p) { return step_of(p, c.replicas); };
        const int64_t rows = micro_batch_sizes(search_.batch, c.replicas).front();  // a replica's (Shape::rows)
        refine_cut(costs_, skips_, uncuttable_, micro_batch_sizes(rows, c.config.micro_batches),
                   search_.memory_per_device, step, budget, plans_[n], c.predicted);
        c.config = plans_[n].config();
        complete(c);
      }
    }
    std::stable_sort(found_.begin(), found_.end(), ranks_before);
    return std::move(found_);
  }

 private:
  // A candidate's step: its prediction's, and its replicas summing their gradients (a ring all-reduce
  // of the largest stage's gradients).
  double step_of(const Prediction& p, int D) const {
    int64_t largest_static = 0;
    for (int64_t s : p.static_bytes) largest_static = std::max(largest_static, s);
    const double gradient_bytes = static_cast<double>(largest_static) / (1 + costs_.state_per_parameter_byte);
    return p.step_s + ring_all_reduce_s(costs_, gradient_bytes, D);
  }
  // A candidate's step, speed, memory and fit from its prediction.
  void complete(PlanCandidate& c) const {
    c.step_s = step_of(c.predicted, c.replicas);
    c.samples_per_s = static_cast<double>(search_.batch) / c.step_s;
    c.largest_total_bytes = c.predicted.largest_total_bytes();
    c.fits = c.largest_total_bytes <= search_.memory_per_device;
  }

  const CostModel& costs_;
  const PlanSearch& search_;
  const CutRequest cut_;
  const bool refined_;
  const std::vector<SkipConnection> skips_;
  const std::vector<bool> uncuttable_;
  const bool any_uncuttable_;
  std::vector<PlanCandidate> found_;
  std::vector<PipelinePlan> plans_;  // found_[n]'s, to refine
  int64_t left_out_for_tensors_ = 0;
};

}  // namespace

std::vector<PlanCandidate> search_plans(const CostModel& costs, const PlanSearch& search) {
  search.check();
  const int L = costs.layer_count();
  GPIPE_CHECK(search.blocks == 0 || search.lead + search.blocks + search.tail == L, "the cut's ", search.lead,
              " + ", search.blocks, " + ", search.tail, " layers are not the model's ", L);
  const std::vector<Shape> shapes = shapes_of(search, L);
  int64_t total = 0, done = 0;
  for (const Shape& s : shapes) total += searched_pairs(s, search);
  GPIPE_CHECK(total <= kMostSearchedPairs, "the search would simulate ", total, " stage x micro-batch pairs (K x V x M "
              "over every configuration and checkpoint mode), more than the ", kMostSearchedPairs, " that keep an "
              "answer within about a minute; narrow it with `stages` (the K to consider), `micro_batches`, `schedule` "
              "or `checkpoint`");
  SearchRun run(costs, search);
  for (const Shape& shape : shapes) {
    run.plan_shape(shape);
    done += searched_pairs(shape, search);
    if (search.progress) search.progress(done, total);
  }
  run.check_found();
  return run.ranked();
}

}  // namespace gpipe
