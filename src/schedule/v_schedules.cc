// v_schedules.cc: the V schedules (zbv, v-half): 2K stages placed as a V, ordered by a list
// schedule over the stages' action times.
#include "schedule/schedule_parts.h"

#include "gpipe/check.h"

#include <algorithm>
#include <cmath>
#include <deque>
#include <limits>
#include <optional>
#include <set>
#include <sstream>
#include <stdexcept>
#include <vector>

namespace gpipe {
namespace {

// When a V schedule's device may start an F, given the stage-micro-batches it holds (from the
// start of their F to the end of their W) and its bound on them.
enum class ForwardRule {
  kUnderTheBound,          // any F while fewer than the bound are held (zbv)
  kUnderTheBoundWithRoom,  // the same, and one on the way down only as kRoomToComeBack allows (zbv
                           // ordered by times, where the bound alone leaves every device waiting)
  kRoomToComeBack,         // an F on the way down only while the F's back up of every micro-batch taken
                           // down still fit under the bound; one on the way up always (its place
                           // was kept): no bound of 2 or more stops a micro-batch halfway (v-half)
};

// The V schedules: a list schedule (schedule.h) of 2K stages, device d running stage d and stage
// 2K-1-d, at most `held_bound` stage-micro-batches held per device. Each device, whenever it is free,
// starts the first of these that is ready: an I (on the way down, then up), an F (up, then down),
// the oldest W waiting; where none is, it waits for the next action to end. Each action takes its
// stage's time in `times` (one slot each where empty): in unit slots, an action ready at the slot's
// start runs in it. Nothing where every device waits and none will end (the bound alone, with times
// of their own, can fill a device with micro-batches on their way down whose way back finds no room).
std::optional<Schedule> v_order(const char* name, int devices, int micro_batches, int held_bound, ForwardRule rule,
                                const std::vector<ActionTimes>& times) {
  const int K = devices, M = micro_batches, S = 2 * K;
  Schedule s = detail::empty_schedule(name, K, M, 2, true, place_stages(StagePlacement::kV, K, 2));
  auto time_of = [&times](int stage, ActionKind kind) {
    if (times.empty()) return 1.0;
    const ActionTimes& t = times[static_cast<size_t>(stage)];
    return kind == ActionKind::kForward ? t.forward : kind == ActionKind::kInputGrad ? t.input_grad : t.weight_grad;
  };
  // Per stage: when its F's and I's end (by micro-batch), and the next F and I to run, each in
  // micro-batch order.
  constexpr double kNever = std::numeric_limits<double>::infinity();
  std::vector<std::vector<double>> f_end(static_cast<size_t>(S), std::vector<double>(static_cast<size_t>(M), kNever));
  auto i_end = f_end;
  std::vector<int> next_f(static_cast<size_t>(S), 0), next_i(static_cast<size_t>(S), 0);
  std::vector<std::deque<std::pair<int, int>>> waiting_w(static_cast<size_t>(K));  // (stage, micro-batch)
  std::vector<int> held(static_cast<size_t>(K), 0);
  std::vector<double> free_at(static_cast<size_t>(K), 0.0);
  std::multiset<double> ends;  // of the actions placed, to wait for the next
  auto ended = [](const std::vector<std::vector<double>>& end, int stage, int i, double t) {
    return end[static_cast<size_t>(stage)][static_cast<size_t>(i)] <= t;
  };
  for (int remaining = 3 * S * M; remaining > 0;) {
    // The devices free first choose, in device order; those that find nothing ready wait for the next
    // action to end, of those placed until then.
    const double t = *std::min_element(free_at.begin(), free_at.end());
    const int remaining_before = remaining;
    std::vector<size_t> waiting;
    for (int d = 0; d < K; ++d) {
      const size_t dd = static_cast<size_t>(d);
      if (free_at[dd] != t) continue;
      auto& row = s.actions[dd];
      const int down = d, up = S - 1 - d;  // the device's stage on the way down, and on the way back up
      // The I of `stage` is ready when its F has ended and the next stage's I has (the last stage: its F alone).
      auto i_ready = [&](int stage) {
        const int i = next_i[static_cast<size_t>(stage)];
        return i < next_f[static_cast<size_t>(stage)] && ended(f_end, stage, i, t) &&
               (stage == S - 1 || ended(i_end, stage + 1, i, t));
      };
      auto f_ready = [&](int stage) {
        const int i = next_f[static_cast<size_t>(stage)];
        if (i >= M || (stage > 0 && !ended(f_end, stage - 1, i, t))) return false;
        const int coming_back = next_f[static_cast<size_t>(down)] - next_f[static_cast<size_t>(up)];
        const bool room_to_come_back = held[dd] + coming_back + 2 <= held_bound;
        if (rule == ForwardRule::kUnderTheBound) return held[dd] < held_bound;
        if (rule == ForwardRule::kUnderTheBoundWithRoom)
          return held[dd] < held_bound && (stage == up || room_to_come_back);
        return stage == up || room_to_come_back;
      };
      auto run = [&](int stage, ActionKind kind, int i) {
        row.push_back(detail::compute(stage, kind, i));
        free_at[dd] = t + time_of(stage, kind);
        ends.insert(free_at[dd]);
        --remaining;
        return free_at[dd];
      };
      auto run_next = [&](int stage, ActionKind kind) {
        const size_t ss = static_cast<size_t>(stage);
        if (kind == ActionKind::kForward) {
          const int i = next_f[ss]++;
          f_end[ss][static_cast<size_t>(i)] = run(stage, kind, i);
          ++held[dd];
        } else {
          const int i = next_i[ss]++;
          i_end[ss][static_cast<size_t>(i)] = run(stage, kind, i);
          waiting_w[dd].push_back({stage, i});
        }
      };
      if (i_ready(down)) {
        run_next(down, ActionKind::kInputGrad);
      } else if (i_ready(up)) {
        run_next(up, ActionKind::kInputGrad);
      } else if (f_ready(up)) {
        run_next(up, ActionKind::kForward);
      } else if (f_ready(down)) {
        run_next(down, ActionKind::kForward);
      } else if (!waiting_w[dd].empty()) {
        const auto [stage, i] = waiting_w[dd].front();
        waiting_w[dd].pop_front();
        run(stage, ActionKind::kWeightGrad, i);
        --held[dd];
      } else {
        waiting.push_back(dd);
      }
    }
    if (waiting.empty()) continue;
    // Where an action was placed at t after a device looked, the device looks again at t (one of no
    // time, a stage without weights' W, may have readied it); else it waits for the next to end.
    const auto next = ends.upper_bound(t);
    const bool placed_now = remaining < remaining_before;
    if (next == ends.end() && !placed_now) return std::nullopt;
    for (size_t dd : waiting) free_at[dd] = placed_now ? t : *next;
  }
  return s;
}

// v_order's schedule, checked; where zbv's bound alone leaves the devices waiting for each other (with
// times of their own), ordered again keeping room for every micro-batch to come back.
Schedule v_schedule(const char* name, int devices, int micro_batches, int held_bound, ForwardRule rule,
                    const std::vector<ActionTimes>& times) {
  detail::check_shape(devices, micro_batches, 2);
  GPIPE_CHECK(times.empty() || times.size() == static_cast<size_t>(2 * devices), "the ", name, " schedule of ",
              devices, " devices runs ", 2 * devices, " stages, but ", times.size(),
              times.size() == 1 ? " stage's times were" : " stages' times were", " given; give one per stage, or none");
  for (size_t stage = 0; stage < times.size(); ++stage) {
    const ActionTimes& t = times[stage];
    GPIPE_CHECK(t.forward >= 0 && t.input_grad >= 0 && t.weight_grad >= 0 && std::isfinite(t.forward) &&
                    std::isfinite(t.input_grad) && std::isfinite(t.weight_grad),
                "stage ", stage, "'s action times must be finite and at least 0 (got F ", t.forward, ", I ",
                t.input_grad, ", W ", t.weight_grad, "); give each stage's F, I and W in seconds, or no times");
  }
  std::optional<Schedule> s = v_order(name, devices, micro_batches, held_bound, rule, times);
  if (!s && rule == ForwardRule::kUnderTheBound)
    s = v_order(name, devices, micro_batches, held_bound, ForwardRule::kUnderTheBoundWithRoom, times);
  if (!s) {  // not a bad argument: no caller may take it for a shape the schedule does not run
    std::ostringstream given;  // the times, so that a report can be reproduced
    for (const ActionTimes& t : times)
      given << (given.tellp() > 0 ? ", " : "") << "{" << t.forward << ", " << t.input_grad << ", " << t.weight_grad
            << "}";
    throw std::logic_error("gpipe: the " + std::string(name) + " schedule of " + std::to_string(devices) +
                           " devices and " + std::to_string(micro_batches) + " micro-batches left every device "
                           "waiting (stage times: " + (times.empty() ? std::string("none") : given.str()) +
                           "); this is a bug in gpipe");
  }
  return std::move(*s);
}

}  // namespace

std::string order_name(const std::vector<ActionTimes>& times) { return times.empty() ? "unit" : "stage_times"; }

Schedule zbv(int devices, int micro_batches, const std::vector<ActionTimes>& times) {
  return v_schedule("zbv", devices, micro_batches, 2 * devices, ForwardRule::kUnderTheBound, times);
}

Schedule v_half(int devices, int micro_batches, const std::vector<ActionTimes>& times) {
  return v_schedule("v-half", devices, micro_batches, devices + 1, ForwardRule::kRoomToComeBack, times);
}

}  // namespace gpipe
