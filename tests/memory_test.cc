// memory_test.cc: allocations charged to the stage that made them; re-materialization lowers the peak; caps fail clearly.
#include "helpers.h"

#include <c10/core/CPUAllocator.h>

#include <thread>

using gpipe::PipelineOptions;

TEST(MemoryScopeTest, ChargesThisThreadsAllocationsUntilFreed) {
  gpipe::enable_memory_tracking();
  auto counter = std::make_shared<gpipe::MemoryCounter>("test");
  torch::Tensor kept;
  {
    gpipe::MemoryScope scope(counter);
    kept = torch::empty({1000}, torch::kFloat);
    torch::Tensor gone = torch::empty({500}, torch::kFloat);
    std::thread([&] { torch::Tensor other = torch::empty({4096}); }).join();  // another thread: not charged
    EXPECT_GE(counter->current_bytes(), 6000);
  }
  torch::Tensor outside = torch::empty({2048});  // no scope: not charged
  EXPECT_GE(counter->current_bytes(), 4000);
  EXPECT_LT(counter->current_bytes(), 6000);
  EXPECT_GE(counter->peak_bytes(), 6000);
  EXPECT_LT(counter->peak_bytes(), 6000 + 4096 * 4);
  kept = torch::Tensor();
  EXPECT_EQ(counter->current_bytes(), 0);
}

TEST(MemoryScopeTest, ConvolutionsAndRawAllocationsWork) {
  // oneDNN's convolutions allocate through raw_allocate, which needs a plain pointer.
  gpipe::enable_memory_tracking();
  auto counter = std::make_shared<gpipe::MemoryCounter>("conv");
  torch::nn::Conv2d conv(torch::nn::Conv2dOptions(3, 8, 3).padding(1));
  {
    gpipe::MemoryScope scope(counter);
    torch::Tensor x = torch::randn({4, 3, 16, 16}, torch::requires_grad());
    conv(x).sum().backward();
    void* raw = c10::GetCPUAllocator()->raw_allocate(1000);
    EXPECT_GE(counter->current_bytes(), 1000);
    c10::GetCPUAllocator()->raw_deallocate(raw);
  }
  EXPECT_GT(counter->peak_bytes(), 4 * 8 * 16 * 16 * 4);
  EXPECT_GT(counter->current_bytes(), 0);  // the weight's and bias's grads, made in the scope
  for (auto p : conv->parameters()) p.mutable_grad() = torch::Tensor();
  EXPECT_EQ(counter->current_bytes(), 0);
}

TEST(MemoryScopeTest, CapFailsTheAllocationWithAClearMessage) {
  gpipe::enable_memory_tracking();
  auto counter = std::make_shared<gpipe::MemoryCounter>("stage 1 (cpu(1 thread))", 1000);
  gpipe::MemoryScope scope(counter);
  try {
    torch::empty({1000}, torch::kFloat);
    FAIL() << "expected OutOfMemory";
  } catch (const std::exception& e) {  // libtorch may wrap it in c10::Error
    const std::string what = e.what();
    EXPECT_NE(what.find("out of memory on stage 1 (cpu(1 thread)): asked for 4000 bytes"), std::string::npos) << what;
    EXPECT_NE(what.find("cap of 1000 bytes"), std::string::npos) << what;
  }
  EXPECT_EQ(counter->current_bytes(), 0);
}

namespace {
// Peak bytes per stage of one step of a wide MLP with `mode`.
std::vector<int64_t> peaks(gpipe::Checkpoint mode) {
  torch::manual_seed(0);
  torch::nn::Sequential model;
  for (int l = 0; l < 8; ++l) {
    model->push_back(torch::nn::Linear(64, 64));
    model->push_back(torch::nn::ReLU());
  }
  gpipe::Pipeline pipe(model, PipelineOptions().devices(2).micro_batches(8).checkpoint(mode).track_memory(true));
  pipe.train_step(torch::randn({1024, 64}), torch::randn({1024, 64}), gpipe::mse_loss);
  std::vector<int64_t> out;
  for (const auto& m : pipe.memory()) {
    EXPECT_GT(m.parameter_bytes, 0);
    out.push_back(m.peak_bytes);
  }
  return out;
}
}  // namespace

TEST(PipelineMemoryTest, RematerializationLowersThePeakOfEveryStage) {
  const auto never = peaks(gpipe::Checkpoint::kNever);
  const auto always = peaks(gpipe::Checkpoint::kAlways);
  ASSERT_EQ(never.size(), 2u);
  for (size_t j = 0; j < 2; ++j) {
    EXPECT_GT(always[j], 0);
    EXPECT_LT(always[j] * 2, never[j]) << "stage " << j << ": always " << always[j] << ", never " << never[j];
  }
}

