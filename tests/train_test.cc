// train_test.cc: the library's training loop (train.h) and its saved state (snapshot.h): the same
// parameters as a plain libtorch loop on one device, a resumed run equal to an unbroken one, and
// every refusal before anything changes.
#include "helpers.h"

#include <caffe2/serialize/inline_container.h>
#include <torch/version.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <sstream>
#include <thread>

using gpipe::LrSchedule;
using gpipe::LrScheduleOptions;
using gpipe::OptimizerKind;
using gpipe::OptimizerOptions;
using gpipe::PipelineOptions;
using gpipe::Trainer;
using gpipe::TrainerOptions;

namespace {

// 7 layers (gpipe::testing::small_mlp's), built the LayerBuilder way from `seed`; with `dropout`, a
// Dropout after the first ReLU (8 layers).
gpipe::Model mlp(uint64_t seed = 3, double dropout = 0.0) {
  return gpipe::Model::of("mlp", dropout > 0 ? 8 : 7, [seed, dropout](gpipe::LayerRange keep) {
    torch::nn::Sequential whole = gpipe::testing::small_mlp(seed);
    torch::nn::Sequential model;
    int n = 0;
    for (const auto& layer : *whole) {
      gpipe::add_layer(model, layer, n++, keep);
      if (dropout > 0 && n == 2) gpipe::add_layer(model, torch::nn::AnyModule(torch::nn::Dropout(dropout)), n++, keep);
    }
    return model;
  });
}

// 50 rows: batches of 16 leave a last batch of 2.
gpipe::Dataset regression_data() {
  torch::manual_seed(7);
  return {torch::randn({50, 12}), torch::randn({50, 4})};
}

TrainerOptions sgd_options() {
  return TrainerOptions()
      .optimizer(OptimizerOptions().kind(OptimizerKind::kSgd).lr(0.05).momentum(0.9).nesterov(true).weight_decay(1e-3))
      .lr_schedule(LrScheduleOptions().kind(LrSchedule::kCosine).warmup_steps(2))
      .clip_grad_norm(0.5)
      .batch_size(16)
      .epochs(3)
      .seed(5)
      .loss(gpipe::mse_loss)
      .classification(false);
}

std::string temp_path(const std::string& name) { return ::testing::TempDir() + "gpipe_train_test_" + name; }

std::vector<torch::Tensor> values(Trainer& trainer) {
  std::vector<torch::Tensor> out;
  for (const auto& p : trainer.pipeline().layers()->parameters()) out.push_back(p.detach().clone());
  return out;
}

void expect_equal(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b, double tol = 0) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t n = 0; n < a.size(); ++n) {
    if (tol == 0)
      EXPECT_TRUE(torch::equal(a[n], b[n])) << "parameter " << n;
    else
      EXPECT_TRUE(gpipe::testing::close(a[n], b[n], tol)) << "parameter " << n;
  }
}

}  // namespace

TEST(LearningRateTest, WarmUpThenTheSchedule) {
  const LrScheduleOptions warm = LrScheduleOptions().warmup_steps(4);
  EXPECT_DOUBLE_EQ(gpipe::learning_rate(0.1, warm, 0, 100), 0.1 * 1 / 4);
  EXPECT_DOUBLE_EQ(gpipe::learning_rate(0.1, warm, 3, 100), 0.1);
  EXPECT_DOUBLE_EQ(gpipe::learning_rate(0.1, warm, 50, 100), 0.1);
  const LrScheduleOptions cosine = LrScheduleOptions(warm).kind(LrSchedule::kCosine);
  EXPECT_DOUBLE_EQ(gpipe::learning_rate(0.1, cosine, 4, 104), 0.1);           // the top, after warm-up
  EXPECT_NEAR(gpipe::learning_rate(0.1, cosine, 54, 104), 0.05, 1e-12);       // half way down
  EXPECT_NEAR(gpipe::learning_rate(0.1, cosine, 104, 104), 0.0, 1e-12);       // the end
  const LrScheduleOptions step = LrScheduleOptions().kind(LrSchedule::kStep).gamma(0.5).step_size(10);
  EXPECT_DOUBLE_EQ(gpipe::learning_rate(0.1, step, 9, 100), 0.1);
  EXPECT_DOUBLE_EQ(gpipe::learning_rate(0.1, step, 10, 100), 0.05);
  EXPECT_DOUBLE_EQ(gpipe::learning_rate(0.1, step, 25, 100), 0.025);
}

TEST(LearningRateTest, RefusesMeaninglessSchedules) {
  using gpipe::testing::expect_invalid;
  expect_invalid([] { LrScheduleOptions().warmup_steps(-1).check(); }, "warm-up");
  expect_invalid([] { LrScheduleOptions().step_size(-5).check(); }, "step size");
  expect_invalid([] { LrScheduleOptions().gamma(0).check(); }, "gamma");
  expect_invalid([] { LrScheduleOptions().gamma(std::nan("")).check(); }, "gamma");
  expect_invalid([] { gpipe::learning_rate(0.1, LrScheduleOptions().kind(LrSchedule::kStep), 3, 10); }, "step size");
}

TEST(OptimizerOptionsTest, RefusesAnotherOptimizersSettings) {
  using gpipe::testing::expect_invalid;
  expect_invalid([] { OptimizerOptions().kind(OptimizerKind::kAdam).momentum(0.9).check(); }, "SGD's");
  expect_invalid([] { OptimizerOptions().kind(OptimizerKind::kSgd).betas(std::make_tuple(0.9, 0.99)).check(); },
                 "Adam's and AdamW's");
  expect_invalid([] { OptimizerOptions().kind(OptimizerKind::kSgd).nesterov(true).check(); }, "`momentum` above 0");
  expect_invalid([] { OptimizerOptions().lr(0).check(); }, "learning rate");
  expect_invalid([] { gpipe::parse_optimizer("lamb"); }, "sgd, adam or adamw");
  EXPECT_EQ(OptimizerOptions().kind(OptimizerKind::kAdamW).decay(), 0.01);  // torch.optim's default
  EXPECT_EQ(OptimizerOptions().kind(OptimizerKind::kAdam).decay(), 0.0);
}

