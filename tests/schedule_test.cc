// schedule_test.cc: GPipe's table asserted literally, the text form, the validator and the simulator.
#include "helpers.h"

using gpipe::Action;
using gpipe::Phase;

namespace {
std::vector<std::string> row(const gpipe::Schedule& s, int j) {
  std::vector<std::string> out;
  for (const Action& a : s.actions[static_cast<size_t>(j)]) out.push_back(a.str());
  return out;
}
}  // namespace

TEST(FillDrainTest, TableForThreeStagesFourMicroBatches) {
  const gpipe::Schedule s = gpipe::fill_drain(3, 4);
  ASSERT_EQ(s.actions.size(), 3u);
  EXPECT_EQ(row(s, 0), (std::vector<std::string>{"0F0", "0F1", "0F2", "0F3", "0B3", "0B2", "0B1", "0B0"}));
  EXPECT_EQ(row(s, 1), (std::vector<std::string>{"1F0", "1F1", "1F2", "1F3", "1B3", "1B2", "1B1", "1B0"}));
  EXPECT_EQ(row(s, 2), (std::vector<std::string>{"2F0", "2F1", "2F2", "2F3", "2B3", "2B2", "2B1", "2B0"}));
}

TEST(FillDrainTest, GridShowsFillAndDrain) {
  EXPECT_EQ(gpipe::format_grid(gpipe::fill_drain(3, 4)),
            "stage 0 | 0F0 0F1 0F2 0F3  .   .   .   .  0B3 0B2 0B1 0B0\n"
            "stage 1 |  .  1F0 1F1 1F2 1F3  .   .  1B3 1B2 1B1 1B0  . \n"
            "stage 2 |  .   .  2F0 2F1 2F2 2F3 2B3 2B2 2B1 2B0  .   . \n");
}

TEST(FillDrainTest, SimulatedStepTakesTwoTimesMPlusKMinusOneSlots) {
  for (int K = 1; K <= 5; ++K)
    for (int M = 1; M <= 9; ++M)
      EXPECT_EQ(gpipe::simulate(gpipe::fill_drain(K, M)).makespan, 2 * (M + K - 1)) << K << "x" << M;
}

TEST(ForwardOnlyTest, EveryStageRunsEveryForward) {
  const gpipe::Schedule s = gpipe::forward_only(2, 3);
  EXPECT_FALSE(s.backward);
  EXPECT_EQ(row(s, 1), (std::vector<std::string>{"1F0", "1F1", "1F2"}));
  EXPECT_NO_THROW(gpipe::validate(s));
  EXPECT_EQ(gpipe::simulate(s).makespan, 4);
}

TEST(ActionTest, TextFormParsesBack) {
  for (const Action& a : {Action{0, Phase::kForward, 0}, Action{12, Phase::kBackward, 305}})
    EXPECT_EQ(Action::parse(a.str()), a);
  EXPECT_EQ(Action::parse("1F0"), (Action{1, Phase::kForward, 0}));
  for (const char* bad : {"", "F0", "1X0", "1F", "1F0x", "-1F0"})
    EXPECT_THROW(Action::parse(bad), std::invalid_argument) << bad;
}

TEST(ValidateTest, AcceptsGeneratedSchedules) {
  for (int K = 1; K <= 6; ++K)
    for (int M = 1; M <= 6; ++M) EXPECT_NO_THROW(gpipe::validate(gpipe::fill_drain(K, M)));
}

TEST(ValidateTest, RejectsBackwardBeforeForward) {
  gpipe::Schedule s = gpipe::fill_drain(2, 2);
  std::swap(s.actions[1][0], s.actions[1][3]);  // 1B0 first
  try {
    gpipe::validate(s);
    FAIL() << "expected std::logic_error";
  } catch (const std::logic_error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("1B0 comes before its forward"), std::string::npos) << what;
    EXPECT_NE(what.find("stage 1 | 1B0 1F1 1B1 1F0  <-- ERROR HERE"), std::string::npos) << what;
  }
}

TEST(ValidateTest, RejectsMissingAndDuplicateActions) {
  gpipe::Schedule s = gpipe::fill_drain(2, 3);
  s.actions[0].pop_back();  // no 0B0
  EXPECT_THROW(gpipe::validate(s), std::logic_error);
  s = gpipe::fill_drain(2, 3);
  s.actions[0][1] = Action{0, Phase::kForward, 0};  // 0F0 twice, no 0F1
  EXPECT_THROW(gpipe::validate(s), std::logic_error);
  s = gpipe::fill_drain(2, 3);
  s.actions[0][0].stage = 1;  // on the wrong row
  EXPECT_THROW(gpipe::validate(s), std::logic_error);
}

TEST(ValidateTest, RejectsDeadlock) {
  gpipe::Schedule s = gpipe::fill_drain(2, 2);
  // Stage 1 waits for micro-batch 1 first; stage 0 waits for 1's gradient of micro-batch 0 ... before sending mb 1.
  s.actions[0] = {{0, Phase::kForward, 0}, {0, Phase::kBackward, 0}, {0, Phase::kForward, 1}, {0, Phase::kBackward, 1}};
  s.actions[1] = {{1, Phase::kForward, 1}, {1, Phase::kForward, 0}, {1, Phase::kBackward, 0}, {1, Phase::kBackward, 1}};
  try {
    gpipe::validate(s);
    FAIL() << "expected std::logic_error";
  } catch (const std::logic_error& e) {
    EXPECT_NE(std::string(e.what()).find("deadlock"), std::string::npos) << e.what();
  }
}

TEST(IdealTest, SpeedupAndBubble) {
  EXPECT_DOUBLE_EQ(gpipe::ideal_speedup(2, 32), 64.0 / 33.0);
  EXPECT_DOUBLE_EQ(gpipe::ideal_bubble(4, 5), 3.0 / 8.0);
  EXPECT_DOUBLE_EQ(gpipe::ideal_speedup(1, 7), 1.0);
}
