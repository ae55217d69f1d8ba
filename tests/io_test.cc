// io_test.cc: files written whole or not at all, links followed, devices written through, errors
// with the system's reason.
#include "helpers.h"

#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include <sys/stat.h>
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
  EXPECT_THROW(gpipe::check_writable((dir_ / "missing" / "out.json").string()), std::runtime_error);
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
