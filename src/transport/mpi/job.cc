// job.cc (MPI): the MPI side of job.h: starting MPI, gathering the ranks' settings, and ending the
// whole job together.
#include "transport/mpi/job.h"

#include "gpipe/mpi_backend.h"

#include "gpipe/trace.h"

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

std::vector<std::string> all_gather_job(const std::string& mine) { return all_gather(MPI_COMM_WORLD, mine); }

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
  if (rank == 0) {
    std::vector<bool> told(all.size(), false);
    for (size_t r = 0; r < all.size(); ++r) {
      if (told[r]) continue;
      std::vector<size_t> ranks;
      for (size_t q = r; q < all.size(); ++q)
        if (!told[q] && all[q] == all[r]) ranks.push_back(q), told[q] = true;
      std::string who;
      for (size_t n = 0; n < ranks.size(); ++n) who += (n ? ", " : "") + std::to_string(ranks[n]);
      print(ranks.size() == all.size() ? all[r] : (ranks.size() == 1 ? "[rank " : "[ranks ") + who + "] " + all[r]);
    }
  }
  MPI_Barrier(failure_comm());  // printed before any rank ends the job
  abort(status);
}

std::vector<LinkTiming> time_link(int warmup, int rank) {
  ErrorChannel errors(MPI_COMM_WORLD);
  MpiTransport transport(MPI_COMM_WORLD, &errors, {0, 1}, 1);  // stage r on rank r
  const int peer = 1 - rank;
  std::vector<LinkTiming> rows;
  for (int64_t bytes = 8; bytes <= (int64_t{64} << 20); bytes *= 8) {
    const torch::Tensor message = torch::ones({bytes / 4});
    const int repeats = static_cast<int>(std::clamp<int64_t>((int64_t{256} << 20) / bytes, 10, 2000));
    std::vector<double> one_way_s;
    for (int r = 0; r < warmup + repeats; ++r) {
      const int64_t begin = now_ns();
      if (rank == 0) {
        transport.send(0, peer, Channel::kActivation, 0, message);
        transport.recv(peer, 0, Channel::kGradient, 0);
      } else {
        transport.recv(peer, 1, Channel::kActivation, 0);
        transport.send(1, peer, Channel::kGradient, 0, message);
      }
      transport.finish();
      if (r >= warmup) one_way_s.push_back(static_cast<double>(now_ns() - begin) * 0.5e-9);
    }
    std::sort(one_way_s.begin(), one_way_s.end());
    rows.push_back({bytes, repeats, one_way_s[one_way_s.size() / 2], one_way_s.front(), one_way_s.back()});
  }
  return rows;
}

}  // namespace gpipe::mpi
