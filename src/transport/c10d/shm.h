// shm.h (internal): a one-way byte stream in shared memory between two processes of one machine, which
// the c10d Links use in place of Gloo's loopback TCP between ranks on the same machine.
//
// Over loopback, each Gloo message crosses in several hand-offs between threads of both processes (its
// receive is announced, then the data is sent by the sender's I/O thread and read by the receiver's), on
// cores that are busy computing; the data is copied twice, by those threads. Here the sending thread
// copies the bytes into the ring and the receiving thread, the one that waits for them, copies them out:
// no other thread, as an MPI rank polls. A reader with nothing to read sleeps on a futex in the shared
// page, which the writer wakes.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

namespace gpipe::c10d {

class ShmRing {
 public:
  /// A new ring of `capacity` bytes (a power of two) under `name` (/dev/shm), its memory reserved now;
  /// nullptr where the machine has no room for it (a container's small /dev/shm), or no shared memory;
  /// then `why`, when given, receives the system's reason ("No space left on device").
  static std::unique_ptr<ShmRing> create(const std::string& name, size_t capacity, std::string* why = nullptr);
  /// The ring another process created under `name`; nullptr where it cannot be reached (another machine,
  /// or another container's /dev/shm).
  static std::unique_ptr<ShmRing> open(const std::string& name);
  /// Removes `name` from /dev/shm (the mappings stay).
  static void unlink(const std::string& name);
  ~ShmRing();
  ShmRing(const ShmRing&) = delete;
  ShmRing& operator=(const ShmRing&) = delete;

  /// The writer: copies as much of `data` as there is room for; returns how much.
  size_t write_some(const void* data, size_t bytes);
  /// The reader: copies up to `bytes` of what was written; returns how much.
  size_t read_some(void* into, size_t bytes);
  /// The reader: how many bytes wait to be read.
  size_t readable() const;
  /// The reader: a ticket for wait_readable, taken before looking at what the sleep would be for.
  uint32_t wait_ticket() const;
  /// The reader: sleeps until something was written or the reader woken since `ticket` was taken
  /// (wait_ticket), or `most` passed.
  void wait_readable(uint32_t ticket, std::chrono::milliseconds most);
  /// The writer: sleeps until something was read (there is room), or `most` passed.
  void wait_writable(std::chrono::milliseconds most);
  /// Wakes this process's readers from wait_readable (to look at a failure elsewhere, or at a receive
  /// another thread completed for them).
  void wake_reader();

 private:
  struct Shared;
  ShmRing(void* mapping, size_t mapped);
  Shared* shared_;
  uint8_t* data_;
  size_t mapped_;
  size_t capacity_;
};

}  // namespace gpipe::c10d
