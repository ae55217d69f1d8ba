// table.cc: the schedule table, one entry per schedule (its generator and traits), what is looked
// up in it by kind or name, the help texts made from it, and make_schedule.
#include "schedule/schedule_parts.h"

#include "gpipe/check.h"

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

namespace gpipe {

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
  detail::check_shape(devices, micro_batches, virtual_stages);
  const ScheduleTraits& traits = schedule_traits(kind);
  traits.check_virtual_stages(virtual_stages);
  traits.check_micro_batches(devices, micro_batches);
  return traits.generate(devices, micro_batches, virtual_stages,
                         traits.orders_by_times ? times : std::vector<ActionTimes>{});
}

}  // namespace gpipe
