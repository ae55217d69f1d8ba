// predict.cc: the prediction of a configuration: its training program simulated with each action's
// time (its stage's compute, a send's time on the link, the update where the devices run it), then
// replayed device by device for the bytes it holds (cost_model.h describes the model).
#include "cost/stage_cost.h"

#include "gpipe/check.h"
#include "gpipe/partition.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <set>
#include <string>
#include <utility>

namespace gpipe {

std::vector<int64_t> Prediction::total_bytes() const {
  std::vector<int64_t> out;
  for (size_t d = 0; d < peak_bytes.size(); ++d) out.push_back(peak_bytes[d] + static_bytes[d]);
  return out;
}

int Prediction::largest_device() const {
  const std::vector<int64_t> totals = total_bytes();
  if (totals.empty()) return -1;
  return static_cast<int>(std::max_element(totals.begin(), totals.end()) - totals.begin());
}

int64_t Prediction::largest_total_bytes() const {
  const int d = largest_device();
  return d < 0 ? 0 : total_bytes()[static_cast<size_t>(d)];
}

namespace {

// What a device holds over a step: changes at simulated times, and the transient peak of each action.
struct Ledger {
  std::vector<std::pair<double, double>> changes;  // (time, bytes): + allocated, - freed
  std::vector<std::pair<double, double>> peaks;    // (start time, extra bytes during the action)
};

int64_t peak_of(Ledger ledger) {
  // Frees before allocations at the same instant: a send waited for is already consumed.
  std::sort(ledger.changes.begin(), ledger.changes.end(),
            [](const auto& a, const auto& b) { return a.first != b.first ? a.first < b.first : a.second < b.second; });
  std::sort(ledger.peaks.begin(), ledger.peaks.end());
  double held = 0, peak = 0;
  size_t c = 0;
  for (const auto& [start, extra] : ledger.peaks) {
    while (c < ledger.changes.size() && ledger.changes[c].first <= start) {
      held += ledger.changes[c++].second;
      peak = std::max(peak, held);
    }
    peak = std::max(peak, held + extra);
  }
  for (; c < ledger.changes.size(); ++c) {
    held += ledger.changes[c].second;
    peak = std::max(peak, held);
  }
  return static_cast<int64_t>(std::llround(std::min(peak, 4.0e18)));  // beyond any device, and no overflow
}

// What every step of a prediction reads: the plan's training program, its stages' costs, the rows of
// each micro-batch, which forwards were re-materialized and the bytes each skip route carries.
class StepModel {
 public:
  StepModel(const CostModel& model, const PipelinePlan& cut, const std::vector<int64_t>& micro_batch_rows)
      : costs(model), plan(cut), schedule(cut.training), micro_batch_rows_(micro_batch_rows) {
    GPIPE_CHECK(plan.layers == costs.layer_count(), "the plan cuts ", plan.layers, " layers but the cost model has ",
                costs.layer_count());
    GPIPE_CHECK(static_cast<int>(micro_batch_rows.size()) == schedule.micro_batches, "the program runs ",
                schedule.micro_batches, " micro-batches but ", micro_batch_rows.size(), " row counts were given");
    stage_ = detail::stage_costs_of(costs, plan.balance);
    // Which forwards were re-materialized: their B or I runs the forward again.
    recomputed_.assign(slots(), 0);
    for (const auto& list : schedule.actions)
      for (const Action& a : list)
        if (a.kind == ActionKind::kForward) recomputed_[slot(a.stage, a.micro_batch)] = a.recompute;
    // The bytes per sample of the tensor skip route k carries, and of its gradient.
    for (const std::string& name : plan.skip_names) {
      const auto it = std::find_if(costs.skips.begin(), costs.skips.end(),
                                   [&](const SkipCost& skip) { return skip.connection.name == name; });
      GPIPE_CHECK(it != costs.skips.end(), "the plan's skip connection \"", name,
                  "\" is not in the cost model; profile the model that has it");
      skip_bytes_.push_back(it->bytes);
    }
  }