// The trainer over 2 stages, 3 micro-batches, against the loop a PyTorch user writes on one device:
// the same shuffled batches, clip_grad_norm_, the learning rate of each step, SGD with Nesterov.
TEST(TrainStatsTest, MedianStepOfOddAndEvenCounts) {
  gpipe::TrainStats stats;
  EXPECT_EQ(stats.median_step_s(), 0);
  stats.step_seconds = {1.0f, 5.0f, 2.0f};
  EXPECT_DOUBLE_EQ(stats.median_step_s(), 2.0);
  stats.step_seconds = {4.0f, 1.0f, 3.0f, 2.0f};
  EXPECT_DOUBLE_EQ(stats.median_step_s(), 2.5);
  stats.step_seconds = {0.5f, 9.0f};
  EXPECT_DOUBLE_EQ(stats.median_step_s(), 4.75);
}

TEST(TrainerTest, EqualsAPlainLoopOnOneDevice) {
  const gpipe::Dataset data = regression_data();
  const TrainerOptions options = sgd_options();
  Trainer trainer(mlp(), PipelineOptions().devices(2).micro_batches(3), options, data);
  trainer.fit();
  EXPECT_EQ(trainer.step(), 4 * 3);  // 4 batches per epoch (the last of 2 rows), 3 epochs
  // Each step's time, once: the training time is their sum and the updates given back at the end.
  const gpipe::TrainStats& stats = trainer.stats();
  ASSERT_EQ(stats.step_seconds.size(), 12u);
  double sum = 0;
  for (float t : stats.step_seconds) sum += t;
  EXPECT_LE(sum, stats.train_seconds * (1 + 1e-6));
  EXPECT_GT(sum, 0.5 * stats.train_seconds);
  const auto [least, most] = std::minmax_element(stats.step_seconds.begin(), stats.step_seconds.end());
  EXPECT_GT(stats.median_step_s(), 0);
  EXPECT_GE(stats.median_step_s(), *least);
  EXPECT_LE(stats.median_step_s(), *most);

  torch::nn::Sequential model = mlp().build(gpipe::LayerRange{});
  torch::optim::SGD sgd(model->parameters(),
                        torch::optim::SGDOptions(0.05).momentum(0.9).nesterov(true).weight_decay(1e-3));
  torch::Generator order = at::detail::createCPUGenerator(5);
  int64_t step = 0;
  for (int epoch = 0; epoch < 3; ++epoch) {
    const torch::Tensor perm = torch::randperm(50, order, torch::kLong);
    for (int64_t first = 0; first < 50; first += 16) {
      const torch::Tensor rows = perm.narrow(0, first, std::min<int64_t>(16, 50 - first));
      sgd.zero_grad();
      gpipe::mse_loss(model->forward(data.input.index_select(0, rows)), data.target.index_select(0, rows)).backward();
      torch::nn::utils::clip_grad_norm_(model->parameters(), 0.5);
      const double warm = step < 2 ? 0.05 * static_cast<double>(step + 1) / 2 : 0.0;
      const double lr = step < 2 ? warm : 0.05 * 0.5 * (1 + std::cos(M_PI * static_cast<double>(step - 2) / 10.0));
      for (auto& group : sgd.param_groups()) group.options().set_lr(lr);
      sgd.step();
      ++step;
    }
  }
  EXPECT_TRUE(gpipe::testing::same_parameters(trainer.pipeline().layers(), model, /*values=*/true, 1e-5));
}

// Saved after its first epoch and resumed by a new trainer, a run with Dropout and Adam ends as an
// unbroken one, bit for bit; another K resumes it too. (The learning rate is constant after its
// warm-up: a cosine's depends on where the run ends, which the first part changes.)
TEST(TrainerTest, ResumedRunEndsAsAnUnbrokenOne) {
  const gpipe::Dataset data = regression_data();
  const TrainerOptions options = TrainerOptions(sgd_options())
                                     .optimizer(OptimizerOptions().lr(1e-2))
                                     .lr_schedule(LrScheduleOptions().warmup_steps(2));
  const PipelineOptions two = PipelineOptions().devices(2).micro_batches(3).checkpoint(gpipe::Checkpoint::kAlways);
  Trainer unbroken(mlp(3, 0.3), two, options, data);
  unbroken.fit();

  const std::string path = temp_path("resume.pt");
  Trainer first(mlp(3, 0.3), two, TrainerOptions(options).epochs(1).save(path), data);
  first.fit();
  EXPECT_EQ(first.saved_at(), 4);
  Trainer resumed(mlp(3, 0.3), two, TrainerOptions(options).save(path), data);
  resumed.resume(path);
  EXPECT_EQ(resumed.start_step(), 4);
  resumed.fit();
  expect_equal(values(resumed), values(unbroken));

  // Without Dropout (whose masks are seeded per stage) one device resumes 2 stages' file.
  Trainer plain(mlp(), two, options, data);
  plain.fit();
  Trainer half(mlp(), two, TrainerOptions(options).epochs(1).save(path), data);
  half.fit();
  Trainer one(mlp(), PipelineOptions().devices(1).micro_batches(3), options, data);
  one.resume(path);
  one.fit();
  expect_equal(values(one), values(plain), 1e-6);
  std::remove(path.c_str());
}

// A stop request (what gpipe train's SIGINT and SIGTERM handlers make) at any step: fit() stops at
// the next step boundary with that step saved; a new trainer resumed from the file, or this one
// continued, ends as an unbroken run, bit for bit. Saving every few steps changes nothing.
TEST(TrainerTest, StopRequestStopsAtAStepBoundarySaved) {
  const gpipe::Dataset data = regression_data();  // 4 steps an epoch, 12 in all
  const TrainerOptions options = TrainerOptions(sgd_options())
                                     .optimizer(OptimizerOptions().lr(1e-2))
                                     .lr_schedule(LrScheduleOptions().warmup_steps(2));
  const PipelineOptions two = PipelineOptions().devices(2).micro_batches(3);
  Trainer unbroken(mlp(3, 0.3), two, options, data);
  unbroken.fit();
  const std::string path = temp_path("stop.pt");
  for (const int64_t stop_at : {0, 1, 3, 4, 5, 11, 12}) {  // 3 and 11: an epoch's last step
    std::remove(path.c_str());
    Trainer first(mlp(3, 0.3), two, TrainerOptions(options).save(path).save_every(3), data);
    gpipe::TrainerCallbacks callbacks;
    callbacks.before_step = [&](int64_t step) {
      if (step == stop_at) gpipe::request_stop(SIGTERM);
    };
    int epochs_evaluated = 0;  // a stop after an epoch's last step still ends that epoch
    callbacks.after_epoch = [&](int epoch) { epochs_evaluated = epoch; };
    if (stop_at == 12) gpipe::request_stop(SIGINT);  // before fit(): it stops before the first step
    first.fit(callbacks);
    EXPECT_EQ(first.stopped_by(), stop_at == 12 ? SIGINT : SIGTERM) << "stop at " << stop_at;
    EXPECT_EQ(first.step(), stop_at == 12 ? 0 : stop_at + 1);
    EXPECT_EQ(first.saved_at(), first.step());
    EXPECT_EQ(epochs_evaluated, stop_at == 12 ? 0 : (stop_at + 1) / 4) << "stop at " << stop_at;
    gpipe::clear_stop_request();
    std::filesystem::copy_file(path, path + ".stopped", std::filesystem::copy_options::overwrite_existing);
    first.fit();  // the same trainer goes on (before another builds its layers, which reseeds)
    SCOPED_TRACE("stopped after step " + std::to_string(stop_at));
    EXPECT_EQ(first.stopped_by(), 0);
    expect_equal(values(first), values(unbroken));
    Trainer resumed(mlp(3, 0.3), two, options, data);
    resumed.resume(path + ".stopped");
    EXPECT_EQ(resumed.start_step(), stop_at == 12 ? 0 : stop_at + 1);
    resumed.fit();
    SCOPED_TRACE("resumed");
    expect_equal(values(resumed), values(unbroken));
  }
  std::remove(path.c_str());
  std::remove((path + ".stopped").c_str());
}

