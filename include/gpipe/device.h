// device.h: where a stage runs: a CPU core group (a thread with its own intra-op threads) or a CUDA device.
#pragma once

#include "gpipe/blas.h"

#include <torch/types.h>

#include <c10/core/Event.h>
#include <c10/core/Stream.h>

#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

namespace gpipe {

/// A device for one stage. On CPU, a "virtual device": the stage's own worker
/// thread plus `threads` intra-op threads (a core group). On CUDA, a GPU.
struct Device {
  torch::Device device{torch::kCPU};
  int threads = 1;  ///< intra-op (and BLAS) threads of the stage
  /// CPU memory the stage may hold, in bytes (0: no cap). An allocation past it
  /// fails with OutOfMemory, so a CPU run shows what fits on a device of that size.
  int64_t memory_cap_bytes = 0;

  /// A CPU core group of `threads` cores.
  static Device cpu(int threads = 1);
  /// CUDA device `index`; its device thread uses one CPU thread.
  static Device cuda(int index);
  /// This device with a memory cap of `bytes`.
  Device with_memory_cap(int64_t bytes) const;

  bool is_cpu() const { return device.is_cpu(); }
  /// "cpu(1 thread)", "cpu(2 threads)" or "cuda:0".
  std::string str() const;
};

/// Throws std::invalid_argument if `device` cannot be used here (a CUDA device
/// in a build or on a machine without it, or fewer than one thread).
void check_device(const Device& device);

/// Throws std::invalid_argument when `threads` intra-op threads per device are more than this
/// machine's cores: "<name><threads> is more than this machine's C cores; use 1 to C (intra-op
/// threads of each device)". `name` is the setting as the caller's user writes it:
/// "`threads_per_device` " (PipelineOptions, checked by make_plan), "--threads-per-stage ", "threads=".
void check_threads_per_device(int threads, const std::string& name = "`threads_per_device` ");

/// The cores of this machine (std::thread::hardware_concurrency, at least 1).
int machine_cores();

/// Makes the calling thread run with `device`'s intra-op thread count.
/// (With the OpenMP backend of ATen this is a per-thread setting.)
void bind_current_thread(const Device& device);

/// Keeps freed memory in the process for reuse instead of returning it to the
/// system at once. glibc gives each device thread its own arena, and by default
/// trims (or unmaps) an arena's free memory as soon as a step's activations and
/// gradients are freed, so the next step faults every page in again: measured
/// here, the default CNN ran at 1310 samples/s against 3100 with this setting.
/// It sets glibc's trim threshold to 256 MiB, its mmap threshold to 32 MiB and
/// its top pad to 64 MiB, once per process (Pipeline and mpi::MpiPipeline call
/// it). It leaves glibc alone when the environment sets any of MALLOC_ARENA_MAX,
/// MALLOC_TRIM_THRESHOLD_, MALLOC_MMAP_THRESHOLD_ or MALLOC_TOP_PAD_ (the user's
/// choice wins) and without glibc. Returns whether it changed the settings.
bool keep_freed_memory();

/// Whether keep_freed_memory() has changed glibc's settings in this process.
bool freed_memory_kept();

/// Where the work of a stage (or of a copy) is queued on its device: on a CUDA device, a stream
/// of its own from c10's pool, never the default stream, so that stages on one GPU run side by
/// side and a copy overlaps compute; on CPU, nothing (every call below does nothing). Written with
/// c10's device-generic Stream, Event and VirtualGuardImpl: the same code builds against a
/// libtorch without CUDA, and runs there on CPU devices.
///
/// Ordering across streams is by events, never by the host waiting (synchronize() aside, for
/// the end of a step): a producer records an event after its work (record), a consumer's stream
/// waits for it on the device (wait), and memory made on one stream and used on another is
/// marked as used there (keep_alive), so that the caching allocator does not hand it out again
/// while that stream's work is still queued (torch.Tensor.record_stream).
class DeviceStream {
 public:
  /// No stream: a CPU device.
  DeviceStream() = default;
  /// A stream from the pool of `device` when it is a CUDA device; none on CPU.
  explicit DeviceStream(const torch::Device& device);

  bool active() const { return stream_.has_value(); }
  /// The stream (check active() first).
  const c10::Stream& stream() const { return *stream_; }
  /// An event recorded on the stream now: complete once the work queued so far has run. Null
  /// without a stream.
  std::shared_ptr<c10::Event> record() const;
  /// Work queued on the stream from now on starts after `event`'s work (the host does not wait).
  void wait(const c10::Event& event) const;
  /// Marks the memory of `tensor` (made on another stream) as used by this stream's work queued
  /// so far; nothing for a tensor on another device or without storage.
  void keep_alive(const torch::Tensor& tensor) const;
  /// Blocks the calling thread until every work queued on the stream has run (the end of a step).
  void synchronize() const;

 private:
  std::optional<c10::Stream> stream_;
};

/// An event recorded on the calling thread's current stream of `device` (what it has queued
/// there so far), or null for a CPU device.
std::shared_ptr<c10::Event> record_current_stream(const torch::Device& device);

/// Whether float32 matrix products and convolutions on a GPU may use TF32 (10-bit mantissas on
/// Ampere and later: about 1e-3 relative error). libtorch allows it for cuDNN by default;
/// exactness checks against one device turn it off. Nothing changes on CPU.
void allow_tf32(bool allowed);

/// A persistent worker thread that runs posted tasks in order, bound to a Device.
///
/// Tasks must not throw (the pipeline catches inside them). The destructor
/// finishes the queued tasks, then joins the thread.
class DeviceThread {
 public:
  explicit DeviceThread(Device device);
  ~DeviceThread();
  DeviceThread(const DeviceThread&) = delete;
  DeviceThread& operator=(const DeviceThread&) = delete;

  void post(std::function<void()> task);
  const Device& device() const { return device_; }

 private:
  void loop();

  Device device_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<std::function<void()>> tasks_;
  bool stopping_ = false;
  std::thread thread_;  // last: starts after the members it uses exist
};

}  // namespace gpipe
