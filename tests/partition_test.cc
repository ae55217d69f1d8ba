// partition_test.cc: even cuts and the errors of a bad balance.
#include "helpers.h"

using gpipe::testing::expect_invalid;

TEST(EvenBalanceTest, FirstStagesTakeTheRemainder) {
  EXPECT_EQ(gpipe::even_balance(10, 3), (std::vector<int>{4, 3, 3}));
  EXPECT_EQ(gpipe::even_balance(4, 4), (std::vector<int>{1, 1, 1, 1}));
  EXPECT_EQ(gpipe::even_balance(7, 1), (std::vector<int>{7}));
}

TEST(EvenBalanceTest, RejectsMoreStagesThanLayers) {
  expect_invalid([] { gpipe::even_balance(3, 4); }, "cannot cut 3 layers into 4 stages");
  expect_invalid([] { gpipe::even_balance(3, 0); }, "at least 1 (got 0)");
}

TEST(CheckBalanceTest, NamesTheProblem) {
  EXPECT_NO_THROW(gpipe::check_balance({2, 3}, 5));
  expect_invalid([] { gpipe::check_balance({2, 2}, 5); }, "model: 5 layers, sum of balance {2, 2}: 4");
  expect_invalid([] { gpipe::check_balance({5, 0}, 5); }, "stage 1 of balance {5, 0} has 0 layers");
  expect_invalid([] { gpipe::check_balance({}, 5); }, "the balance is empty");
}

TEST(StageOffsetsTest, CumulativeStarts) {
  EXPECT_EQ(gpipe::stage_offsets({4, 3, 3}), (std::vector<int>{0, 4, 7, 10}));
}

TEST(WorkloadBalanceTest, EmbeddingAndHeadRideWithTheEnds) {
  gpipe::Workload w = gpipe::make_workload("transformer");
  EXPECT_EQ(w.model->size(), 10u);
  EXPECT_EQ(w.balance(2), (std::vector<int>{5, 5}));
  EXPECT_EQ(w.balance(4), (std::vector<int>{3, 2, 2, 3}));
  gpipe::Workload mlp = gpipe::make_workload("tiny");
  EXPECT_EQ(mlp.balance(3), (std::vector<int>{6, 6, 4}));
}