// A step still running stop_timeout seconds after the request is abandoned with the parameters as
// they were (here its loss takes 0.5 s); the file holds the step before, and resumes to an unbroken run.
TEST(TrainerTest, StopRequestAbandonsAStepThatRunsTooLong) {
  const gpipe::Dataset data = regression_data();
  const TrainerOptions options = TrainerOptions(sgd_options()).optimizer(OptimizerOptions().lr(1e-2)).lr_schedule({});
  const PipelineOptions two = PipelineOptions().devices(2).micro_batches(2);
  Trainer unbroken(mlp(), two, options, data);
  unbroken.fit();
  const std::string path = temp_path("abandon.pt");
  std::atomic<bool> slow{false};
  TrainerOptions slow_options = TrainerOptions(options).save(path).stop_timeout(0.05);
  slow_options.loss([&slow](const torch::Tensor& out, const torch::Tensor& target) {
    if (slow) std::this_thread::sleep_for(std::chrono::milliseconds(500));  // a step that takes long
    return gpipe::mse_loss(out, target);
  });
  Trainer first(mlp(), two, slow_options, data);
  std::vector<torch::Tensor> before;
  gpipe::TrainerCallbacks callbacks;
  callbacks.before_step = [&](int64_t step) {
    if (step != 6) return;
    before = values(first);
    slow = true;
    gpipe::request_stop(SIGINT);
  };
  first.fit(callbacks);
  gpipe::clear_stop_request();
  EXPECT_EQ(first.stopped_by(), SIGINT);
  EXPECT_EQ(first.step(), 6);
  EXPECT_EQ(first.saved_at(), 6);
  expect_equal(values(first), before);
  Trainer resumed(mlp(), two, options, data);
  resumed.resume(path);
  resumed.fit();
  expect_equal(values(resumed), values(unbroken));
  std::remove(path.c_str());
}

// A missing, corrupt or other model's file is refused before anything changes.
TEST(TrainerTest, RefusesABadSnapshotAndChangesNothing) {
  using gpipe::testing::expect_invalid;
  const gpipe::Dataset data = regression_data();
  const std::string path = temp_path("bad.pt");
  Trainer saver(mlp(), PipelineOptions().devices(2).micro_batches(2), TrainerOptions(sgd_options()).epochs(1).save(path),
                data);
  saver.fit();

  Trainer trainer(mlp(9), PipelineOptions().devices(2).micro_batches(2), sgd_options(), data);
  const std::vector<torch::Tensor> before = values(trainer);
  expect_invalid([&] { trainer.resume(path + ".missing"); }, "no such file");

  std::string bytes;
  {
    std::ifstream in(path, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), {});
  }
  std::string corrupt = bytes;
  corrupt[corrupt.size() / 2] = static_cast<char>(corrupt[corrupt.size() / 2] ^ 1);
  std::ofstream(path + ".corrupt", std::ios::binary) << corrupt;
  expect_invalid([&] { trainer.resume(path + ".corrupt"); }, "truncated, corrupt");
  std::ofstream(path + ".short", std::ios::binary) << bytes.substr(0, bytes.size() / 3);
  expect_invalid([&] { trainer.resume(path + ".short"); }, "truncated, corrupt");

  // A whole file (its digest matches) whose optimizer state does not fit the parameter: refused by
  // read_snapshot, not by the first step after the restore.
  {
    const size_t trailer = gpipe::seal_snapshot("").size();
    c10::impl::GenericDict dict = gpipe::load_torch_save(bytes.substr(0, bytes.size() - trailer)).toGenericDict();
    c10::impl::GenericDict states = dict.at("optimizer_states").toGenericDict();
    const std::string name = states.begin()->key().toStringRef();
    c10::impl::GenericDict state(c10::StringType::get(), c10::AnyType::get());
    state.insert("momentum_buffer", torch::zeros({3}));
    states.insert_or_assign(name, state);
    const std::vector<char> pickled = torch::pickle_save(dict);
    std::ofstream(path + ".state", std::ios::binary) << gpipe::seal_snapshot(std::string(pickled.begin(), pickled.end()));
    expect_invalid([&] { trainer.resume(path + ".state"); }, "optimizer state momentum_buffer of " + name);
  }

  // A wider model's file: its first layer is [16, 10], not [16, 12].
  const gpipe::Model wider = gpipe::Model::of("wider", 2, [](gpipe::LayerRange keep) {
    torch::manual_seed(0);
    torch::nn::Sequential m;
    gpipe::add_layer(m, torch::nn::AnyModule(torch::nn::Linear(10, 16)), 0, keep);
    gpipe::add_layer(m, torch::nn::AnyModule(torch::nn::ReLU()), 1, keep);
    return m;
  });
  Trainer other(wider, PipelineOptions().devices(1),
                TrainerOptions(sgd_options()).epochs(1).lr_schedule(LrScheduleOptions()).save(path + ".other"),
                {torch::randn({8, 10}), torch::randn({8, 16})});  // one step: no warm-up
  other.fit();
  expect_invalid([&] { trainer.resume(path + ".other"); }, "checkpoint file of another model");
  // A deeper model's file: every parameter of this model is in it, and two more. Refused by the
  // count that all stages agree on, still before any parameter changes.
  const gpipe::Model deeper = gpipe::Model::of("deeper", 8, [](gpipe::LayerRange keep) {
    torch::nn::Sequential m = mlp().build(keep);
    gpipe::add_layer(m, torch::nn::AnyModule(torch::nn::Linear(4, 4)), 7, keep);
    return m;
  });
  Trainer longer(deeper, PipelineOptions().devices(1), TrainerOptions(sgd_options()).epochs(1).save(path + ".deeper"),
                 data);
  longer.fit();
  expect_invalid([&] { trainer.resume(path + ".deeper"); }, "it holds");
  // Adam's file for an SGD run.
  expect_invalid([&] {
    Trainer adam(mlp(), PipelineOptions().devices(2).micro_batches(2), TrainerOptions(sgd_options()).optimizer(OptimizerOptions()),
                 data);
    adam.resume(path);
  }, "resume with the same optimizer");
  expect_equal(values(trainer), before);
  EXPECT_EQ(trainer.step(), 0);
  for (const std::string suffix : {"", ".corrupt", ".short", ".state", ".other", ".deeper"}) std::remove((path + suffix).c_str());
}