TEST(PipelineMemoryTest, CapNamesStageMicroBatchBytesAndCapAndChangesNothing) {
  auto model = gpipe::testing::small_mlp(0);
  gpipe::Pipeline pipe(model, PipelineOptions().devices(2).micro_batches(2).device_list(
                                  {gpipe::Device::cpu(), gpipe::Device::cpu().with_memory_cap(2000)}));
  const torch::Tensor x = torch::randn({64, 12}), y = torch::randn({64, 4});
  try {
    pipe.train_step(x, y, gpipe::mse_loss);
    FAIL() << "expected an out-of-memory StageError";
  } catch (const gpipe::StageError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("stage 1 failed in the forward of micro-batch 0"), std::string::npos) << what;
    EXPECT_NE(what.find("out of memory on device 1"), std::string::npos) << what;
    EXPECT_NE(what.find("cap of 2000 bytes"), std::string::npos) << what;
  }
  for (const auto& p : model->parameters()) EXPECT_FALSE(p.grad().defined());
  EXPECT_TRUE(pipe.memory().size() == 2);
}

TEST(PipelineMemoryTest, NoTrackingNoReport) {
  gpipe::Pipeline pipe(gpipe::testing::small_mlp(0), PipelineOptions().devices(2));
  EXPECT_TRUE(pipe.memory().empty());
}

// A module with one parameter it uses and one it does not.
class HalfUsed : public torch::nn::Module {
 public:
  HalfUsed() {
    used = register_parameter("used", torch::randn({256, 256}) * 0.05);
    unused = register_parameter("unused", torch::randn({8}));
  }
  torch::Tensor forward(const torch::Tensor& x) { return x.matmul(used); }
  torch::Tensor used, unused;
};

TEST(PipelineMemoryTest, PeaksLeaveGradientsToTheParametersAndUnusedOnesStayUndefined) {
  torch::manual_seed(3);
  auto half = std::make_shared<HalfUsed>();
  torch::nn::Sequential model(torch::nn::Linear(256, 256), torch::nn::ReLU(), torch::nn::Linear(256, 256),
                              torch::nn::ReLU(), torch::nn::Linear(256, 256));
  model->push_back(half);
  torch::nn::Sequential reference(torch::nn::Linear(256, 256), torch::nn::ReLU(), torch::nn::Linear(256, 256),
                                  torch::nn::ReLU(), torch::nn::Linear(256, 256));
  auto half_ref = std::make_shared<HalfUsed>();
  reference->push_back(half_ref);
  for (size_t n = 0; n < model->parameters().size(); ++n) {
    torch::NoGradGuard no_grad;
    reference->parameters()[n].copy_(model->parameters()[n]);
  }
  gpipe::Pipeline pipe(model, PipelineOptions().balance({5, 1}).micro_batches(2).track_memory(true));
  // Two rows: the activations are a few KiB; stage 0's gradients 771 KiB, stage 1's 256 KiB.
  // Backward holds one weight's gradient at a time before adding it to the stage's.
  const torch::Tensor x = torch::randn({2, 256}), y = torch::randn({2, 256});
  pipe.train_step(x, y, gpipe::mse_loss);
  for (const auto& m : pipe.memory()) {
    EXPECT_GE(m.parameter_bytes, 2 * 256 * 256 * 4);      // parameters and their gradients
    EXPECT_LT(m.peak_bytes, 2 * 256 * 256 * 4) << "a peak counts the gradients";
  }
  EXPECT_FALSE(half->unused.grad().defined());
  gpipe::testing::reference_step(reference, x, y, gpipe::mse_loss);
  EXPECT_TRUE(gpipe::testing::close(half->used.grad(), half_ref->used.grad()));
  EXPECT_TRUE(gpipe::testing::close(model->parameters()[0].grad(), reference->parameters()[0].grad()));
}

// The held peak counts what is allocated at the moments the executor notes (between actions),
// not a buffer freed within an action; reset_peak starts both peaks from what is held.
TEST(MemoryCounterTest, HeldPeakLeavesOutBuffersFreedWithinAnAction) {
  gpipe::MemoryCounter counter("device 0");
  counter.charge(100);  // kept for backward
  counter.note_held();
  counter.charge(400);  // a buffer inside the next action
  counter.release(400);
  counter.note_held();
  EXPECT_EQ(counter.peak_bytes(), 500);
  EXPECT_EQ(counter.held_peak_bytes(), 100);
  counter.release(60);
  counter.reset_peak();
  EXPECT_EQ(counter.held_peak_bytes(), 40);
  EXPECT_EQ(counter.peak_bytes(), 40);
}
