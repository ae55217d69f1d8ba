// c10d_vote_test.cc: gpipe::c10d::start_over's vote on a new store, in one process: rank 0 of 2 over a
// TCPStore this test hosts, whose rank 1 the test plays, saying its word in the store itself.
#include <gpipe/c10d_backend.h>

#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <chrono>
#include <cstdlib>

namespace {

// Rank 1's word comes while rank 0 is between two slices of its wait (`between` runs after a slice
// ran out, the key not yet set): read in step, it lets rank 0 take the store at once. A slice's wait
// that ran out leaves on its connection the answer the server sends once the key is set; waited on the
// connection the vote then checks and reads on, that answer was read as the check's, the read out of
// step, and rank 0 waited GPIPE_TIMEOUT for bytes that never came (under load, rank 1 waited for it to
// connect meanwhile: tests/python/test_process_group.py hung).
TEST(C10dVote, AWordSaidBetweenTwoSlicesOfTheWaitIsReadInStep) {
  setenv("GPIPE_TIMEOUT", "5", 1);  // out of step, the read would throw after 5 s
  unsetenv("TORCHELASTIC_RESTART_COUNT");
  ::c10d::TCPStoreOptions options;
  options.port = 0;
  options.isServer = true;
  options.waitWorkers = false;
  options.timeout = std::chrono::seconds(30);
  auto store = c10::make_intrusive<::c10d::TCPStore>("127.0.0.1", options);
  options.port = store->getPort();
  options.isServer = false;
  const auto rank1 = c10::make_intrusive<::c10d::TCPStore>("127.0.0.1", options);
  int slices = 0;
  const auto began = std::chrono::steady_clock::now();
  gpipe::c10d::start_over(store, 0, 2, "vote", {}, /*let_go=*/false, [&] {
    // The vote's keys: gpipe/<restart>/<scope>/<start over this store>/taken/<rank>.
    if (slices++ == 0) rank1->set("gpipe/0/vote/1/taken/1", std::vector<uint8_t>{'+'});
  });
  EXPECT_EQ(slices, 1);  // the word read at the check after the slice that said it
  EXPECT_LT(std::chrono::steady_clock::now() - began, std::chrono::seconds(4));
}

}  // namespace
