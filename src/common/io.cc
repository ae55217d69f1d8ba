// io.cc: whole-or-nothing file writes (a synced temporary file, then a rename), and the temporary
// files a signal or a killed process would leave behind removed.
#include "gpipe/io.h"

#include <atomic>
#include <cctype>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <sstream>
#include <string>
#include <stdexcept>

#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <sys/stat.h>
#include <time.h>
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

// The temporary files being written, for remove_partial_files() in a signal handler: a slot's
// name is mkstemp's own buffer, so the handler sees the file's name from the moment it exists.
// state: 0 free, 1 taken (being filled), 2 holds a name to remove.
struct PartialFile {
  std::atomic<int> state{0};
  char name[4096];
};
constexpr int kPartialSlots = 8;
PartialFile partial_files[kPartialSlots];

// A slot holding `name_template`, or nullptr when all are taken or the name is too long.
PartialFile* claim_partial(const std::string& name_template) {
  if (name_template.size() >= sizeof(PartialFile::name)) return nullptr;
  for (PartialFile& slot : partial_files) {
    int expected = 0;
    if (!slot.state.compare_exchange_strong(expected, 1)) continue;
    std::memcpy(slot.name, name_template.c_str(), name_template.size() + 1);
    slot.state.store(2);
    return &slot;
  }
  return nullptr;
}


// While it lives, SIGXFSZ (a write past the file-size limit, `ulimit -f`) is blocked on this thread,
// so that write() fails with EFBIG rather than the signal ending the process; one that came is
// taken before the old mask is back.
class NoFileSizeSignal {
 public:
  NoFileSizeSignal() {
    sigset_t mask;
    sigemptyset(&mask);
    sigaddset(&mask, SIGXFSZ);
    ::pthread_sigmask(SIG_BLOCK, &mask, &old_);
  }
  ~NoFileSizeSignal() {
    sigset_t pending;
    sigemptyset(&pending);
    if (::sigpending(&pending) == 0 && sigismember(&pending, SIGXFSZ) == 1 && sigismember(&old_, SIGXFSZ) != 1) {
      sigset_t mask;
      sigemptyset(&mask);
      sigaddset(&mask, SIGXFSZ);
      const timespec now{0, 0};
      ::sigtimedwait(&mask, nullptr, &now);
    }
    ::pthread_sigmask(SIG_SETMASK, &old_, nullptr);
  }
  NoFileSizeSignal(const NoFileSizeSignal&) = delete;
  NoFileSizeSignal& operator=(const NoFileSizeSignal&) = delete;

 private:
  sigset_t old_;
};