// An archive is checked before libtorch reads it: a storage record shorter than the tensor on it
// (or empty), a memo slot far past the filled ones, a length past the end, an opcode that takes
// more than the stack holds.
TEST(LoadTorchSaveTest, RefusesACorruptArchiveBeforeLibtorchReadsIt) {
  // Each is refused with a message that names what is wrong.
  auto expect_refused = [](const std::string& bytes, const std::string& needle) {
    try {
      gpipe::load_torch_save(bytes);
      ADD_FAILURE() << "expected an error containing \"" << needle << "\"";
    } catch (const std::runtime_error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << "message: " << e.what() << "\nexpected: " << needle;
    }
  };
  const torch::Tensor tensor = torch::arange(8, torch::kFloat);
  const std::vector<char> saved = torch::pickle_save(tensor);
  std::map<std::string, std::string> records;  // name → bytes
  {
    std::istringstream in(std::string(saved.begin(), saved.end()));
    caffe2::serialize::PyTorchStreamReader reader(&in);
    for (const std::string& record : reader.getAllRecords()) {
      auto [data, size] = reader.getRecord(record);
      records[record] = std::string(static_cast<const char*>(data.get()), size);
    }
  }
  ASSERT_TRUE(records.count("data.pkl") && records.count("data/0"));
  // The archive, its record `name` replaced by `bytes`.
  auto with_record = [&](const std::string& name, const std::string& bytes) {
    std::string out;
    caffe2::serialize::PyTorchStreamWriter writer([&](const void* data, size_t size) {
      out.append(static_cast<const char*>(data), size);
      return size;
    });
    for (const auto& [record, kept] : records) {
      const std::string& written = record == name ? bytes : kept;
      writer.writeRecord(record, written.data(), written.size());
    }
    writer.writeEndOfFile();
    return out;
  };
  ASSERT_TRUE(gpipe::load_torch_save(with_record("data/0", records["data/0"])).toTensor().equal(tensor));

  expect_refused(with_record("data/0", std::string(12, '\0')), "reaches past the data stored for it");
  expect_refused(with_record("data/0", ""), "reaches past the data stored for it");
  // A storage with no record ("9") and 8 - 2^62 elements: libtorch reads no record for a storage
  // of fewer than one element, and gives it (8 - 2^62)·4 bytes, 32 modulo 2^64, at a null address.
  {
    std::string pickle = records["data.pkl"];
    const std::string storage("X\x01\0\0\0" "0q\x03X\x03\0\0\0cpuq\x04K\x08t", 21);
    ASSERT_NE(pickle.find(storage), std::string::npos);
    pickle.replace(pickle.find(storage), storage.size(),
                   std::string("X\x01\0\0\0" "9q\x03X\x03\0\0\0cpuq\x04\x8a\x08\x08\0\0\0\0\0\0\xc0t", 29));
    expect_refused(with_record("data.pkl", pickle), "reaches past the data stored for it");
  }
  // BININT 1, LONG_BINPUT into slot 2^31, STOP.
  expect_refused(with_record("data.pkl", std::string("\x80\x02J\x01\0\0\0r\0\0\0\x80.", 13)), "memo slot 2147483648");
  // A string of 2^31 - 1 bytes, three of them there; a pickle without its STOP.
  expect_refused(with_record("data.pkl", std::string("\x80\x02X\xff\xff\xff\x7f" "ab.", 10)),
                 "declares more bytes than it holds");
  expect_refused(with_record("data.pkl", std::string("\x80\x02J\x01\0\0\0", 7)), "has no STOP");
  // TUPLE3 over two items; TUPLE2 over one item above a MARK (and one below it); a slot never filled.
  expect_refused(with_record("data.pkl", "\x80\x02K\x01K\x02\x87."), "takes more items than the stack holds");
  expect_refused(with_record("data.pkl", "\x80\x02K\x01(K\x02\x86."), "takes more items than the stack holds");
  expect_refused(with_record("data.pkl", "\x80\x02h\x05."), "reads memo slot 5 with 0 filled");
  // DICT over three items.
  expect_refused(with_record("data.pkl", "\x80\x02(K\x01K\x02K\x03" "d."), "DICT over an odd number of items");

}

// A step whose loss is NaN throws before the update: the parameters and the step count stay; and
// no snapshot of NaN parameters is written.
TEST(TrainerTest, NonFiniteLossLeavesTheParametersAsTheyWere) {
  const gpipe::Dataset data = regression_data();
  const std::string path = temp_path("nan.pt");
  std::remove(path.c_str());
  Trainer trainer(mlp(), PipelineOptions().devices(2).micro_batches(2),
                  TrainerOptions(sgd_options()).save(path).loss([](const torch::Tensor& out, const torch::Tensor& y) {
                    return gpipe::mse_loss(out, y) * std::numeric_limits<float>::quiet_NaN();
                  }),
                  data);
  const std::vector<torch::Tensor> before = values(trainer);
  EXPECT_THROW(trainer.train_step(torch::arange(16), 1), std::runtime_error);
  EXPECT_EQ(trainer.step(), 0);
  expect_equal(values(trainer), before);

  torch::NoGradGuard no_grad;
  trainer.pipeline().parameters().front().view(-1)[0] = std::numeric_limits<float>::infinity();
  EXPECT_THROW(trainer.save(), std::runtime_error);
  EXPECT_FALSE(std::ifstream(path).good());
}

