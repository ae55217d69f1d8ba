// shm.cc (c10d): ShmRing, a one-way byte stream in shared memory (shm.h).
#include "transport/c10d/shm.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <ctime>
#include <new>

namespace gpipe::c10d {

// The first page of the mapping; the data follows. Each counter on its own cache line.
struct ShmRing::Shared {
  alignas(64) std::atomic<uint64_t> written;  // bytes written in all (the writer's)
  alignas(64) std::atomic<uint64_t> read;     // bytes read in all (the reader's)
  alignas(64) std::atomic<uint32_t> writes;   // the reader's futex word: counts the writes and wake-ups
  std::atomic<uint32_t> reader_sleeps;  // how many threads sleep on `writes`
  alignas(64) std::atomic<uint32_t> reads;    // the writer's: counts the reads
  std::atomic<uint32_t> writer_sleeps;  // how many threads sleep on `reads`
  uint64_t capacity;
};

namespace {

constexpr size_t kPage = 4096;
static_assert(sizeof(std::atomic<uint32_t>) == 4 && std::atomic<uint64_t>::is_always_lock_free);

// Across processes: no FUTEX_PRIVATE_FLAG.
void futex_wait(std::atomic<uint32_t>* word, uint32_t expected, std::chrono::milliseconds most) {
  timespec limit{static_cast<time_t>(most.count() / 1000), static_cast<long>(most.count() % 1000) * 1000000L};
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, expected, &limit, nullptr, 0);
}

void futex_wake(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT32_MAX, nullptr, nullptr, 0);
}

void* map(int fd, size_t bytes) {
  void* at = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  return at == MAP_FAILED ? nullptr : at;
}

}  // namespace

ShmRing::ShmRing(void* mapping, size_t mapped)
    : shared_(static_cast<Shared*>(mapping)),
      data_(static_cast<uint8_t*>(mapping) + kPage),
      mapped_(mapped),
      capacity_(static_cast<size_t>(shared_->capacity)) {}

std::unique_ptr<ShmRing> ShmRing::create(const std::string& name, size_t capacity, std::string* why) {
  const int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) {
    if (why != nullptr) *why = std::strerror(errno);
    return nullptr;
  }
  const size_t bytes = kPage + capacity;
  // Reserved now: a /dev/shm without room fails here, not with SIGBUS at a later write.
  const int reserved = posix_fallocate(fd, 0, static_cast<off_t>(bytes));
  void* at = reserved == 0 ? map(fd, bytes) : nullptr;
  if (at == nullptr && why != nullptr) *why = std::strerror(reserved != 0 ? reserved : errno);
  close(fd);
  if (at == nullptr) {
    shm_unlink(name.c_str());
    return nullptr;
  }
  auto* shared = new (at) Shared();
  shared->capacity = capacity;
  return std::unique_ptr<ShmRing>(new ShmRing(at, bytes));
}

std::unique_ptr<ShmRing> ShmRing::open(const std::string& name) {
  const int fd = shm_open(name.c_str(), O_RDWR, 0600);
  if (fd < 0) return nullptr;
  struct stat st {};
  void* at = fstat(fd, &st) == 0 && st.st_size > static_cast<off_t>(kPage) ? map(fd, static_cast<size_t>(st.st_size))
                                                                             : nullptr;
  close(fd);
  if (at == nullptr) return nullptr;
  const auto* shared = static_cast<const Shared*>(at);
  if (shared->capacity + kPage != static_cast<uint64_t>(st.st_size)) {
    munmap(at, static_cast<size_t>(st.st_size));
    return nullptr;
  }
  return std::unique_ptr<ShmRing>(new ShmRing(at, static_cast<size_t>(st.st_size)));
}

void ShmRing::unlink(const std::string& name) { shm_unlink(name.c_str()); }

ShmRing::~ShmRing() { munmap(shared_, mapped_); }

size_t ShmRing::write_some(const void* data, size_t bytes) {
  const uint64_t written = shared_->written.load(std::memory_order_relaxed);
  const uint64_t read = shared_->read.load(std::memory_order_acquire);
  const size_t n = std::min(bytes, capacity_ - static_cast<size_t>(written - read));
  if (n == 0) return 0;
  const size_t at = static_cast<size_t>(written) & (capacity_ - 1);
  const size_t first = std::min(n, capacity_ - at);
  std::memcpy(data_ + at, data, first);
  std::memcpy(data_, static_cast<const uint8_t*>(data) + first, n - first);
  // Sequentially consistent, as the reader's: either it sees the bytes before it sleeps, or this sees
  // it sleeping and wakes it (and a futex wait on a `writes` that moved returns at once).
  shared_->written.store(written + n);
  shared_->writes.fetch_add(1);
  if (shared_->reader_sleeps.load() != 0) futex_wake(&shared_->writes);
  return n;
}

size_t ShmRing::readable() const {
  return static_cast<size_t>(shared_->written.load(std::memory_order_acquire) -
                             shared_->read.load(std::memory_order_relaxed));
}

size_t ShmRing::read_some(void* into, size_t bytes) {
  const uint64_t read = shared_->read.load(std::memory_order_relaxed);
  const size_t n = std::min(bytes, readable());
  if (n == 0) return 0;
  const size_t at = static_cast<size_t>(read) & (capacity_ - 1);
  const size_t first = std::min(n, capacity_ - at);
  std::memcpy(into, data_ + at, first);
  std::memcpy(static_cast<uint8_t*>(into) + first, data_, n - first);
  shared_->read.store(read + n);
  shared_->reads.fetch_add(1);
  if (shared_->writer_sleeps.load() != 0) futex_wake(&shared_->reads);
  return n;
}

uint32_t ShmRing::wait_ticket() const { return shared_->writes.load(); }

void ShmRing::wait_readable(uint32_t ticket, std::chrono::milliseconds most) {
  shared_->reader_sleeps.fetch_add(1);
  if (shared_->written.load() == shared_->read.load()) futex_wait(&shared_->writes, ticket, most);
  shared_->reader_sleeps.fetch_sub(1);
}

void ShmRing::wait_writable(std::chrono::milliseconds most) {
  const uint32_t reads = shared_->reads.load();
  shared_->writer_sleeps.fetch_add(1);
  if (shared_->written.load() - shared_->read.load() == capacity_) futex_wait(&shared_->reads, reads, most);
  shared_->writer_sleeps.fetch_sub(1);
}

void ShmRing::wake_reader() {
  // As write_some: a reader about to sleep sees the count move, or is seen sleeping and woken.
  shared_->writes.fetch_add(1);
  if (shared_->reader_sleeps.load() != 0) futex_wake(&shared_->writes);
}

}  // namespace gpipe::c10d
