// memory.cc: the tracking CPU allocator behind MemoryCounter and MemoryScope.
#include "gpipe/memory.h"

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

#include <cstring>
#include <mutex>

namespace gpipe {

MemoryCounter::MemoryCounter(std::string name, int64_t cap_bytes)
    : name_(std::move(name)), cap_bytes_(cap_bytes) {}

void MemoryCounter::reset_peak() { peak_.store(current_bytes(), std::memory_order_relaxed); }

void MemoryCounter::charge(int64_t bytes) {
  const int64_t now = current_.fetch_add(bytes, std::memory_order_relaxed) + bytes;
  if (cap_bytes_ > 0 && now > cap_bytes_) {
    current_.fetch_sub(bytes, std::memory_order_relaxed);
    throw OutOfMemory("out of memory on " + name_ + ": asked for " + std::to_string(bytes) + " bytes with " +
                      std::to_string(now - bytes) + " in use, over the cap of " + std::to_string(cap_bytes_) +
                      " bytes; raise the cap, use more micro-batches, or checkpoint always");
  }
  int64_t peak = peak_.load(std::memory_order_relaxed);
  while (now > peak && !peak_.compare_exchange_weak(peak, now, std::memory_order_relaxed)) {
  }
}

void MemoryCounter::release(int64_t bytes) { current_.fetch_sub(bytes, std::memory_order_relaxed); }

namespace {

thread_local std::shared_ptr<MemoryCounter> current_counter;

// What a charged allocation carries to its deleter.
struct Charge {
  c10::DataPtr inner;
  int64_t bytes;
  std::shared_ptr<MemoryCounter> counter;  // outlives the stage if the tensor does
};

void release_charge(void* context) {
  auto* charge = static_cast<Charge*>(context);
  charge->counter->release(charge->bytes);
  delete charge;  // frees the memory through the inner DataPtr
}

// libtorch 1.13 declares allocate() const, 2.x non-const with copy_data():
// this class provides both, so it builds against either.
class TrackingAllocator final : public c10::Allocator {
 public:
  explicit TrackingAllocator(c10::Allocator* base) : base_(base) {}

  c10::DataPtr allocate(size_t n) const { return track(n); }
  c10::DataPtr allocate(size_t n) { return track(n); }
  void copy_data(void* dest, const void* src, size_t count) const { std::memcpy(dest, src, count); }

 private:
  c10::DataPtr track(size_t n) const {
    const std::shared_ptr<MemoryCounter>& counter = current_counter;
    if (!counter) return base_->allocate(n);
    counter->charge(static_cast<int64_t>(n));
    c10::DataPtr inner;
    try {
      inner = base_->allocate(n);
    } catch (...) {
      counter->release(static_cast<int64_t>(n));
      throw;
    }
    void* data = inner.get();
    const c10::Device device = inner.device();
    auto* charge = new Charge{std::move(inner), static_cast<int64_t>(n), counter};
    return c10::DataPtr(data, charge, &release_charge, device);
  }

  c10::Allocator* base_;
};

}  // namespace

void enable_memory_tracking() {
  static std::once_flag once;
  std::call_once(once, [] {
    static TrackingAllocator allocator(c10::GetCPUAllocator());
    c10::SetCPUAllocator(&allocator, /*priority=*/100);
  });
}

MemoryScope::MemoryScope(std::shared_ptr<MemoryCounter> counter) : previous_(std::move(current_counter)) {
  current_counter = std::move(counter);
}

MemoryScope::~MemoryScope() { current_counter = std::move(previous_); }

}  // namespace gpipe
