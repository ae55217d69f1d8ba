// transport_test.cc: messages addressed by micro-batch, any order, and cancellation of a blocked recv.
#include "helpers.h"

#include <future>

using gpipe::Channel;

TEST(InProcessTransportTest, MessagesArriveByAddressInAnyOrder) {
  gpipe::InProcessTransport t(2);
  t.send(0, 1, Channel::kActivation, 1, torch::full({2}, 1.0));
  t.send(0, 1, Channel::kActivation, 0, torch::full({2}, 0.0));
  t.send(1, 0, Channel::kGradient, 0, torch::full({2}, 5.0));
  EXPECT_EQ(t.recv(0, 1, Channel::kActivation, 0).only()[0].item<float>(), 0.0f);
  EXPECT_EQ(t.recv(0, 1, Channel::kActivation, 1).only()[0].item<float>(), 1.0f);
  EXPECT_EQ(t.recv(1, 0, Channel::kGradient, 0).only()[0].item<float>(), 5.0f);
}

TEST(InProcessTransportTest, RecvWaitsForTheSender) {
  gpipe::InProcessTransport t(2);
  auto got = std::async(std::launch::async, [&] { return t.recv(0, 1, Channel::kActivation, 3); });
  t.send(0, 1, Channel::kActivation, 3, torch::ones({4}));
  ASSERT_EQ(got.wait_for(std::chrono::seconds(30)), std::future_status::ready);
  EXPECT_EQ(got.get().only().sum().item<float>(), 4.0f);
}

// The Transport contract (transport.h), as MpiTransport keeps it too (mpi_test.cc): a cancel wakes
// a blocked recv with its reason, later sends and recvs throw Cancelled, and the transport takes no
// further step: begin() throws std::logic_error; the runtime replaces it (a step after a failed one
// runs exactly: FaultTest.ForwardFaultIsReportedAndChangesNothing).
TEST(InProcessTransportTest, CancelWakesABlockedRecvWithItsReasonAndEndsTheTransport) {
  gpipe::InProcessTransport t(2);
  auto got = std::async(std::launch::async, [&] { return t.recv(1, 0, Channel::kGradient, 0); });
  t.cancel("gpipe: stage 1 failed");
  ASSERT_EQ(got.wait_for(std::chrono::seconds(30)), std::future_status::ready);
  try {
    got.get();
    ADD_FAILURE() << "recv returned after cancel";
  } catch (const gpipe::Cancelled& e) {
    EXPECT_STREQ(e.what(), "gpipe: stage 1 failed");
  }
  EXPECT_THROW(t.recv(0, 1, Channel::kActivation, 0), gpipe::Cancelled) << "a later recv is cancelled too";
  EXPECT_THROW(t.send(1, 0, Channel::kGradient, 0, torch::ones({1})), gpipe::Cancelled) << "and a later send";
  EXPECT_THROW(t.begin({}), std::logic_error) << "a cancelled transport takes no further step";
  EXPECT_TRUE(t.cancelled());
  // A new transport carries the next step's messages.
  gpipe::InProcessTransport next(2);
  next.begin({});
  next.send(1, 0, Channel::kGradient, 0, torch::ones({1}));
  EXPECT_EQ(next.recv(1, 0, Channel::kGradient, 0).only().item<float>(), 1.0f);
}

// begin() after a step that ended normally starts the next one on the same transport.
TEST(InProcessTransportTest, BeginAfterAFinishedStepReusesTheTransport) {
  gpipe::InProcessTransport t(2);
  t.begin({});
  t.send(0, 1, Channel::kActivation, 0, torch::ones({2}));
  EXPECT_EQ(t.recv(0, 1, Channel::kActivation, 0).only().sum().item<float>(), 2.0f);
  t.finish();
  t.begin({});
  t.send(1, 0, Channel::kGradient, 0, torch::ones({1}));
  EXPECT_EQ(t.recv(1, 0, Channel::kGradient, 0).only().item<float>(), 1.0f);
}

TEST(InProcessTransportTest, CountsTheBytesSent) {
  gpipe::InProcessTransport t(2);
  t.send(0, 1, Channel::kActivation, 0, torch::ones({3}, torch::kFloat64));
  t.send(1, 0, Channel::kGradient, 0, torch::ones({2}));
  EXPECT_EQ(t.bytes_sent(), 3 * 8 + 2 * 4);
}