void write_all(int fd, const std::string& contents, const std::string& path, const std::string& shown) {
  size_t done = 0;
  const NoFileSizeSignal no_signal;
  while (done < contents.size()) {
    const ssize_t n = ::write(fd, contents.data() + done, contents.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int error = n < 0 ? errno : ENOSPC;
      ::close(fd);
      if (!path.empty()) ::unlink(path.c_str());
      if (error == EFBIG)
        throw std::runtime_error("gpipe: cannot write " + shown + ": " + std::strerror(error) + " (" +
                                 std::to_string(contents.size()) + " bytes, above this process's file-size limit: "
                                 "raise it, ulimit -f, or write to a file system that takes it)");
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
  std::error_code error;
  if (!fs::is_directory(folder, error))
    throw std::runtime_error("gpipe: cannot write " + path + ": " + folder.string() +
                             (fs::exists(folder, error) ? " is not a folder" : " does not exist") +
                             "; give a path in a folder that exists (mkdir -p " + folder.string() + ")");
  if (::access(folder.c_str(), W_OK | X_OK) != 0) fail("write", path, errno);
  // access() says yes to root everywhere, and to folders that take no new files (/proc, a read-only
  // mount): create the temporary file a write would create, then remove it.
  std::string probe = target + ".tmp." + std::to_string(::getpid()) + ".XXXXXX";
  const int fd = ::mkstemp(probe.data());
  if (fd < 0) {
    const int error = errno;
    throw std::runtime_error("gpipe: cannot write " + path + ": the folder " + folder.string() +
                             " takes no new files (" + std::strerror(error) + ")");
  }
  ::close(fd);
  ::unlink(probe.c_str());
}

void check_input_file(const std::string& path) {
  std::error_code ec;
  const fs::file_status link = fs::symlink_status(path, ec);
  const fs::file_status file = fs::status(path, ec);
  const std::string shown = fs::is_symlink(link) ? path + " (a link to " + resolve(path) + ")" : path;
  if (!fs::exists(file)) {
    if (fs::is_symlink(link)) throw std::runtime_error(shown + " does not exist: the link leads nowhere");
    throw std::runtime_error("no such file: " + path);
  }
  if (fs::is_regular_file(file)) return;
  const char* kind = fs::is_directory(file)        ? "a folder"
                     : fs::is_fifo(file)           ? "a FIFO (a named pipe)"
                     : fs::is_character_file(file) ? "a character device"
                     : fs::is_block_file(file)     ? "a block device"
                     : fs::is_socket(file)         ? "a socket"
                                                   : "not a regular file";
  throw std::runtime_error(shown + " is " + kind + ", not a file; give the path of a file");
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
  remove_stale_temporaries(target);
  // Named by the process, so that a later write knows whether its writer still runs.
  std::string tmp = target + ".tmp." + std::to_string(::getpid()) + ".XXXXXX";
  // Registered before it exists: a signal handler that ends the process removes it (mkstemp
  // writes the name into the slot itself).
  PartialFile* slot = claim_partial(tmp);
  struct Release {  // the slot is freed once the file is renamed or removed
    PartialFile* slot;
    ~Release() {
      if (slot) slot->state.store(0);
    }
  } release{slot};
  const int fd = ::mkstemp(slot ? slot->name : tmp.data());
  if (fd < 0) fail("write", path, errno);
  if (slot) tmp = slot->name;
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

void remove_partial_files() {
  for (PartialFile& slot : partial_files)
    if (slot.state.load() == 2) ::unlink(slot.name);
}

void remove_stale_temporaries(const std::string& path) {
  const fs::path target = resolve(path);
  const std::string prefix = target.filename().string() + ".tmp.";
  std::error_code ec;
  fs::path folder = target.parent_path();
  if (folder.empty()) folder = ".";
  for (fs::directory_iterator it(folder, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (name.compare(0, prefix.size(), prefix) != 0) continue;
    // PATH.tmp.<pid>.XXXXXX; PATH.tmp.XXXXXX from gpipe before it named the writer.
    const std::string rest = name.substr(prefix.size());
    const size_t dot = rest.find('.');
    long pid = 0;
    if (dot != std::string::npos) {
      const std::string digits = rest.substr(0, dot);
      if (digits.empty() || digits.size() > 9 || digits.find_first_not_of("0123456789") != std::string::npos ||
          rest.size() - dot - 1 != 6)
        continue;
      pid = std::stol(digits);
      if (pid != ::getpid() && process_runs(pid)) continue;  // another process is writing it now
      if (pid == ::getpid()) {  // this process's: stale unless it is being written now
        bool live = false;
        for (const PartialFile& slot : partial_files)
          live = live || (slot.state.load() == 2 && fs::path(slot.name).filename() == name);
        if (live) continue;
      }
    } else if (rest.size() != 6) {
      continue;
    }
    std::error_code ignored;
    if (it->is_regular_file(ignored)) fs::remove(it->path(), ignored);
  }
}

std::string read_file(const std::string& path) {
  check_input_file(path);
  std::ifstream in(path, std::ios::binary);
  std::ostringstream bytes;
  bytes << in.rdbuf();
  if (!in && !in.eof()) throw std::runtime_error("cannot read " + path);
  return bytes.str();
}

bool has_extension(const std::string& path, const std::string& extension) {
  if (path.size() < extension.size()) return false;
  const size_t from = path.size() - extension.size();
  for (size_t n = 0; n < extension.size(); ++n)
    if (std::tolower(static_cast<unsigned char>(path[from + n])) !=
        std::tolower(static_cast<unsigned char>(extension[n])))
      return false;
  return true;
}

bool process_runs(long pid) {
  if (pid <= 0) return false;
  if (::kill(static_cast<pid_t>(pid), 0) != 0) return errno != ESRCH;
  // A zombie (ended, its parent not yet told) runs no more: the state after the name in /proc/PID/stat.
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  const std::string line((std::istreambuf_iterator<char>(stat)), std::istreambuf_iterator<char>());
  const size_t name_end = line.rfind(')');
  const char state = name_end != std::string::npos && name_end + 2 < line.size() ? line[name_end + 2] : '?';
  return state != 'Z' && state != 'X';
}

}  // namespace gpipe
