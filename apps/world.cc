// world.cc: MPI start-up for the gpipe program, settings agreement across ranks, and failing the whole job.
#include "world.h"

#if defined(GPIPE_HAS_MPI) && GPIPE_HAS_MPI
#include <gpipe/mpi.h>
#endif
#include <gpipe/check.h>

#include <chrono>
#include <cstdlib>
#include <iostream>
#include <memory>
#include <stdexcept>
#include <thread>
#include <vector>

#include <unistd.h>

namespace gpipe::cli {
namespace {

World& the_world() {
  static World w;
  return w;
}

#if defined(GPIPE_HAS_MPI) && GPIPE_HAS_MPI
bool launched_by_mpi() { return mpi::launched(); }

// A communicator only fail() uses, so its barrier can meet no other collective.
MPI_Comm& failure_comm() {
  static MPI_Comm comm = MPI_COMM_NULL;
  return comm;
}
#else
bool launched_by_mpi() { return std::getenv("OMPI_COMM_WORLD_SIZE") != nullptr || std::getenv("PMI_SIZE") != nullptr; }
#endif

}  // namespace

const World& world() { return the_world(); }

void start_world(int* argc, char*** argv) {
  if (!launched_by_mpi()) return;
#if defined(GPIPE_HAS_MPI) && GPIPE_HAS_MPI
  const mpi::Environment& environment = mpi::process_environment(argc, argv);
  // One rank is one process: it runs as without mpirun (threads, one checkpoint file).
  the_world() = World{environment.rank(), environment.size(), environment.size() > 1};
  MPI_Comm_dup(MPI_COMM_WORLD, &failure_comm());
#else
  (void)argc;
  (void)argv;
  throw std::runtime_error("this gpipe was built without MPI, but it was started by mpirun; "
                           "install libopenmpi-dev and rebuild with -DGPIPE_MPI=ON");
#endif
}

int replicas_of(int devices) {
#if defined(GPIPE_HAS_MPI) && GPIPE_HAS_MPI
  if (world().mpi) return mpi::place(world().rank, world().size, devices).replicas;
#endif
  return 1;
}

void check_same_settings(const nlohmann::json& settings) {
#if defined(GPIPE_HAS_MPI) && GPIPE_HAS_MPI
  if (!world().mpi) return;
  const std::vector<std::string> all = mpi::all_gather(MPI_COMM_WORLD, settings.dump());
  const nlohmann::json first = nlohmann::json::parse(all[0]);
  for (int r = 1; r < static_cast<int>(all.size()); ++r) {
    const nlohmann::json theirs = nlohmann::json::parse(all[static_cast<size_t>(r)]);
    for (const auto& [key, value] : first.items())
      GPIPE_CHECK(theirs.contains(key) && theirs[key] == value, "the ranks were started with different settings: rank 0 has ",
                  key, " = ", value.dump(), ", rank ", r, " has ", theirs.contains(key) ? theirs[key].dump() : "none",
                  "; give every rank the same command line");
  }
#else
  (void)settings;
#endif
}

void check_same_bytes(const std::vector<std::pair<std::string, uint64_t>>& inputs) {
#if defined(GPIPE_HAS_MPI) && GPIPE_HAS_MPI
  if (!world().mpi) return;
  nlohmann::json mine = nlohmann::json::array();
  for (const auto& [what, digest] : inputs) mine.push_back({what, digest});
  const std::vector<std::string> all = mpi::all_gather(MPI_COMM_WORLD, mine.dump());
  const nlohmann::json first = nlohmann::json::parse(all[0]);
  for (int r = 1; r < static_cast<int>(all.size()); ++r) {
    const nlohmann::json theirs = nlohmann::json::parse(all[static_cast<size_t>(r)]);
    GPIPE_CHECK(theirs.size() == first.size(), "rank ", r, " read other inputs than rank 0; give every rank the same "
                "command line");
    for (size_t n = 0; n < first.size(); ++n)
      GPIPE_CHECK(theirs[n] == first[n], "rank ", r, " read other bytes than rank 0 behind ",
                  first[n][0].get<std::string>(), " (each rank opens the path itself, from its own working folder "
                  "and machine): the ranks would train a mixture of two models or datasets; give every rank the "
                  "same file (a path they all see alike, or identical copies)");
  }
#else
  (void)inputs;
#endif
}

void print_error_line(const std::string& line) {
  // One write(2) per line: ranks of one job share the terminal, and a line
  // written piece by piece comes out interleaved with another rank's.
  const std::string text = line + "\n";
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = ::write(STDERR_FILENO, text.data() + done, text.size() - done);
    if (n <= 0) break;
    done += static_cast<size_t>(n);
  }
}

int fail(int status, const std::string& message) {
  if (!world().mpi || world().size == 1) {
    print_error_line(message);
    return status;
  }
#if defined(GPIPE_HAS_MPI) && GPIPE_HAS_MPI
  // Ranks that fail together (bad settings, a usage error every rank makes alike, or a stage's
  // failure that every rank has heard of) meet here: wait up to 5 s for all of them, then the
  // first rank prints each different message once (with the ranks that gave it, unless all did).
  // A rank that never comes (it is computing, or dead) only delays the end: each rank then prints
  // its own message. Then every rank ends.
  MPI_Request request = MPI_REQUEST_NULL;
  MPI_Ibarrier(failure_comm(), &request);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  int done = 0;
  while (!done && std::chrono::steady_clock::now() < deadline) {
    MPI_Test(&request, &done, MPI_STATUS_IGNORE);
    if (!done) std::this_thread::yield();
  }
  if (!done) {
    print_error_line("[rank " + std::to_string(world().rank) + "] " + message);
    mpi::abort(status);
  }
  const std::vector<std::string> all = mpi::all_gather(failure_comm(), message);
  if (world().rank == 0) {
    std::vector<bool> told(all.size(), false);
    for (size_t r = 0; r < all.size(); ++r) {
      if (told[r]) continue;
      std::vector<size_t> ranks;
      for (size_t q = r; q < all.size(); ++q)
        if (!told[q] && all[q] == all[r]) ranks.push_back(q), told[q] = true;
      std::string who;
      for (size_t n = 0; n < ranks.size(); ++n) who += (n ? ", " : "") + std::to_string(ranks[n]);
      print_error_line(ranks.size() == all.size() ? all[r]
                                                  : (ranks.size() == 1 ? "[rank " : "[ranks ") + who + "] " + all[r]);
    }
  }
  MPI_Barrier(failure_comm());  // printed before any rank ends the job
  mpi::abort(status);
#else
  return status;
#endif
}

}  // namespace gpipe::cli
