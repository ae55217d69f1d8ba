// memory.cc: the tracking CPU allocator behind MemoryCounter and MemoryScope.
#include "gpipe/memory.h"

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

#include <cstring>
#include <mutex>
#include <new>

namespace gpipe {

MemoryCounter::MemoryCounter(std::string name, int64_t cap_bytes)
    : name_(std::move(name)), cap_bytes_(cap_bytes) {}

void MemoryCounter::reset_peak() {
  peak_.store(current_bytes(), std::memory_order_relaxed);
  held_peak_.store(current_bytes(), std::memory_order_relaxed);
}

void MemoryCounter::note_held() {
  const int64_t now = current_bytes();
  int64_t peak = held_peak_.load(std::memory_order_relaxed);
  while (now > peak && !held_peak_.compare_exchange_weak(peak, now, std::memory_order_relaxed)) {
  }
}

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

// Every block the tracking allocator hands out starts with this header, so the
// data pointer alone leads back to its charge (libtorch's raw_allocate and
// raw_deallocate, used by oneDNN, pass nothing else). 64 bytes keep the data
// aligned as libtorch's CPU allocator aligns it.
constexpr size_t kHeaderBytes = 64;
struct Header {
  std::shared_ptr<MemoryCounter>* counter;  // null for an uncharged block
  int64_t bytes;
};
static_assert(sizeof(Header) <= kHeaderBytes, "the header must fit before the data");

c10::DeleterFnPtr base_delete = nullptr;  // the wrapped allocator's raw deleter

void release_block(void* data) {
  if (data == nullptr) return;
  char* block = static_cast<char*>(data) - kHeaderBytes;
  auto* header = reinterpret_cast<Header*>(block);
  if (header->counter != nullptr) {
    (*header->counter)->release(header->bytes);
    delete header->counter;  // the counter outlives its stage while a tensor of it lives
  }
  base_delete(block);
}

// libtorch 1.13 declares allocate() const, 2.x non-const with copy_data():
// this class provides both, so it builds against either (and so marks neither `override`).
#if defined(__clang__)
#pragma clang diagnostic push
#pragma clang diagnostic ignored "-Winconsistent-missing-override"
#endif
class TrackingAllocator final : public c10::Allocator {
 public:
  explicit TrackingAllocator(c10::Allocator* base) : base_(base) {}

  c10::DataPtr allocate(size_t n) const { return track(n); }
  c10::DataPtr allocate(size_t n) { return track(n); }
  c10::DeleterFnPtr raw_deleter() const override { return &release_block; }
  void copy_data(void* dest, const void* src, size_t count) const { std::memcpy(dest, src, count); }

 private:
  c10::DataPtr track(size_t n) const {
    const std::shared_ptr<MemoryCounter>& counter = current_counter;
    if (counter) counter->charge(static_cast<int64_t>(n));  // throws past the cap
    void* block = nullptr;
    try {
      block = base_->raw_allocate(n + kHeaderBytes);
    } catch (...) {
      if (counter) counter->release(static_cast<int64_t>(n));
      throw;
    }
    new (block) Header{counter ? new std::shared_ptr<MemoryCounter>(counter) : nullptr, static_cast<int64_t>(n)};
    void* data = static_cast<char*>(block) + kHeaderBytes;
    return c10::DataPtr(data, data, &release_block, c10::Device(c10::DeviceType::CPU));
  }

  c10::Allocator* base_;
};
#if defined(__clang__)
#pragma clang diagnostic pop
#endif

}  // namespace

void enable_memory_tracking() {
  static std::once_flag once;
  std::call_once(once, [] {
    c10::Allocator* base = c10::GetCPUAllocator();
    base_delete = base->raw_deleter();
    if (base_delete == nullptr)
      throw std::runtime_error("gpipe: cannot track memory: libtorch's CPU allocator has no raw deleter");
    static TrackingAllocator allocator(base);
    c10::SetCPUAllocator(&allocator, /*priority=*/100);
  });
}

MemoryScope::MemoryScope(std::shared_ptr<MemoryCounter> counter) : previous_(std::move(current_counter)) {
  current_counter = std::move(counter);
}

MemoryScope::~MemoryScope() { current_counter = std::move(previous_); }

}  // namespace gpipe
