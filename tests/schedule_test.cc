// schedule_test.cc: the step-program API. Each generator's grid asserted literally, the text form,
// the lowering pass (sends, receives, recompute flags), the validator, make_schedule's refusals and
// the simulator's makespan, bubble and in-flight counts against the formulas in schedule.h.
#include "helpers.h"

#include <algorithm>
#include <random>
#include <cmath>
#include <functional>
#include <sstream>

using gpipe::Action;
using gpipe::ActionKind;
using gpipe::Channel;
using gpipe::Checkpoint;
using gpipe::Schedule;
using gpipe::ScheduleKind;

namespace {

// Device d's actions in text form.
std::vector<std::string> row(const Schedule& s, int d) {
  std::vector<std::string> out;
  for (const Action& a : s.actions[static_cast<size_t>(d)]) out.push_back(a.str());
  return out;
}

// Device d's actions in text form, joined by spaces: "0F0r 0SEND_F0>1 ...".
std::string line(const Schedule& s, int d) {
  std::string out;
  for (const Action& a : s.actions[static_cast<size_t>(d)]) out += (out.empty() ? "" : " ") + a.str();
  return out;
}

// The message of the std::invalid_argument that `f` throws; a test failure (and "") if it throws none.
std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected std::invalid_argument";
  return "";
}

// The line of a validator message that carries the "<-- ERROR HERE" mark ("" if none).
std::string marked_line(const std::string& message) {
  std::istringstream in(message);
  for (std::string l; std::getline(in, l);)
    if (l.find("<-- ERROR HERE") != std::string::npos) return l;
  return "";
}

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

// validate(s) must throw; its message must contain `why` and mark the row of `device`.
void expect_invalid(const Schedule& s, const std::string& why, int device) {
  const std::string what = error_of([&] { gpipe::validate(s); });
  EXPECT_TRUE(contains(what, why)) << "expected \"" << why << "\" in:\n" << what;
  EXPECT_EQ(marked_line(what).rfind("device " + std::to_string(device) + " |", 0), 0u)
      << "expected device " << device << "'s row marked in:\n" << what;
}

// Replaces the action written `from` in device d's row by `to` (exactly one must be there).
void replace_action(Schedule& s, int d, const std::string& from, const std::string& to) {
  auto& r = s.actions[static_cast<size_t>(d)];
  const auto it = std::find(r.begin(), r.end(), Action::parse(from));
  ASSERT_NE(it, r.end()) << from << " not in device " << d << "'s row";
  *it = Action::parse(to);
}

// Removes the action written `text` from device d's row.
void remove_action(Schedule& s, int d, const std::string& text) {
  auto& r = s.actions[static_cast<size_t>(d)];
  const auto it = std::find(r.begin(), r.end(), Action::parse(text));
  ASSERT_NE(it, r.end()) << text << " not in device " << d << "'s row";
  r.erase(it);
}

// Swaps the actions written `a` and `b` in device d's row.
void swap_actions(Schedule& s, int d, const std::string& a, const std::string& b) {
  auto& r = s.actions[static_cast<size_t>(d)];
  const auto ia = std::find(r.begin(), r.end(), Action::parse(a));
  const auto ib = std::find(r.begin(), r.end(), Action::parse(b));
  ASSERT_NE(ia, r.end()) << a;
  ASSERT_NE(ib, r.end()) << b;
  std::iter_swap(ia, ib);
}

// Every schedule the generators make for K in 1..6, M in 1..12 (interleaved: V in 2..3, M a multiple of K;
// fill-drain and forwards also over zbv's V placement).
std::vector<Schedule> all_generated() {
  std::vector<Schedule> out;
  for (int K = 1; K <= 6; ++K)
    for (int M = 1; M <= 12; ++M) {
      out.push_back(gpipe::fill_drain(K, M));
      out.push_back(gpipe::one_f_one_b(K, M));
      out.push_back(gpipe::zb1p(K, M));
      out.push_back(gpipe::zbv(K, M));
      out.push_back(gpipe::v_half(K, M));
      out.push_back(gpipe::forward_only(K, M));
      out.push_back(gpipe::forward_only(K, M, 2));
      out.push_back(gpipe::fill_drain(K, M, 2, gpipe::zbv(K, 1).placement));
      out.push_back(gpipe::forward_only(K, M, 2, gpipe::zbv(K, 1).placement));
      if (M % K == 0)
        for (int V = 2; V <= 3; ++V) out.push_back(gpipe::interleaved(K, M, V));
    }
  return out;
}

std::string shape(const Schedule& s) {
  return s.name + " K=" + std::to_string(s.devices) + " M=" + std::to_string(s.micro_batches) +
         " V=" + std::to_string(s.virtual_stages());
}

}  // namespace

// ---------------------------------------------------------------- grids

// Fill-drain, K=3, M=4: each device runs its 4 forwards one slot after the previous device, then the
// backwards in reverse order, last device first: 2(M+K-1) = 12 slots, a bubble of (K-1)/(M+K-1) = 1/3.
TEST(FillDrainTest, GridShowsFillAndDrain) {
  EXPECT_EQ(gpipe::format_grid(gpipe::fill_drain(3, 4)),
            "device 0 | 0F0 0F1 0F2 0F3  .   .   .   .  0B3 0B2 0B1 0B0\n"
            "device 1 |  .  1F0 1F1 1F2 1F3  .   .  1B3 1B2 1B1 1B0  . \n"
            "device 2 |  .   .  2F0 2F1 2F2 2F3 2B3 2B2 2B1 2B0  .   . \n");
}

TEST(FillDrainTest, TableForThreeStagesFourMicroBatches) {
  const Schedule s = gpipe::fill_drain(3, 4);
  EXPECT_EQ(s.name, "gpipe");
  EXPECT_EQ(s.devices, 3);
  EXPECT_EQ(s.stages, 3);
  EXPECT_EQ(s.micro_batches, 4);
  EXPECT_TRUE(s.backward);
  EXPECT_EQ(s.placement, (std::vector<int>{0, 1, 2}));
  EXPECT_FALSE(s.lowered());
  ASSERT_EQ(s.actions.size(), 3u);
  EXPECT_EQ(row(s, 0), (std::vector<std::string>{"0F0", "0F1", "0F2", "0F3", "0B3", "0B2", "0B1", "0B0"}));
  EXPECT_EQ(row(s, 1), (std::vector<std::string>{"1F0", "1F1", "1F2", "1F3", "1B3", "1B2", "1B1", "1B0"}));
  EXPECT_EQ(row(s, 2), (std::vector<std::string>{"2F0", "2F1", "2F2", "2F3", "2B3", "2B2", "2B1", "2B0"}));
}

// Fill-drain with two stages per device (the fallback for a batch interleaved cannot take): each
// device runs its stages' forwards in stage order, then their backwards in reverse.
TEST(FillDrainTest, TwoStagesPerDeviceTable) {
  const Schedule s = gpipe::fill_drain(2, 3, 2);
  EXPECT_EQ(s.stages, 4);
  EXPECT_EQ(s.placement, (std::vector<int>{0, 1, 0, 1}));
  EXPECT_EQ(row(s, 0), (std::vector<std::string>{"0F0", "0F1", "0F2", "2F0", "2F1", "2F2", "2B2", "2B1", "2B0",
                                                 "0B2", "0B1", "0B0"}));
  EXPECT_EQ(row(s, 1), (std::vector<std::string>{"1F0", "1F1", "1F2", "3F0", "3F1", "3F2", "3B2", "3B1", "3B0",
                                                 "1B2", "1B1", "1B0"}));
  gpipe::validate(gpipe::lower(s, Checkpoint::kExceptLast));
}

// 1F1B, K=3, M=4: device d runs K-1-d warm-up forwards (2, 1, 0), then alternates one forward and one
// backward, then drains. The last device runs 2Fi 2Bi back to back; the same 12 slots as fill-drain,
// with at most 3, 2, 1 micro-batches in flight instead of 4 everywhere.
TEST(OneFOneBTest, GridShowsWarmUpSteadyStateAndDrain) {
  EXPECT_EQ(gpipe::format_grid(gpipe::one_f_one_b(3, 4)),
            "device 0 | 0F0 0F1 0F2  .   .  0B0 0F3 0B1  .  0B2  .  0B3\n"
            "device 1 |  .  1F0 1F1  .  1B0 1F2 1B1 1F3 1B2  .  1B3  . \n"
            "device 2 |  .   .  2F0 2B0 2F1 2B1 2F2 2B2 2F3 2B3  .   . \n");
}

TEST(OneFOneBTest, WarmUpIsKMinusOneMinusDForwardsThenAlternates) {
  for (int K = 1; K <= 6; ++K)
    for (int M = 1; M <= 12; ++M) {
      const Schedule s = gpipe::one_f_one_b(K, M);
      EXPECT_EQ(s.name, "1f1b");
      for (int d = 0; d < K; ++d) {
        const auto& r = s.actions[static_cast<size_t>(d)];
        ASSERT_EQ(r.size(), static_cast<size_t>(2 * M));
        const int warmup = std::min(K - 1 - d, M);
        for (int n = 0; n < warmup; ++n) EXPECT_EQ(r[static_cast<size_t>(n)].str(), std::to_string(d) + "F" + std::to_string(n));
        // Then F, B, F, B, ... (M - warmup pairs), then the remaining backwards.
        for (int n = 0; n < M - warmup; ++n) {
          EXPECT_EQ(r[static_cast<size_t>(warmup + 2 * n)].kind, ActionKind::kForward) << K << "x" << M << " d" << d;
          EXPECT_EQ(r[static_cast<size_t>(warmup + 2 * n + 1)].kind, ActionKind::kBackward) << K << "x" << M << " d" << d;
        }
        for (size_t n = static_cast<size_t>(2 * M - warmup); n < r.size(); ++n)
          EXPECT_EQ(r[n].kind, ActionKind::kBackward) << K << "x" << M << " d" << d;
      }
    }
}