TEST(TrainerTest, RefusesOptionsThatLeaveNoStep) {
  using gpipe::testing::expect_invalid;
  const gpipe::Dataset data = regression_data();
  expect_invalid([&] { Trainer(mlp(), PipelineOptions().devices(2), TrainerOptions(sgd_options()).batch_size(0), data); },
                 "batch size");
  expect_invalid([&] {
    Trainer(mlp(), PipelineOptions().devices(2), TrainerOptions(sgd_options()).batch_size(64).drop_last(true), data);
  }, "leaves no step");
  expect_invalid([&] { Trainer(mlp(), PipelineOptions().devices(2), sgd_options(), gpipe::Dataset{}); },
                 "no samples");
  expect_invalid([&] {
    Trainer(mlp(), PipelineOptions().devices(2), TrainerOptions(sgd_options()).per_device_files(true), data);
  }, "for MPI runs");
  expect_invalid([&] { Trainer(mlp(), PipelineOptions().devices(2), TrainerOptions(sgd_options()).clip_grad_norm(-1), data); },
                 "gradient norm");
  // A warm-up longer than the run (3 epochs of 4 steps) would never reach the learning rate.
  auto warm = [](int64_t steps) { return LrScheduleOptions().kind(LrSchedule::kCosine).warmup_steps(steps); };
  expect_invalid([&] { Trainer(mlp(), PipelineOptions().devices(2), TrainerOptions(sgd_options()).lr_schedule(warm(13)), data); },
                 "the warm-up of 13 steps (`warmup_steps`) is longer than the run's 12 steps (3 epochs of 4 steps): "
                 "the learning rate would never reach its value");
  expect_invalid([&] {
    Trainer(mlp(), PipelineOptions().devices(2), TrainerOptions(sgd_options()).steps(5).lr_schedule(warm(6)), data);
  }, "longer than the run's 5 steps (3 epochs of 4 steps, limited by `steps` 5)");
  Trainer(mlp(), PipelineOptions().devices(2), TrainerOptions(sgd_options()).lr_schedule(warm(12)), data);
}

// A boundary of the cut that passes more tensors than a message carries (the MPI transport's limit,
// kMostBoundaryTensors) is refused before any step, naming the layer; without a limit it is not.
TEST(CheckStageInputsTest, RefusesABoundaryOfMoreTensorsThanTheLimit) {
  const gpipe::Model model = gpipe::Model::of("tuples", 6, [](gpipe::LayerRange keep) {
    return gpipe::testing::tuple_model(1, keep);
  });
  const gpipe::Tensors sample = gpipe::Tensors::tuple_of(
      {torch::randn({2, gpipe::testing::kSeq, gpipe::testing::kIn}), torch::rand({gpipe::testing::kIn}) + 0.5});
  gpipe::check_stage_inputs(model, sample, {1, 5});  // (hidden, mask) after layer 0: 2 tensors
  gpipe::check_stage_inputs(model, sample, {1, 5}, 2);
  gpipe::testing::expect_invalid([&] { gpipe::check_stage_inputs(model, sample, {1, 5}, 1); },
                                 "layer 0 ('0') ends stage 0 of the cut {1, 5} and passes 2 tensors to stage 1, more "
                                 "than one MPI message carries (1)");
  gpipe::testing::expect_invalid([&] { gpipe::check_stage_inputs(model, sample, {4, 2}, 4); },
                                 "layer 3 ('3') ends stage 0 of the cut {4, 2} and passes 5 tensors to stage 1");
  EXPECT_EQ(gpipe::kMostBoundaryTensors, 64);
}

// The test hook GPIPE_TEST_FAULT (train.h): a library user's run fails as gpipe train's does.
class TestFaultEnvironment {
 public:
  explicit TestFaultEnvironment(const char* value) { setenv("GPIPE_TEST_FAULT", value, 1); }
  ~TestFaultEnvironment() { unsetenv("GPIPE_TEST_FAULT"); }
};

// Each step's update applied on the devices during the next step (update_on_devices, the default) is
// the update after the step on the calling thread, to the bit: parameters and optimizer state, for
// SGD with momentum, Adam and AdamW, interleaved on 2 devices. The progress callback sees the
// parameters before the step's update (held for the devices), after_step sees them whole.
TEST(TrainerTest, UpdateOnDevicesIsTheUpdateAfterTheStepToTheBit) {
  const gpipe::Dataset data = regression_data();
  const PipelineOptions interleaved = PipelineOptions().devices(2).micro_batches(2).schedule(
      gpipe::ScheduleKind::kInterleaved);
  for (const OptimizerKind kind : {OptimizerKind::kSgd, OptimizerKind::kAdam, OptimizerKind::kAdamW}) {
    SCOPED_TRACE(static_cast<int>(kind));
    TrainerOptions options = sgd_options();
    if (kind != OptimizerKind::kSgd) options.optimizer(OptimizerOptions().kind(kind).lr(1e-2).weight_decay(1e-2));
    const std::string held_path = temp_path("held.pt"), after_path = temp_path("after.pt"),
                      devices_path = temp_path("devices.pt");
    Trainer held(mlp(), interleaved, TrainerOptions(options).save(held_path), data);
    Trainer after(mlp(), interleaved, TrainerOptions(options).save(after_path).update_on_devices(false), data);
    std::vector<torch::Tensor> seen_in_progress, seen_after_step;
    gpipe::TrainerCallbacks callbacks;
    callbacks.progress = [&](int, int64_t) { seen_in_progress = values(held); };
    callbacks.after_step = [&](int, int64_t) {
      seen_after_step = values(held);
      bool changed = false;  // the update was held: applying it changed the parameters
      for (size_t n = 0; n < seen_after_step.size(); ++n) changed = changed || !torch::equal(seen_after_step[n], seen_in_progress[n]);
      EXPECT_TRUE(changed) << "step " << held.step();
    };
    held.fit(callbacks);
    // after_step applied each update on this thread: take the callbacks away to see the devices do it.
    Trainer devices(mlp(), interleaved, TrainerOptions(options).save(devices_path), data);
    double device_seconds = 0;  // the devices' time in held updates, counted busy
    gpipe::TrainerCallbacks progress_only;
    progress_only.progress = [&](int, int64_t) {
      for (const auto& row : devices.pipeline().last_trace().other)
        for (const gpipe::WorkSpan& span : row) device_seconds += static_cast<double>(span.end_ns - span.begin_ns) * 1e-9;
    };
    devices.fit(progress_only);
    after.fit();
    expect_equal(values(held), values(after));
    expect_equal(values(devices), values(after));
    EXPECT_GT(device_seconds, 0) << "no update ran on a device";
    // The optimizer state too: the files hold the same bytes.
    auto bytes = [](const std::string& path) {
      std::ifstream in(path, std::ios::binary);
      return std::string((std::istreambuf_iterator<char>(in)), {});
    };
    EXPECT_FALSE(bytes(after_path).empty());
    EXPECT_EQ(bytes(held_path), bytes(after_path));
    EXPECT_EQ(bytes(devices_path), bytes(after_path));
    for (const std::string& path : {held_path, after_path, devices_path}) std::remove(path.c_str());
  }
}

