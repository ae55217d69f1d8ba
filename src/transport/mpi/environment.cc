// environment.cc: MPI's set-up for a process, communicators, the collectives over a whole job
// (all_gather, the layout of a gather).
#include "transport/mpi/group.h"

#include "gpipe/check.h"

#include <climits>
#include <cstdio>
#include <cstdlib>
#include <sstream>

namespace gpipe::mpi {

namespace detail {

void check_mpi(int code, const char* what) {
  if (code == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  MPI_Error_string(code, text, &length);
  throw std::runtime_error(std::string("gpipe: ") + what + " failed: " + std::string(text, static_cast<size_t>(length)));
}

int rank_of(MPI_Comm comm) {
  int rank = 0;
  MPI_Comm_rank(comm, &rank);
  return rank;
}

int size_of(MPI_Comm comm) {
  int size = 0;
  MPI_Comm_size(comm, &size);
  return size;
}

Layout layout_of(const std::vector<int64_t>& sizes) {
  Layout out;
  int64_t total = 0;
  for (int64_t n : sizes) {
    out.lengths.push_back(static_cast<int>(std::min<int64_t>(n, INT_MAX)));
    out.offsets.push_back(static_cast<int>(std::min<int64_t>(total, INT_MAX)));
    total += n;
  }
  if (total > INT_MAX)
    throw std::length_error("gpipe: the ranks' parts add up to " + std::to_string(total) +
                             " bytes, more than the 2 GiB that one MPI gather carries");
  out.total = total;
  return out;
}

}  // namespace detail

using detail::check_mpi;

bool launched() {
  for (const char* name : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS"})
    if (std::getenv(name) != nullptr) return true;
  return false;
}

Environment::Environment(int* argc, char*** argv) {
  int initialized = 0;
  MPI_Initialized(&initialized);
  GPIPE_CHECK(!initialized, "MPI is already initialised; create one gpipe::mpi::Environment per process");
  // Open MPI over TCP: a send above the eager limit (64 KiB) leaves only after the receiver's
  // answer, handled in the sender's next MPI call, so a boundary tensor waits for its stage's
  // next action. 4 MiB sends it whole into the socket buffer (docs/mpi.md: 40% across two
  // hosts). Set before MPI_Init, which reads them; what the user set wins.
  for (const char* name : {"OMPI_MCA_btl_tcp_eager_limit", "OMPI_MCA_btl_tcp_rndv_eager_limit",
                           "OMPI_MCA_btl_tcp_max_send_size"})
    setenv(name, "4194304", /*overwrite=*/0);
  int provided = 0;
  check_mpi(MPI_Init_thread(argc, argv, MPI_THREAD_FUNNELED, &provided), "MPI_Init_thread");
  rank_ = detail::rank_of(MPI_COMM_WORLD);
  size_ = detail::size_of(MPI_COMM_WORLD);
}

Environment::~Environment() {
  leave();  // a rank still waiting for this one stops rather than waiting forever
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized) MPI_Finalize();
}

Environment& process_environment(int* argc, char*** argv) {
  static Environment environment(argc, argv);  // destroyed at exit: MPI_Finalize
  return environment;
}

void abort(int status) {
  std::fflush(stdout);
  std::fflush(stderr);
  MPI_Abort(MPI_COMM_WORLD, status);
  std::_Exit(status);
}

Communicator::~Communicator() {
  if (comm_ != MPI_COMM_NULL) MPI_Comm_free(&comm_);
}

Communicator& Communicator::operator=(Communicator&& other) noexcept {
  if (this != &other) {
    if (comm_ != MPI_COMM_NULL) MPI_Comm_free(&comm_);
    comm_ = other.comm_;
    other.comm_ = MPI_COMM_NULL;
  }
  return *this;
}

Communicator Communicator::duplicate(MPI_Comm comm) {
  Communicator c;
  check_mpi(MPI_Comm_dup(comm, &c.comm_), "MPI_Comm_dup");
  return c;
}

Communicator Communicator::split(MPI_Comm comm, int color, int key) {
  Communicator c;
  check_mpi(MPI_Comm_split(comm, color, key, &c.comm_), "MPI_Comm_split");
  return c;
}

std::vector<std::string> all_gather(MPI_Comm comm, const std::string& mine) {
  const int size = detail::size_of(comm);
  int64_t length = static_cast<int64_t>(mine.size());
  std::vector<int64_t> sizes(static_cast<size_t>(size));
  check_mpi(MPI_Allgather(&length, 1, MPI_INT64_T, sizes.data(), 1, MPI_INT64_T, comm), "MPI_Allgather");
  const detail::Layout l = detail::layout_of(sizes);
  std::string all(static_cast<size_t>(l.total), '\0');
  check_mpi(MPI_Allgatherv(mine.data(), static_cast<int>(length), MPI_CHAR, all.data(), l.lengths.data(),
                           l.offsets.data(), MPI_CHAR, comm),
            "MPI_Allgatherv");
  std::vector<std::string> out;
  for (int r = 0; r < size; ++r)
    out.push_back(all.substr(static_cast<size_t>(l.offsets[static_cast<size_t>(r)]),
                             static_cast<size_t>(l.lengths[static_cast<size_t>(r)])));
  return out;
}

}  // namespace gpipe::mpi
