// io_test.cc: files written whole or not at all, links followed, devices written through, errors
// with the system's reason.
#include "helpers.h"

#include <chrono>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <thread>

#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

namespace {

namespace fs = std::filesystem;

std::string read(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream out;
  out << in.rdbuf();
  return out.str();
}

class IoTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("gpipe-io-test-" + std::to_string(::getpid()));
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  // Files in the folder other than `keep`: temporary files left behind.
  std::vector<std::string> others(const std::set<std::string>& keep) const {
    std::vector<std::string> out;
    for (const auto& e : fs::directory_iterator(dir_))
      if (!keep.count(e.path().filename().string())) out.push_back(e.path().filename().string());
    return out;
  }
  fs::path dir_;
};

TEST(HasExtensionTest, IsCaseInsensitive) {
  EXPECT_TRUE(gpipe::has_extension("step.svg", ".svg"));
  EXPECT_TRUE(gpipe::has_extension("step.SVG", ".svg"));
  EXPECT_TRUE(gpipe::has_extension("dir.d/Step.Svg", ".svg"));
  EXPECT_TRUE(gpipe::has_extension("a.PNG", ".png"));
  EXPECT_FALSE(gpipe::has_extension("step.svg.json", ".svg"));
  EXPECT_FALSE(gpipe::has_extension("svg", ".svg"));
  EXPECT_FALSE(gpipe::has_extension("stepsvg", ".svg"));
}

TEST_F(IoTest, ReplacesAFileWholeAndKeepsItsPermissions) {
  const fs::path file = dir_ / "out.json";
  gpipe::write_file_atomically(file.string(), "first");
  ::chmod(file.c_str(), 0640);
  gpipe::write_file_atomically(file.string(), "second");
  EXPECT_EQ(read(file), "second");
  struct stat st{};
  ASSERT_EQ(::stat(file.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 07777, 0640u);
  EXPECT_TRUE(others({"out.json"}).empty());
}

TEST_F(IoTest, FollowsASymbolicLinkAndKeepsIt) {
  const fs::path target = dir_ / "target.json", link = dir_ / "link.json";
  fs::create_symlink(target, link);
  gpipe::write_file_atomically(link.string(), "through the link");
  EXPECT_TRUE(fs::is_symlink(fs::symlink_status(link)));
  EXPECT_EQ(read(target), "through the link");
}

TEST_F(IoTest, WritesIntoADeviceWithoutReplacingIt) {
  gpipe::write_file_atomically("/dev/null", "discarded");
  EXPECT_TRUE(fs::is_character_file("/dev/null"));
  gpipe::check_writable("/dev/null");
}

TEST_F(IoTest, SaysWhyItCannotAndLeavesNothingBehind) {
  try {
    gpipe::write_file_atomically((dir_ / "missing" / "out.json").string(), "x");
    ADD_FAILURE() << "no error";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("No such file or directory"), std::string::npos) << e.what();
  }
  try {
    gpipe::check_writable((dir_ / "missing" / "out.json").string());
    ADD_FAILURE() << "no error";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("missing does not exist; give a path in a folder that exists"),
              std::string::npos) << e.what();
  }
  try {
    gpipe::write_file_atomically(dir_.string(), "x");
    ADD_FAILURE() << "no error";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("it is a folder"), std::string::npos) << e.what();
  }
  try {  // a full device: the write itself fails
    gpipe::write_file_atomically("/dev/full", "x");
    ADD_FAILURE() << "no error";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("No space left on device"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(fs::is_character_file("/dev/full"));
  EXPECT_TRUE(others({}).empty());
  gpipe::check_writable((dir_ / "new.json").string());
  EXPECT_FALSE(fs::exists(dir_ / "new.json")) << "checking creates nothing";
}

}  // namespace

namespace {

// A temporary file of `target`'s in `dir` (PATH.tmp.*), or "".
std::string temporary_of(const fs::path& dir, const std::string& target) {
  for (const auto& e : fs::directory_iterator(dir))
    if (e.path().filename().string().rfind(target + ".tmp.", 0) == 0) return e.path().filename().string();
  return "";
}

}  // namespace

