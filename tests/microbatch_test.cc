// microbatch_test.cc: even splits, views, and the round trip through gather.
#include "helpers.h"

using gpipe::testing::expect_invalid;

TEST(MicroBatchSizesTest, EvenWhenDivisible) {
  EXPECT_EQ(gpipe::micro_batch_sizes(12, 4), (std::vector<int64_t>{3, 3, 3, 3}));
}

TEST(MicroBatchSizesTest, FirstChunksTakeTheRemainder) {
  EXPECT_EQ(gpipe::micro_batch_sizes(10, 4), (std::vector<int64_t>{3, 3, 2, 2}));
  EXPECT_EQ(gpipe::micro_batch_sizes(13, 8), (std::vector<int64_t>{2, 2, 2, 2, 2, 1, 1, 1}));
}

TEST(MicroBatchSizesTest, RejectsMoreChunksThanSamples) {
  expect_invalid([] { gpipe::micro_batch_sizes(4, 8); }, "larger than the batch size (4)");
  expect_invalid([] { gpipe::micro_batch_sizes(4, 0); }, "at least 1 (got 0)");
}

TEST(ScatterTest, PiecesAreViewsThatGatherBack) {
  torch::Tensor x = torch::arange(30).reshape({10, 3});
  auto pieces = gpipe::scatter(x, 3);
  ASSERT_EQ(pieces.size(), 3u);
  EXPECT_EQ(pieces[0].size(0), 4);
  EXPECT_EQ(pieces[2].size(0), 3);
  EXPECT_EQ(pieces[1].data_ptr(), x[4].data_ptr());  // no copy
  EXPECT_TRUE(torch::equal(gpipe::gather(pieces), x));
}

TEST(ScatterTest, RejectsScalars) {
  expect_invalid([] { gpipe::scatter(torch::tensor(1.0), 1); }, "batch dimension");
}