// ZB-H1, K=2, M=4: backwards split into I (input gradient) and W (weights). Device 0 keeps at most
// K-0 = 2 micro-batches awaiting their I, so it idles at slot 2; each device prefers an I, then an F,
// and runs a W only when it has nothing else: the W's fill the drain. 3M+K-1 = 13 slots,
// bubble (K-1)/(3M+K-1) = 1/13.
TEST(ZB1PTest, GridShowsWeightGradientsFillingTheDrain) {
  EXPECT_EQ(gpipe::format_grid(gpipe::zb1p(2, 4)),
            "device 0 | 0F0 0F1  .  0I0 0F2 0I1 0F3 0I2 0W0 0I3 0W1 0W2 0W3\n"
            "device 1 |  .  1F0 1I0 1F1 1I1 1F2 1I2 1F3 1I3 1W0 1W1 1W2 1W3\n");
}

// Device d never has more than K-d micro-batches whose F ran and whose I did not (1F1B's bound), and
// each W comes after its I, in micro-batch order.
TEST(ZB1PTest, AtMostKMinusDMicroBatchesAwaitTheirI) {
  for (int K = 1; K <= 6; ++K)
    for (int M = 1; M <= 12; ++M) {
      const Schedule s = gpipe::zb1p(K, M);
      EXPECT_EQ(s.name, "zb1p");
      for (int d = 0; d < K; ++d) {
        int awaiting = 0, most = 0, next_w = 0;
        for (const Action& a : s.actions[static_cast<size_t>(d)]) {
          EXPECT_NE(a.kind, ActionKind::kBackward) << a;
          if (a.kind == ActionKind::kForward) most = std::max(most, ++awaiting);
          if (a.kind == ActionKind::kInputGrad) --awaiting;
          if (a.kind == ActionKind::kWeightGrad) EXPECT_EQ(a.micro_batch, next_w++) << K << "x" << M << " d" << d;
        }
        EXPECT_EQ(most, std::min(K - d, M)) << K << "x" << M << " d" << d;
        EXPECT_EQ(next_w, M);
      }
    }
}

// Interleaved 1F1B, K=2, M=4, V=2: stages 0 and 2 on device 0, stages 1 and 3 on device 1. Device d
// starts with 2(K-1-d) + (V-1)K warm-up forwards (4 and 2), taking the micro-batches K = 2 at a time
// through its first stage, then through its second; then one forward, one backward; then drains.
// 18 slots where 1F1B's 4-stage pipeline would take 2(M+K-1) = 10 slots of double length:
// bubble (K-1)/(VM+K-1) = 1/9 instead of 1F1B's 1/5.
TEST(InterleavedTest, GridShowsTwoStagesPerDevice) {
  EXPECT_EQ(gpipe::format_grid(gpipe::interleaved(2, 4, 2)),
            "device 0 | 0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1  .  2B2  .  2B3 0B2 0B3\n"
            "device 1 |  .  1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3  . \n");
}

TEST(InterleavedTest, StageSRunsOnDeviceSModK) {
  const Schedule s = gpipe::interleaved(3, 6, 2);
  EXPECT_EQ(s.name, "interleaved");
  EXPECT_EQ(s.stages, 6);
  EXPECT_EQ(s.virtual_stages(), 2);
  EXPECT_EQ(s.placement, (std::vector<int>{0, 1, 2, 0, 1, 2}));
  EXPECT_EQ(s.stages_of(1), (std::vector<int>{1, 4}));
  for (int d = 0; d < 3; ++d) {
    EXPECT_EQ(s.actions[static_cast<size_t>(d)].size(), 2u * 6u * 2u);  // V·M forwards and backwards
    for (const Action& a : s.actions[static_cast<size_t>(d)]) EXPECT_EQ(a.stage % 3, d) << a;
  }
}

// ZB-V, K=2, M=4: stages 0 and 3 on device 0, 1 and 2 on device 1 (a V: down 0, 1, back up 2, 3).
// Each device prefers an I (of its stage on the way down, then of the one on the way up), then an
// F (up, then down), then a W; an F only while fewer than 2K = 4 stage-micro-batches are held. So
// device 0 runs 3 forwards of stage 0 and one of stage 3, then must run 3W0 before 3F1. Every action
// takes a slot: 6M+K-1 = 25 slots, the least possible (device 1 starts at slot 1), bubble
// (K-1)/(6M+K-1) = 1/25, fill-drain's 1/5 with B = I + W.
TEST(ZBVTest, GridShowsTheVAndNoBubbleInTheSteadyState) {
  EXPECT_EQ(gpipe::format_grid(gpipe::zbv(2, 4)),
            "device 0 | 0F0 0F1 0F2 3F0 3I0 3W0 3F1 0I0 3I1 0W0 0F3 0I1 3W1 3F2 3I2 0W1 3W2 0I2 0W2 3F3 3I3 3W3  .  0I3 0W3\n"
            "device 1 |  .  1F0 2F0 1F1 2F1 2I0 1I0 2W0 1F2 2I1 1I1 1W0 2F2 2W1 1F3 2I2 1I2 1W1 2F3 2W2 1W2 2I3 1I3 2W3 1W3\n");
}

// K=4, M=8: 6M+K-1 = 51 slots; device d starts at slot d and idles K-1 = 3 slots in all.
TEST(ZBVTest, GridAtFourDevices) {
  EXPECT_EQ(gpipe::format_grid(gpipe::zbv(4, 8)),
            "device 0 | 0F0 0F1 0F2 0F3 0F4 0F5 0F6 7F0 7I0 7W0 7F1 7I1 7W1 7F2 7I2 0I0 7W2 7F3 7I3 0I1 0W0 0I2 0F7 7W3 7F4 0I3 7I4 0W1 0W2 0W3 7F5 7I5 7W4 0I4 7W5 7F6 7I6 0W4 7W6 0I5 0W5 7F7 7I7 0I6 7W7 0W6  .   .   .  0I7 0W7\n"
            "device 1 |  .  1F0 1F1 1F2 1F3 1F4 6F0 1F5 6F1 6I0 6W0 6F2 6I1 6W1 1I0 6I2 6F3 1W0 1I1 6I3 1I2 1F6 6W2 6F4 1I3 1W1 1F7 6I4 6W3 6F5 1W2 1W3 1I4 6I5 6F6 6W4 1W4 6I6 1I5 6W5 6F7 6W6 1I6 6I7 1W5 1W6 6W7  .  1I7 1W7  . \n"
            "device 2 |  .   .  2F0 2F1 2F2 5F0 2F3 5F1 2F4 5F2 5I0 5W0 5F3 2I0 5I1 2W0 5I2 2I1 2F5 2I2 5I3 5W1 5F4 2I3 5W2 2F6 2W1 5F5 5I4 2W2 2F7 2I4 5W3 5F6 5I5 2W3 5W4 2I5 5I6 5F7 2W4 2I6 5W5 2W5 5I7 5W6 2W6 2I7 5W7 2W7  . \n"
            "device 3 |  .   .   .  3F0 4F0 3F1 4F1 3F2 4F2 3F3 4F3 4I0 3I0 4W0 3F4 4I1 3I1 4I2 3I2 3W0 4F4 4I3 3I3 4W1 3F5 3W1 4F5 4W2 3F6 4I4 3I4 3W2 4F6 4W3 3F7 4I5 3I5 3W3 4F7 4I6 3I6 4W4 3W4 4W5 3W5 4I7 3I7 4W6 3W6 4W7 3W7\n");
}

TEST(ZBVTest, StagesArePlacedAsAV) {
  const Schedule s = gpipe::zbv(3, 6);
  EXPECT_EQ(s.name, "zbv");
  EXPECT_EQ(s.stages, 6);
  EXPECT_EQ(s.virtual_stages(), 2);
  EXPECT_EQ(s.placement, (std::vector<int>{0, 1, 2, 2, 1, 0}));
  EXPECT_EQ(s.stages_of(0), (std::vector<int>{0, 5}));
  EXPECT_EQ(s.stages_of(2), (std::vector<int>{2, 3}));
  for (int d = 0; d < 3; ++d) {
    EXPECT_EQ(s.actions[static_cast<size_t>(d)].size(), 2u * 6u * 3u);  // F, I and W of 2 stages x M
    for (const Action& a : s.actions[static_cast<size_t>(d)]) {
      EXPECT_TRUE(a.stage == d || a.stage == 5 - d) << a;
      EXPECT_NE(a.kind, ActionKind::kBackward) << a;
    }
  }
  // The lowered program: the first and last stage on device 0, the V's turn (2 -> 3) inside device 2.
  const Schedule p = gpipe::lower(s, Checkpoint::kNever);
  EXPECT_TRUE(contains(line(p, 2), "2SEND_F0>3")) << line(p, 2);
  EXPECT_TRUE(contains(line(p, 2), "3RECV_F0<2")) << line(p, 2);
  EXPECT_TRUE(contains(line(p, 2), "3SEND_B0>2")) << line(p, 2);
  EXPECT_TRUE(contains(line(p, 0), "5RECV_F0<4")) << line(p, 0);
  EXPECT_FALSE(contains(line(p, 0), "0RECV_F")) << line(p, 0);  // the first stage receives no activation
  EXPECT_FALSE(contains(line(p, 0), "5SEND_F")) << line(p, 0);  // the last sends none
}

// V-Half, K=2, M=4: zbv's V and order of preference, at most K+1 = 3 stage-micro-batches held per
// device. Device 0 takes micro-batch 1 down (0F1) only once micro-batch 0 has come back up (3F0)
// and its W is done (3W0): with 0F0 and 3F0 held, a second micro-batch and its way back up would
// make 4. So at K=2 a micro-batch at a time crosses device 0: 30 slots against zbv's 25.
TEST(VHalfTest, GridAtTwoDevices) {
  EXPECT_EQ(gpipe::format_grid(gpipe::v_half(2, 4)),
            "device 0 | 0F0  .   .  3F0 3I0 3W0 0F1 0I0 0W0  .  3F1 3I1 3W1 0F2 0I1 0W1  .  3F2 3I2 3W2 0F3 0I2 0W2  .  3F3 3I3 3W3  .  0I3 0W3\n"
            "device 1 |  .  1F0 2F0  .   .  2I0 1I0 2W0 1F1 2F1 1W0  .  2I1 1I1 2W1 1F2 2F2 1W1  .  2I2 1I2 2W2 1F3 2F3 1W2  .  2I3 1I3 2W3 1W3\n");
}