// A signal that ends the process while it writes (gpipe train's handlers) removes the temporary
// file first: a child writing 32 MB files without end is sent SIGTERM once its temporary file exists.
TEST_F(IoTest, ASignalThatEndsTheWriterLeavesNoTemporaryFile) {
  const fs::path path = dir_ / "big.bin";
  for (int trial = 0; trial < 5; ++trial) {
    const pid_t child = ::fork();
    ASSERT_GE(child, 0);
    if (child == 0) {
      gpipe::install_signal_handlers(trial % 2 ? gpipe::OnSignal::kEndNow : gpipe::OnSignal::kStopAtStep);
      if (trial % 2 == 0) gpipe::request_stop(SIGINT);  // so SIGTERM is the second signal: it ends at once
      const std::string bytes(32 << 20, static_cast<char>('a' + trial));
      for (;;) gpipe::write_file_atomically(path.string(), bytes);
    }
    // Waits on the folder (what the child does), bounded: the temporary file appears.
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    while (temporary_of(dir_, "big.bin").empty() && std::chrono::steady_clock::now() < deadline)
      std::this_thread::yield();
    ASSERT_FALSE(temporary_of(dir_, "big.bin").empty());
    ::kill(child, SIGTERM);
    int status = 0;
    ASSERT_EQ(::waitpid(child, &status, 0), child);
    if (trial % 2)
      EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGTERM) << status;
    else
      EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 128 + SIGTERM) << status;
    EXPECT_EQ(temporary_of(dir_, "big.bin"), "") << "trial " << trial;
    if (fs::exists(path)) EXPECT_EQ(fs::file_size(path), size_t{32} << 20);
  }
}

// A writer killed outright (SIGKILL) leaves its temporary file; the next write of the same file
// removes it, and keeps those of a process that still runs and of other files.
TEST_F(IoTest, RemovesTheTemporaryFilesOfWritersThatNoLongerRun) {
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) ::_exit(0);
  ASSERT_EQ(::waitpid(child, nullptr, 0), child);  // a process id that no longer runs
  const std::string dead = "out.txt.tmp." + std::to_string(child) + ".abcdef";
  const std::string live = "out.txt.tmp." + std::to_string(::getppid()) + ".abcdef";
  for (const std::string& name : {dead, live, std::string("out.txt.tmp.XYZ123"), std::string("other.txt.tmp.1.abcdef")})
    std::ofstream(dir_ / name) << "partial";
  gpipe::write_file_atomically((dir_ / "out.txt").string(), "whole");
  EXPECT_EQ(read(dir_ / "out.txt"), "whole");
  EXPECT_FALSE(fs::exists(dir_ / dead));
  EXPECT_FALSE(fs::exists(dir_ / "out.txt.tmp.XYZ123"));  // the name gpipe gave its files before
  EXPECT_TRUE(fs::exists(dir_ / live));
  EXPECT_TRUE(fs::exists(dir_ / "other.txt.tmp.1.abcdef"));
}

// A file-size limit (ulimit -f) below the file's size: the same clean error as a full disk, no
// temporary file left, and the process not ended by SIGXFSZ (in a child, whose limit it lowers).
TEST_F(IoTest, AFileSizeLimitIsACleanErrorNotSigxfsz) {
  const fs::path path = dir_ / "large.bin";
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    rlimit limit{};
    ::getrlimit(RLIMIT_FSIZE, &limit);
    limit.rlim_cur = 4096;
    ::setrlimit(RLIMIT_FSIZE, &limit);
    try {
      gpipe::write_file_atomically(path.string(), std::string(100000, 'x'));
    } catch (const std::runtime_error& e) {
      const std::string what = e.what();
      ::_exit(what.find("File too large") != std::string::npos && what.find("ulimit -f") != std::string::npos ? 0 : 2);
    }
    ::_exit(1);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "status " << status;
  EXPECT_EQ(others({}), std::vector<std::string>{});
}
