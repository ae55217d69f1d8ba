// device.cc: stage devices, their worker threads, and the BLAS thread setting.
#include "gpipe/device.h"

#include "gpipe/check.h"

#include <torch/torch.h>

#include <c10/core/impl/VirtualGuardImpl.h>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include <algorithm>
#include <atomic>
#include <cstdlib>

namespace gpipe {

Device Device::cpu(int threads) {
  Device d;
  d.threads = threads;
  return d;
}

Device Device::cuda(int index) {
  Device d;
  d.device = torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(index));
  return d;
}

Device Device::with_memory_cap(int64_t bytes) const {
  Device d = *this;
  d.memory_cap_bytes = bytes;
  return d;
}

std::string Device::str() const {
  if (!is_cpu()) return device.str();
  return "cpu(" + std::to_string(threads) + (threads == 1 ? " thread)" : " threads)");
}

void check_device(const Device& device) {
  GPIPE_CHECK(device.threads >= 1, "a device needs at least 1 thread (got ", device.threads,
              " for ", device.device.str(), "); use Device::cpu(1) or more");
  GPIPE_CHECK(device.memory_cap_bytes >= 0, "a memory cap cannot be negative (got ", device.memory_cap_bytes,
              " bytes); use 0 for no cap");
  if (device.device.is_cuda()) {
    GPIPE_CHECK(torch::cuda::is_available(), "device ", device.device.str(),
                " asked for, but this libtorch has no CUDA or no GPU is visible; use CPU devices "
                "or build gpipe against a CUDA libtorch");
    const int64_t count = static_cast<int64_t>(torch::cuda::device_count());
    GPIPE_CHECK(device.device.index() < count, "device ", device.device.str(),
                " does not exist: ", count, " CUDA device(s) are visible");
  } else {
    GPIPE_CHECK(device.device.is_cpu(), "unsupported device type ", device.device.str(),
                "; gpipe runs stages on cpu or cuda");
  }
}

int machine_cores() { return static_cast<int>(std::max(1u, std::thread::hardware_concurrency())); }

void check_threads_per_device(int threads, const std::string& name) {
  const int cores = machine_cores();
  GPIPE_CHECK(threads <= cores, name, threads, " is more than this machine's ", cores, " cores; use 1 to ", cores,
              " (intra-op threads of each device)");
}

void bind_current_thread(const Device& device) {
  at::set_num_threads(device.is_cpu() ? device.threads : 1);
}

namespace {
std::atomic<bool> memory_kept{false};
}  // namespace

bool freed_memory_kept() { return memory_kept.load(); }

bool keep_freed_memory() {
#if defined(__GLIBC__)
  static const bool changed = [] {
    for (const char* name : {"MALLOC_ARENA_MAX", "MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_"})
      if (std::getenv(name) != nullptr) return false;
    // All three: setting one alone turns off glibc's dynamic thresholds and is slower than none.
    const bool done = mallopt(M_TRIM_THRESHOLD, 256 << 20) == 1 && mallopt(M_MMAP_THRESHOLD, 32 << 20) == 1 &&
                      mallopt(M_TOP_PAD, 64 << 20) == 1;
    memory_kept = done;
    return done;
  }();
  return changed;
#else
  return false;
#endif
}

void allow_tf32(bool allowed) {
  at::globalContext().setAllowTF32CuBLAS(allowed);
  at::globalContext().setAllowTF32CuDNN(allowed);
}

DeviceStream::DeviceStream(const torch::Device& device) {
  if (!device.is_cuda()) return;
  const c10::impl::VirtualGuardImpl impl(device.type());
  stream_ = impl.getStreamFromGlobalPool(device.has_index() ? device : impl.getDevice(), /*isHighPriority=*/false);
}

std::shared_ptr<c10::Event> DeviceStream::record() const {
  if (!stream_) return nullptr;
  auto event = std::make_shared<c10::Event>(stream_->device_type());
  event->record(*stream_);
  return event;
}

void DeviceStream::wait(const c10::Event& event) const {
  if (stream_ && event.was_marked_for_recording()) event.block(*stream_);
}

void DeviceStream::keep_alive(const torch::Tensor& tensor) const {
  if (!stream_ || !tensor.defined() || tensor.device() != stream_->device() || !tensor.has_storage()) return;
  const c10::impl::VirtualGuardImpl impl(stream_->device_type());
  impl.recordDataPtrOnStream(tensor.storage().data_ptr(), *stream_);
}

void DeviceStream::synchronize() const {
  if (!stream_) return;
  const c10::impl::VirtualGuardImpl impl(stream_->device_type());
  impl.synchronizeStream(*stream_);
}

std::shared_ptr<c10::Event> record_current_stream(const torch::Device& device) {
  if (!device.is_cuda()) return nullptr;
  const c10::impl::VirtualGuardImpl impl(device.type());
  // The device's index as the caller means it: cuda means the current device.
  const torch::Device at = device.has_index() ? device : impl.getDevice();
  auto event = std::make_shared<c10::Event>(device.type());
  event->record(impl.getStream(at));
  return event;
}

DeviceThread::DeviceThread(Device device)
    : device_(std::move(device)), thread_([this] { loop(); }) {}

DeviceThread::~DeviceThread() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_one();
  thread_.join();
}

void DeviceThread::post(std::function<void()> task) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    tasks_.push_back(std::move(task));
  }
  wake_.notify_one();
}

void DeviceThread::loop() {
  bind_current_thread(device_);
  for (;;) {
    std::function<void()> task;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      wake_.wait(lock, [this] { return stopping_ || !tasks_.empty(); });
      if (tasks_.empty()) return;  // stopping, nothing left
      task = std::move(tasks_.front());
      tasks_.pop_front();
    }
    task();
  }
}

}  // namespace gpipe