  const CostModel& costs;
  const PipelinePlan& plan;
  const Schedule& schedule;  // the plan's training program

  // One entry per (stage, micro-batch): S·M.
  size_t slots() const { return static_cast<size_t>(schedule.stages) * static_cast<size_t>(schedule.micro_batches); }
  size_t slot(int s, int i) const {
    return static_cast<size_t>(s) * static_cast<size_t>(schedule.micro_batches) + static_cast<size_t>(i);
  }
  const detail::StageCost& at(int s) const { return stage_[static_cast<size_t>(s)]; }
  // The rows of `a`'s micro-batch.
  double rows(const Action& a) const {
    return static_cast<double>(micro_batch_rows_[static_cast<size_t>(a.micro_batch)]);
  }
  // Whether `a`'s forward was re-materialized (the given program's flag).
  bool again(const Action& a) const { return recomputed_[slot(a.stage, a.micro_batch)] != 0; }
  // The bytes per sample a send carries: a skip tensor or its gradient, the stage's output, or the
  // gradient of its input.
  double sent(const Action& a) const {
    const int k = skip_of(a.channel);
    if (k >= 0) return skip_bytes_[static_cast<size_t>(k)];
    return carries_gradient(a.channel) ? at(a.stage).input : at(a.stage).output;
  }

 private:
  const std::vector<int64_t>& micro_batch_rows_;
  std::vector<detail::StageCost> stage_;
  std::vector<char> recomputed_;  // [slot]
  std::vector<double> skip_bytes_;
};

// The parameter bytes of a plan's stages on their devices.
struct ParameterBytes {
  std::vector<double> held;  // per stage: what it adds to its device's
  double unique = 0;         // every parameter once: what one process steps
  double tied_all_reduce_s = 0;  // summing the copies' gradients of tensors tied across devices
};

// The parameter bytes each stage adds to its device's: a tensor tied across layers (CostModel::tied)
// counts on the first of its stages on each device. Across devices, each holds a copy, whose
// gradients are summed when every stage is done (over the link; free between threads), and one
// process steps the tensor once.
ParameterBytes parameter_bytes_of(const StepModel& m) {
  const CostModel& costs = m.costs;
  ParameterBytes p;
  for (int s = 0; s < m.schedule.stages; ++s) {
    p.held.push_back(static_cast<double>(m.at(s).parameter_bytes));
    p.unique += p.held.back();
  }
  const std::vector<int> offsets = stage_offsets(m.plan.balance);
  for (const TiedParameter& tied : costs.tied) {
    std::set<int> holders;
    for (int l : tied.layers) {
      GPIPE_CHECK(l >= 0 && l < costs.layer_count(), "a tied parameter is used by layer ", l,
                  ", which the cost model does not have (layers 0..", costs.layer_count() - 1, ")");
      const int s = static_cast<int>(std::upper_bound(offsets.begin(), offsets.end(), l) - offsets.begin()) - 1;
      if (!holders.insert(m.schedule.placement[static_cast<size_t>(s)]).second)
        p.held[static_cast<size_t>(s)] -= static_cast<double>(tied.bytes);
    }
    p.unique -= static_cast<double>(tied.bytes) * static_cast<double>(tied.layers.size() - 1);
    p.tied_all_reduce_s += ring_all_reduce_s(costs, static_cast<double>(tied.bytes), static_cast<int>(holders.size()));
  }
  return p;
}

// The update on the devices (update_on_devices): each stage's share before its first action on its
// device, or all of a device's before its first action where that is a receive, as the Trainer
// applies it. Keyed by the action's text, unique in a program.
std::map<std::string, double> updates_before(const StepModel& m, const ParameterBytes& parameters) {
  std::map<std::string, double> update_before;
  const Schedule lowered = m.schedule.lowered() ? m.schedule : lower(m.schedule, Checkpoint::kNever);
  for (int d = 0; d < m.schedule.devices; ++d) {
    const std::vector<Action>& row = lowered.actions[static_cast<size_t>(d)];
    if (row.empty()) continue;
    std::set<int> entered;
    for (const Action& a : row)
      if (entered.insert(a.stage).second)
        update_before[(row.front().kind == ActionKind::kRecv ? row.front() : a).str()] +=
            m.costs.update_s_per_parameter_byte * parameters.held[static_cast<size_t>(a.stage)];
  }
  return update_before;
}

// The training program simulated with each action's time: its stage's compute, a send's time on the
// link, and with update_on_devices each stage's update before it.
SimulatedRun simulate_step(const StepModel& m, const ParameterBytes& parameters) {
  const CostModel& costs = m.costs;
  const Schedule& schedule = m.schedule;
  const CostFn cost = [&](const Action& a) -> double {
    const double n = m.rows(a);
    switch (a.kind) {
      case ActionKind::kForward:
      case ActionKind::kBackward:
      case ActionKind::kInputGrad:
      case ActionKind::kWeightGrad:
        return detail::compute_seconds(m.at(a.stage), a.kind, n, m.again(a), costs.action_overhead_s);
      case ActionKind::kSend:  // between two stages of one device the executor hands it over: free
        if (schedule.placement[static_cast<size_t>(a.stage)] == schedule.placement[static_cast<size_t>(a.peer)]) return 0.0;
        return costs.link_bytes_per_s > 0 ? costs.link_latency_s + m.sent(a) * n / costs.link_bytes_per_s : 0.0;
      case ActionKind::kRecv: return 0.0;
    }
    return 0.0;
  };
  if (!costs.update_on_devices) return simulate(schedule, cost, CostFn());
  const std::map<std::string, double> update_before = updates_before(m, parameters);
  const CostFn work_before = [&](const Action& a) {
    const auto it = update_before.find(a.str());
    return it == update_before.end() ? 0.0 : it->second;
  };
  return simulate(schedule, cost, work_before);
}

// When each (stage, micro-batch)'s F, its B or I, and its W end in a simulated run (NaN: there is none).
struct ActionEnds {
  std::vector<double> forward, backward, weight;  // [slot]

