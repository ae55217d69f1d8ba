// simulate.cc: a program run with a cost per action (when each starts and ends, the bubble, the
// stage-micro-batches held), and what is read from it: validate, the grid, the ideal speedup.
#include "schedule/schedule_parts.h"

#include <algorithm>
#include <map>
#include <numeric>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace gpipe {

double unit_cost(const Action& action) { return action.is_compute() ? 1.0 : 0.0; }

SimulatedRun simulate(const Schedule& schedule, const CostFn& cost, const CostFn& work_before) {
  SimulatedRun run;
  run.program = schedule.lowered() ? schedule : lower(schedule, Checkpoint::kNever);
  const Schedule& p = run.program;
  detail::check_structure(p);
  const size_t K = p.actions.size();
  run.start.resize(K);
  run.end.resize(K);
  run.busy.assign(K, 0.0);
  run.peak_in_flight.assign(K, 0);

  std::map<detail::CommKey, double> sent;  // when each message left
  std::vector<size_t> next(K, 0);
  std::vector<double> free_at(K, 0.0);
  size_t remaining = 0;
  for (const auto& row : p.actions) remaining += row.size();
  while (remaining > 0) {
    bool progress = false;
    for (size_t d = 0; d < K; ++d) {
      const auto& row = p.actions[d];
      while (next[d] < row.size()) {  // place every action of device d that can start
        const Action& a = row[next[d]];
        double begin = free_at[d];
        if (a.kind == ActionKind::kRecv) {
          const auto it = sent.find(detail::comm_key(a));
          if (it == sent.end()) break;
          begin = std::max(begin, it->second);
        }
        if (work_before) {  // done before the action, while a receive waits
          const double work = work_before(a);
          run.busy[d] += work;
          begin = std::max(begin, free_at[d] + work);
        }
        const double finish = begin + cost(a);
        if (a.kind == ActionKind::kSend) sent[detail::comm_key(a)] = finish;
        if (a.is_compute()) run.busy[d] += finish - begin;
        run.start[d].push_back(begin);
        run.end[d].push_back(finish);
        free_at[d] = finish;
        run.makespan = std::max(run.makespan, finish);
        ++next[d];
        --remaining;
        progress = true;
      }
    }
    if (!progress) {
      size_t stuck = 0;
      while (next[stuck] >= p.actions[stuck].size()) ++stuck;
      const Action& a = p.actions[stuck][next[stuck]];
      detail::fail(p, static_cast<int>(stuck),
           "deadlock: device " + std::to_string(stuck) + " waits in " + a.str() + " for stage " + std::to_string(a.peer) +
               ", which is itself waiting");
    }
  }
  run.bubble = run.makespan > 0
                   ? 1.0 - std::accumulate(run.busy.begin(), run.busy.end(), 0.0) / (static_cast<double>(K) * run.makespan)
                   : 0.0;

  // In flight per device: +1 when a forward starts, -1 when its B (or W) ends.
  for (size_t d = 0; d < K; ++d) {
    std::vector<std::pair<double, int>> events;
    const auto& row = p.actions[d];
    for (size_t n = 0; n < row.size(); ++n) {
      const Action& a = row[n];
      if (a.kind == ActionKind::kForward && p.backward) events.push_back({run.start[d][n], +1});
      if (a.kind == ActionKind::kBackward || a.kind == ActionKind::kWeightGrad) events.push_back({run.end[d][n], -1});
    }
    std::sort(events.begin(), events.end());  // ends (-1) before starts (+1) at the same time
    int held = 0;
    for (const auto& [t, delta] : events) run.peak_in_flight[d] = std::max(run.peak_in_flight[d], held += delta);
  }
  return run;
}

void validate(const Schedule& schedule) { simulate(schedule); }

std::string format_grid(const Schedule& schedule) {
  const SimulatedRun run = simulate(schedule);
  const Schedule& p = run.program;
  size_t width = 1;
  for (const auto& row : p.actions)
    for (const Action& a : row)
      if (a.is_compute()) width = std::max(width, a.str().size());
  const size_t slots = static_cast<size_t>(run.makespan + 0.5);
  std::ostringstream out;
  for (size_t d = 0; d < p.actions.size(); ++d) {
    std::vector<std::string> cells(slots);
    for (size_t n = 0; n < p.actions[d].size(); ++n)
      if (p.actions[d][n].is_compute()) cells[static_cast<size_t>(run.start[d][n] + 0.5)] = p.actions[d][n].str();
    out << "device " << d << " |";
    for (const std::string& cell : cells) {
      const std::string text = cell.empty() ? "." : cell;
      const size_t pad = width - text.size();
      out << ' ' << std::string(pad - pad / 2, ' ') << text << std::string(pad / 2, ' ');
    }
    out << '\n';
  }
  return out.str();
}

double balanced_cost(const Action& action) {
  if (!action.is_compute()) return 0.0;
  return action.kind == ActionKind::kBackward ? 2.0 : 1.0;
}

double ideal_speedup(const Schedule& schedule) {
  return static_cast<double>(schedule.devices) * (1.0 - simulate(schedule, balanced_cost).bubble);
}

double ideal_speedup(int devices, int micro_batches) {
  return static_cast<double>(devices) * micro_batches / (static_cast<double>(micro_batches) + devices - 1);
}

double ideal_bubble(int devices, int micro_batches) {
  return (static_cast<double>(devices) - 1) / (static_cast<double>(micro_batches) + devices - 1);  // no int overflow
}

}  // namespace gpipe
