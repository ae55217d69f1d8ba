// job.cc: the job this process belongs to (job.h); the backends' sides are src/transport/mpi/job.cc
// and src/transport/c10d/world.cc.
#include "gpipe/job.h"

#include "gpipe/backend.h"
#include "gpipe/check.h"

#if defined(GPIPE_HAS_MPI) && GPIPE_HAS_MPI
#include "gpipe/mpi_backend.h"
#include "transport/mpi/job.h"
#endif
#if defined(GPIPE_HAS_C10D) && GPIPE_HAS_C10D
#include "transport/c10d/c10d.h"
#endif

#include <cstdlib>
#include <fstream>
#include <iterator>
#include <map>
#include <set>
#include <stdexcept>
#include <string>

#include <unistd.h>

namespace gpipe {
namespace {

Job& the_job() {
  static Job j;
  return j;
}

// Every rank's `mine`, in rank order; `mine` alone in a job of one process.
std::vector<std::string> gather_all(const std::string& mine) {
  if (job().distributed) return all_gather_processes(mine);
  return {mine};
}

// Which backend started the job (start_job); kThreads in a job of one process.
Runtime& job_backend() {
  static Runtime runtime = Runtime::kThreads;
  return runtime;
}

// Settings as one text: "name\0value\0" each.
std::string joined(const std::vector<std::pair<std::string, std::string>>& settings) {
  std::string out;
  for (const auto& [name, value] : settings) out += name + '\0' + value + '\0';
  return out;
}

std::vector<std::pair<std::string, std::string>> split(const std::string& text) {
  std::vector<std::pair<std::string, std::string>> out;
  for (size_t at = 0; at < text.size();) {
    const size_t name_end = text.find('\0', at), value_end = text.find('\0', name_end + 1);
    out.emplace_back(text.substr(at, name_end - at), text.substr(name_end + 1, value_end - name_end - 1));
    at = value_end + 1;
  }
  return out;
}

}  // namespace

const Job& job() { return the_job(); }

namespace {
void remember_launcher_words();  // below, with the launcher's words
}  // namespace

const Job& start_job(int* argc, char*** argv) {
#if defined(GPIPE_HAS_MPI) && GPIPE_HAS_MPI
  if (mpi::launched()) {
    const auto [rank, size] = mpi::start_job(argc, argv);
    // One rank is one process: it runs as without mpirun (threads, one checkpoint file).
    the_job() = Job{rank, size, size > 1, "mpirun"};
    job_backend() = Runtime::kMpi;
    remember_launcher_words();
    return job();
  }
#else
  (void)argc;
  (void)argv;
  if (std::getenv("OMPI_COMM_WORLD_SIZE") != nullptr || std::getenv("PMI_SIZE") != nullptr)
    throw std::runtime_error("this gpipe was built without MPI, but it was started by mpirun; install "
                             "libopenmpi-dev and rebuild with MPI (cmake -DGPIPE_MPI=ON)");
#endif
#if defined(GPIPE_HAS_C10D) && GPIPE_HAS_C10D
  if (c10d::launched()) {
    const auto [rank, size] = c10d::start_job();
    the_job() = Job{rank, size, size > 1, "torchrun"};
    job_backend() = Runtime::kC10d;
    remember_launcher_words();
  }
#endif
  // Some of env://'s variables without the others: not a job, which a user who meant one would not see.
  const char* env_vars[] = {"RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"};
  int set = 0;
  for (const char* name : env_vars) set += std::getenv(name) != nullptr && *std::getenv(name) != '\0' ? 1 : 0;
  if (set > 0 && set < 4 && std::getenv("WORLD_SIZE") != nullptr && std::string(std::getenv("WORLD_SIZE")) != "1")
    print_error_line("gpipe: warning: some of RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT are set, not all: this "
                     "process runs alone; start a job of several with torchrun, which sets them all");
#if !(defined(GPIPE_HAS_C10D) && GPIPE_HAS_C10D)
  if (std::getenv("TORCHELASTIC_RUN_ID") != nullptr && std::getenv("WORLD_SIZE") != nullptr &&
      std::string(std::getenv("WORLD_SIZE")) != "1")
    throw std::runtime_error("this gpipe was built without the c10d backend, but it was started by torchrun; install "
                             "libgloo-dev and rebuild with it (cmake -DGPIPE_C10D=ON)");
#endif
  return job();
}

int replicas_of(int devices) {
  if (job().distributed) return place(job().rank, job().size, devices).replicas;
  return 1;
}

void check_same_settings(const std::vector<std::pair<std::string, std::string>>& settings, const std::string& fix) {
  if (!job().distributed) return;
  // Each name's values (a name given twice keeps both, in order), compared by name: the order in which
  // settings were given does not matter.
  auto by_name = [](const std::vector<std::pair<std::string, std::string>>& list) {
    std::map<std::string, std::string> out;
    for (const auto& [name, value] : list) out[name] += (out.count(name) ? ", " : "") + value;
    return out;
  };
  const std::vector<std::string> all = gather_all(joined(settings));
  const auto first = by_name(split(all[0]));
  for (size_t r = 1; r < all.size(); ++r) {
    const auto theirs = by_name(split(all[r]));
    std::set<std::string> names;
    for (const auto& [name, value] : first) names.insert(name);
    for (const auto& [name, value] : theirs) names.insert(name);
    for (const std::string& name : names) {
      const auto mine = first.find(name), other = theirs.find(name);
      if (mine != first.end() && other != theirs.end() && mine->second == other->second) continue;
      const std::string shown_mine = mine == first.end() ? "no " + name : name + " " + mine->second;
      const std::string shown_other = other == theirs.end() ? "no " + name
                                      : mine == first.end() ? name + " " + other->second : other->second;
      GPIPE_CHECK(false, "the ranks were started with different settings: rank 0 has ", shown_mine, ", rank ", r,
                  " has ", shown_other, "; ", fix);
    }
  }
}

void check_same_bytes(const std::vector<std::pair<std::string, uint64_t>>& inputs) {
  if (!job().distributed) return;
  std::vector<std::pair<std::string, std::string>> settings;
  for (const auto& [what, digest] : inputs) settings.emplace_back(what, std::to_string(digest));
  const std::vector<std::string> all = gather_all(joined(settings));
  const auto first = split(all[0]);
  for (size_t r = 1; r < all.size(); ++r) {
    const auto theirs = split(all[r]);
    GPIPE_CHECK(theirs.size() == first.size(), "rank ", r, " read other inputs than rank 0; give every rank the same "
                "command line");
    for (size_t n = 0; n < first.size(); ++n)
      GPIPE_CHECK(theirs[n] == first[n], "rank ", r, " read other bytes than rank 0 behind ", first[n].first,
                  " (each rank opens the path itself, from its own working folder and machine): the ranks would "
                  "train a mixture of two models or datasets; give every rank the same file (a path they all see "
                  "alike, or identical copies)");
  }
}

namespace {

// `word` as a shell reads it back: itself, or in single quotes.
std::string shell_quoted(const std::string& word) {
  const bool plain = !word.empty() && word.find_first_not_of("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
                                                             "0123456789_-+=./:,@%") == std::string::npos;
  if (plain) return word;
  std::string out = "'";
  for (char c : word) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

// A process's arguments as the kernel has them (/proc/PID/cmdline); none when it cannot be read.
std::vector<std::string> arguments_of(const std::string& pid) {
  std::ifstream in("/proc/" + pid + "/cmdline", std::ios::binary);
  const std::string all((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<std::string> args;
  for (size_t at = 0; at < all.size();) {
    const size_t end = all.find('\0', at);
    args.push_back(all.substr(at, end == std::string::npos ? std::string::npos : end - at));
    at = end == std::string::npos ? all.size() : end + 1;
  }
  return args;
}

// Under mpirun or torchrun, the launcher's words before `program`: the parent's own (mpirun and every
// flag the user gave it, a hostfile, --allow-run-as-root; torchrun and its flags) when the parent is
// the launcher, as it is for the ranks on its host; "mpirun -np N" or torchrun's otherwise.
std::string launcher_words(const std::string& program) {
  const std::vector<std::string> parent = arguments_of(std::to_string(getppid()));
  const std::string name = parent.empty() ? "" : parent[0].substr(parent[0].find_last_of('/') + 1);
  // torchrun's agent is a Python program: /usr/bin/python3 /usr/bin/torchrun ... PROGRAM.
  const bool torchrun = parent.size() > 1 && (parent[1].find("torchrun") != std::string::npos ||
                                              parent[1].find("torch.distributed.run") != std::string::npos ||
                                              (parent.size() > 2 && parent[2] == "torch.distributed.run"));
  if (name == "mpirun" || name == "mpiexec" || name == "orterun" || name == "prterun" || torchrun) {
    for (size_t n = 1; n < parent.size(); ++n) {
      if (parent[n] != program) continue;
      std::string out;
      for (size_t k = 0; k < n; ++k) out += (k == 0 ? "" : " ") + shell_quoted(parent[k]);
      return out;
    }
  }
  if (job_backend() == Runtime::kC10d)  // Debian's torchrun (torch 1.13) starts only with the three log flags
    return "torchrun --redirects 2 --tee 2 --log_dir torchrun-logs --nproc_per_node " + std::to_string(job().size) +
           " --no_python";
  return "mpirun -np " + std::to_string(job().size);
}

// The launcher's words, read as the job starts, while the launcher is this process's parent: a rank
// whose torchrun agent was killed (and that stops for it) still prints the command it was started by.
std::string& launcher_words_at_start() {
  static std::string words;
  return words;
}

void remember_launcher_words() {
  const std::vector<std::string> args = arguments_of("self");
  if (job().distributed && !args.empty()) launcher_words_at_start() = launcher_words(args[0]);
}

}  // namespace

std::string resume_command(const std::string& file, const std::string& flag) {
  const std::vector<std::string> args = arguments_of("self");
  std::string out = !job().distributed || args.empty() ? ""
                    : !launcher_words_at_start().empty() ? launcher_words_at_start()
                                                         : launcher_words(args[0]);
  for (size_t n = 0; n < args.size(); ++n) {
    if (args[n] == flag) {  // and its value
      ++n;
      continue;
    }
    if (args[n].rfind(flag + "=", 0) == 0) continue;
    out += (out.empty() ? "" : " ") + shell_quoted(args[n]);
  }
  return out + " " + flag + " " + shell_quoted(file);
}

void print_error_line(const std::string& line) {
  // One write(2) per line: ranks of one job share the terminal, and a line written piece by piece
  // comes out interleaved with another rank's.
  const std::string text = line + "\n";
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = ::write(STDERR_FILENO, text.data() + done, text.size() - done);
    if (n <= 0) break;
    done += static_cast<size_t>(n);
  }
}

std::vector<LinkTiming> time_link(int warmup) {
  GPIPE_CHECK(job().size == 2, "timing the link needs a job of two ranks; start it with mpirun -np 2 or torchrun with "
              "two processes (got ", job().size, job().size == 1 ? " rank)" : " ranks)");
#if defined(GPIPE_HAS_C10D) && GPIPE_HAS_C10D
  if (job_backend() == Runtime::kC10d) return c10d::time_link(warmup);
#endif
#if defined(GPIPE_HAS_MPI) && GPIPE_HAS_MPI
  return mpi::time_link(warmup, job().rank);
#else
  (void)warmup;
  return {};
#endif
}

int end_job(int status, const std::string& message) {
#if defined(GPIPE_HAS_C10D) && GPIPE_HAS_C10D
  if (job().distributed && job_backend() == Runtime::kC10d) c10d::end_job(status, message, print_error_line);
#endif
#if defined(GPIPE_HAS_MPI) && GPIPE_HAS_MPI
  if (job().distributed) mpi::end_job(status, message, print_error_line, job().rank);
#endif
  print_error_line(message);
  return status;
}

}  // namespace gpipe