// K=4, M=8: every device holds at most 5 stage-micro-batches (zbv: 8), 60 slots (zbv: 51).
TEST(VHalfTest, GridAtFourDevices) {
  EXPECT_EQ(gpipe::format_grid(gpipe::v_half(4, 8)),
            "device 0 | 0F0 0F1  .   .   .   .   .  7F0 7I0 7F1 7I1 7W0 0F2 7W1  .  0I0 0W0 0I1 0F3 0W1 7F2 7I2 7W2 0F4  .   .  7F3 7I3 0I2 7W3 0W2 0F5 7F4 7I4 0I3 7W4 0W3 0F6 7F5 7I5 0I4 7W5 0W4 0F7 7F6 7I6 0I5 7W6 0W5  .  7F7 7I7 0I6 7W7 0W6  .   .   .  0I7 0W7\n"
            "device 1 |  .  1F0 1F1  .   .   .  6F0  .  6F1 6I0 6W0 6I1 6W1 1F2 1I0 1W0 1I1 1W1  .  6F2 1F3  .  6I2 6W2 1F4 6F3  .  1I2 6I3 1W2 6W3 6F4 1F5 1I3 6I4 1W3 6W4 6F5 1F6 1I4 6I5 1W4 6W5 6F6 1F7 1I5 6I6 1W5 6W6 6F7  .  1I6 6I7 1W6 6W7  .   .  1I7 1W7  . \n"
            "device 2 |  .   .  2F0 2F1  .  5F0  .  5F1  .   .  5I0 5W0 5I1 2I0 2F2 2I1 5W1 2W0 5F2 2W1  .  2F3  .  5I2 5F3 5W2 2I2 2F4 2W2 5I3 5F4 5W3 2I3 2F5 2W3 5I4 5F5 5W4 2I4 2F6 2W4 5I5 5F6 5W5 2I5 2F7 2W5 5I6 5F7 5W6 2I6 2W6  .  5I7 5W7  .  2I7 2W7  .   . \n"
            "device 3 |  .   .   .  3F0 4F0 3F1 4F1  .   .   .   .  4I0 3I0 4I1 3I1 4W0 3F2 4F2 3W0 4W1 3W1  .  3F3 4F3 4I2 3I2 4W2 3W2 3F4 4F4 4I3 3I3 4W3 3W3 3F5 4F5 4I4 3I4 4W4 3W4 3F6 4F6 4I5 3I5 4W5 3W5 3F7 4F7 4I6 3I6 4W6 3W6  .   .  4I7 3I7 4W7 3W7  .   . \n");
}

TEST(VHalfTest, HoldsAtMostKPlusOneStageMicroBatches) {
  for (int K = 1; K <= 6; ++K)
    for (int M = 1; M <= 12; ++M) {
      const gpipe::Schedule s = gpipe::v_half(K, M);
      EXPECT_EQ(s.name, "v-half");
      EXPECT_EQ(s.placement, gpipe::zbv(K, 1).placement);
      const auto half = gpipe::simulate(s).peak_in_flight;
      const auto zb = gpipe::simulate(gpipe::zbv(K, M)).peak_in_flight;
      for (int d = 0; d < K; ++d) {
        EXPECT_LE(half[static_cast<size_t>(d)], K + 1) << K << "x" << M << " d" << d;
        EXPECT_LE(half[static_cast<size_t>(d)], zb[static_cast<size_t>(d)]) << K << "x" << M << " d" << d;
      }
      if (M >= K + 1 && K >= 2) EXPECT_EQ(*std::max_element(half.begin(), half.end()), K + 1) << K << "x" << M;
    }
}

// The memory bound: at most 2K stage-micro-batches held per device from the start of an F to the end
// of its W, each half a device's layers: K micro-batches, 1F1B's peak (device 0's K - 0).
TEST(ZBVTest, HoldsAtMostOneFOneBsPeak) {
  for (int K = 1; K <= 6; ++K)
    for (int M = 1; M <= 12; ++M) {
      const auto zb = gpipe::simulate(gpipe::zbv(K, M)).peak_in_flight;
      const auto one = gpipe::simulate(gpipe::one_f_one_b(K, M)).peak_in_flight;
      const int one_peak = *std::max_element(one.begin(), one.end());
      for (int d = 0; d < K; ++d) {
        EXPECT_LE(zb[static_cast<size_t>(d)], 2 * K) << K << "x" << M << " d" << d;
        EXPECT_LE(zb[static_cast<size_t>(d)], 2 * one_peak) << K << "x" << M << " d" << d;  // in half-size stages
      }
      if (M >= 2 * K) EXPECT_EQ(zb[0], 2 * K) << K << "x" << M;
    }
}

// zbv and v-half ordered by each stage's F, I and W times: every program valid and within its memory
// bound, whatever the times (random, and some zero, as a stage without weights has no W), and the
// simulated step with those times no longer than the order of unit slots, and shorter where a device's
// two stages differ in length (the transformer's cut [4, 1, 3, 2]: 3, 1, 3 and 1.5 blocks).
std::vector<gpipe::ActionTimes> random_times(int stages, std::mt19937& random) {
  std::uniform_real_distribution<double> time(0.2, 3.0);
  std::vector<gpipe::ActionTimes> times;
  for (int s = 0; s < stages; ++s) times.push_back({time(random), time(random), s % 3 == 1 ? 0.0 : time(random)});
  return times;
}

gpipe::CostFn cost_of(const std::vector<gpipe::ActionTimes>& times) {
  return [times](const gpipe::Action& a) {
    const gpipe::ActionTimes& t = times[static_cast<size_t>(a.stage)];
    switch (a.kind) {
      case gpipe::ActionKind::kForward: return t.forward;
      case gpipe::ActionKind::kInputGrad: return t.input_grad;
      case gpipe::ActionKind::kWeightGrad: return t.weight_grad;
      default: return 0.0;
    }
  };
}

TEST(ZBVTest, OrderedByTimesEveryProgramIsValidAndWithinItsBound) {
  std::mt19937 random(5);
  for (int K = 1; K <= 5; ++K)
    for (int M = 1; M <= 10; ++M)
      for (int draw = 0; draw < 4; ++draw) {
        const std::vector<gpipe::ActionTimes> times = random_times(2 * K, random);
        for (const gpipe::Schedule& s : {gpipe::zbv(K, M, times), gpipe::v_half(K, M, times)}) {
          SCOPED_TRACE(s.name + " " + std::to_string(K) + "x" + std::to_string(M) + " draw " + std::to_string(draw));
          EXPECT_EQ(s.placement, gpipe::zbv(K, M).placement);
          ASSERT_NO_THROW(gpipe::validate(gpipe::lower(s, gpipe::Checkpoint::kNever)));
          const auto peak = gpipe::simulate(s, cost_of(times)).peak_in_flight;
          const int bound = s.name == "zbv" ? 2 * K : K + 1;
          for (int held : peak) EXPECT_LE(held, bound);
        }
      }
}

TEST(ZBVTest, OrderedByTimesAStepOfUnequalStagesIsShorter) {
  const std::vector<gpipe::ActionTimes> times{{3, 3.6, 2.8}, {1, 1.3, 0.9}, {3, 3.7, 2.7}, {1.5, 1.9, 1.7}};
  for (int M : {4, 8, 16}) {
    const gpipe::SimulatedRun slots = gpipe::simulate(gpipe::zbv(2, M), cost_of(times));
    const gpipe::SimulatedRun timed = gpipe::simulate(gpipe::zbv(2, M, times), cost_of(times));
    EXPECT_LT(timed.makespan, slots.makespan * (M <= 8 ? 0.97 : 0.99)) << "M=" << M;
    EXPECT_LT(timed.bubble, slots.bubble) << "M=" << M;
  }
  // Equal times give the unit order itself: of one slot, and of a tenth (not a sum of exact binary fractions).
  for (double each : {1.0, 0.1})
    for (int K = 1; K <= 4; ++K)
      for (int M = 1; M <= 9; ++M) {
        const std::vector<gpipe::ActionTimes> equal(static_cast<size_t>(2 * K), {each, each, each});
        EXPECT_EQ(gpipe::format_grid(gpipe::zbv(K, M, equal)), gpipe::format_grid(gpipe::zbv(K, M)))
            << K << "x" << M << " times " << each;
        EXPECT_EQ(gpipe::format_grid(gpipe::v_half(K, M, equal)), gpipe::format_grid(gpipe::v_half(K, M)))
            << K << "x" << M << " times " << each;
      }
  // Times of zero (all of them, or a stage's F or I): valid programs within their bounds all the same.
  for (const std::vector<gpipe::ActionTimes>& times :
       {std::vector<gpipe::ActionTimes>(4, {0, 0, 0}),
        std::vector<gpipe::ActionTimes>{{0, 1, 1}, {1, 0, 1}, {1, 1, 0}, {0, 0, 1}}})
    for (int M : {1, 3, 8}) {
      for (const gpipe::Schedule& s : {gpipe::zbv(2, M, times), gpipe::v_half(2, M, times)}) {
        SCOPED_TRACE(s.name + " M=" + std::to_string(M));
        ASSERT_NO_THROW(gpipe::validate(gpipe::lower(s, gpipe::Checkpoint::kNever)));
        for (int held : gpipe::simulate(s, cost_of(times)).peak_in_flight) EXPECT_LE(held, s.name == "zbv" ? 4 : 3);
      }
    }
  EXPECT_THROW(gpipe::zbv(2, 4, std::vector<gpipe::ActionTimes>(3)), std::invalid_argument);
  EXPECT_THROW(gpipe::zbv(2, 4, {{1, 1, 1}, {1, -1, 1}, {1, 1, 1}, {1, 1, 1}}), std::invalid_argument);
}

