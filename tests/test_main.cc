// test_main.cc: runs the tests with every stage and the reference on one thread each.
#include <gtest/gtest.h>
#include <torch/torch.h>

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  at::set_num_threads(1);
  return RUN_ALL_TESTS();
}
