// job.h: the job this process belongs to: one rank of a job of several (under mpirun: MPI; under
// torchrun: c10d), or a job of one process; what its ranks must agree on before any work, and ending
// the whole job when one rank cannot go on. A front end (gpipe's command line, a program of one's
// own) calls these; none calls MPI or c10d itself.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace gpipe {

struct Job {
  int rank = 0;
  int size = 1;
  bool distributed = false;  ///< more than one rank (started by mpirun or torchrun)
  /// What started the job, for messages: "mpirun" (MPI), "torchrun" (c10d), or "" (one process).
  std::string launcher;
  /// Whether this rank prints progress, tables and summaries (the first rank does).
  bool prints() const { return rank == 0; }
};

/// The job. Before start_job: a job of one process.
const Job& job();

/// Starts the backend whose launcher started this process, for the rest of the process (MPI under
/// mpirun, c10d under torchrun), and returns the job. Throws std::runtime_error when a launcher
/// started a gpipe built without its backend (naming the CMake option that builds it in); warns
/// when only some of torchrun's variables are set.
const Job& start_job(int* argc, char*** argv);

/// D, the replicas of a pipeline of K `devices` in this job: the ranks divided by K (throws
/// std::invalid_argument unless the ranks are a multiple of K); 1 in a job of one process.
int replicas_of(int devices);

/// Compares named settings (name, value as text) across the ranks of the job: unless every rank has
/// the same names and values, every rank throws the same std::invalid_argument naming the first
/// that differs, rank 0's value and the other rank's, and `fix`. A job of one process has nothing to
/// compare.
void check_same_settings(const std::vector<std::pair<std::string, std::string>>& settings,
                         const std::string& fix = "give every rank the same settings");

/// Compares, across the ranks, digests of what each rank read (what, e.g. "the data file d.pt", and
/// its digest: digest.h). Every rank throws the same std::invalid_argument naming the first input
/// whose bytes differ (each rank opens a path itself, from its own working folder and machine).
void check_same_bytes(const std::vector<std::pair<std::string, uint64_t>>& inputs);

/// The command that runs this process again from the snapshot `file` (snapshot.h), for a program
/// whose option `flag` (gpipe train's "--resume") names the file to resume from: this process's
/// command line (as the kernel has it, /proc/self/cmdline) with `flag` FILE in place of any `flag`
/// given, each word quoted for a shell where it needs it; under mpirun or torchrun, after the
/// launcher's words (its own command line when it is this process's parent, else "mpirun -np N" or
/// "torchrun --nproc_per_node N --no_python").
std::string resume_command(const std::string& file, const std::string& flag);

/// Writes `line` and a newline to standard error in one write, so that lines of ranks sharing a
/// terminal never mix.
void print_error_line(const std::string& line);

/// Reports `message` on standard error and returns `status`. In a job of several ranks it ends the
/// whole job instead and never returns: ranks that fail together within 5 s print each different
/// message once (with the ranks that gave it, unless all did); a rank that does not come (it is
/// computing, or dead) only delays the end.
int end_job(int status, const std::string& message);

/// One message size of time_link: the median one-way time of a ping-pong and its spread.
struct LinkTiming {
  int64_t bytes = 0;
  int repeats = 0;
  double one_way_s = 0, min_s = 0, max_s = 0;
  /// The bandwidth of the median one-way time, in GB/s (10^9 bytes per second).
  double gb_per_s() const { return one_way_s > 0 ? static_cast<double>(bytes) / one_way_s * 1e-9 : 0.0; }
};

/// Latency and bandwidth of the transport between the two ranks of a job of 2, by ping-pong per
/// message size (8 B to 64 MiB; header and data messages, as a pipeline sends them), after `warmup`
/// untimed rounds; collective. Throws std::invalid_argument in a job of another size, or in a job of
/// one process.
std::vector<LinkTiming> time_link(int warmup);

}  // namespace gpipe