TEST(ForwardOnlyTest, EveryStageRunsEveryForward) {
  const Schedule s = gpipe::forward_only(2, 3);
  EXPECT_FALSE(s.backward);
  EXPECT_EQ(row(s, 1), (std::vector<std::string>{"1F0", "1F1", "1F2"}));
  EXPECT_NO_THROW(gpipe::validate(s));
  EXPECT_EQ(gpipe::simulate(s).makespan, 4);
  EXPECT_EQ(gpipe::simulate(s).peak_in_flight, (std::vector<int>{0, 0}));  // nothing awaits a backward
}

// Inference with two stages per device: each device runs its stages in order, so device 0 runs
// stage 2 after stage 1 has produced it.
TEST(ForwardOnlyTest, GridWithTwoStagesPerDevice) {
  const Schedule s = gpipe::forward_only(2, 3, 2);
  EXPECT_EQ(s.placement, (std::vector<int>{0, 1, 0, 1}));
  EXPECT_EQ(gpipe::format_grid(s),
            "device 0 | 0F0 0F1 0F2 2F0 2F1 2F2  . \n"
            "device 1 |  .  1F0 1F1 1F2 3F0 3F1 3F2\n");
}

// ---------------------------------------------------------------- text form

TEST(ActionTest, EveryKindParsesBack) {
  for (const char* text : {"0F0", "1F0r", "12B305", "1I0", "1W0", "3W17", "1SEND_F0>2", "2RECV_F0<1", "2SEND_B0>1",
                           "1RECV_B0<2", "0SEND_F123>7", "7RECV_B4<0"}) {
    const Action a = Action::parse(text);
    EXPECT_EQ(a.str(), text);
    EXPECT_EQ(Action::parse(a.str()), a) << text;
  }
}

TEST(ActionTest, ParseFillsEveryField) {
  const Action f = Action::parse("1F0r");
  EXPECT_EQ(f.stage, 1);
  EXPECT_EQ(f.kind, ActionKind::kForward);
  EXPECT_EQ(f.micro_batch, 0);
  EXPECT_TRUE(f.recompute);
  EXPECT_TRUE(f.is_compute());
  EXPECT_FALSE(f.is_backward());
  EXPECT_FALSE(Action::parse("1F0").recompute);
  EXPECT_NE(Action::parse("1F0"), f);

  EXPECT_EQ(Action::parse("4B2").kind, ActionKind::kBackward);
  EXPECT_TRUE(Action::parse("4B2").is_backward());
  EXPECT_EQ(Action::parse("4I2").kind, ActionKind::kInputGrad);
  EXPECT_TRUE(Action::parse("4I2").is_backward());
  EXPECT_EQ(Action::parse("4W2").kind, ActionKind::kWeightGrad);
  EXPECT_FALSE(Action::parse("4W2").is_backward());

  const Action send = Action::parse("1SEND_F0>2");
  EXPECT_EQ(send.kind, ActionKind::kSend);
  EXPECT_EQ(send.stage, 1);
  EXPECT_EQ(send.channel, Channel::kActivation);
  EXPECT_EQ(send.micro_batch, 0);
  EXPECT_EQ(send.peer, 2);
  EXPECT_FALSE(send.is_compute());

  const Action recv = Action::parse("1RECV_B3<2");
  EXPECT_EQ(recv.kind, ActionKind::kRecv);
  EXPECT_EQ(recv.stage, 1);
  EXPECT_EQ(recv.channel, Channel::kGradient);
  EXPECT_EQ(recv.micro_batch, 3);
  EXPECT_EQ(recv.peer, 2);

  // Built by hand, the same actions print the same way.
  Action a;
  a.stage = 2;
  a.kind = ActionKind::kRecv;
  a.channel = Channel::kGradient;
  a.micro_batch = 5;
  a.peer = 3;
  EXPECT_EQ(a.str(), "2RECV_B5<3");
  std::ostringstream out;
  out << a;
  EXPECT_EQ(out.str(), "2RECV_B5<3");
  EXPECT_NE(Action::parse("2RECV_B5<4"), a);  // peers differ
  EXPECT_NE(Action::parse("2RECV_F5<3"), a);  // channels differ
  EXPECT_NE(Action::parse("2SEND_B5>3"), a);  // kinds differ
}

TEST(ActionTest, MalformedTextThrows) {
  for (const char* bad : {"", "F0", "1X0", "1F", "1F0x", "-1F0", "1B0r", "1I0r", "1W0r", "1SEND_F0<2", "1RECV_B0>0",
                          "1SEND_X0>2", "1SEND_F0>", "1SEND_F0", "1F0 ", " 1F0", "1f0"})
    EXPECT_THROW(Action::parse(bad), std::invalid_argument) << '"' << bad << '"';
  EXPECT_TRUE(contains(error_of([] { Action::parse("1B0r"); }), "only a forward carries the recompute flag"));
  EXPECT_TRUE(contains(error_of([] { Action::parse("1SEND_F0<2"); }), "a send is written SEND_F0>2"));
  EXPECT_TRUE(contains(error_of([] { Action::parse("1X0"); }), "cannot parse action \"1X0\""));
}

// ---------------------------------------------------------------- lowering

// 1F1B, K=2, M=2: device 0 runs 0F0 0F1 0B0 0B1, device 1 runs 1F0 1B0 1F1 1B1. With except_last a
// forward keeps its activations only when the next compute action of its device is its own backward:
// 1F0 and 1F1 (followed by 1B0, 1B1) keep them; 0F0 (followed by 0F1) and 0F1 (followed by 0B0, another
// micro-batch's) re-materialize. A send follows the action that produces the tensor; a receive
// precedes the action that consumes it.
TEST(LowerTest, OneFOneBExceptLast) {
  const Schedule p = gpipe::lower(gpipe::one_f_one_b(2, 2), Checkpoint::kExceptLast);
  EXPECT_TRUE(p.lowered());
  EXPECT_EQ(p.name, "1f1b");
  EXPECT_EQ(line(p, 0), "0F0r 0SEND_F0>1 0F1r 0SEND_F1>1 0RECV_B0<1 0B0 0RECV_B1<1 0B1");
  EXPECT_EQ(line(p, 1), "1RECV_F0<0 1F0 1B0 1SEND_B0>0 1RECV_F1<0 1F1 1B1 1SEND_B1>0");
}

TEST(LowerTest, OneFOneBAlwaysAndNever) {
  const Schedule always = gpipe::lower(gpipe::one_f_one_b(2, 2), Checkpoint::kAlways);
  EXPECT_EQ(line(always, 0), "0F0r 0SEND_F0>1 0F1r 0SEND_F1>1 0RECV_B0<1 0B0 0RECV_B1<1 0B1");
  EXPECT_EQ(line(always, 1), "1RECV_F0<0 1F0r 1B0 1SEND_B0>0 1RECV_F1<0 1F1r 1B1 1SEND_B1>0");
  const Schedule never = gpipe::lower(gpipe::one_f_one_b(2, 2), Checkpoint::kNever);
  EXPECT_EQ(line(never, 0), "0F0 0SEND_F0>1 0F1 0SEND_F1>1 0RECV_B0<1 0B0 0RECV_B1<1 0B1");
  EXPECT_EQ(line(never, 1), "1RECV_F0<0 1F0 1B0 1SEND_B0>0 1RECV_F1<0 1F1 1B1 1SEND_B1>0");
}

// Interleaved, K=2, M=2, V=2: messages go stage to stage whatever the devices: stage 1 -> 2 goes from
// device 1 (1SEND_F0>2) to device 0 (2RECV_F0<1), and its gradient back from device 0 (2SEND_B0>1) to
// device 1 (1RECV_B0<2). The last stage, 3, receives no gradient; the first, 0, sends none.
// With except_last only 3F0 and 3F1, each followed by its own backward, keep their activations.
TEST(LowerTest, InterleavedSendsCrossDevicesStageByStage) {
  const Schedule compute = gpipe::interleaved(2, 2, 2);
  const Schedule p = gpipe::lower(compute, Checkpoint::kExceptLast);
  EXPECT_EQ(line(p, 0),
            "0F0r 0SEND_F0>1 0F1r 0SEND_F1>1 2RECV_F0<1 2F0r 2SEND_F0>3 2RECV_F1<1 2F1r 2SEND_F1>3 "
            "2RECV_B0<3 2B0 2SEND_B0>1 2RECV_B1<3 2B1 2SEND_B1>1 0RECV_B0<1 0B0 0RECV_B1<1 0B1");
  EXPECT_EQ(line(p, 1),
            "1RECV_F0<0 1F0r 1SEND_F0>2 1RECV_F1<0 1F1r 1SEND_F1>2 3RECV_F0<2 3F0 3B0 3SEND_B0>2 "
            "3RECV_F1<2 3F1 3B1 3SEND_B1>2 1RECV_B0<2 1B0 1SEND_B0>0 1RECV_B1<2 1B1 1SEND_B1>0");
  EXPECT_EQ(p.placement, compute.placement);
  EXPECT_NO_THROW(gpipe::validate(p));
}

// ZB-H1: the gradient is sent after I (not W); a W has no messages. 1F0 and 1F1 are followed by their I.
TEST(LowerTest, ZB1PSendsAfterI) {
  const Schedule p = gpipe::lower(gpipe::zb1p(2, 2), Checkpoint::kExceptLast);
  EXPECT_EQ(line(p, 0), "0F0r 0SEND_F0>1 0F1r 0SEND_F1>1 0RECV_B0<1 0I0 0W0 0RECV_B1<1 0I1 0W1");
  EXPECT_EQ(line(p, 1), "1RECV_F0<0 1F0 1I0 1SEND_B0>0 1RECV_F1<0 1F1 1I1 1SEND_B1>0 1W0 1W1");
}

