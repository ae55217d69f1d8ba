// rank_tests.h: test programs that every rank of a job runs (mpi_test, c10d_test): rank 0 prints the
// tests as usual, the others only their failures, each line naming the rank.
#pragma once

#include <gtest/gtest.h>

#include <cstdio>

namespace gpipe::testing {

class RankFailures : public ::testing::EmptyTestEventListener {
 public:
  explicit RankFailures(int rank) : rank_(rank) {}
  void OnTestPartResult(const ::testing::TestPartResult& result) override {
    if (result.failed())
      std::fprintf(stderr, "[rank %d] %s:%d: %s\n", rank_, result.file_name() ? result.file_name() : "?",
                   result.line_number(), result.summary());
  }

 private:
  int rank_;
};

/// After InitGoogleTest: on every rank but the first, only failures are printed.
inline void print_only_failures_unless_first(int rank) {
  if (rank == 0) return;
  auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
  delete listeners.Release(listeners.default_result_printer());
  listeners.Append(new RankFailures(rank));
}

}  // namespace gpipe::testing