  ActionEnds(const StepModel& m, const SimulatedRun& run)
      : forward(m.slots(), std::nan("")), backward(m.slots(), std::nan("")), weight(m.slots(), std::nan("")) {
    const Schedule& program = run.program;
    for (size_t d = 0; d < static_cast<size_t>(m.schedule.devices); ++d)
      for (size_t n = 0; n < program.actions[d].size(); ++n) {
        const Action& a = program.actions[d][n];
        const double end = run.end[d][n];
        if (a.kind == ActionKind::kForward) forward[m.slot(a.stage, a.micro_batch)] = end;
        if (a.is_backward()) backward[m.slot(a.stage, a.micro_batch)] = end;
        if (a.kind == ActionKind::kWeightGrad) weight[m.slot(a.stage, a.micro_batch)] = end;
      }
  }
};

// What each device holds over the simulated run: each action replayed on its device's ledger as
// cost_model.h describes (what a stage keeps, what it sends, each action's transient peak).
std::vector<Ledger> replay_bytes(const StepModel& m, const SimulatedRun& run) {
  const ActionEnds ends(m, run);
  auto split = [&](int s, int i) { return !std::isnan(ends.weight[m.slot(s, i)]); };
  // When stage s lets go of micro-batch i (its input, its skip tensors): at the end of its W, or of its B.
  auto released = [&](int s, int i) { return split(s, i) ? ends.weight[m.slot(s, i)] : ends.backward[m.slot(s, i)]; };
  auto backward_end = [&](int s, int i) { return ends.backward[m.slot(s, i)]; };
  auto weight_end = [&](int s, int i) { return ends.weight[m.slot(s, i)]; };

  const Schedule& program = run.program;  // lowered
  std::vector<Ledger> ledger(static_cast<size_t>(m.schedule.devices));
  for (size_t d = 0; d < ledger.size(); ++d) {
    auto hold = [&ledger, d](double bytes, double from, double until) {
      if (bytes <= 0 || !(until > from)) return;
      ledger[d].changes.push_back({from, bytes});
      ledger[d].changes.push_back({until, -bytes});
    };
    for (size_t n = 0; n < program.actions[d].size(); ++n) {
      const Action& a = program.actions[d][n];
      const detail::StageCost& c = m.at(a.stage);
      const int s = a.stage, i = a.micro_batch;
      const double rows_a = m.rows(a), start = run.start[d][n], end = run.end[d][n];
      auto peak = [&](double bytes) { ledger[d].peaks.push_back({start, bytes * rows_a}); };
      switch (a.kind) {
        case ActionKind::kForward:
          if (m.again(a)) {  // the given program's flag (simulate() re-lowers a one-stage program)
            peak(c.recompute_peak);
          } else if (!split(s, i)) {
            peak(c.forward_peak);
            hold(c.kept * rows_a, end, backward_end(s, i));
          } else {  // I frees what W does not need, W the rest
            peak(std::max(c.forward_peak, c.split_kept));
            hold((c.split_kept - c.weight_kept) * rows_a, end, backward_end(s, i));
            hold(c.weight_kept * rows_a, end, weight_end(s, i));
          }
          break;
        case ActionKind::kBackward:
        case ActionKind::kInputGrad:
          if (m.again(a)) {
            peak(std::max(c.forward_peak, c.kept + c.backward_extra));
            if (a.kind == ActionKind::kInputGrad)  // the recomputed forward's W share waits for W
              hold(c.weight_kept * rows_a, end, weight_end(s, i));
          } else {
            peak(c.backward_extra);
          }
          break;
        case ActionKind::kSend: {
          // What a device sends stays charged to it (its thread allocated it) until the receiving stage
          // t is done with it.
          const int t = a.peer;
          if (!carries_gradient(a.channel)) {
            // A stage output or a stashed tensor, made by s's F: t holds it until it lets go of the
            // micro-batch; a forward that kept its activations holds it among them until its B (W).
            const double kept_until = c.whole ? released(s, i) : backward_end(s, i);
            hold(m.sent(a) * rows_a, m.again(a) ? ends.forward[m.slot(s, i)] : kept_until, released(t, i));
          } else {
            // The gradient of s's input or of a tensor it popped, made by its B or I: t's B or I uses
            // it, and a split W keeps it when it starts there (weight_keeps_output_grad).
            const double until = m.at(t).weight_keeps_output_grad ? released(t, i) : backward_end(t, i);
            hold(m.sent(a) * rows_a, backward_end(s, i), until);
          }
          break;
        }
        case ActionKind::kWeightGrad:
        case ActionKind::kRecv:
          break;
      }
    }
  }
  return ledger;
}

}  // namespace

Prediction predict(const CostModel& costs, const PipelinePlan& plan, const std::vector<int64_t>& micro_batch_rows) {
  const StepModel m(costs, plan, micro_batch_rows);
  const ParameterBytes parameters = parameter_bytes_of(m);
  const SimulatedRun run = simulate_step(m, parameters);
  const std::vector<Ledger> ledger = replay_bytes(m, run);
  Prediction p;
  p.bubble = run.bubble;
  for (int d = 0; d < m.schedule.devices; ++d) {
    p.peak_bytes.push_back(peak_of(ledger[static_cast<size_t>(d)]));
    double held = 0;
    for (int s : run.program.stages_of(d)) held += parameters.held[static_cast<size_t>(s)];
    p.static_bytes.push_back(static_cast<int64_t>(std::min(held * (1.0 + costs.state_per_parameter_byte), 4.0e18)));
  }
  p.step_s = run.makespan + costs.step_overhead_s + parameters.tied_all_reduce_s +
             (costs.update_on_devices ? 0.0 : costs.update_s_per_parameter_byte * parameters.unique);
  return p;
}

}  // namespace gpipe