// Inference: nothing to re-materialize, whatever the mode.
TEST(LowerTest, ForwardOnlyNeverRecomputes) {
  const Schedule p = gpipe::lower(gpipe::forward_only(2, 2), Checkpoint::kAlways);
  EXPECT_EQ(line(p, 0), "0F0 0SEND_F0>1 0F1 0SEND_F1>1");
  EXPECT_EQ(line(p, 1), "1RECV_F0<0 1F0 1RECV_F1<0 1F1");
}

TEST(LowerTest, KeepsComputeOrderAndEveryGeneratedProgramValidates) {
  for (const Schedule& s : all_generated())
    for (Checkpoint mode : {Checkpoint::kAlways, Checkpoint::kExceptLast, Checkpoint::kNever}) {
      const Schedule p = gpipe::lower(s, mode);
      EXPECT_EQ(p.lowered(), s.stages > 1) << shape(s);  // one stage: nothing to send
      for (size_t d = 0; d < s.actions.size(); ++d) {
        std::vector<Action> compute;
        for (Action a : p.actions[d])
          if (a.is_compute()) {
            a.recompute = false;
            compute.push_back(a);
          }
        EXPECT_EQ(compute, s.actions[d]) << shape(s) << " d" << d;
      }
      EXPECT_NO_THROW(gpipe::validate(p)) << shape(s) << " " << gpipe::to_string(mode);
    }
}

TEST(LowerTest, LoweringTwiceThrows) {
  const Schedule p = gpipe::lower(gpipe::fill_drain(2, 2), Checkpoint::kNever);
  EXPECT_TRUE(contains(error_of([&] { gpipe::lower(p, Checkpoint::kNever); }), "already lowered"));
}

TEST(CheckpointTest, NamesParseBack) {
  for (Checkpoint mode : {Checkpoint::kAlways, Checkpoint::kExceptLast, Checkpoint::kNever})
    EXPECT_EQ(gpipe::parse_checkpoint(gpipe::to_string(mode)), mode);
  EXPECT_EQ(gpipe::to_string(Checkpoint::kExceptLast), "except_last");
  EXPECT_THROW(gpipe::parse_checkpoint("sometimes"), std::invalid_argument);
}

// ---------------------------------------------------------------- validation

TEST(ValidateTest, AcceptsGeneratedSchedules) {
  for (const Schedule& s : all_generated()) EXPECT_NO_THROW(gpipe::validate(s)) << shape(s);
}

TEST(ValidateTest, RejectsMissingBackward) {
  Schedule s = gpipe::fill_drain(2, 3);
  s.actions[0].pop_back();  // no 0B0
  expect_invalid(s, "0B0 (or its I and W) is missing", 0);
}

TEST(ValidateTest, RejectsDuplicateForward) {
  Schedule s = gpipe::fill_drain(2, 3);
  replace_action(s, 0, "0F1", "0F0");  // 0F0 twice, no 0F1
  expect_invalid(s, "0F0 appears twice", 0);
}

TEST(ValidateTest, RejectsBackwardBeforeForward) {
  Schedule s = gpipe::fill_drain(2, 2);
  std::swap(s.actions[1][0], s.actions[1][3]);  // 1B0 first
  const std::string what = error_of([&] { gpipe::validate(s); });
  EXPECT_TRUE(contains(what, "1B0 comes before its forward")) << what;
  // The marked row is the lowered program's, with its sends and receives.
  EXPECT_EQ(marked_line(what), "device 1 | 1B0 1SEND_B0>0 1RECV_F1<0 1F1 1B1 1SEND_B1>0 1RECV_F0<0 1F0  <-- ERROR HERE");
}

TEST(ValidateTest, RejectsWeightGradientBeforeItsInputGradient) {
  Schedule s = gpipe::zb1p(2, 2);
  swap_actions(s, 0, "0I0", "0W0");
  expect_invalid(s, "0W0 comes before its I", 0);
}

TEST(ValidateTest, RejectsWeightGradientWithoutInputGradient) {
  Schedule s = gpipe::zb1p(2, 2);
  remove_action(s, 1, "1I1");  // 1W1 stays, with no I
  expect_invalid(s, "1W1 comes before its I", 1);
  s = gpipe::zb1p(2, 2);
  replace_action(s, 0, "0I0", "0B0");  // a full backward, then a stray W
  expect_invalid(s, "0W0 comes before its I", 0);
}

TEST(ValidateTest, RejectsInputGradientWithoutWeightGradient) {
  Schedule s = gpipe::zb1p(2, 2);
  remove_action(s, 1, "1W1");
  expect_invalid(s, "1W1 is missing", 1);
}

TEST(ValidateTest, RejectsBothBackwardAndInputGradient) {
  Schedule s = gpipe::fill_drain(2, 2);
  s.actions[1].push_back(Action::parse("1I0"));
  expect_invalid(s, "1I0: a micro-batch's backward is either B, or I then W, not both", 1);
}

TEST(ValidateTest, RejectsBackwardInForwardOnlySchedule) {
  Schedule s = gpipe::forward_only(2, 2);
  s.actions[1].push_back(Action::parse("1B0"));
  expect_invalid(s, "1B0 is a backward in a forward-only schedule", 1);
}

TEST(ValidateTest, RejectsActionOnTheWrongDevice) {
  Schedule s = gpipe::fill_drain(2, 3);
  s.actions[0][0].stage = 1;  // 1F0 in device 0's row; validate reports the receive lowering put before it
  expect_invalid(s, "1RECV_F0<0 is in the row of device 0, but stage 1 is placed on device 1", 0);
  s = gpipe::fill_drain(2, 2);
  remove_action(s, 1, "1B1");  // the last stage's backward (no receive before it) moved to device 0
  s.actions[0].push_back(Action::parse("1B1"));
  expect_invalid(s, "1B1 is in the row of device 0, but stage 1 is placed on device 1", 0);
  // Interleaved: stage 2 belongs to device 0.
  s = gpipe::interleaved(2, 2, 2);
  s.actions[1].push_back(Action::parse("2W0"));
  expect_invalid(s, "2W0 is in the row of device 1, but stage 2 is placed on device 0", 1);
}

TEST(ValidateTest, RejectsOutOfRangeStagesMicroBatchesAndPlacement) {
  Schedule s = gpipe::fill_drain(2, 2);
  s.actions[1].push_back(Action::parse("1F2"));
  expect_invalid(s, "1RECV_F2<0 names a micro-batch outside 0..1", 1);
  s = gpipe::fill_drain(2, 2);
  s.placement = {0, 2};
  EXPECT_TRUE(contains(error_of([&] { gpipe::validate(s); }), "stage 1 is placed on device 2, outside 0..1"));
  s = gpipe::fill_drain(2, 2);
  s.actions.pop_back();
  EXPECT_TRUE(contains(error_of([&] { gpipe::validate(s); }), "expected 2 rows (one per device), got 1"));
}

// lower(one_f_one_b(2, 1)): device 0: 0F0 0SEND_F0>1 0RECV_B0<1 0B0; device 1: 1RECV_F0<0 1F0 1B0 1SEND_B0>0.
TEST(ValidateTest, RejectsSendWithoutReceive) {
  Schedule p = gpipe::lower(gpipe::one_f_one_b(2, 1), Checkpoint::kNever);
  remove_action(p, 1, "1RECV_F0<0");  // then 1F0 has no input: named first
  expect_invalid(p, "1F0 has no earlier receive of its input from stage 0", 1);
  p = gpipe::lower(gpipe::one_f_one_b(2, 1), Checkpoint::kNever);
  p.actions[0].push_back(Action::parse("0SEND_F0>1"));  // sent twice
  expect_invalid(p, "0SEND_F0>1 is sent 2 time(s) and received 1 time(s)", 0);
}

// A program must deliver each input before the action that uses it, along the right direction.
TEST(ValidateTest, RejectsInputsThatArriveLateOrTheWrongWay) {
  Schedule p = gpipe::lower(gpipe::one_f_one_b(2, 1), Checkpoint::kNever);
  std::swap(p.actions[1][0], p.actions[1][1]);  // 1F0 before 1RECV_F0<0
  expect_invalid(p, "1F0 has no earlier receive of its input from stage 0", 1);
  p = gpipe::lower(gpipe::one_f_one_b(2, 1), Checkpoint::kNever);
  for (auto& row : p.actions)
    for (Action& a : row)
      if (!a.is_compute() && a.channel == gpipe::Channel::kActivation) a.channel = gpipe::Channel::kGradient;
  expect_invalid(p, "moves a gradient the wrong way", 0);
}

TEST(ValidateTest, RejectsReceiveWithoutSend) {
  Schedule p = gpipe::lower(gpipe::one_f_one_b(2, 1), Checkpoint::kNever);
  remove_action(p, 0, "0SEND_F0>1");
  expect_invalid(p, "1RECV_F0<0 waits for a message no stage sends", 1);
}

// Both devices start by receiving: device 0 the gradient of 0, device 1 the activation of 0.
TEST(ValidateTest, RejectsDeadlockOfTwoReceives) {
  Schedule p = gpipe::lower(gpipe::one_f_one_b(2, 1), Checkpoint::kNever);
  remove_action(p, 0, "0RECV_B0<1");
  p.actions[0].insert(p.actions[0].begin(), Action::parse("0RECV_B0<1"));
  ASSERT_EQ(line(p, 0), "0RECV_B0<1 0F0 0SEND_F0>1 0B0");
  const std::string what = error_of([&] { gpipe::validate(p); });
  EXPECT_TRUE(contains(what, "deadlock: device 0 waits in 0RECV_B0<1 for stage 1")) << what;
  EXPECT_EQ(marked_line(what), "device 0 | 0RECV_B0<1 0F0 0SEND_F0>1 0B0  <-- ERROR HERE");
  EXPECT_THROW(gpipe::simulate(p), std::invalid_argument);
}

