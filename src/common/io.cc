// io.cc: whole-or-nothing file writes (a synced temporary file, then a rename).
#include "gpipe/io.h"

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <stdexcept>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

namespace gpipe {
namespace {

namespace fs = std::filesystem;

[[noreturn]] void fail(const std::string& what, const std::string& path, int error) {
  throw std::runtime_error("gpipe: cannot " + what + " " + path + ": " + std::strerror(error));
}

// The file a write to `path` lands in: the end of its chain of symbolic links
// (which may not exist yet).
std::string resolve(const std::string& path) {
  fs::path p = path;
  std::error_code ec;
  for (int hops = 0; hops < 40 && fs::is_symlink(fs::symlink_status(p, ec)); ++hops) {
    const fs::path next = fs::read_symlink(p, ec);
    if (ec) break;
    p = next.is_absolute() ? next : p.parent_path() / next;
  }
  return p.string();
}

// Whether `path` exists and is something other than a regular file or a folder (a device, a pipe).
bool is_special(const std::string& path) {
  struct stat st{};
  return ::stat(path.c_str(), &st) == 0 && !S_ISREG(st.st_mode) && !S_ISDIR(st.st_mode);
}

// The process's umask, read without setting it (umask(2) would change it for every thread
// for a moment); 022 where /proc does not say.
mode_t process_umask() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line))
    if (line.rfind("Umask:", 0) == 0) return static_cast<mode_t>(std::stoul(line.substr(6), nullptr, 8));
  return 022;
}

void write_all(int fd, const std::string& contents, const std::string& path, const std::string& shown) {
  size_t done = 0;
  while (done < contents.size()) {
    const ssize_t n = ::write(fd, contents.data() + done, contents.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int error = n < 0 ? errno : ENOSPC;
      ::close(fd);
      if (!path.empty()) ::unlink(path.c_str());
      fail("write", shown, error);
    }
    done += static_cast<size_t>(n);
  }
}

}  // namespace

void check_writable(const std::string& path) {
  const std::string target = resolve(path);
  if (fs::is_directory(target)) throw std::runtime_error("gpipe: cannot write " + path + ": it is a folder");
  if (is_special(target)) {
    if (::access(target.c_str(), W_OK) != 0) fail("write", path, errno);
    return;
  }
  const fs::path folder = fs::absolute(target).parent_path();
  if (!fs::is_directory(folder)) fail("write", path, ENOENT);
  if (::access(folder.c_str(), W_OK | X_OK) != 0) fail("write", path, errno);
}

void write_file_atomically(const std::string& path, const std::string& contents) {
  const std::string target = resolve(path);
  if (fs::is_directory(target)) throw std::runtime_error("gpipe: cannot write " + path + ": it is a folder");
  if (is_special(target)) {  // nothing to replace: write through
    // Non-blocking open: a FIFO without a reader is an error (ENXIO), not a wait without end.
    const int fd = ::open(target.c_str(), O_WRONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0 && errno == ENXIO)
      throw std::runtime_error("gpipe: cannot write " + path + ": it is a FIFO that no process reads; start the reader first");
    if (fd < 0) fail("write", path, errno);
    const int flags = ::fcntl(fd, F_GETFL);
    if (flags >= 0) ::fcntl(fd, F_SETFL, flags & ~O_NONBLOCK);  // then write all of it
    write_all(fd, contents, "", path);
    if (::close(fd) != 0) fail("write", path, errno);
    return;
  }
  std::string tmp = target + ".tmp.XXXXXX";
  const int fd = ::mkstemp(tmp.data());
  if (fd < 0) fail("write", path, errno);
  // The new file takes the old one's permissions, or those a plain create would give.
  struct stat old{};
  mode_t mode = 0;
  if (::stat(target.c_str(), &old) == 0) {
    mode = old.st_mode & 07777;
  } else {
    mode = 0666 & ~process_umask();
  }
  ::fchmod(fd, mode);
  write_all(fd, contents, tmp, path);
  const int synced = ::fsync(fd) == 0 ? 0 : errno;
  const int closed = ::close(fd) == 0 ? 0 : errno;
  if (synced != 0 || closed != 0) {
    ::unlink(tmp.c_str());
    fail("write", path, synced != 0 ? synced : closed);
  }
  if (::rename(tmp.c_str(), target.c_str()) != 0) {
    const int error = errno;
    ::unlink(tmp.c_str());
    fail("replace", path, error);
  }
  // The rename itself is on disk once the folder is synced.
  const int dir = ::open(fs::absolute(target).parent_path().c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir >= 0) {
    ::fsync(dir);
    ::close(dir);
  }
}

std::string read_file(const std::string& path) {
  if (std::filesystem::is_directory(path)) throw std::runtime_error(path + " is a folder, not a file");
  if (!std::filesystem::is_regular_file(path)) throw std::runtime_error("no such file: " + path);
  std::ifstream in(path, std::ios::binary);
  std::ostringstream bytes;
  bytes << in.rdbuf();
  if (!in && !in.eof()) throw std::runtime_error("cannot read " + path);
  return bytes.str();
}

}  // namespace gpipe