TEST(TrainerTest, TestFaultThrowsInTheLossOfItsStepAndChangesNothing) {
  const gpipe::Dataset data = regression_data();
  const TestFaultEnvironment fault("throw:2");
  Trainer trainer(mlp(), PipelineOptions().devices(2).micro_batches(2), sgd_options(), data);
  std::vector<torch::Tensor> before;  // after the last step that ran
  try {
    trainer.fit({nullptr, [&](int, int64_t) { before = values(trainer); }, nullptr});
    ADD_FAILURE() << "the run did not fail";
  } catch (const gpipe::StageError& e) {
    EXPECT_NE(std::string(e.what()).find("stage 1 failed"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("injected fault in the loss (GPIPE_TEST_FAULT)"), std::string::npos)
        << e.what();
  }
  EXPECT_EQ(trainer.step(), 2) << "steps 0 and 1 ran, step 2 failed";
  expect_equal(values(trainer), before);
  // Those two steps are a one-device run's, which fails in the same step.
  Trainer reference(mlp(), PipelineOptions().devices(1), sgd_options(), data);
  EXPECT_THROW(reference.fit(), gpipe::StageError);
  EXPECT_EQ(reference.step(), 2);
  expect_equal(values(trainer), values(reference), 1e-5);
}

TEST(TrainerTest, TestFaultRefusesAValueItDoesNotKnow) {
  using gpipe::testing::expect_invalid;
  const gpipe::Dataset data = regression_data();
  for (const char* value : {"throw", "throw:x", "exit:1", "crash:3", "throw:-1"}) {
    const TestFaultEnvironment fault(value);
    expect_invalid([&] { Trainer(mlp(), PipelineOptions().devices(2), sgd_options(), data); }, "GPIPE_TEST_FAULT");
  }
}

TEST(TrainerTest, TestFaultEndsTheProcessBeforeItsStep) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  const gpipe::Dataset data = regression_data();
  EXPECT_EXIT(
      {
        const TestFaultEnvironment fault("exit:0:1");
        Trainer trainer(mlp(), PipelineOptions().devices(2).micro_batches(2), sgd_options(), data);
        trainer.fit({[](int64_t step) { std::fprintf(stderr, "step %lld\n", static_cast<long long>(step)); }, nullptr,
                     nullptr});
      },
      ::testing::ExitedWithCode(3), "step 1");
}

// A snapshot file is checked against the whole model before any work: another model's is refused
// with both counts, and the run's random numbers are left as they were.
TEST(TrainerTest, ASnapshotIsCheckedAgainstTheWholeModel) {
  const gpipe::Dataset data = regression_data();
  const std::string path = temp_path("check_of.pt");
  const gpipe::Model deeper = gpipe::Model::of("deeper", 8, [](gpipe::LayerRange keep) {
    torch::nn::Sequential m = mlp().build(keep);
    gpipe::add_layer(m, torch::nn::AnyModule(torch::nn::Linear(4, 4)), 7, keep);
    return m;
  });
  Trainer saver(deeper, PipelineOptions().devices(1), TrainerOptions(sgd_options()).epochs(1).save(path), data);
  saver.fit();
  const std::string sgd = gpipe::optimizer_name(OptimizerKind::kSgd);
  EXPECT_NO_THROW(gpipe::check_snapshot_of(path, deeper, sgd));
  torch::manual_seed(11);
  const torch::Tensor expected = torch::rand({4});
  torch::manual_seed(11);
  gpipe::testing::expect_invalid([&] { gpipe::check_snapshot_of(path, mlp(), sgd); },
                                 "is a checkpoint file of another model: it holds");
  EXPECT_TRUE(torch::equal(torch::rand({4}), expected));
  EXPECT_THROW(gpipe::check_snapshot_of(path + ".missing", mlp(), sgd), std::runtime_error);
}

