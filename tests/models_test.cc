// The residual network and the U-Net of models.h: their shapes, and one pipelined step of each,
// BatchNorm and skip connections crossing stages, against the same model on one device; the
// byte-level GPT (causal, its head tied to its embedding across stages) and its text data.
#include "helpers.h"

#include <gpipe/microbatch.h>
#include <gpipe/workloads.h>

#include <cmath>
#include <filesystem>
#include <fstream>

#include <unistd.h>

namespace {

using gpipe::PipelineOptions;

TEST(ModelsTest, ShapesAndLayerCounts) {
  torch::NoGradGuard no_grad;
  const torch::Tensor x = torch::randn({3, 1, 28, 28});
  torch::nn::Sequential resnet = gpipe::fashion_resnet(), unet = gpipe::fashion_unet();
  EXPECT_EQ(static_cast<int>(resnet->size()), gpipe::kFashionResnetLayers);
  EXPECT_EQ(static_cast<int>(unet->size()), gpipe::kFashionUnetLayers);
  EXPECT_EQ(resnet->forward(x).sizes(), (std::vector<int64_t>{3, 10}));
  EXPECT_EQ(unet->forward(x).sizes(), x.sizes());
  EXPECT_EQ(gpipe::skip_connections(resnet).size(), 3u);
  EXPECT_EQ(gpipe::skip_connections(unet).size(), 2u);
}

// A workload's shape (what a task list and a cut read) is the built workload's, and costs no random
// number: the generator's next draw is the one it would have been.
TEST(ModelsTest, AWorkloadsShapeIsItsBuildsAndDrawsNothing) {
  for (const std::string& name : gpipe::workload_names()) {
    for (const bool tie : {false, true}) {
      if (tie && name != "transformer") continue;
      SCOPED_TRACE(name + (tie ? " tied" : ""));
      const gpipe::Workload built = gpipe::make_workload(name, 3, {}, tie);
      torch::manual_seed(11);
      const gpipe::Workload shape = gpipe::workload_shape(name, tie);
      const torch::Tensor next = torch::rand({4});
      torch::manual_seed(11);
      EXPECT_TRUE(torch::equal(next, torch::rand({4})));
      EXPECT_EQ(shape.layers, built.layers);
      EXPECT_EQ(static_cast<int>(built.model->size()), built.layers);
      EXPECT_EQ(shape.model->size(), 0u);
      EXPECT_EQ(shape.block_layers, built.block_layers);
      EXPECT_EQ(shape.lead_layers, built.lead_layers);
      EXPECT_EQ(shape.tail_layers, built.tail_layers);
      EXPECT_EQ(shape.tied, built.tied);
      EXPECT_EQ(shape.input.sizes(), built.input.sizes());
      EXPECT_EQ(shape.input.scalar_type(), built.input.scalar_type());
      EXPECT_EQ(shape.target.sizes(), built.target.sizes());
      EXPECT_EQ(shape.target.scalar_type(), built.target.scalar_type());
    }
  }
}

// The cost model profiles layer by layer; a Pop finds what its Stash put, on every pass.
TEST(ModelsTest, TheCostModelProfilesModelsWithSkips) {
  for (const auto& m : {gpipe::fashion_resnet(), gpipe::fashion_unet()}) {
    const torch::Tensor x = torch::randn({2, 1, 28, 28});
    const gpipe::CostModel costs = gpipe::profile_layers(m, x, gpipe::ProfileLayersOptions().warmup(0).repetitions(1));
    EXPECT_EQ(costs.layers.size(), m->size());
  }
}

// The gradient of one step on one device, each micro-batch normalized by its own statistics.
void micro_batch_reference(torch::nn::Sequential model, const torch::Tensor& x, const torch::Tensor& y, int M,
                           const gpipe::LossFn& loss) {
  std::vector<torch::Tensor> saved;
  for (const auto& b : model->buffers()) saved.push_back(b.clone());
  const auto xs = gpipe::scatter(x, M), ys = gpipe::scatter(y, M);
  for (size_t i = 0; i < xs.size(); ++i)
    (loss(model->forward(xs[i]), ys[i]) * (static_cast<double>(xs[i].size(0)) / static_cast<double>(x.size(0))))
        .backward();
  torch::NoGradGuard no_grad;
  for (size_t n = 0; n < saved.size(); ++n) model->buffers()[n].copy_(saved[n]);
}

TEST(ModelsTest, ResNetOnThreeStagesHasOneDevicesGradients) {
  for (gpipe::ScheduleKind schedule : {gpipe::ScheduleKind::kGPipe, gpipe::ScheduleKind::kZB1P}) {
    SCOPED_TRACE(gpipe::to_string(schedule));
    torch::manual_seed(1);
    torch::nn::Sequential piped = gpipe::fashion_resnet();
    torch::manual_seed(1);
    torch::nn::Sequential reference = gpipe::fashion_resnet();
    // Cuts inside blocks: a residual connection crosses from stage 0 to 1 and from 1 to 2.
    gpipe::Pipeline pipe(piped, PipelineOptions().balance({5, 12, 13}).micro_batches(3).schedule(schedule)
                                    .checkpoint(gpipe::Checkpoint::kExceptLast));
    EXPECT_GE(pipe.schedule().skips.size(), 2u);
    const torch::Tensor x = torch::randn({9, 1, 28, 28}), y = torch::randint(10, {9}, torch::kLong);
    pipe.train_step(x, y, gpipe::cross_entropy_loss);
    micro_batch_reference(reference, x, y, 3, gpipe::cross_entropy_loss);
    EXPECT_TRUE(gpipe::testing::same_parameters(piped, reference, /*values=*/false, 1e-4));
    EXPECT_GT(pipe.skip_bytes(), 0);
  }
}

TEST(ModelsTest, UNetOnThreeStagesHasOneDevicesGradients) {
  torch::manual_seed(2);
  torch::nn::Sequential piped = gpipe::fashion_unet();
  torch::manual_seed(2);
  torch::nn::Sequential reference = gpipe::fashion_unet();
  // Cut so that both long skips cross: "28" from stage 0 to 2, "14" from stage 1 to 2.
  gpipe::Pipeline pipe(piped, PipelineOptions().balance({5, 10, 14}).micro_batches(2).checkpoint(gpipe::Checkpoint::kAlways));
  const torch::Tensor x = torch::randn({4, 1, 28, 28}), y = torch::randn({4, 1, 28, 28});
  const double loss = pipe.train_step(x, y, gpipe::mse_loss).item<double>();
  const double expected = gpipe::testing::reference_step(reference, x, y, gpipe::mse_loss).item<double>();
  EXPECT_NEAR(loss, expected, 1e-5 * expected);
  EXPECT_TRUE(gpipe::testing::same_parameters(piped, reference, /*values=*/false, 1e-4));
  // Both long skips cross stages: [4, 16, 28, 28] and [4, 32, 14, 14] floats out, as many gradient floats back.
  EXPECT_EQ(pipe.skip_bytes(), 2 * 4 * (4 * 16 * 28 * 28 + 4 * 32 * 14 * 14));
}

// ---------------------------------------------------------------- the byte-level GPT

gpipe::GptOptions tiny_gpt() {
  gpipe::GptOptions o;
  o.context = 12;
  o.width = 16;
  o.heads = 2;
  o.blocks = 3;
  o.feed_forward = 32;
  return o;
}

TEST(GptTest, ScoresEveryNextByteSeeingOnlyThePast) {
  const gpipe::GptOptions o = tiny_gpt();
  torch::manual_seed(0);
  torch::nn::Sequential gpt = gpipe::byte_gpt(o);
  EXPECT_EQ(static_cast<int>(gpt->size()), o.layers());
  const auto named = gpt->named_parameters();
  ASSERT_EQ(o.tied().size(), 1u);
  EXPECT_TRUE(named[o.tied()[0][0]].is_same(named[o.tied()[0][1]])) << "the head reads the embedding's tensor";
  torch::NoGradGuard no_grad;
  const torch::Tensor x = torch::randint(256, {2, o.context}, torch::kLong);
  const torch::Tensor out = gpt->forward(x);
  EXPECT_EQ(out.sizes(), (std::vector<int64_t>{2, o.context, 256}));
  // Changing byte 7 changes no score before position 7, and the scores from there on.
  torch::Tensor changed = x.clone();
  changed[0][7] = (x[0][7].item<int64_t>() + 1) % 256;
  const torch::Tensor again = gpt->forward(changed);
  EXPECT_TRUE(again.narrow(1, 0, 7).equal(out.narrow(1, 0, 7)));
  EXPECT_FALSE(again[0][7].equal(out[0][7]));
  // A shorter sequence scores as the start of a longer one; a longer one than the context is refused.
  EXPECT_TRUE(gpipe::testing::close(gpt->forward(x.narrow(1, 0, 5)), out.narrow(1, 0, 5), 1e-5));
  gpipe::testing::expect_invalid([&] { gpt->forward(torch::zeros({1, o.context + 1}, torch::kLong)); }, "context of 12");
  gpipe::GptOptions bad = o;
  bad.heads = 3;
  gpipe::testing::expect_invalid([&] { gpipe::byte_gpt(bad); }, "not a multiple of its 3 heads");
}

// Three SGD steps with the embedding on the first stage and the head it is tied to on the last,
// in every checkpoint mode and several schedules, against the same model on one device. (SGD:
// Adam would turn a gradient that is zero up to rounding, the key bias's, into whole steps.)
TEST(GptTest, PipelinedWithTheHeadOnAnotherStageMatchesOneDevice) {
  const gpipe::GptOptions o = tiny_gpt();  // 6 layers: embedding, 3 blocks, LayerNorm, head
  struct Config {
    std::vector<int> balance;
    gpipe::ScheduleKind schedule;
    gpipe::Checkpoint mode;
  };
  const std::vector<Config> configs = {
      {{2, 4}, gpipe::ScheduleKind::kGPipe, gpipe::Checkpoint::kAlways},
      {{2, 2, 2}, gpipe::ScheduleKind::kGPipe, gpipe::Checkpoint::kExceptLast},
      {{1, 2, 3}, gpipe::ScheduleKind::k1F1B, gpipe::Checkpoint::kNever},
      {{3, 3}, gpipe::ScheduleKind::kZB1P, gpipe::Checkpoint::kExceptLast},
      {{1, 2, 1, 2}, gpipe::ScheduleKind::kInterleaved, gpipe::Checkpoint::kAlways},
  };
  for (const Config& c : configs) {
    SCOPED_TRACE(gpipe::to_string(c.schedule) + " " + gpipe::to_string(c.mode) + " stages " +
                 std::to_string(c.balance.size()));
    torch::manual_seed(5);
    torch::nn::Sequential piped = gpipe::byte_gpt(o);
    torch::manual_seed(5);
    torch::nn::Sequential reference = gpipe::byte_gpt(o);
    gpipe::Pipeline pipe(piped, PipelineOptions().balance(c.balance).micro_batches(4).schedule(c.schedule)
                                    .checkpoint(c.mode).tied_parameters(o.tied()));
    EXPECT_EQ(pipe.parameters().size() + 1, piped->parameters().size()) << "the tied tensor is listed once";
    torch::optim::SGD sgd_piped(pipe.parameters(), 0.5);
    torch::optim::SGD sgd_reference(gpipe::unique_parameters(*reference), 0.5);
    for (int step = 0; step < 3; ++step) {
      torch::manual_seed(40 + step);
      const torch::Tensor text = torch::randint(256, {7, o.context + 1}, torch::kLong);
      const torch::Tensor x = text.narrow(1, 0, o.context), y = text.narrow(1, 1, o.context);
      sgd_piped.zero_grad();
      sgd_reference.zero_grad();
      const double loss = pipe.train_step(x, y, gpipe::cross_entropy_loss).item<double>();
      const double expected =
          gpipe::testing::reference_step(reference, x, y, gpipe::cross_entropy_loss).item<double>();
      EXPECT_NEAR(loss, expected, 1e-5 * expected);
      ASSERT_TRUE(gpipe::testing::same_parameters(piped, reference, /*values=*/false, 1e-4)) << "step " << step;
      sgd_piped.step();
      sgd_reference.step();
    }
    EXPECT_TRUE(gpipe::testing::same_parameters(piped, reference, /*values=*/true, 1e-4));
    const auto named = piped->named_parameters();
    EXPECT_TRUE(named[o.tied()[0][0]].is_same(named[o.tied()[0][1]]));
  }
}

// A few steps of the Trainer on windows of real-looking text: the loss falls, bits per byte are finite.
TEST(GptTest, TrainsOnTextAndTheLossFalls) {
  std::string text;
  for (int n = 0; n < 60; ++n) text += "The quick brown fox jumps over the lazy dog.\n%\n";
  const gpipe::GptOptions o = tiny_gpt();
  const gpipe::Dataset windows = gpipe::byte_windows(text, o.context);
  gpipe::Model model = gpipe::Model::of("GPT", o.layers(), [o](gpipe::LayerRange keep) {
    torch::manual_seed(1);
    return gpipe::byte_gpt(o, keep);
  });
  model.tied = o.tied();
  gpipe::Trainer trainer(model, PipelineOptions().devices(2).micro_batches(2),
                         gpipe::TrainerOptions().batch_size(16).epochs(4).optimizer(gpipe::OptimizerOptions().lr(1e-2))
                             .classification(false),
                         windows);
  const double before = trainer.evaluate(windows).loss;
  trainer.fit();
  const double after = trainer.evaluate(windows).loss;
  EXPECT_TRUE(std::isfinite(after / std::log(2.0)));
  EXPECT_LT(after, 0.7 * before) << "bits per byte " << before / std::log(2.0) << " -> " << after / std::log(2.0);
  EXPECT_LT(trainer.stats().last_loss, trainer.stats().first_loss);
}

// The fortune files: which files are read, where each is split, the windows, and the references.
TEST(TextDataTest, FortunesSplitEachFileAtAFortuneAfterNinetyPercent) {
  const std::filesystem::path dir = std::filesystem::temp_directory_path() / ("gpipe-fortunes-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  auto write = [&](const std::string& name, const std::string& text) { std::ofstream(dir / name) << text; };
  std::string b;
  for (int n = 0; n < 10; ++n) b += "fortune " + std::to_string(n) + "\n%\n";  // 10 fortunes of 12 bytes
  write("b", b);
  write("a", "first\n%\nsecond\n");  // no fortune begins in the last tenth: all of it trains
  write("a.dat", "index");
  std::filesystem::create_symlink(dir / "a", dir / "a.u8");
  std::filesystem::create_symlink(dir / "b", dir / "c");  // a link: not read twice
  const gpipe::TextCorpus corpus = gpipe::load_fortunes(dir.string());
  EXPECT_EQ(corpus.files, (std::vector<std::string>{"a", "b"}));
  // b's last tenth starts at byte 108, where fortune 9 starts: the test part.
  EXPECT_EQ(corpus.test, "fortune 9\n%\n");
  EXPECT_EQ(corpus.train, "first\n%\nsecond\n" + b.substr(0, 108));
  std::filesystem::remove_all(dir);
  try {
    gpipe::load_fortunes(dir.string());
    ADD_FAILURE() << "a missing folder was accepted";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("apt-get install fortunes"), std::string::npos) << e.what();
  }

  // Windows line ends; a folder of one long fortune each: split at a line after 90%.
  std::filesystem::create_directories(dir);
  std::string crlf;
  for (int n = 0; n < 10; ++n) crlf += "fortune " + std::to_string(n) + "\r\n%\r\n";
  write("crlf", crlf);
  const gpipe::TextCorpus windows_ends = gpipe::load_fortunes(dir.string());
  EXPECT_EQ(windows_ends.test, "fortune 9\n%\n");
  std::filesystem::remove(dir / "crlf");
  std::string long_one;
  for (int n = 0; n < 20; ++n) long_one += "line " + std::to_string(n) + " of one long fortune\n";
  long_one += "%\n";
  write("long", long_one);
  const gpipe::TextCorpus single = gpipe::load_fortunes(dir.string());
  EXPECT_EQ(single.test, "line 19 of one long fortune\n%\n");
  EXPECT_EQ(single.train + single.test, long_one);
  std::filesystem::remove_all(dir);

  const gpipe::Dataset w = gpipe::byte_windows("abcdefghij", 3);  // 3 windows; "j" is only a target
  EXPECT_EQ(w.input.sizes(), (std::vector<int64_t>{3, 3}));
  EXPECT_EQ(w.input[2][0].item<int64_t>(), 'g');
  EXPECT_EQ(w.target[2][2].item<int64_t>(), 'j');
  gpipe::testing::expect_invalid([] { gpipe::byte_windows("abc", 3); }, "holds no window");
  // Input and target are views of one int64 copy of the text: 8 bytes per byte of text, not a copy
  // per window (a 143 MB corpus took 3.3 GB).
  const std::string text(100001, 'q');
  const gpipe::Dataset big = gpipe::byte_windows(text, 100);
  EXPECT_TRUE(big.input.storage().is_alias_of(big.target.storage()));
  EXPECT_LE(big.input.storage().nbytes(), 8 * text.size());

  // "ab" 3 times in training: P(b | a) = (3 + 1) / (3 + 256); P(a | b) = (2 + 1) / (2 + 256).
  const double bigram = gpipe::bigram_bits_per_byte("ababab", "aba");
  EXPECT_NEAR(bigram, -(std::log2(4.0 / 259) + std::log2(3.0 / 258)) / 2, 1e-12);
  const std::string repeated(10000, 'x');
  EXPECT_LT(gpipe::gzip_bits_per_byte(repeated), 0.1);
  EXPECT_GT(gpipe::gzip_bits_per_byte("a"), 8.0);  // the header costs more than one byte saves
}

}  // namespace