// A compute-only schedule that cannot run: stage 1 waits for micro-batch 1, which stage 0 sends only
// after the gradient of micro-batch 0 has come back.
TEST(ValidateTest, RejectsDeadlockInComputeOrder) {
  Schedule s = gpipe::fill_drain(2, 2);
  s.actions[0] = {Action::parse("0F0"), Action::parse("0B0"), Action::parse("0F1"), Action::parse("0B1")};
  s.actions[1] = {Action::parse("1F1"), Action::parse("1F0"), Action::parse("1B0"), Action::parse("1B1")};
  expect_invalid(s, "deadlock: device 0 waits in 0RECV_B0<1", 0);
}

// ---------------------------------------------------------------- make_schedule

TEST(MakeScheduleTest, BuildsEachKind) {
  EXPECT_EQ(row(gpipe::make_schedule(ScheduleKind::kGPipe, 3, 4), 1), row(gpipe::fill_drain(3, 4), 1));
  EXPECT_EQ(row(gpipe::make_schedule(ScheduleKind::k1F1B, 3, 4), 0), row(gpipe::one_f_one_b(3, 4), 0));
  EXPECT_EQ(row(gpipe::make_schedule(ScheduleKind::kZB1P, 3, 4), 0), row(gpipe::zb1p(3, 4), 0));
  EXPECT_EQ(row(gpipe::make_schedule(ScheduleKind::kInterleaved, 2, 4, 2), 1), row(gpipe::interleaved(2, 4, 2), 1));
  EXPECT_EQ(row(gpipe::make_schedule(ScheduleKind::kZBV, 2, 4, 2), 1), row(gpipe::zbv(2, 4), 1));
  EXPECT_EQ(row(gpipe::make_schedule(ScheduleKind::kVHalf, 2, 4, 2), 0), row(gpipe::v_half(2, 4), 0));
  for (ScheduleKind kind : gpipe::all_schedules()) {
    const int V = kind == ScheduleKind::kInterleaved ? 3 : gpipe::default_virtual_stages(kind);
    const Schedule s = gpipe::make_schedule(kind, 2, 4, V);
    EXPECT_EQ(s.name, gpipe::to_string(kind));
    EXPECT_EQ(s.virtual_stages(), V);
  }
}

// Which V each schedule takes, and its own: the one rule the front ends and make_plan ask.
TEST(MakeScheduleTest, EachScheduleTakesItsVirtualStages) {
  EXPECT_EQ(gpipe::default_virtual_stages(ScheduleKind::kInterleaved), 2);
  EXPECT_EQ(gpipe::default_virtual_stages(ScheduleKind::kZBV), 2);
  for (ScheduleKind kind : {ScheduleKind::kGPipe, ScheduleKind::k1F1B, ScheduleKind::kZB1P}) {
    EXPECT_EQ(gpipe::default_virtual_stages(kind), 1);
    EXPECT_TRUE(gpipe::takes_virtual_stages(kind, 1));
    EXPECT_FALSE(gpipe::takes_virtual_stages(kind, 2));
  }
  EXPECT_FALSE(gpipe::takes_virtual_stages(ScheduleKind::kInterleaved, 1));
  EXPECT_TRUE(gpipe::takes_virtual_stages(ScheduleKind::kInterleaved, 3));
  for (ScheduleKind kind : {ScheduleKind::kZBV, ScheduleKind::kVHalf}) {
    EXPECT_TRUE(gpipe::v_shaped(kind));
    EXPECT_EQ(gpipe::default_virtual_stages(kind), 2);
    EXPECT_TRUE(gpipe::takes_virtual_stages(kind, 2));
    EXPECT_FALSE(gpipe::takes_virtual_stages(kind, 3));
  }
  EXPECT_FALSE(gpipe::v_shaped(ScheduleKind::kInterleaved));
  for (ScheduleKind kind : gpipe::all_schedules())
    EXPECT_NO_THROW(gpipe::check_virtual_stages(kind, gpipe::default_virtual_stages(kind))) << gpipe::to_string(kind);
  const std::string what = error_of([] { gpipe::make_schedule(ScheduleKind::kZBV, 2, 4, 3); });
  EXPECT_TRUE(contains(what, "the zbv schedule runs 2 stages per device")) << what;
  EXPECT_TRUE(contains(what, "use interleaved for another V")) << what;
  EXPECT_TRUE(contains(error_of([] { gpipe::check_virtual_stages(ScheduleKind::kZBV, 1); }), "(got 1)"));
  EXPECT_TRUE(contains(error_of([] { gpipe::check_virtual_stages(ScheduleKind::kVHalf, 4); }),
                       "the v-half schedule runs 2 stages per device"));
}

// Every entry of the schedule table: its generator makes a schedule that validates, named as the
// entry, with the entry's placement, its backward split or not, and a peak in flight within the
// entry's memory bound, reached by some device once M >= 2K.
TEST(ScheduleTableTest, EveryEntryMatchesItsGenerator) {
  const auto& table = gpipe::schedule_table();
  ASSERT_EQ(table.size(), gpipe::all_schedules().size());
  for (const gpipe::ScheduleTraits& traits : table) {
    EXPECT_EQ(&gpipe::schedule_traits(traits.kind), &traits);
    EXPECT_EQ(gpipe::parse_schedule(traits.name), traits.kind);
    EXPECT_TRUE(traits.takes_virtual_stages(traits.default_virtual_stages)) << traits.name;
    EXPECT_FALSE(traits.takes_virtual_stages(traits.least_virtual_stages - 1)) << traits.name;
    std::vector<int> Vs{traits.default_virtual_stages};
    if (traits.chooses_virtual_stages()) Vs.push_back(traits.default_virtual_stages + 1);
    for (int V : Vs)
      for (int K = 1; K <= 5; ++K)
        for (int M = 1; M <= 10; ++M) {
          const std::string where = traits.name + " K=" + std::to_string(K) + " M=" + std::to_string(M) +
                                    " V=" + std::to_string(V);
          if (traits.micro_batches_multiple_of_devices && M % K != 0) {
            EXPECT_THROW(gpipe::make_schedule(traits.kind, K, M, V), std::invalid_argument) << where;
            continue;
          }
          const Schedule s = gpipe::make_schedule(traits.kind, K, M, V);
          EXPECT_NO_THROW(gpipe::validate(s)) << where;
          EXPECT_EQ(s.name, traits.name) << where;
          EXPECT_EQ(s.virtual_stages(), V) << where;
          EXPECT_EQ(s.placement, gpipe::place_stages(traits.placement, K, V)) << where;
          bool split = false;
          for (const auto& actions : s.actions)
            for (const Action& a : actions) split = split || a.kind == ActionKind::kInputGrad;
          EXPECT_EQ(split, traits.splits_backward) << where;
          const std::vector<int> peak = gpipe::simulate(s).peak_in_flight;
          int most = 0, bound = 0;
          for (int d = 0; d < K; ++d) {
            const int b = traits.peak_in_flight(K, M, V, d);
            EXPECT_LE(peak[static_cast<size_t>(d)], b) << where << " d" << d;
            most = std::max(most, peak[static_cast<size_t>(d)]);
            bound = std::max(bound, b);
          }
          if (M >= 2 * K) EXPECT_EQ(most, bound) << where;
        }
  }
  EXPECT_EQ(gpipe::place_stages(gpipe::StagePlacement::kLoop, 2, 2), (std::vector<int>{0, 1, 0, 1}));
  EXPECT_EQ(gpipe::place_stages(gpipe::StagePlacement::kV, 2, 2), (std::vector<int>{0, 1, 1, 0}));
}

TEST(MakeScheduleTest, RefusesWhatCannotRun) {
  std::string what = error_of([] { gpipe::make_schedule(ScheduleKind::kInterleaved, 2, 3, 2); });
  EXPECT_TRUE(contains(what, "multiple")) << what;
  EXPECT_TRUE(contains(what, "use M = 4")) << what;
  what = error_of([] { gpipe::make_schedule(ScheduleKind::kInterleaved, 2, 4, 1); });
  EXPECT_TRUE(contains(what, "at least 2 stages per device")) << what;
  for (ScheduleKind kind : {ScheduleKind::kGPipe, ScheduleKind::k1F1B, ScheduleKind::kZB1P}) {
    what = error_of([&] { gpipe::make_schedule(kind, 2, 4, 2); });
    EXPECT_TRUE(contains(what, "the " + gpipe::to_string(kind) + " schedule runs one stage per device")) << what;
    EXPECT_TRUE(contains(what, "use the interleaved schedule")) << what;
  }
  what = error_of([] { gpipe::make_schedule(ScheduleKind::kGPipe, 0, 4); });
  EXPECT_TRUE(contains(what, "at least 1 device (got 0)")) << what;
  what = error_of([] { gpipe::make_schedule(ScheduleKind::k1F1B, 2, 0); });
  EXPECT_TRUE(contains(what, "at least 1 micro-batch (got 0)")) << what;
  what = error_of([] { gpipe::make_schedule(ScheduleKind::kInterleaved, 2, 4, 0); });
  EXPECT_TRUE(contains(what, "at least 1 stage per device (got 0)")) << what;
  // The generators refuse the same shapes by themselves.
  EXPECT_THROW(gpipe::interleaved(3, 4, 2), std::invalid_argument);
  EXPECT_THROW(gpipe::zb1p(2, 0), std::invalid_argument);
  EXPECT_THROW(gpipe::one_f_one_b(-1, 2), std::invalid_argument);
  EXPECT_THROW(gpipe::fill_drain(2, -3), std::invalid_argument);
}