// A Trainer's file says how its pipeline ran (what gpipe train's auto takes again on resume); a
// file whose record of it does not hold together is refused as corrupt.
TEST(TrainerTest, ASnapshotRecordsItsPipeline) {
  const gpipe::Dataset data = regression_data();
  const std::string path = temp_path("pipeline_of.pt");
  const std::vector<gpipe::ActionTimes> times{{0.1, 0.3, 1.0 / 3}, {1, 1, 0}, {2.5, 2.5, 2.5}, {1e-4, 7, 0.25}};
  const PipelineOptions options = PipelineOptions().devices(2).micro_batches(3).schedule(gpipe::ScheduleKind::kZBV)
                                      .balance({1, 2, 2, 2}).checkpoint(gpipe::Checkpoint::kAlways).stage_times(times);
  Trainer saver(mlp(), options, TrainerOptions(sgd_options()).epochs(1).save(path), data);
  saver.fit();
  const std::string sgd = gpipe::optimizer_name(OptimizerKind::kSgd);
  const std::optional<gpipe::SavedPipeline> saved = gpipe::check_snapshot_of(path, mlp(), sgd);
  ASSERT_TRUE(saved.has_value());
  EXPECT_EQ(saved->config.schedule, gpipe::ScheduleKind::kZBV);
  EXPECT_EQ(saved->config.devices, 2);
  EXPECT_EQ(saved->config.micro_batches, 3);
  EXPECT_EQ(saved->batch, std::min<int64_t>(TrainerOptions(sgd_options()).batch_size(), data.size()));
  EXPECT_EQ(saved->config.virtual_stages, 2);
  EXPECT_EQ(saved->config.balance, (std::vector<int>{1, 2, 2, 2}));
  EXPECT_EQ(saved->config.checkpoint, gpipe::Checkpoint::kAlways);
  ASSERT_EQ(saved->config.stage_times.size(), times.size());  // the order it ran in, bit for bit
  for (size_t s = 0; s < times.size(); ++s) {
    EXPECT_EQ(saved->config.stage_times[s].forward, times[s].forward);
    EXPECT_EQ(saved->config.stage_times[s].input_grad, times[s].input_grad);
    EXPECT_EQ(saved->config.stage_times[s].weight_grad, times[s].weight_grad);
  }

  // Saved without a record (as the Python package saves): none read back. With a cut of other than
  // K·V stages: refused, naming it.
  const torch::nn::Sequential whole = mlp().build(gpipe::LayerRange{});
  torch::optim::SGD optimizer(whole->parameters(), 0.1);
  const torch::Tensor generator = at::detail::getDefaultCPUGenerator().get_state();
  gpipe::TrainState state{0, generator, generator, std::nullopt, std::nullopt};
  auto save = [&] {
    gpipe::save_snapshot(path, {gpipe::encode_snapshot_part(whole, optimizer)}, whole, std::nullopt, sgd, state);
  };
  save();
  EXPECT_FALSE(gpipe::check_snapshot_of(path, mlp(), sgd).has_value());
  state.pipeline = gpipe::SavedPipeline{{gpipe::ScheduleKind::kGPipe, 2, 1, 4, {3, 2, 2}, gpipe::Checkpoint::kNever}, 64};
  save();
  try {
    gpipe::check_snapshot_of(path, mlp(), sgd);
    ADD_FAILURE() << "a cut of 3 stages for K·V = 2 was read";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("is corrupt: its pipeline's balance has 3 stages, not K·V"), std::string::npos)
        << e.what();
  }
  // Stage times of other than 3 per stage: refused, naming them.
  state.pipeline = gpipe::SavedPipeline{
      {gpipe::ScheduleKind::kZBV, 2, 2, 4, {1, 2, 2, 2}, gpipe::Checkpoint::kNever, {{1, 1, 1}, {1, 1, 1}}}, 64};
  save();
  try {
    gpipe::check_snapshot_of(path, mlp(), sgd);
    ADD_FAILURE() << "2 stages' times for 4 stages were read";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("is corrupt: its pipeline's stage_times holds 6 times, not 3 for each of its "
                                         "4 stages"), std::string::npos) << e.what();
  }
  // A pipeline no run could have had: 1F1B with 3 stages per device; interleaved M=3 on K=2; more
  // micro-batches than rows.
  for (const gpipe::SavedPipeline& impossible :
       {gpipe::SavedPipeline{{gpipe::ScheduleKind::k1F1B, 1, 3, 4, {3, 2, 2}, gpipe::Checkpoint::kNever}, 64},
        gpipe::SavedPipeline{{gpipe::ScheduleKind::kInterleaved, 2, 2, 3, {1, 2, 2, 2}, gpipe::Checkpoint::kNever}, 64},
        gpipe::SavedPipeline{{gpipe::ScheduleKind::kGPipe, 2, 1, 65, {3, 4}, gpipe::Checkpoint::kNever}, 64}}) {
    state.pipeline = impossible;
    save();
    try {
      gpipe::check_snapshot_of(path, mlp(), sgd);
      ADD_FAILURE() << gpipe::to_string(impossible.config.schedule) << " was read";
    } catch (const std::runtime_error& e) {
      EXPECT_NE(std::string(e.what()).find("is corrupt: its pipeline cannot have run: "), std::string::npos) << e.what();
    }
  }
  std::remove(path.c_str());
}

TEST(OptimizerOptionsTest, StateBytesPerParameterByte) {
  EXPECT_EQ(gpipe::state_per_parameter_byte(OptimizerOptions().kind(OptimizerKind::kSgd)), 1.0);
  EXPECT_EQ(gpipe::state_per_parameter_byte(OptimizerOptions().kind(OptimizerKind::kSgd).momentum(0.9)), 2.0);
  EXPECT_EQ(gpipe::state_per_parameter_byte(OptimizerOptions().kind(OptimizerKind::kAdam)), 3.0);
  EXPECT_EQ(gpipe::state_per_parameter_byte(OptimizerOptions().kind(OptimizerKind::kAdamW)), 3.0);
}

// ---------------------------------------------------------------- the loss scale (loss_scale.h)

// GradScaler's rule on a made-up history of steps (f: all gradients finite, x: one was not), with a
// growth interval of 2 from a scale of 8: x0.5 on each x, x2 after two f in a row, the count of f
// starting again after each change.
TEST(LossScaleTest, TheScaleFollowsGradScalersRule) {
  gpipe::LossScaler scaler(gpipe::LossScaleOptions().init_scale(8).growth_interval(2));
  const std::string history = "ffxfxffff";
  const std::vector<double> expected = {8, 16, 8, 8, 4, 4, 8, 8, 16};
  for (size_t n = 0; n < history.size(); ++n) {
    scaler.update(history[n] == 'f');
    EXPECT_EQ(scaler.scale(), expected[n]) << "after step " << n + 1 << " (" << history.substr(0, n + 1) << ")";
  }
  EXPECT_EQ(scaler.state().skipped, 2);
  // A growth past float's range leaves the scale as it is, as GradScaler's float scale does.
  gpipe::LossScaler top(gpipe::LossScaleOptions().init_scale(std::ldexp(1.0, 127)).growth_interval(1));
  top.update(true);
  EXPECT_EQ(top.scale(), std::ldexp(1.0, 127));
  EXPECT_EQ(top.state().growth_tracker, 0);
  gpipe::testing::expect_invalid([] { gpipe::LossScaler(gpipe::LossScaleOptions().growth_factor(1)); }, "growth factor");
  gpipe::testing::expect_invalid([] { gpipe::LossScaler(gpipe::LossScaleOptions().init_scale(0)); }, "first loss scale");
}

// A scale that is a power of two changes no bit: the scaled run's parameters are the unscaled run's,
// on 2 devices with clipping, momentum and the update on the devices.
TEST(LossScaleTest, APowerOfTwoScaleChangesNoBit) {
  const gpipe::Dataset data = regression_data();
  const PipelineOptions pipeline = PipelineOptions().devices(2).micro_batches(4);
  Trainer plain(mlp(), pipeline, sgd_options(), data);
  Trainer scaled(mlp(), pipeline, TrainerOptions(sgd_options()).loss_scale(gpipe::LossScaleOptions()), data);
  plain.fit();
  scaled.fit();
  expect_equal(values(scaled), values(plain));
  ASSERT_NE(scaled.loss_scaler(), nullptr);
  EXPECT_EQ(scaled.loss_scaler()->scale(), 65536.0);
  EXPECT_EQ(scaled.stats().skipped_steps, 0);
  EXPECT_EQ(plain.loss_scaler(), nullptr);
}

