// settings_test.cc: the table of a training run's settings (settings.h): one row per setting, the
// checks a flag, a keyword argument and a C++ caller's member all get, and the marks of what was given.
#include "helpers.h"

#include <gpipe/gpipe.h>
#include <gtest/gtest.h>
#include <torch/version.h>

#include <set>

namespace {

using gpipe::testing::expect_invalid;

TEST(SettingsTest, EveryRowHasItsOwnNameFlagAndKeyword) {
  std::set<std::string> names, flags, keywords;
  for (const gpipe::Setting& row : gpipe::train_settings()) {
    SCOPED_TRACE(row.name);
    EXPECT_TRUE(names.insert(row.name).second);
    EXPECT_TRUE(flags.insert(row.flag).second);
    EXPECT_EQ(row.flag.rfind("--", 0), 0u);
    EXPECT_FALSE(row.help.empty());
    if (!row.keyword.empty()) EXPECT_TRUE(keywords.insert(row.keyword).second);
    EXPECT_EQ(&gpipe::find_setting(row.name), &row);
  }
  EXPECT_THROW(gpipe::find_setting("no_such_setting"), std::logic_error);
  EXPECT_THROW(gpipe::TrainSettings().was_given("micro_batch"), std::logic_error);  // a typo is a mistake, not "no"
  // Python's keyword arguments of the pipeline, by their names in the table.
  EXPECT_EQ(gpipe::find_setting("micro_batches").keyword, "chunks");
  EXPECT_EQ(gpipe::find_setting("threads_per_device").keyword, "threads");
  EXPECT_EQ(gpipe::find_setting("precision").keyword, "precision");
}

TEST(SettingsTest, ChecksSayWhatIsWrong) {
  const gpipe::Setting& m = gpipe::find_setting("micro_batches");
  EXPECT_EQ(gpipe::check_field(m, "4"), "");
  EXPECT_EQ(gpipe::check_field(m, "0"), "must be at least 1 (got 0)");
  EXPECT_EQ(gpipe::check_field(m, "2.5"), "must be one whole number, at least 1 (got 2.5)");
  EXPECT_EQ(gpipe::check_field(gpipe::find_setting("lr"), "-1"), "must be a finite number above 0 (got -1)");
  EXPECT_EQ(gpipe::check_field(gpipe::find_setting("lr"), "nan"), "must be a finite number above 0 (got nan)");
  EXPECT_EQ(gpipe::check_field(gpipe::find_setting("precision"), "fp8"), "must be fp32, bf16 or fp16 (got fp8)");
  EXPECT_EQ(gpipe::check_field(gpipe::find_setting("seed"), "18446744073709551615"), "");
  EXPECT_NE(gpipe::check_field(gpipe::find_setting("seed"), "18446744073709551616"), "");
  EXPECT_NE(gpipe::check_field(gpipe::find_setting("seed"), "-1"), "");
}

TEST(SettingsTest, SetByNameChecksAndMarksGiven) {
  gpipe::TrainSettings s;
  EXPECT_FALSE(s.was_given("precision"));
  gpipe::set_setting(gpipe::find_setting("precision"), s, "bf16");
  EXPECT_EQ(s.precision, "bf16");
  EXPECT_TRUE(s.was_given("precision"));
  gpipe::set_setting(gpipe::find_setting("betas"), s, "0.8,0.9");
  EXPECT_EQ(s.betas, (std::vector<double>{0.8, 0.9}));
  gpipe::set_setting(gpipe::find_setting("shuffle"), s, "false");
  EXPECT_FALSE(s.shuffle);
  expect_invalid([&] { gpipe::set_setting(gpipe::find_setting("betas"), s, "0.9"); }, "`betas` takes 2 values separated by commas (got 1)");
  expect_invalid([&] { gpipe::set_setting(gpipe::find_setting("devices"), s, "0"); }, "`devices` must be at least 1");
  EXPECT_EQ(s.devices, 2);  // a refused value leaves the setting as it was
  // An empty entry of a list, and a leading zero (which the command line's parser reads as octal).
  expect_invalid([&] { gpipe::set_setting(gpipe::find_setting("balance"), s, "3,,8"); },
                 "`balance` has an empty entry (got 3,,8)");
  expect_invalid([&] { gpipe::set_setting(gpipe::find_setting("balance"), s, "3,8,"); }, "has an empty entry");
  EXPECT_EQ(gpipe::check_field(gpipe::find_setting("batch_size"), "010"),
            "must be one whole number, at least 1, written without a leading zero (got 010)");
  EXPECT_NE(gpipe::check_field(gpipe::find_setting("seed"), "010"), "");
  EXPECT_EQ(gpipe::check_field(gpipe::find_setting("seed"), "0"), "");
  EXPECT_EQ(gpipe::with_request_settings(gpipe::PipelineRequest(), s).precision, gpipe::Precision::kBFloat16);
}

// A C++ caller's settings get the checks a flag gets, before any work.
TEST(SettingsTest, ResolveTrainingChecksEveryMemberByItsRow) {
  const gpipe::Task task = gpipe::find_task("cnn");
  gpipe::TrainSettings s;
  s.schedule = "gpipe";
  s.lr = -1;
  expect_invalid([&] { gpipe::resolve_training(s, task); }, "`lr` must be a finite number above 0 (got -1)");
  s.lr = 0.1;
  s.precision = "half";
  expect_invalid([&] { gpipe::resolve_training(s, task); }, "`precision` must be fp32, bf16 or fp16 (got half)");
#if TORCH_VERSION_MAJOR < 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR < 4)
  s.precision = "fp16";  // the command line's stages are CPU threads
  expect_invalid([&] { gpipe::resolve_training(s, task); }, "`precision` fp16 runs on CUDA devices with this torch");
#endif
  s.precision = "bf16";
  gpipe::resolve_training(s, task);
  EXPECT_EQ(gpipe::with_request_settings(gpipe::PipelineRequest(), s).precision, gpipe::Precision::kBFloat16);
}

// gpipe bench's rows: where bench sweeps a setting of gpipe train, its row is train's (name, flag,
// check), over a list of the sweep's; the rest are its own, each with its own name and flag.
TEST(SettingsTest, BenchSweepsTrainsRowsAndSetsItsOwnFromText) {
  std::set<std::string> names, flags;
  for (const gpipe::Field<gpipe::BenchSweep>& row : gpipe::bench_fields()) {
    SCOPED_TRACE(row.name);
    EXPECT_TRUE(names.insert(row.name).second);
    EXPECT_TRUE(flags.insert(row.flag).second);
    EXPECT_FALSE(row.help.empty());
  }
  auto bench_row = [](const std::string& name) {
    for (const auto& row : gpipe::bench_fields())
      if (row.name == name) return row;
    ADD_FAILURE() << "bench has no row " << name;
    return gpipe::bench_fields().front();
  };
  for (const char* shared : {"devices", "micro_batches", "checkpoint", "threads_per_device", "balance", "precision"}) {
    SCOPED_TRACE(shared);
    const gpipe::Setting& train = gpipe::find_setting(shared);
    const gpipe::Field<gpipe::BenchSweep> bench = bench_row(shared);
    EXPECT_EQ(bench.flag, train.flag);
    for (const char* text : {"0", "1", "2.5", "fp8", "bf16", "never", "010"})
      EXPECT_EQ(gpipe::check_field(bench, text), gpipe::check_field(train, text)) << text;
  }
  gpipe::BenchSweep sweep;
  gpipe::set_field(bench_row("devices"), sweep, "1,2");
  EXPECT_EQ(sweep.stages, (std::vector<int>{1, 2}));
  gpipe::set_field(bench_row("checkpoint"), sweep, "never,always");
  EXPECT_EQ(sweep.checkpoints, (std::vector<std::string>{"never", "always"}));
  gpipe::set_field(bench_row("precision"), sweep, "bf16");
  EXPECT_EQ(sweep.precision, "bf16");
  gpipe::set_field(bench_row("tie_embeddings"), sweep, "true");
  EXPECT_TRUE(sweep.tie_embeddings);
  EXPECT_EQ(gpipe::field_text(bench_row("micro_batches"), sweep), "32");
  expect_invalid([&] { gpipe::set_field(bench_row("devices"), sweep, "1,,2"); }, "`devices` has an empty entry");
  expect_invalid([&] { gpipe::set_field(bench_row("checkpoint"), sweep, "never,sometimes"); },
                 "`checkpoint` must be always, except_last or never (got sometimes)");
  expect_invalid([&] { gpipe::set_field(bench_row("schedule"), sweep, "task"); }, "`schedule` must be");
  expect_invalid([&] { gpipe::set_field(bench_row("virtual_stages"), sweep, "1"); }, "from 2 to 64");
  EXPECT_EQ(sweep.stages, (std::vector<int>{1, 2}));  // a refused text changes nothing
}

}  // namespace