TEST(MakeScheduleTest, NamesParseBack) {
  for (ScheduleKind kind : gpipe::all_schedules()) EXPECT_EQ(gpipe::parse_schedule(gpipe::to_string(kind)), kind);
  EXPECT_EQ(gpipe::parse_schedule("gpipe"), ScheduleKind::kGPipe);
  EXPECT_EQ(gpipe::to_string(ScheduleKind::k1F1B), "1f1b");
  EXPECT_EQ(gpipe::schedule_names(),
            (std::vector<std::string>{"gpipe", "1f1b", "interleaved", "zb1p", "zbv", "v-half"}));
  EXPECT_EQ(gpipe::checkpoint_names(), (std::vector<std::string>{"always", "except_last", "never"}));
  const std::string what = error_of([] { gpipe::parse_schedule("zb"); });
  EXPECT_TRUE(contains(what, "unknown schedule \"zb\"")) << what;
  EXPECT_TRUE(contains(what, "gpipe|1f1b|interleaved|zb1p|zbv|v-half")) << what;
  EXPECT_THROW(gpipe::parse_schedule("GPipe"), std::invalid_argument);
}

// The registry looked up by name, and the help texts made from it: every entry's name and summary,
// its rule on M, and its V.
TEST(ScheduleRegistryTest, LookedUpByNameAndDescribedInTheHelp) {
  for (const gpipe::ScheduleTraits& traits : gpipe::schedule_table()) {
    EXPECT_EQ(&gpipe::find_schedule(traits.name), &traits);
    EXPECT_FALSE(traits.summary.empty()) << traits.name;
    EXPECT_TRUE(contains(gpipe::schedule_help(), traits.name + " (" + traits.summary)) << traits.name;
    EXPECT_TRUE(contains(gpipe::virtual_stages_help(), traits.name) || traits.least_virtual_stages == 1)
        << traits.name;
  }
  EXPECT_TRUE(contains(error_of([] { gpipe::find_schedule("zb"); }), "unknown schedule \"zb\"; use one of gpipe|"));
  EXPECT_EQ(gpipe::schedule_help(),
            "gpipe (fill-drain), 1f1b (one forward, one backward: PipeDream-Flush), interleaved (1F1B over V stages "
            "per device: Megatron-LM's; M a multiple of K), zb1p (zero bubble ZB-H1, backward split into I and W), "
            "zbv (zero bubble ZB-V, 2 stages per device placed as a V) or v-half (zbv's V in (K+1)/2K of its "
            "activation memory)");
  EXPECT_EQ(gpipe::virtual_stages_help(),
            "interleaved: 2 or more, default 2; zbv and v-half: 2, placed as a V (stages d and 2K-1-d on device d); "
            "the others: 1");
  EXPECT_EQ(gpipe::schedules_placed(gpipe::StagePlacement::kLoop), "gpipe, 1f1b, interleaved or zb1p");
  EXPECT_EQ(gpipe::schedules_placed(gpipe::StagePlacement::kV), "zbv or v-half");
}

// ---------------------------------------------------------------- programs as text

// Every schedule's program, compute-only and lowered (with skip connections), printed and read back,
// is the same program; so is the whole of what gpipe schedule --program prints (its grid first).
TEST(ProgramTextTest, PrintedProgramsParseBack) {
  for (const gpipe::ScheduleTraits& traits : gpipe::schedule_table()) {
    const int V = traits.default_virtual_stages;
    const Schedule compute = gpipe::make_schedule(traits.kind, 2, 4, V);
    const Schedule lowered = gpipe::lower(compute, Checkpoint::kExceptLast, {{0, 2 * V - 1}});
    for (const Schedule& s : {compute, lowered}) {
      const Schedule back = gpipe::parse_program(gpipe::format_program(s), traits.name);
      EXPECT_EQ(back.devices, s.devices) << traits.name;
      EXPECT_EQ(back.stages, s.stages) << traits.name;
      EXPECT_EQ(back.micro_batches, s.micro_batches) << traits.name;
      EXPECT_EQ(back.placement, s.placement) << traits.name;
      EXPECT_EQ(back.actions, s.actions) << traits.name;
      EXPECT_EQ(back.lowered(), s.lowered()) << traits.name;
    }
    const std::string printed = traits.name + ": K=2 devices, M=4 micro-batches\n" + gpipe::format_grid(compute) +
                                "simulated bubble 0.2\nprogram with checkpoint never:\n" +
                                gpipe::format_program(gpipe::lower(compute, Checkpoint::kNever));
    EXPECT_EQ(gpipe::parse_program(printed).actions, gpipe::lower(compute, Checkpoint::kNever).actions) << traits.name;
  }
  // Comments and blank lines are skipped.
  const Schedule s = gpipe::parse_program("# two devices\n\ndevice 0 | 0F0 0B0\n  # the last\ndevice 1 | 1F0 1B0\n");
  EXPECT_EQ(s.devices, 2);
  EXPECT_EQ(s.stages, 2);
  EXPECT_EQ(s.micro_batches, 1);
  EXPECT_NO_THROW(gpipe::validate(s));
}

// A program that is not one is refused naming its line and what is wrong.
TEST(ProgramTextTest, MalformedProgramsAreRefusedNamingTheLine) {
  auto refused = [](const std::string& text, const std::string& needle) {
    const std::string what = error_of([&] { gpipe::parse_program(text); });
    EXPECT_TRUE(contains(what, needle)) << what;
  };
  refused("device 0 | 0F0 0B0\ndevice 1 | 1F0 1X0 1B0\n", "line 2 of the program: cannot parse action \"1X0\"");
  refused("device 0 | 0F0 0B0\ndevise 1 | 1F0 1B0\n", "line 2 of the program is not a row \"device D | actions\"");
  refused("device 0 | 0F0 0B0\ndevice 2 | 1F0 1B0\n", "line 2 of the program is the row of device 2 where the row "
                                                        "of device 1 comes");
  refused("device 0 | 0F0 0B0 1F1\ndevice 1 | 1F0 1B0\n", "line 2 of the program: 1F0 is in the row of device 1, "
                                                            "but stage 1 is in the row of device 0 (line 1)");
  refused("device 0 | 0F0 0B0\ndevice 1 | 2F0 2B0\n", "no action of stage 1");
  refused("device 0 | 0F0 999999F0\n", "names stage 999999 but holds only 2 actions");
  refused("device 0 | 0F0  .   .  0B0\n", "an idle slot of the grid the gpipe schedule command prints");
  refused("simulated bubble 0.1\n", "the program has no rows");
}

// ---------------------------------------------------------------- simulation

TEST(SimulateTest, RecordsWhenEachActionRuns) {
  const Schedule s = gpipe::one_f_one_b(2, 2);
  const gpipe::SimulatedRun run = gpipe::simulate(s);
  EXPECT_EQ(line(run.program, 1), line(gpipe::lower(s, Checkpoint::kNever), 1));  // lowered with kNever
  // device 1: 1RECV_F0<0 1F0 1B0 1SEND_B0>0 1RECV_F1<0 1F1 1B1 1SEND_B1>0
  EXPECT_EQ(run.start[1], (std::vector<double>{1, 1, 2, 3, 3, 3, 4, 5}));
  EXPECT_EQ(run.end[1], (std::vector<double>{1, 2, 3, 3, 3, 4, 5, 5}));
  EXPECT_EQ(run.makespan, 6);
  EXPECT_EQ(run.busy, (std::vector<double>{4, 4}));
  EXPECT_DOUBLE_EQ(run.bubble, 1.0 / 3.0);
  // An already lowered program is simulated as it is.
  const Schedule p = gpipe::lower(s, Checkpoint::kAlways);
  EXPECT_EQ(line(gpipe::simulate(p).program, 0), line(p, 0));
}

TEST(SimulateTest, UsesTheCostFunction) {
  const auto cost = [](const Action& a) {
    if (!a.is_compute()) return 0.0;
    return a.kind == ActionKind::kBackward ? 2.0 : 1.0;
  };
  // With B twice F, a slot pair costs 3: both fill-drain and 1F1B take 3(M+K-1).
  for (int K = 1; K <= 6; ++K)
    for (int M = 1; M <= 12; ++M) {
      EXPECT_EQ(gpipe::simulate(gpipe::fill_drain(K, M), cost).makespan, 3 * (M + K - 1)) << K << "x" << M;
      EXPECT_EQ(gpipe::simulate(gpipe::one_f_one_b(K, M), cost).makespan, 3 * (M + K - 1)) << K << "x" << M;
    }
  // A send that takes time delays its receiver.
  const auto slow_link = [](const Action& a) { return a.kind == ActionKind::kSend ? 0.5 : gpipe::unit_cost(a); };
  EXPECT_EQ(gpipe::simulate(gpipe::fill_drain(2, 1), slow_link).makespan, 5);  // F, send, F, B, send, B
  EXPECT_EQ(gpipe::unit_cost(Action::parse("0SEND_F0>1")), 0.0);
  EXPECT_EQ(gpipe::unit_cost(Action::parse("0W0")), 1.0);
}

TEST(SimulateTest, FillDrainAndOneFOneBTakeTwoTimesMPlusKMinusOneSlots) {
  for (int K = 1; K <= 6; ++K)
    for (int M = 1; M <= 12; ++M)
      for (const Schedule& s : {gpipe::fill_drain(K, M), gpipe::one_f_one_b(K, M)}) {
        const gpipe::SimulatedRun run = gpipe::simulate(s);
        EXPECT_EQ(run.makespan, 2 * (M + K - 1)) << shape(s);
        EXPECT_NEAR(run.bubble, gpipe::ideal_bubble(K, M), 1e-12) << shape(s);
      }
}

