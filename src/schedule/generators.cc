// generators.cc: the schedules that place their actions by a fixed rule (fill-drain, 1F1B,
// interleaved, forward-only) or by a unit-time list (zb1p), and the pieces every generator builds
// with. The V schedules, which order by stage times, are in v_schedules.cc.
#include "schedule/schedule_parts.h"

#include "gpipe/check.h"

#include <algorithm>
#include <cstdint>
#include <deque>
#include <limits>
#include <vector>

namespace gpipe {
namespace detail {

void check_shape(int devices, int micro_batches, int virtual_stages) {
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

Schedule empty_schedule(const std::string& name, int devices, int micro_batches, int virtual_stages, bool backward,
                        const std::vector<int>& placement) {
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

}  // namespace detail

Schedule fill_drain(int devices, int micro_batches, int virtual_stages, const std::vector<int>& placement) {
  detail::check_shape(devices, micro_batches, virtual_stages);
  Schedule s = detail::empty_schedule("gpipe", devices, micro_batches, virtual_stages, true, placement);
  for (int d = 0; d < devices; ++d) {
    auto& row = s.actions[static_cast<size_t>(d)];
    const std::vector<int> mine = s.stages_of(d);
    for (int stage : mine)
      for (int i = 0; i < micro_batches; ++i) row.push_back(detail::compute(stage, ActionKind::kForward, i));
    for (auto it = mine.rbegin(); it != mine.rend(); ++it)
      for (int i = micro_batches - 1; i >= 0; --i) row.push_back(detail::compute(*it, ActionKind::kBackward, i));
  }
  return s;
}

Schedule one_f_one_b(int devices, int micro_batches) {
  detail::check_shape(devices, micro_batches);
  Schedule s = detail::empty_schedule("1f1b", devices, micro_batches, 1, true);
  const int M = micro_batches;
  for (int d = 0; d < devices; ++d) {
    auto& row = s.actions[static_cast<size_t>(d)];
    const int warmup = std::min(devices - 1 - d, M);
    for (int i = 0; i < warmup; ++i) row.push_back(detail::compute(d, ActionKind::kForward, i));
    for (int i = 0; i < M - warmup; ++i) {  // steady state: one forward, one backward
      row.push_back(detail::compute(d, ActionKind::kForward, warmup + i));
      row.push_back(detail::compute(d, ActionKind::kBackward, i));
    }
    for (int i = M - warmup; i < M; ++i) row.push_back(detail::compute(d, ActionKind::kBackward, i));  // drain
  }
  return s;
}

Schedule interleaved(int devices, int micro_batches, int virtual_stages) {
  detail::check_shape(devices, micro_batches, virtual_stages);
  const int K = devices, M = micro_batches, V = virtual_stages;
  const ScheduleTraits& traits = schedule_traits(ScheduleKind::kInterleaved);
  traits.check_virtual_stages(V);
  traits.check_micro_batches(K, M);
  Schedule s = detail::empty_schedule("interleaved", K, M, V, true);
  // The k-th forward (backward) of a device: its v-th stage (stage v·K + d) and micro-batch,
  // taking K micro-batches through its stage 0, then through its stage 1, ... (Megatron-LM's order).
  auto micro_batch = [&](int k) { return (k / (K * V)) * K + k % K; };
  auto forward_stage = [&](int k) { return (k / K) % V; };
  auto backward_stage = [&](int k) { return V - 1 - (k / K) % V; };
  const int total = M * V;
  for (int d = 0; d < K; ++d) {
    auto& row = s.actions[static_cast<size_t>(d)];
    auto forward = [&](int k) {
      row.push_back(detail::compute(forward_stage(k) * K + d, ActionKind::kForward, micro_batch(k)));
    };
    auto backward = [&](int k) {
      row.push_back(detail::compute(backward_stage(k) * K + d, ActionKind::kBackward, micro_batch(k)));
    };
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
  detail::check_shape(devices, micro_batches);
  const int K = devices, M = micro_batches;
  Schedule s = detail::empty_schedule("zb1p", K, M, 1, true);
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
        row.push_back(detail::compute(d, ActionKind::kInputGrad, i));
        i_end[dd][static_cast<size_t>(i)] = t + 1;
        waiting_w[dd].push_back(i);
        ++next_i[dd];
      } else if (f_ready) {
        row.push_back(detail::compute(d, ActionKind::kForward, f));
        f_end[dd][static_cast<size_t>(f)] = t + 1;
        ++next_f[dd];
      } else if (!waiting_w[dd].empty()) {
        row.push_back(detail::compute(d, ActionKind::kWeightGrad, waiting_w[dd].front()));
        waiting_w[dd].pop_front();
      } else {
        continue;  // idle this slot
      }
      --remaining;
    }
  }
  return s;
}
Schedule forward_only(int devices, int micro_batches, int virtual_stages, const std::vector<int>& placement) {
  detail::check_shape(devices, micro_batches, virtual_stages);
  Schedule s = detail::empty_schedule("forward", devices, micro_batches, virtual_stages, false, placement);
  for (int stage = 0; stage < s.stages; ++stage)
    for (int i = 0; i < micro_batches; ++i)
      s.actions[static_cast<size_t>(s.placement[static_cast<size_t>(stage)])].push_back(
          detail::compute(stage, ActionKind::kForward, i));
  return s;
}

}  // namespace gpipe
