// schedule.cc: schedule generators, the lowering pass that adds sends and receives, the validator,
// the simulator and the grid printer.
#include "gpipe/schedule.h"

#include "gpipe/check.h"

#include <algorithm>
#include <cmath>
#include <deque>
#include <limits>
#include <map>
#include <numeric>
#include <optional>
#include <ostream>
#include <regex>
#include <set>
#include <sstream>
#include <stdexcept>
#include <tuple>

namespace gpipe {

std::string to_string(Checkpoint mode) {
  switch (mode) {
    case Checkpoint::kAlways: return "always";
    case Checkpoint::kExceptLast: return "except_last";
    case Checkpoint::kNever: return "never";
  }
  return "?";
}

Checkpoint parse_checkpoint(const std::string& text) {
  for (Checkpoint mode : {Checkpoint::kAlways, Checkpoint::kExceptLast, Checkpoint::kNever})
    if (text == to_string(mode)) return mode;
  GPIPE_CHECK(false, "unknown checkpoint mode \"", text, "\"; use always, except_last or never");
  return Checkpoint::kNever;
}

std::vector<std::string> checkpoint_names() {
  return {to_string(Checkpoint::kAlways), to_string(Checkpoint::kExceptLast), to_string(Checkpoint::kNever)};
}

// ---------------------------------------------------------------- actions

Channel skip_channel(int skip, bool gradient) { return static_cast<Channel>(2 + 2 * skip + (gradient ? 1 : 0)); }

int skip_of(Channel channel) {
  const int c = static_cast<int>(channel);
  return c >= 2 ? (c - 2) / 2 : -1;
}

bool carries_gradient(Channel channel) { return static_cast<int>(channel) % 2 == 1; }

std::string Action::str() const {
  const std::string s = std::to_string(stage), i = std::to_string(micro_batch);
  const int skip = skip_of(channel);
  const std::string what = skip < 0 ? (channel == Channel::kActivation ? "F" : "B")
                                    : (carries_gradient(channel) ? "G" : "S") + std::to_string(skip) + ".";
  switch (kind) {
    case ActionKind::kSend: return s + "SEND_" + what + i + ">" + std::to_string(peer);
    case ActionKind::kRecv: return s + "RECV_" + what + i + "<" + std::to_string(peer);
    default: return s + static_cast<char>(kind) + i + (recompute ? "r" : "");
  }
}

std::ostream& operator<<(std::ostream& out, const Action& action) { return out << action.str(); }

bool Action::operator==(const Action& other) const {
  return stage == other.stage && kind == other.kind && micro_batch == other.micro_batch &&
         recompute == other.recompute && (is_compute() || (channel == other.channel && peer == other.peer));
}

Action Action::parse(const std::string& text) {
  static const std::regex compute(R"((\d{1,9})([FBIW])(\d{1,9})(r?))");
  static const std::regex comm(R"((\d{1,9})(SEND|RECV)_([FB]|[SG]\d{1,6}\.)(\d{1,9})([<>])(\d{1,9}))");
  std::smatch m;
  Action a;
  if (std::regex_match(text, m, compute)) {
    a.stage = std::stoi(m[1]);
    a.kind = static_cast<ActionKind>(m[2].str()[0]);
    a.micro_batch = std::stoi(m[3]);
    a.recompute = m[4].length() > 0;
    GPIPE_CHECK(!a.recompute || a.kind == ActionKind::kForward, "cannot parse action \"", text,
                "\": only a forward carries the recompute flag r");
    return a;
  }
  if (std::regex_match(text, m, comm)) {
    a.stage = std::stoi(m[1]);
    a.kind = m[2] == "SEND" ? ActionKind::kSend : ActionKind::kRecv;
    const std::string what = m[3];
    if (what == "F" || what == "B")
      a.channel = what == "F" ? Channel::kActivation : Channel::kGradient;
    else
      a.channel = skip_channel(std::stoi(what.substr(1)), what[0] == 'G');
    a.micro_batch = std::stoi(m[4]);
    GPIPE_CHECK((m[5] == ">") == (a.kind == ActionKind::kSend), "cannot parse action \"", text,
                "\": a send is written SEND_F0>2 (to stage 2), a receive RECV_F0<1 (from stage 1)");
    a.peer = std::stoi(m[6]);
    return a;
  }
  GPIPE_CHECK(false, "cannot parse action \"", text,
              "\": expected <stage><F|B|I|W><micro-batch>[r] such as \"1F0\", or a send or receive such as "
              "\"1SEND_F0>2\" / \"2RECV_F0<1\" (a skip connection's: \"0SEND_S1.0>2\", \"2SEND_G1.0>0\")");
  return a;
}

bool Schedule::lowered() const {
  for (const auto& row : actions)
    for (const Action& a : row)
      if (!a.is_compute()) return true;
  return false;
}

std::vector<int> Schedule::stages_of(int device) const {
  std::vector<int> out;
  for (int s = 0; s < static_cast<int>(placement.size()); ++s)
    if (placement[static_cast<size_t>(s)] == device) out.push_back(s);
  return out;
}

// ---------------------------------------------------------------- generators

namespace {

void check_shape(int devices, int micro_batches, int virtual_stages = 1) {
  GPIPE_CHECK(devices >= 1, "a schedule needs at least 1 device (got ", devices, ")");
  GPIPE_CHECK(micro_batches >= 1, "a schedule needs at least 1 micro-batch (got ", micro_batches, ")");
  GPIPE_CHECK(virtual_stages >= 1, "a schedule needs at least 1 stage per device (got ", virtual_stages, ")");
  // Every stage has an action per micro-batch and kind, each a few dozen bytes, lowered and simulated.
  constexpr int64_t kMostStageMicroBatches = int64_t{1} << 21;
  const int64_t cells = int64_t{devices} * virtual_stages * micro_batches;
  GPIPE_CHECK(cells <= kMostStageMicroBatches, "a schedule of ", devices, " devices x ", virtual_stages,
              " stages each x ", micro_batches, " micro-batches has ", cells,
              " (stage, micro-batch) pairs, more than the ", kMostStageMicroBatches,
              " gpipe plans in memory; use fewer micro-batches or stages");
}

// A schedule with empty rows and stage s on device placement[s], or s mod K when `placement` is empty.
Schedule empty_schedule(const std::string& name, int devices, int micro_batches, int virtual_stages, bool backward,
                        const std::vector<int>& placement = {}) {
  Schedule s;
  s.name = name;
  s.devices = devices;
  s.stages = devices * virtual_stages;
  s.micro_batches = micro_batches;
  s.backward = backward;
  if (placement.empty()) {
    s.placement = place_stages(StagePlacement::kLoop, devices, virtual_stages);
  } else {
    GPIPE_CHECK(static_cast<int>(placement.size()) == s.stages, "a placement of ", placement.size(),
                " stages for ", devices, " devices x ", virtual_stages, " stages each; give ", s.stages);
    for (int d : placement)
      GPIPE_CHECK(d >= 0 && d < devices, "the placement puts a stage on device ", d, ", outside 0..", devices - 1);
    s.placement = placement;
  }
  s.actions.resize(static_cast<size_t>(devices));
  return s;
}

Action compute(int stage, ActionKind kind, int micro_batch) {
  Action a;
  a.stage = stage;
  a.kind = kind;
  a.micro_batch = micro_batch;
  return a;
}

}  // namespace

Schedule fill_drain(int devices, int micro_batches, int virtual_stages, const std::vector<int>& placement) {
  check_shape(devices, micro_batches, virtual_stages);
  Schedule s = empty_schedule("gpipe", devices, micro_batches, virtual_stages, true, placement);
  for (int d = 0; d < devices; ++d) {
    auto& row = s.actions[static_cast<size_t>(d)];
    const std::vector<int> mine = s.stages_of(d);
    for (int stage : mine)
      for (int i = 0; i < micro_batches; ++i) row.push_back(compute(stage, ActionKind::kForward, i));
    for (auto it = mine.rbegin(); it != mine.rend(); ++it)
      for (int i = micro_batches - 1; i >= 0; --i) row.push_back(compute(*it, ActionKind::kBackward, i));
  }
  return s;
}

Schedule one_f_one_b(int devices, int micro_batches) {
  check_shape(devices, micro_batches);
  Schedule s = empty_schedule("1f1b", devices, micro_batches, 1, true);
  const int M = micro_batches;
  for (int d = 0; d < devices; ++d) {
    auto& row = s.actions[static_cast<size_t>(d)];
    const int warmup = std::min(devices - 1 - d, M);
    for (int i = 0; i < warmup; ++i) row.push_back(compute(d, ActionKind::kForward, i));
    for (int i = 0; i < M - warmup; ++i) {  // steady state: one forward, one backward
      row.push_back(compute(d, ActionKind::kForward, warmup + i));
      row.push_back(compute(d, ActionKind::kBackward, i));
    }
    for (int i = M - warmup; i < M; ++i) row.push_back(compute(d, ActionKind::kBackward, i));  // drain
  }
  return s;
}

Schedule interleaved(int devices, int micro_batches, int virtual_stages) {
  check_shape(devices, micro_batches, virtual_stages);
  const int K = devices, M = micro_batches, V = virtual_stages;
  const ScheduleTraits& traits = schedule_traits(ScheduleKind::kInterleaved);
  traits.check_virtual_stages(V);
  traits.check_micro_batches(K, M);
  Schedule s = empty_schedule("interleaved", K, M, V, true);
  // The k-th forward (backward) of a device: its v-th stage (stage v·K + d) and micro-batch,
  // taking K micro-batches through its stage 0, then through its stage 1, ... (Megatron-LM's order).
  auto micro_batch = [&](int k) { return (k / (K * V)) * K + k % K; };
  auto forward_stage = [&](int k) { return (k / K) % V; };
  auto backward_stage = [&](int k) { return V - 1 - (k / K) % V; };
  const int total = M * V;
  for (int d = 0; d < K; ++d) {
    auto& row = s.actions[static_cast<size_t>(d)];
    auto forward = [&](int k) { row.push_back(compute(forward_stage(k) * K + d, ActionKind::kForward, micro_batch(k))); };
    auto backward = [&](int k) { row.push_back(compute(backward_stage(k) * K + d, ActionKind::kBackward, micro_batch(k))); };
    const int warmup = std::min(2 * (K - 1 - d) + (V - 1) * K, total);
    for (int k = 0; k < warmup; ++k) forward(k);
    for (int k = 0; k < total - warmup; ++k) {
      forward(warmup + k);
      backward(k);
    }
    for (int k = total - warmup; k < total; ++k) backward(k);
  }
  return s;
}

Schedule zb1p(int devices, int micro_batches) {
  check_shape(devices, micro_batches);
  const int K = devices, M = micro_batches;
  Schedule s = empty_schedule("zb1p", K, M, 1, true);
  // A unit-time list schedule. When free, device d runs, in this order of preference:
  //   the next I (in micro-batch order) whose gradient is there;
  //   the next F whose input is there, while fewer than K-d micro-batches await their I (1F1B's bound);
  //   the oldest W waiting.
  constexpr int kNever = std::numeric_limits<int>::max();
  std::vector<std::vector<int>> f_end(static_cast<size_t>(K), std::vector<int>(static_cast<size_t>(M), kNever));
  auto i_end = f_end;
  std::vector<int> next_f(static_cast<size_t>(K), 0), next_i(static_cast<size_t>(K), 0);
  std::vector<std::deque<int>> waiting_w(static_cast<size_t>(K));
  int remaining = 3 * K * M;
  for (int t = 0; remaining > 0; ++t) {
    for (int d = 0; d < K; ++d) {
      const size_t dd = static_cast<size_t>(d);
      auto& row = s.actions[dd];
      const int f = next_f[dd], i = next_i[dd];
      const bool i_ready = i < f && f_end[dd][static_cast<size_t>(i)] <= t &&
                           (d == K - 1 || i_end[dd + 1][static_cast<size_t>(i)] <= t);
      const bool f_ready = f < M && f - i < K - d && (d == 0 || f_end[dd - 1][static_cast<size_t>(f)] <= t);
      if (i_ready) {
        row.push_back(compute(d, ActionKind::kInputGrad, i));
        i_end[dd][static_cast<size_t>(i)] = t + 1;
        waiting_w[dd].push_back(i);
        ++next_i[dd];
      } else if (f_ready) {
        row.push_back(compute(d, ActionKind::kForward, f));
        f_end[dd][static_cast<size_t>(f)] = t + 1;
        ++next_f[dd];
      } else if (!waiting_w[dd].empty()) {
        row.push_back(compute(d, ActionKind::kWeightGrad, waiting_w[dd].front()));
        waiting_w[dd].pop_front();
      } else {
        continue;  // idle this slot
      }
      --remaining;
    }
  }
  return s;
}

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
  Schedule s = empty_schedule(name, K, M, 2, true, place_stages(StagePlacement::kV, K, 2));
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
        row.push_back(compute(stage, kind, i));
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
  check_shape(devices, micro_batches, 2);
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

Schedule forward_only(int devices, int micro_batches, int virtual_stages, const std::vector<int>& placement) {
  check_shape(devices, micro_batches, virtual_stages);
  Schedule s = empty_schedule("forward", devices, micro_batches, virtual_stages, false, placement);
  for (int stage = 0; stage < s.stages; ++stage)
    for (int i = 0; i < micro_batches; ++i)
      s.actions[static_cast<size_t>(s.placement[static_cast<size_t>(stage)])].push_back(
          compute(stage, ActionKind::kForward, i));
  return s;
}

// ---------------------------------------------------------------- the table

std::vector<int> place_stages(StagePlacement placement, int devices, int virtual_stages) {
  const int K = devices, S = devices * virtual_stages;
  std::vector<int> out;
  for (int stage = 0; stage < S; ++stage)
    out.push_back(placement == StagePlacement::kLoop ? stage % K : stage < K ? stage : S - 1 - stage);
  return out;
}

const std::vector<ScheduleTraits>& schedule_table() {
  // One entry per schedule, in the order help texts list them; the memory bounds are those the
  // generators' comments in schedule.h derive (tests/schedule_test.cc checks them by simulation).
  static const std::vector<ScheduleTraits> table = [] {
    const std::string one_stage =
        " schedule runs one stage per device, but {V} stages per device were asked for; use the interleaved "
        "schedule (or zbv or v-half for 2), or 1 stage per device";
    const std::string v_stages =
        " schedule runs 2 stages per device, placed as a V (got {V}); leave V to the schedule (2), or use interleaved "
        "for another V";
    std::vector<ScheduleTraits> t(6);
    t[0].kind = ScheduleKind::kGPipe;
    t[0].name = "gpipe";
    t[0].summary = "fill-drain";
    t[0].generate = [](int K, int M, int, const std::vector<ActionTimes>&) { return fill_drain(K, M); };
    t[0].peak_in_flight = [](int, int M, int V, int) { return V * M; };  // every micro-batch, until the drain
    t[1].kind = ScheduleKind::k1F1B;
    t[1].name = "1f1b";
    t[1].summary = "one forward, one backward: PipeDream-Flush";
    t[1].generate = [](int K, int M, int, const std::vector<ActionTimes>&) { return one_f_one_b(K, M); };
    t[1].peak_in_flight = [](int K, int M, int, int d) { return std::min(K - d, M); };
    t[2].kind = ScheduleKind::kInterleaved;
    t[2].name = "interleaved";
    t[2].summary = "1F1B over V stages per device: Megatron-LM's";
    t[2].generate = [](int K, int M, int V, const std::vector<ActionTimes>&) { return interleaved(K, M, V); };
    t[2].default_virtual_stages = 2;
    t[2].least_virtual_stages = 2;
    t[2].most_virtual_stages = 0;
    t[2].virtual_stages_rule = "the interleaved schedule needs at least 2 stages per device (got {V}); set virtual "
                               "stages V >= 2, or use 1f1b for one stage per device";
    t[2].micro_batches_multiple_of_devices = true;
    t[2].peak_in_flight = [](int K, int M, int V, int d) { return std::min((V - 1) * K + 2 * (K - 1 - d) + 1, V * M); };
    t[3].kind = ScheduleKind::kZB1P;
    t[3].name = "zb1p";
    t[3].summary = "zero bubble ZB-H1, backward split into I and W";
    t[3].generate = [](int K, int M, int, const std::vector<ActionTimes>&) { return zb1p(K, M); };
    t[3].splits_backward = true;
    t[3].peak_in_flight = [](int, int M, int, int) { return M; };  // the W's wait for the drain
    t[4].kind = ScheduleKind::kZBV;
    t[4].name = "zbv";
    t[4].summary = "zero bubble ZB-V, 2 stages per device placed as a V";
    t[4].generate = [](int K, int M, int, const std::vector<ActionTimes>& times) { return zbv(K, M, times); };
    t[4].peak_in_flight = [](int K, int M, int, int) { return std::min(2 * K, 2 * M); };
    t[5].kind = ScheduleKind::kVHalf;
    t[5].name = "v-half";
    t[5].summary = "zbv's V in (K+1)/2K of its activation memory";
    t[5].generate = [](int K, int M, int, const std::vector<ActionTimes>& times) {
      return v_half(K, M, times);
    };
    t[5].peak_in_flight = [](int K, int M, int, int) { return std::min(K + 1, 2 * M); };
    for (ScheduleTraits& e : t) {
      if (e.kind == ScheduleKind::kZBV || e.kind == ScheduleKind::kVHalf) {
        e.default_virtual_stages = e.least_virtual_stages = e.most_virtual_stages = 2;
        e.placement = StagePlacement::kV;
        e.splits_backward = true;
        e.orders_by_times = true;
        e.virtual_stages_rule = "the " + e.name + v_stages;
      } else if (e.virtual_stages_rule.empty()) {
        e.virtual_stages_rule = "the " + e.name + one_stage;
      }
    }
    return t;
  }();
  return table;
}

const ScheduleTraits& schedule_traits(ScheduleKind kind) {
  for (const ScheduleTraits& traits : schedule_table())
    if (traits.kind == kind) return traits;
  GPIPE_CHECK(false, "schedule ", static_cast<int>(kind), " has no entry in the schedule table");
  return schedule_table().front();
}

bool ScheduleTraits::takes_virtual_stages(int virtual_stages) const {
  return virtual_stages >= least_virtual_stages && (most_virtual_stages == 0 || virtual_stages <= most_virtual_stages);
}

void ScheduleTraits::check_virtual_stages(int virtual_stages) const {
  if (takes_virtual_stages(virtual_stages)) return;
  std::string text = virtual_stages_rule;
  const size_t at = text.find("{V}");
  if (at != std::string::npos) text.replace(at, 3, std::to_string(virtual_stages));
  GPIPE_CHECK(false, text);
}

void ScheduleTraits::check_micro_batches(int devices, int micro_batches) const {
  const int K = devices, M = micro_batches;
  GPIPE_CHECK(!micro_batches_multiple_of_devices || M % K == 0, "the ", name, " schedule takes micro-batches ", K,
              " at a time, one per device, so M (", M, ") must be a multiple of K (", K, "); use M = ",
              K * std::max(1, (M + K - 1) / K), " or another schedule");
}

std::string to_string(ScheduleKind kind) {
  for (const ScheduleTraits& traits : schedule_table())
    if (traits.kind == kind) return traits.name;
  return "?";
}

std::vector<ScheduleKind> all_schedules() {
  std::vector<ScheduleKind> kinds;
  for (const ScheduleTraits& traits : schedule_table()) kinds.push_back(traits.kind);
  return kinds;
}

std::vector<std::string> schedule_names() {
  std::vector<std::string> names;
  for (const ScheduleTraits& traits : schedule_table()) names.push_back(traits.name);
  return names;
}

bool v_shaped(ScheduleKind kind) { return schedule_traits(kind).placement == StagePlacement::kV; }

int default_virtual_stages(ScheduleKind kind) { return schedule_traits(kind).default_virtual_stages; }

bool takes_virtual_stages(ScheduleKind kind, int virtual_stages) {
  return schedule_traits(kind).takes_virtual_stages(virtual_stages);
}

void check_virtual_stages(ScheduleKind kind, int virtual_stages) {
  schedule_traits(kind).check_virtual_stages(virtual_stages);
}

const ScheduleTraits& find_schedule(const std::string& name) {
  for (const ScheduleTraits& traits : schedule_table())
    if (name == traits.name) return traits;
  std::string names;
  for (const std::string& known : schedule_names()) names += (names.empty() ? "" : "|") + known;
  GPIPE_CHECK(false, "unknown schedule \"", name, "\"; use one of ", names);
  return schedule_table().front();
}

ScheduleKind parse_schedule(const std::string& text) { return find_schedule(text).kind; }

namespace {

// "a", "a or b", "a, b or c" (`last` "and": "a, b and c").
std::string listed(const std::vector<std::string>& items, const char* last = " or ") {
  std::string out;
  for (size_t n = 0; n < items.size(); ++n)
    out += (n == 0 ? "" : n + 1 == items.size() ? last : ", ") + items[n];
  return out;
}

}  // namespace

std::string schedule_help() {
  std::vector<std::string> items;
  for (const ScheduleTraits& e : schedule_table())
    items.push_back(e.name + " (" + e.summary + (e.micro_batches_multiple_of_devices ? "; M a multiple of K" : "") + ")");
  return listed(items);
}

std::string virtual_stages_help() {
  // The schedules grouped by the V they take, in the table's order; those of one stage per device last.
  std::vector<std::pair<std::string, std::vector<std::string>>> groups;
  std::vector<std::string> single;
  for (const ScheduleTraits& e : schedule_table()) {
    if (!e.chooses_virtual_stages() && e.least_virtual_stages == 1) {
      single.push_back(e.name);
      continue;
    }
    std::string rule = std::to_string(e.least_virtual_stages);
    if (e.chooses_virtual_stages())
      rule += (e.most_virtual_stages == 0 ? " or more" : " to " + std::to_string(e.most_virtual_stages)) +
              ", default " + std::to_string(e.default_virtual_stages);
    if (e.placement == StagePlacement::kV) rule += ", placed as a V (stages d and 2K-1-d on device d)";
    auto it = std::find_if(groups.begin(), groups.end(), [&](const auto& g) { return g.first == rule; });
    if (it == groups.end()) it = groups.emplace(groups.end(), rule, std::vector<std::string>{});
    it->second.push_back(e.name);
  }
  std::string out;
  for (const auto& [rule, names] : groups) out += (out.empty() ? "" : "; ") + listed(names, " and ") + ": " + rule;
  if (!single.empty()) out += (out.empty() ? listed(single, " and ") : "; the others") + std::string(": 1");
  return out;
}

std::string schedules_placed(StagePlacement placement) {
  std::vector<std::string> names;
  for (const ScheduleTraits& e : schedule_table())
    if (e.placement == placement) names.push_back(e.name);
  return listed(names);
}

Schedule make_schedule(ScheduleKind kind, int devices, int micro_batches, int virtual_stages,
                       const std::vector<ActionTimes>& times) {
  check_shape(devices, micro_batches, virtual_stages);
  const ScheduleTraits& traits = schedule_traits(kind);
  traits.check_virtual_stages(virtual_stages);
  traits.check_micro_batches(devices, micro_batches);
  return traits.generate(devices, micro_batches, virtual_stages,
                         traits.orders_by_times ? times : std::vector<ActionTimes>{});
}

// ---------------------------------------------------------------- lowering

Schedule lower(const Schedule& schedule, Checkpoint mode, const std::vector<SkipRoute>& skips) {
  GPIPE_CHECK(!schedule.lowered(), "the ", schedule.name, " schedule is already lowered");
  Schedule program = schedule;
  program.skips = skips;
  const int S = schedule.stages;
  for (size_t k = 0; k < skips.size(); ++k)
    GPIPE_CHECK(skips[k].from >= 0 && skips[k].from < skips[k].to && skips[k].to < S, "skip connection ", k,
                " goes from stage ", skips[k].from, " to stage ", skips[k].to,
                "; it must go forward, between two stages of 0..", S - 1);
  for (auto& row : program.actions) {
    std::vector<Action> out;
    for (size_t n = 0; n < row.size(); ++n) {
      Action a = row[n];
      auto comm = [&](ActionKind kind, Channel channel, int peer) {
        Action c = compute(a.stage, kind, a.micro_batch);
        c.channel = channel;
        c.peer = peer;
        out.push_back(c);
      };
      // The skip connections this stage pops (stashed upstream) and stashes (popped downstream).
      auto skip_comm = [&](ActionKind kind, bool popped_here, bool gradient) {
        for (size_t k = 0; k < skips.size(); ++k) {
          const SkipRoute& r = skips[k];
          if ((popped_here ? r.to : r.from) == a.stage)
            comm(kind, skip_channel(static_cast<int>(k), gradient), popped_here ? r.from : r.to);
        }
      };
      if (a.kind == ActionKind::kForward) {
        if (schedule.backward) {
          // The next compute action of this device after the forward.
          const Action* next = n + 1 < row.size() ? &row[n + 1] : nullptr;
          const bool follows = next != nullptr && next->is_backward() && next->stage == a.stage &&
                               next->micro_batch == a.micro_batch;
          a.recompute = mode == Checkpoint::kAlways || (mode == Checkpoint::kExceptLast && !follows);
        }
        if (a.stage > 0) comm(ActionKind::kRecv, Channel::kActivation, a.stage - 1);
        skip_comm(ActionKind::kRecv, /*popped_here=*/true, /*gradient=*/false);
        out.push_back(a);
        if (a.stage < S - 1) comm(ActionKind::kSend, Channel::kActivation, a.stage + 1);
        skip_comm(ActionKind::kSend, /*popped_here=*/false, /*gradient=*/false);
      } else if (a.is_backward()) {
        if (a.stage < S - 1) comm(ActionKind::kRecv, Channel::kGradient, a.stage + 1);
        skip_comm(ActionKind::kRecv, /*popped_here=*/false, /*gradient=*/true);
        out.push_back(a);
        if (a.stage > 0) comm(ActionKind::kSend, Channel::kGradient, a.stage - 1);
        skip_comm(ActionKind::kSend, /*popped_here=*/true, /*gradient=*/true);
      } else {
        out.push_back(a);
      }
    }
    row = std::move(out);
  }
  return program;
}

// ---------------------------------------------------------------- validation and simulation

namespace {

// The lists, one row a device, with "<-- ERROR HERE" after row `bad_device`.
std::string format_lists(const Schedule& schedule, int bad_device) {
  std::ostringstream out;
  for (size_t d = 0; d < schedule.actions.size(); ++d) {
    out << "device " << d << " |";
    for (const Action& a : schedule.actions[d]) out << ' ' << a.str();
    if (static_cast<int>(d) == bad_device) out << "  <-- ERROR HERE";
    out << '\n';
  }
  return out.str();
}

[[noreturn]] void fail(const Schedule& schedule, int bad_device, const std::string& why) {
  throw std::invalid_argument("gpipe: invalid " + (schedule.name.empty() ? std::string() : schedule.name + " ") +
                              "schedule: " + why + "\n" + format_lists(schedule, bad_device));
}

using CommKey = std::tuple<int, int, int, int>;  // (from stage, to stage, channel, micro-batch)

CommKey comm_key(const Action& a) {
  const bool send = a.kind == ActionKind::kSend;
  return {send ? a.stage : a.peer, send ? a.peer : a.stage, static_cast<int>(a.channel), a.micro_batch};
}

void check_structure(const Schedule& schedule) {
  const int K = schedule.devices, S = schedule.stages, M = schedule.micro_batches;
  if (K < 1 || M < 1 || S < K) fail(schedule, -1, "devices and micro-batches must be at least 1, and stages at least devices");
  if (static_cast<int>(schedule.placement.size()) != S)
    fail(schedule, -1, "the placement names " + std::to_string(schedule.placement.size()) + " stages, expected " +
                           std::to_string(S));
  for (int s = 0; s < S; ++s) {
    const int d = schedule.placement[static_cast<size_t>(s)];
    if (d < 0 || d >= K) fail(schedule, -1, "stage " + std::to_string(s) + " is placed on device " + std::to_string(d) +
                                                ", outside 0.." + std::to_string(K - 1));
  }
  if (static_cast<int>(schedule.actions.size()) != K)
    fail(schedule, -1, "expected " + std::to_string(K) + " rows (one per device), got " +
                           std::to_string(schedule.actions.size()));

  // Per (stage, micro-batch): how many F, B, I, W, in order of appearance on its device.
  std::map<std::pair<int, int>, std::map<char, int>> seen;
  std::map<CommKey, int> sends, recvs;
  const bool lowered = schedule.lowered();
  for (int d = 0; d < K; ++d) {
    std::set<std::tuple<int, int, int>> received;  // (stage, channel, micro-batch) this device has taken in
    for (const Action& a : schedule.actions[static_cast<size_t>(d)]) {
      if (a.stage < 0 || a.stage >= S) fail(schedule, d, a.str() + " names a stage outside 0.." + std::to_string(S - 1));
      if (schedule.placement[static_cast<size_t>(a.stage)] != d)
        fail(schedule, d, a.str() + " is in the row of device " + std::to_string(d) + ", but stage " +
                              std::to_string(a.stage) + " is placed on device " +
                              std::to_string(schedule.placement[static_cast<size_t>(a.stage)]));
      if (a.micro_batch < 0 || a.micro_batch >= M)
        fail(schedule, d, a.str() + " names a micro-batch outside 0.." + std::to_string(M - 1));
      if (!a.is_compute()) {
        if (a.peer < 0 || a.peer >= S) fail(schedule, d, a.str() + " names a stage outside 0.." + std::to_string(S - 1));
        const int skip = skip_of(a.channel);
        if (skip < 0) {
          // Activations go to the next stage, gradients to the previous one.
          const bool towards_next = (a.kind == ActionKind::kSend) == (a.channel == Channel::kActivation);
          if (a.peer != a.stage + (towards_next ? 1 : -1))
            fail(schedule, d, a.str() + (a.channel == Channel::kActivation ? " moves an activation" : " moves a gradient") +
                                  " the wrong way: activations go from stage s to s+1, gradients from s+1 to s");
        } else {
          // A skip connection's tensor goes from its stash to its pop, its gradient back.
          if (skip >= static_cast<int>(schedule.skips.size()))
            fail(schedule, d, a.str() + " names skip connection " + std::to_string(skip) + ", but the program has " +
                                  std::to_string(schedule.skips.size()));
          const SkipRoute& r = schedule.skips[static_cast<size_t>(skip)];
          const bool towards_pop = (a.kind == ActionKind::kSend) != carries_gradient(a.channel);
          if (a.stage != (towards_pop ? r.from : r.to) || a.peer != (towards_pop ? r.to : r.from))
            fail(schedule, d, a.str() + " moves skip connection " + std::to_string(skip) + " the wrong way: it goes from "
                                  "stage " + std::to_string(r.from) + " to stage " + std::to_string(r.to) +
                                  ", its gradient back");
        }
        ++(a.kind == ActionKind::kSend ? sends : recvs)[comm_key(a)];
        if (a.kind == ActionKind::kRecv) received.insert({a.stage, static_cast<int>(a.channel), a.micro_batch});
        continue;
      }
      // In a program, an action that needs another stage's tensor comes after its receive.
      const bool needs_activation = a.kind == ActionKind::kForward && a.stage > 0;
      const bool needs_gradient = a.is_backward() && a.stage < S - 1;
      if (lowered && (needs_activation || needs_gradient) &&
          received.count({a.stage, static_cast<int>(needs_activation ? Channel::kActivation : Channel::kGradient),
                          a.micro_batch}) == 0)
        fail(schedule, d, a.str() + " has no earlier receive of its " +
                              (needs_activation ? "input from stage " + std::to_string(a.stage - 1)
                                                : "output's gradient from stage " + std::to_string(a.stage + 1)));
      auto& count = seen[{a.stage, a.micro_batch}];
      const char k = static_cast<char>(a.kind);
      if (a.kind != ActionKind::kForward && !schedule.backward)
        fail(schedule, d, a.str() + " is a backward in a forward-only schedule");
      if (a.kind != ActionKind::kForward && count['F'] == 0) fail(schedule, d, a.str() + " comes before its forward");
      if (a.kind == ActionKind::kWeightGrad && count['I'] == 0) fail(schedule, d, a.str() + " comes before its I");
      if (count[k] > 0) fail(schedule, d, a.str() + " appears twice");
      if ((a.kind == ActionKind::kBackward && (count['I'] || count['W'])) ||
          (a.kind == ActionKind::kInputGrad && count['B']))
        fail(schedule, d, a.str() + ": a micro-batch's backward is either B, or I then W, not both");
      ++count[k];
    }
  }
  for (int s = 0; s < S; ++s) {
    const int d = schedule.placement[static_cast<size_t>(s)];
    for (int i = 0; i < M; ++i) {
      auto& count = seen[{s, i}];
      const std::string name = std::to_string(s) + "F" + std::to_string(i);
      if (count['F'] != 1) fail(schedule, d, name + " is missing");
      if (schedule.backward && count['B'] == 0 && count['I'] == 0)
        fail(schedule, d, std::to_string(s) + "B" + std::to_string(i) + " (or its I and W) is missing");
      if (count['I'] == 1 && count['W'] == 0) fail(schedule, d, std::to_string(s) + "W" + std::to_string(i) + " is missing");
    }
  }
  for (const auto& [key, n] : sends)
    if (n != 1 || recvs[key] != 1) {
      const auto [from, to, channel, i] = key;
      Action a = compute(from, ActionKind::kSend, i);
      a.channel = static_cast<Channel>(channel);
      a.peer = to;
      fail(schedule, schedule.placement[static_cast<size_t>(from)],
           a.str() + " is sent " + std::to_string(n) + " time(s) and received " + std::to_string(recvs[key]) +
               " time(s); each message needs exactly one of each");
    }
  for (const auto& [key, n] : recvs)
    if (sends.count(key) == 0) {
      const auto [from, to, channel, i] = key;
      Action a = compute(to, ActionKind::kRecv, i);
      a.channel = static_cast<Channel>(channel);
      a.peer = from;
      fail(schedule, schedule.placement[static_cast<size_t>(to)], a.str() + " waits for a message no stage sends");
    }
}

}  // namespace

std::string format_program(const Schedule& program) { return format_lists(program, -1); }

Schedule parse_program(const std::string& text, const std::string& name) {
  // The rows first (a row of device 0 begins the program again: gpipe schedule --program prints its
  // grid, whose idle slots are no actions, before it), then their actions.
  struct Row {
    int line;
    std::string actions;
  };
  std::vector<Row> rows;
  std::istringstream in(text);
  int number = 0;
  for (std::string line; std::getline(in, line);) {
    ++number;
    const size_t bar = line.find('|'), first = line.find_first_not_of(" \t\r");
    if (bar == std::string::npos || line[first] == '#') continue;
    std::istringstream head(line.substr(0, bar));
    std::string word, rest;
    int device = -1;
    GPIPE_CHECK((head >> word) && word == "device" && (head >> device) && !(head >> rest), "line ", number,
                " of the program is not a row \"device D | actions\": \"", line.substr(0, bar),
                "|\"; give one row per device, as the program the gpipe schedule command prints");
    if (device == 0) rows.clear();
    GPIPE_CHECK(device == static_cast<int>(rows.size()), "line ", number, " of the program is the row of device ",
                device, " where the row of device ", rows.size(), " comes; give one row per device, in order from device 0");
    rows.push_back({number, line.substr(bar + 1)});
  }
  GPIPE_CHECK(!rows.empty(), "the program has no rows; give one line \"device D | actions\" per device, as the "
              "program the gpipe schedule command prints");

  Schedule program;
  program.name = name;
  program.devices = static_cast<int>(rows.size());
  size_t count = 0;
  for (const Row& row : rows) {
    std::vector<Action> actions;
    std::istringstream words(row.actions);
    for (std::string word; words >> word;) {
      try {
        actions.push_back(Action::parse(word));
      } catch (const std::invalid_argument& e) {
        GPIPE_CHECK(false, "line ", row.line, " of the program: ", without_program_name(e.what()),
                    word == "." ? " (an idle slot of the grid the gpipe schedule command prints: give the program it prints)"
                                : "");
      }
      program.stages = std::max(program.stages, actions.back().stage + 1);
      program.micro_batches = std::max(program.micro_batches, actions.back().micro_batch + 1);
    }
    count += actions.size();
    program.actions.push_back(std::move(actions));
  }
  // Every stage has at least its forwards, so a stage beyond the actions' count is a typo (and not a
  // placement of a billion entries).
  GPIPE_CHECK(static_cast<size_t>(program.stages) <= count, "the program names stage ", program.stages - 1,
              " but holds only ", count, " actions, too few for ", program.stages, " stages; check its stage numbers");
  program.placement.assign(static_cast<size_t>(program.stages), -1);
  for (int d = 0; d < program.devices; ++d)
    for (const Action& a : program.actions[static_cast<size_t>(d)]) {
      int& placed = program.placement[static_cast<size_t>(a.stage)];
      GPIPE_CHECK(placed < 0 || placed == d, "line ", rows[static_cast<size_t>(d)].line, " of the program: ", a.str(),
                  " is in the row of device ", d, ", but stage ", a.stage, " is in the row of device ", placed,
                  " (line ", rows[static_cast<size_t>(std::max(placed, 0))].line,
                  "); a stage runs on one device: keep its actions in one row");
      placed = d;
    }
  for (int s = 0; s < program.stages; ++s)
    GPIPE_CHECK(program.placement[static_cast<size_t>(s)] >= 0, "the program names stages up to ", program.stages - 1,
                " but no action of stage ", s, "; every stage needs its forwards and backwards");
  return program;
}

double unit_cost(const Action& action) { return action.is_compute() ? 1.0 : 0.0; }

SimulatedRun simulate(const Schedule& schedule, const CostFn& cost, const CostFn& work_before) {
  SimulatedRun run;
  run.program = schedule.lowered() ? schedule : lower(schedule, Checkpoint::kNever);
  const Schedule& p = run.program;
  check_structure(p);
  const size_t K = p.actions.size();
  run.start.resize(K);
  run.end.resize(K);
  run.busy.assign(K, 0.0);
  run.peak_in_flight.assign(K, 0);

  std::map<CommKey, double> sent;  // when each message left
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
          const auto it = sent.find(comm_key(a));
          if (it == sent.end()) break;
          begin = std::max(begin, it->second);
        }
        if (work_before) {  // done before the action, while a receive waits
          const double work = work_before(a);
          run.busy[d] += work;
          begin = std::max(begin, free_at[d] + work);
        }
        const double finish = begin + cost(a);
        if (a.kind == ActionKind::kSend) sent[comm_key(a)] = finish;
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
      fail(p, static_cast<int>(stuck),
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
