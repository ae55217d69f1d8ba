// job.cc (MPI): the MPI side of job.h: starting MPI, ending the whole job together, timing the link.
#include "transport/mpi/job.h"

#include "gpipe/mpi_backend.h"

#include "gpipe/trace.h"
#include "transport/rank_group.h"

#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <thread>

namespace gpipe::mpi {
namespace {

// A communicator only end_job uses, so its barrier can meet no other collective.
MPI_Comm& failure_comm() {
  static MPI_Comm comm = MPI_COMM_NULL;
  return comm;
}

}  // namespace

std::pair<int, int> start_job(int* argc, char*** argv) {
  const Environment& environment = process_environment(argc, argv);
  MPI_Comm_dup(MPI_COMM_WORLD, &failure_comm());
  return {environment.rank(), environment.size()};
}

void end_job(int status, const std::string& message, const std::function<void(const std::string&)>& print,
             int rank) {
  // Ranks that fail together meet here: wait up to 5 s for all of them, then the first rank prints
  // each different message once; a rank that never comes only delays the end, each rank then
  // printing its own message. Then every rank ends.
  // The launcher ends the other ranks with SIGTERM once the first calls MPI_Abort: the job's error
  // is said here, so that signal ends a rank without a line of its own ("ended by SIGTERM").
  for (int s : {SIGINT, SIGTERM, SIGHUP}) std::signal(s, SIG_DFL);
  MPI_Request request = MPI_REQUEST_NULL;
  MPI_Ibarrier(failure_comm(), &request);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  int done = 0;
  while (!done && std::chrono::steady_clock::now() < deadline) {
    MPI_Test(&request, &done, MPI_STATUS_IGNORE);
    if (!done) std::this_thread::yield();
  }
  if (!done) {
    print("[rank " + std::to_string(rank) + "] " + message);
    abort(status);
  }
  const std::vector<std::string> all = all_gather(failure_comm(), message);
  if (rank == 0) gpipe::detail::print_by_message(all, print);
  MPI_Barrier(failure_comm());  // printed before any rank ends the job
  abort(status);
}

std::vector<LinkTiming> time_link(int warmup, int rank) {
  ErrorChannel errors(MPI_COMM_WORLD);
  MpiTransport transport(MPI_COMM_WORLD, &errors, {0, 1}, 1);  // stage r on rank r
  return gpipe::detail::time_transport(transport, rank, warmup);
}

}  // namespace gpipe::mpi