// A gradient that overflows in one stage (the last one of 2) skips the step on every stage: the
// parameters after it are those before it, the scale halves, and the next step trains again. With
// the update on the devices and after the step alike.
TEST(LossScaleTest, AnInfiniteGradientInOneStageSkipsTheStepEverywhere) {
  const TestFaultEnvironment fault("inf:0:1");  // after step 2's backward (0-based step 1)
  const gpipe::Dataset data = regression_data();
  for (const bool on_devices : {true, false}) {
    SCOPED_TRACE(on_devices ? "update on the devices" : "update after the step");
    Trainer trainer(mlp(), PipelineOptions().devices(2).micro_batches(4),
                    TrainerOptions(sgd_options()).loss_scale(gpipe::LossScaleOptions()).update_on_devices(on_devices),
                    data);
    std::vector<std::vector<torch::Tensor>> after;  // the parameters after each step
    std::vector<double> scales;
    gpipe::TrainerCallbacks callbacks;
    callbacks.after_step = [&](int, int64_t) {
      after.push_back(values(trainer));
      scales.push_back(trainer.loss_scaler()->scale());
    };
    trainer.fit(callbacks);
    ASSERT_GE(after.size(), 3u);
    expect_equal(after[1], after[0]);  // step 2 skipped on both stages
    EXPECT_FALSE(torch::equal(after[2][0], after[1][0]));  // step 3 trained the first stage again
    EXPECT_EQ(scales[0], 65536.0);
    EXPECT_EQ(scales[1], 32768.0);
    EXPECT_EQ(trainer.stats().skipped_steps, 1);
    EXPECT_EQ(trainer.loss_scaler()->state().skipped, 1);
    EXPECT_TRUE(trainer.pipeline().all_finite());
  }
}

// With the update held for the devices (no callback finishing it each step), a skipped step holds
// nothing: the run ends with the parameters of the run that updates after each step, to the bit.
TEST(LossScaleTest, ASkippedStepHoldsNoUpdateForTheDevices) {
  const TestFaultEnvironment fault("inf:0:2");
  const gpipe::Dataset data = regression_data();
  std::vector<std::vector<torch::Tensor>> ends;
  for (const bool on_devices : {true, false}) {
    Trainer trainer(mlp(), PipelineOptions().devices(2).micro_batches(4),
                    TrainerOptions(sgd_options()).loss_scale(gpipe::LossScaleOptions()).update_on_devices(on_devices),
                    data);
    trainer.fit();
    EXPECT_EQ(trainer.stats().skipped_steps, 1);
    ends.push_back(values(trainer));
  }
  expect_equal(ends[0], ends[1]);
}

// The scale is in the checkpoint: a run stopped after a skipped step and resumed ends as the unbroken
// run, parameters and scale to the bit.
TEST(LossScaleTest, AResumedRunContinuesTheScale) {
  const TestFaultEnvironment fault("inf:0:1");
  const gpipe::Dataset data = regression_data();
  const PipelineOptions pipeline = PipelineOptions().devices(2).micro_batches(4);
  const TrainerOptions options = TrainerOptions(sgd_options())
                                     .lr_schedule(LrScheduleOptions().warmup_steps(2))  // the same at any length
                                     .loss_scale(gpipe::LossScaleOptions().growth_interval(3));
  Trainer unbroken(mlp(), pipeline, options, data);
  unbroken.fit();
  const std::string path = temp_path("scaled.pt");
  {
    Trainer first(mlp(), pipeline, TrainerOptions(options).steps(4).save(path), data);
    first.fit();
    EXPECT_EQ(first.loss_scaler()->state().skipped, 1);
  }
  Trainer resumed(mlp(), pipeline, TrainerOptions(options).save(path), data);
  resumed.resume(path);
  EXPECT_EQ(resumed.loss_scaler()->state().skipped, 1);
  EXPECT_EQ(resumed.loss_scaler()->state().growth_tracker, 2);  // steps 3 and 4 finite since the skip
  // A run that does not say whether to scale goes on scaling a file that was scaled.
  Trainer unsaid(mlp(), pipeline, TrainerOptions(options).loss_scale(std::nullopt), data);
  unsaid.resume(path);
  ASSERT_NE(unsaid.loss_scaler(), nullptr);
  EXPECT_EQ(unsaid.loss_scaler()->state(), resumed.loss_scaler()->state());
  resumed.fit();
  expect_equal(values(resumed), values(unbroken));
  EXPECT_EQ(resumed.loss_scaler()->state(), unbroken.loss_scaler()->state());
  std::remove(path.c_str());
}

// A loss that is not finite still stops the run, scale or none: no loss scale mends a forward that
// overflows.
TEST(LossScaleTest, ANonFiniteLossStillStopsTheRun) {
  const gpipe::Dataset data = regression_data();
  const gpipe::LossFn infinite = [](const torch::Tensor& out, const torch::Tensor& y) {
    return gpipe::mse_loss(out, y) * std::numeric_limits<float>::infinity();
  };
  Trainer trainer(mlp(), PipelineOptions().devices(2).micro_batches(4),
                  TrainerOptions(sgd_options()).loss(infinite).loss_scale(gpipe::LossScaleOptions()), data);
  const std::vector<torch::Tensor> before = values(trainer);
  try {
    trainer.fit();
    FAIL() << "an infinite loss trained";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("the loss became infinite in step 1"), std::string::npos) << e.what();
  }
  expect_equal(values(trainer), before);
  EXPECT_EQ(trainer.step(), 0);  // the step did not count
}

#if TORCH_VERSION_MAJOR < 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR < 4)
// Float16 on a CPU is refused before any step where torch's CPU autocast takes bfloat16 only.
TEST(LossScaleTest, Fp16OnACpuIsRefusedWithThisTorch) {
  gpipe::testing::expect_invalid([] { Trainer(mlp(), PipelineOptions().devices(2).precision(gpipe::Precision::kFloat16), sgd_options(),
                              regression_data()); },
                 "`precision` fp16 runs on CUDA devices with this torch");
}
#endif