// ZB-H1's (K-1)/(3M+K-1) holds exactly when M >= K. With fewer micro-batches than devices there are
// not enough W's to fill the wait for the first gradient: the step takes 2(M+K)-1 slots.
TEST(SimulateTest, ZB1PBubbleIsAThirdOfOneFOneBs) {
  for (int K : {2, 4})
    for (int M : {4, 8}) {
      const gpipe::SimulatedRun run = gpipe::simulate(gpipe::zb1p(K, M));
      EXPECT_EQ(run.makespan, 3 * M + K - 1) << K << "x" << M;
      EXPECT_NEAR(run.bubble, static_cast<double>(K - 1) / (3 * M + K - 1), 1e-12) << K << "x" << M;
    }
  for (int K = 1; K <= 6; ++K)
    for (int M = 1; M <= 12; ++M) {
      const gpipe::SimulatedRun run = gpipe::simulate(gpipe::zb1p(K, M));
      EXPECT_EQ(run.makespan, std::max(3 * M + K - 1, 2 * (M + K) - 1)) << K << "x" << M;
      if (M >= K) EXPECT_NEAR(run.bubble, static_cast<double>(K - 1) / (3 * M + K - 1), 1e-12) << K << "x" << M;
      if (K > 1) EXPECT_LT(run.bubble, gpipe::simulate(gpipe::one_f_one_b(K, M)).bubble) << K << "x" << M;
    }
  // The header's comparison: 0.38 of fill-drain's bubble at K=2, M=4.
  EXPECT_NEAR(gpipe::simulate(gpipe::zb1p(2, 4)).bubble / gpipe::simulate(gpipe::fill_drain(2, 4)).bubble, 5.0 / 13.0,
              1e-12);
}

// ZB-V with F = I = W (unit or balanced cost): 6M+K-1 slots, the least possible, for M >= K and K <= 4,
// so its bubble is (K-1)/(6M+K-1); a few slots more at some larger shapes; any M runs.
TEST(SimulateTest, ZBVHasNoBubbleInTheSteadyState) {
  for (int K = 1; K <= 4; ++K)
    for (int M = K; M <= 16; ++M) {
      const gpipe::SimulatedRun run = gpipe::simulate(gpipe::zbv(K, M), gpipe::balanced_cost);
      EXPECT_EQ(run.makespan, 6 * M + K - 1) << K << "x" << M;
      EXPECT_NEAR(run.bubble, static_cast<double>(K - 1) / (6 * M + K - 1), 1e-12) << K << "x" << M;
      EXPECT_EQ(gpipe::simulate(gpipe::zbv(K, M)).makespan, run.makespan) << K << "x" << M;
    }
  for (int K = 2; K <= 6; ++K)
    for (int M = 1; M <= 12; ++M) {
      const gpipe::SimulatedRun run = gpipe::simulate(gpipe::zbv(K, M));
      EXPECT_GE(run.makespan, 6 * M + K - 1) << K << "x" << M;
      if (M >= K) {
        EXPECT_LE(run.makespan, 6 * M + 2 * K - 1) << K << "x" << M;
        EXPECT_LT(run.bubble, gpipe::simulate(gpipe::zb1p(K, M)).bubble) << K << "x" << M;
        EXPECT_LT(run.bubble, 0.5 * gpipe::simulate(gpipe::fill_drain(K, M), gpipe::balanced_cost).bubble)
            << K << "x" << M;
      }
    }
  // At the shapes: K=2, M=4 and 8, a fifth or less of fill-drain's bubble.
  EXPECT_NEAR(gpipe::simulate(gpipe::zbv(2, 4)).bubble, 1.0 / 25, 1e-12);
  EXPECT_NEAR(gpipe::simulate(gpipe::zbv(2, 8)).bubble, 1.0 / 49, 1e-12);
}

// V-Half pays for its memory in slots: never fewer than zbv's; at K=2 more than fill-drain's bubble
// (58 slots for M=8, 48 of them busy), from K=4 less (60 slots for M=8, 108 for M=16; 48 and 96 busy).
TEST(SimulateTest, VHalfTradesBubbleForMemory) {
  for (int K = 1; K <= 6; ++K)
    for (int M = 1; M <= 12; ++M)
      EXPECT_GE(gpipe::simulate(gpipe::v_half(K, M)).makespan, gpipe::simulate(gpipe::zbv(K, M)).makespan)
          << K << "x" << M;
  auto fill_drain_bubble = [](int K, int M) {
    return gpipe::simulate(gpipe::fill_drain(K, M), gpipe::balanced_cost).bubble;
  };
  EXPECT_NEAR(gpipe::simulate(gpipe::v_half(2, 8)).bubble, 10.0 / 58, 1e-12);
  EXPECT_GT(gpipe::simulate(gpipe::v_half(2, 8)).bubble, fill_drain_bubble(2, 8));
  EXPECT_NEAR(gpipe::simulate(gpipe::v_half(4, 8)).bubble, 12.0 / 60, 1e-12);
  EXPECT_NEAR(gpipe::simulate(gpipe::v_half(4, 16)).bubble, 12.0 / 108, 1e-12);
  EXPECT_LT(gpipe::simulate(gpipe::v_half(4, 8)).bubble, fill_drain_bubble(4, 8));
  EXPECT_LT(gpipe::simulate(gpipe::v_half(4, 16)).bubble, fill_drain_bubble(4, 16));
}

TEST(SimulateTest, InterleavedBubbleIsAboutVTimesSmaller) {
  for (int K = 1; K <= 6; ++K)
    for (int V = 2; V <= 3; ++V)
      for (int M = K; M <= 12; M += K) {
        const double bubble = gpipe::simulate(gpipe::interleaved(K, M, V)).bubble;
        EXPECT_NEAR(bubble, static_cast<double>(K - 1) / (V * M + K - 1), 1e-12) << K << "x" << M << " V=" << V;
        if (K > 1) EXPECT_LT(bubble, gpipe::simulate(gpipe::one_f_one_b(K, M)).bubble) << K << "x" << M << " V=" << V;
      }
}

TEST(SimulateTest, PeakInFlight) {
  for (int K = 1; K <= 6; ++K)
    for (int M = 1; M <= 12; ++M) {
      const auto fill = gpipe::simulate(gpipe::fill_drain(K, M)).peak_in_flight;
      const auto one = gpipe::simulate(gpipe::one_f_one_b(K, M)).peak_in_flight;
      const auto zb = gpipe::simulate(gpipe::zb1p(K, M)).peak_in_flight;
      ASSERT_EQ(fill.size(), static_cast<size_t>(K));
      for (int d = 0; d < K; ++d) {
        const size_t dd = static_cast<size_t>(d);
        EXPECT_EQ(fill[dd], M) << K << "x" << M << " d" << d;                  // fill-drain: all of them
        EXPECT_EQ(one[dd], std::min(K - d, M)) << K << "x" << M << " d" << d;  // 1F1B: K-d
        // ZB-H1 holds a micro-batch until its W, and runs W's only when idle: all M on every device.
        EXPECT_EQ(zb[dd], M) << K << "x" << M << " d" << d;
      }
      if (M % K == 0)
        for (int V = 2; V <= 3; ++V) {
          const auto inter = gpipe::simulate(gpipe::interleaved(K, M, V)).peak_in_flight;
          for (int d = 0; d < K; ++d)
            EXPECT_EQ(inter[static_cast<size_t>(d)], std::min((V - 1) * K + 2 * (K - 1 - d) + 1, V * M))
                << K << "x" << M << " V=" << V << " d" << d;
        }
    }
}

TEST(IdealTest, SpeedupAndBubble) {
  EXPECT_DOUBLE_EQ(gpipe::ideal_speedup(2, 32), 64.0 / 33.0);
  EXPECT_DOUBLE_EQ(gpipe::ideal_bubble(4, 5), 3.0 / 8.0);
  EXPECT_DOUBLE_EQ(gpipe::ideal_speedup(1, 7), 1.0);
  EXPECT_DOUBLE_EQ(gpipe::ideal_bubble(1, 7), 0.0);
  // The simulated fill-drain step agrees: speedup = K·M unit slots of work on one device / makespan.
  for (int K = 1; K <= 5; ++K)
    for (int M = 1; M <= 9; ++M)
      EXPECT_DOUBLE_EQ(2.0 * K * M / gpipe::simulate(gpipe::fill_drain(K, M)).makespan, gpipe::ideal_speedup(K, M));
}

// Per schedule: K·(1 - bubble) with B twice F. Fill-drain and 1F1B reach K·M/(M+K-1); the
// interleaved schedule (K-1)/(V·M+K-1)'s bubble; zb1p beats both once M >= K.
TEST(IdealTest, SpeedupOfEachSchedule) {
  EXPECT_DOUBLE_EQ(gpipe::balanced_cost(gpipe::Action::parse("1B0")), 2.0);
  EXPECT_DOUBLE_EQ(gpipe::balanced_cost(gpipe::Action::parse("1W0")), 1.0);
  EXPECT_DOUBLE_EQ(gpipe::balanced_cost(gpipe::Action::parse("1SEND_F0>2")), 0.0);
  for (int K = 1; K <= 4; ++K)
    for (int M = 1; M <= 8; ++M) {
      EXPECT_NEAR(gpipe::ideal_speedup(gpipe::fill_drain(K, M)), gpipe::ideal_speedup(K, M), 1e-12) << K << "x" << M;
      EXPECT_NEAR(gpipe::ideal_speedup(gpipe::one_f_one_b(K, M)), gpipe::ideal_speedup(K, M), 1e-12) << K << "x" << M;
      if (M >= K && K > 1) EXPECT_GT(gpipe::ideal_speedup(gpipe::zb1p(K, M)), gpipe::ideal_speedup(K, M)) << K << "x" << M;
    }
  EXPECT_NEAR(gpipe::ideal_speedup(gpipe::interleaved(2, 4, 2)), 2.0 * (1.0 - 1.0 / 9.0), 1e-12);
  EXPECT_NEAR(gpipe::ideal_speedup(gpipe::zbv(2, 4)), 2.0 * (1.0 - 1.0 / 25.0), 1e-12);
}

TEST(ScheduleSizeTest, AScheduleTooLargeToPlanIsRefusedBeforeItIsBuilt) {
  EXPECT_NE(error_of([] { gpipe::fill_drain(4096, 1024); }).find("use fewer micro-batches or stages"),
            std::string::npos);
  EXPECT_NE(error_of([] { gpipe::interleaved(1024, 2048, 4); }).find("1024 devices x 4 stages each"),
            std::string::npos);
  EXPECT_NO_THROW(gpipe::one_f_one_b(128, 512));  // gpipe plan's sizes
}
