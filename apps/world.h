// world.h: the job this process belongs to: one MPI rank of many (under mpirun), or a world of one.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace gpipe::cli {

struct World {
  int rank = 0;
  int size = 1;
  bool mpi = false;  ///< started by mpirun, in a build with the MPI runtime
  /// Whether this rank prints progress, tables and summaries (rank 0 does).
  bool prints() const { return rank == 0; }
};

/// The job. Before start_world: a world of one.
const World& world();

/// Initialises MPI when the program was started by an MPI launcher and gpipe
/// was built with MPI; MPI is finalised when the program exits. Throws
/// std::runtime_error when started by a launcher in a build without MPI.
void start_world(int* argc, char*** argv);

/// D, the replicas of a pipeline of K `devices` in this job: the MPI placement's (mpi::place,
/// which throws std::invalid_argument unless the ranks are a multiple of K), 1 without mpirun.
int replicas_of(int devices);

/// Compares `settings` across the ranks of an MPI job; every rank throws the
/// same std::invalid_argument naming the first setting that differs. A world
/// of one has nothing to compare.
void check_same_settings(const nlohmann::json& settings);

/// Compares, across the ranks of an MPI job, digests of what each rank read from files: `inputs`
/// holds (what was read, e.g. "--data data.pt", its digest). Every rank throws the same
/// std::invalid_argument naming the first input whose bytes differ (each rank opens a path
/// itself, from its own working folder and machine) and the fix. A world of one has nothing to compare.
void check_same_bytes(const std::vector<std::pair<std::string, uint64_t>>& inputs);

/// Writes `line` and a newline to standard error in one write, so that lines
/// of ranks sharing a terminal never mix.
void print_error_line(const std::string& line);

/// Reports `message` on standard error and returns `status` for main() to
/// return. Under MPI with more than one rank it ends the whole job instead
/// (the failing rank's message is printed with its rank), and never returns.
int fail(int status, const std::string& message);

}  // namespace gpipe::cli
