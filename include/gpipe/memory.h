// memory.h: CPU memory accounting per device (a tracking allocator), with an optional cap per device.
//
// While a MemoryScope is alive on a thread, every CPU allocation that thread
// makes through libtorch is charged to the scope's counter until it is freed,
// whichever thread frees it. A pipeline gives each stage a counter and runs
// the stage's actions in its scope, so the counters read as peak bytes per
// stage; a counter with a cap makes an allocation past the cap fail.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>

namespace gpipe {

/// Thrown by an allocation that would take a counter past its cap.
class OutOfMemory : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// Bytes held by the allocations charged to one scope (one stage).
class MemoryCounter {
 public:
  /// `name` appears in out-of-memory errors; `cap_bytes` 0 means no cap.
  explicit MemoryCounter(std::string name, int64_t cap_bytes = 0);

  const std::string& name() const { return name_; }
  int64_t cap_bytes() const { return cap_bytes_; }
  int64_t current_bytes() const { return current_.load(std::memory_order_relaxed); }
  int64_t peak_bytes() const { return peak_.load(std::memory_order_relaxed); }
  /// The largest of the bytes held at the moments note_held() was called:
  /// with the executor calling it after every action, the peak of what stays
  /// allocated between actions (activations kept for backward, tensors in
  /// transit), without the buffers an action frees before it ends.
  int64_t held_peak_bytes() const { return held_peak_.load(std::memory_order_relaxed); }
  void note_held();
  /// Starts new peaks from the bytes held now.
  void reset_peak();

  /// Charges `bytes`; throws OutOfMemory, charging nothing, past the cap.
  void charge(int64_t bytes);
  void release(int64_t bytes);

 private:
  std::string name_;
  int64_t cap_bytes_;
  std::atomic<int64_t> current_{0};
  std::atomic<int64_t> peak_{0};
  std::atomic<int64_t> held_peak_{0};
};

/// Installs gpipe's tracking allocator as libtorch's CPU allocator, once per
/// process; allocations made outside any MemoryScope pass through uncharged.
void enable_memory_tracking();

/// Charges this thread's CPU allocations to `counter` while alive; scopes nest.
class MemoryScope {
 public:
  explicit MemoryScope(std::shared_ptr<MemoryCounter> counter);
  ~MemoryScope();
  MemoryScope(const MemoryScope&) = delete;
  MemoryScope& operator=(const MemoryScope&) = delete;

 private:
  std::shared_ptr<MemoryCounter> previous_;
};

}  // namespace gpipe
