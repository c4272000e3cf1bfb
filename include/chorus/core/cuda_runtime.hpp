#pragma once
// The CUDA runtime API as chorus uses it: the status check macro. Empty in CPU-only builds.
#include "../error.hpp"
#include "device_assert.hpp"

#if CHORUS_CUDA
#include <cuda_runtime.h>

#include <array>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <new>
#include <string>
#include <string_view>
#include <vector>

/// Checks a cudaError_t; throws chorus::Error naming the call, the error and where.
#define CHORUS_CUDA_CHECK(expr)                                                               \
  do {                                                                                        \
    cudaError_t chorus_err_ = (expr);                                                         \
    if (chorus_err_ != cudaSuccess) [[unlikely]] {                                            \
      (void)cudaGetLastError();                                                               \
      ::chorus::detail::throw_error("CUDA error: ", cudaGetErrorName(chorus_err_), " (",       \
                                    cudaGetErrorString(chorus_err_), ") in ", #expr, " at ", \
                                    __FILE__, ":", __LINE__);                                 \
    }                                                                                         \
  } while (0)

CHORUS_NAMESPACE_BEGIN
namespace cuda {
/// Note [CHORUS_DEBUG_SYNC]: with CHORUS_DEBUG_SYNC=1 every launch is followed by a device
/// synchronisation and an error check, so a fault is reported at the launch that caused it.
inline bool debug_sync_enabled() {
  static const bool on = [] {
    const char* v = std::getenv("CHORUS_DEBUG_SYNC");
    return v && std::string_view(v) != "0" && std::string_view(v) != "";
  }();
  return on;
}

/// Checks the launch that was just made (and, in debug-sync mode, its execution).
inline void check_launch(const char* what) {
  cudaError_t e = cudaGetLastError();
  CHORUS_CHECK(e == cudaSuccess, "CUDA kernel launch failed (", what, "): ", cudaGetErrorString(e));
  if (debug_sync_enabled()) {
    e = cudaDeviceSynchronize();
    if (e != cudaSuccess) (void)cudaGetLastError();  // thrown below, not left for the next launch
    CHORUS_CHECK(e == cudaSuccess, "CUDA kernel failed (", what, ", CHORUS_DEBUG_SYNC): ",
                 cudaGetErrorString(e));
  }
}

/// Note [tolerated CUDA errors]: a call whose failure is tolerated (a query that answers
/// cudaErrorNotReady, a best-effort call in a destructor) still leaves its code in the thread's
/// last-error slot, and the next check_launch() would then blame an unrelated kernel for it.
/// Every tolerated code goes through tolerate(), which clears the slot.
inline cudaError_t tolerate(cudaError_t e) {
  if (e != cudaSuccess) (void)cudaGetLastError();
  return e;
}

/// Sets the current CUDA device for the calling thread for the guard's lifetime.
class DeviceGuard {
 public:
  explicit DeviceGuard(int index) {
    CHORUS_CUDA_CHECK(cudaGetDevice(&prev_));
    if (prev_ != index) CHORUS_CUDA_CHECK(cudaSetDevice(index));
  }
  ~DeviceGuard() {
    int cur = -1;
    if (tolerate(cudaGetDevice(&cur)) == cudaSuccess && cur != prev_) (void)tolerate(cudaSetDevice(prev_));
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int prev_ = 0;
};

namespace detail {
inline constexpr int kMaxEventPoolDevices = 64;
}

/// Events are reused instead of created per record (cudaEventCreate takes a driver lock):
/// released events go back to their device's free list. Lives for the whole process.
class EventPool {
 public:
  static EventPool& get() {
    static EventPool* p = new EventPool();
    return *p;
  }
  /// An event of `device` (timing disabled), made current on `device` where one is created.
  cudaEvent_t acquire(int device) {
    CHORUS_CHECK(device >= 0 && device < detail::kMaxEventPoolDevices, "EventPool: device ", device, " out of range");
    auto& slot = slots_[device];
    {
      std::lock_guard<std::mutex> lk(slot.m);
      if (!slot.free.empty()) {
        cudaEvent_t e = slot.free.back();
        slot.free.pop_back();
        return e;
      }
    }
    DeviceGuard g(device);
    cudaEvent_t e = nullptr;
    CHORUS_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    created_.fetch_add(1, std::memory_order_relaxed);
    return e;
  }
  void release(int device, cudaEvent_t e) noexcept {
    if (!e || device < 0 || device >= detail::kMaxEventPoolDevices) return;
    auto& slot = slots_[device];
    try {
      std::lock_guard<std::mutex> lk(slot.m);
      slot.free.push_back(e);
    } catch (...) {  // out of memory growing the free list: let the event go
      (void)tolerate(cudaEventDestroy(e));
    }
  }
  /// Events created so far (tests: a steady state creates none).
  std::int64_t created() const { return created_.load(std::memory_order_relaxed); }

 private:
  struct Slot {
    std::mutex m;
    std::vector<cudaEvent_t> free;
  };
  std::array<Slot, detail::kMaxEventPoolDevices> slots_;
  std::atomic<std::int64_t> created_{0};
};

namespace detail {
/// Per device: the guard word (device memory) and the record (mapped pinned host memory) of
/// Note [device-side validation]. Made on first use, kept for the process.
struct DeviceAssertState {
  std::mutex m;  // making the state; and every check that found a record (Note [re-arming device-side validation])
  std::array<std::atomic<int*>, kMaxEventPoolDevices> guards{};
  std::atomic<::chorus::detail::DeviceAssert*> records{nullptr};      // host address
  std::atomic<::chorus::detail::DeviceAssert*> dev_records{nullptr};  // the same memory, as devices see it
  std::atomic<std::uint64_t> devices{0};  // bit d: a kernel on cuda:d was given a sink
  static DeviceAssertState& get() {
    static DeviceAssertState* s = new DeviceAssertState();
    return *s;
  }
};
}  // namespace detail

/// What a kernel on `device` reports to (Note [device-side validation]).
inline ::chorus::detail::DeviceAssertSink device_assert_sink(int device) {
  CHORUS_CHECK(device >= 0 && device < detail::kMaxEventPoolDevices, "device_assert_sink: device ", device,
               " out of range");
  auto& st = detail::DeviceAssertState::get();
  int* guard = st.guards[device].load(std::memory_order_acquire);
  auto* records = st.records.load(std::memory_order_acquire);
  if (!guard || !records) {
    std::lock_guard<std::mutex> lk(st.m);
    if (!st.records.load()) {
      void* p = nullptr;
      CHORUS_CUDA_CHECK(cudaHostAlloc(&p, sizeof(::chorus::detail::DeviceAssert) * detail::kMaxEventPoolDevices,
                                      cudaHostAllocMapped | cudaHostAllocPortable));
      auto* r = static_cast<::chorus::detail::DeviceAssert*>(p);
      for (int i = 0; i < detail::kMaxEventPoolDevices; ++i) new (r + i)::chorus::detail::DeviceAssert{};
      void* dev = nullptr;  // portable + mapped: one device address for every device (UVA)
      CHORUS_CUDA_CHECK(cudaHostGetDevicePointer(&dev, p, 0));
      st.dev_records.store(static_cast<::chorus::detail::DeviceAssert*>(dev), std::memory_order_release);
      st.records.store(r, std::memory_order_release);
    }
    if (!st.guards[device].load()) {
      DeviceGuard g(device);
      void* p = nullptr;
      CHORUS_CUDA_CHECK(cudaMalloc(&p, sizeof(int)));
      CHORUS_CUDA_CHECK(cudaMemset(p, 0, sizeof(int)));
      CHORUS_CUDA_CHECK(cudaDeviceSynchronize());  // the zero lands before any stream uses it
      st.guards[device].store(static_cast<int*>(p), std::memory_order_release);
    }
    guard = st.guards[device].load();
  }
  const std::uint64_t bit = std::uint64_t{1} << device;
  if (!(st.devices.load(std::memory_order_relaxed) & bit)) st.devices.fetch_or(bit, std::memory_order_release);
  return {guard, st.dev_records.load(std::memory_order_acquire) + device};
}

/// Throws the errors that kernels on any device recorded since the last check, and re-arms
/// those devices. Called at every synchronisation (Note [device-side validation]): a record is
/// complete once its code is visible, whichever device's work the synchronisation covered, so
/// a replica's bad index on cuda:1 is reported by a loop that only calls loss.item() on cuda:0.
inline void check_device_asserts() {
  auto& st = detail::DeviceAssertState::get();
  const std::uint64_t devices = st.devices.load(std::memory_order_acquire);
  if (!devices) return;  // no kernel was ever given a sink: no cost
  auto* records = st.records.load(std::memory_order_acquire);
  if (!records) return;
  bool any = false;  // a glance without the lock first: the common case finds nothing
  for (int d = 0; d < detail::kMaxEventPoolDevices && !any; ++d)
    any = ((devices >> d) & 1u) && *static_cast<volatile int*>(&records[d].code) != ::chorus::detail::kAssertNone;
  if (!any) return;
  std::string failed_rearm;
  std::string msg;
  {
    std::lock_guard<std::mutex> lk(st.m);  // one check clears a record at a time
    msg = ::chorus::detail::take_device_asserts(records, devices, [&](int d) {
      // The guard's reset lands before this returns: a kernel launched later on any stream
      // (not ordered after the legacy stream's memset) must find it armed.
      int prev = 0;
      cudaError_t e = tolerate(cudaGetDevice(&prev));
      if (e == cudaSuccess) e = tolerate(cudaSetDevice(d));
      if (e == cudaSuccess) e = tolerate(cudaMemset(st.guards[d].load(std::memory_order_acquire), 0, sizeof(int)));
      if (e == cudaSuccess) e = tolerate(cudaDeviceSynchronize());
      (void)tolerate(cudaSetDevice(prev));
      if (e != cudaSuccess)
        failed_rearm += std::string(failed_rearm.empty() ? "" : ", ") + "cuda:" + std::to_string(d) + " (" +
                        cudaGetErrorString(e) + ")";
    });
  }
  if (msg.empty()) return;  // another check took them meanwhile
  if (!failed_rearm.empty()) msg += "; device-side validation could not be re-armed on " + failed_rearm;
  throw Error(msg);
}

/// The same check: every device is looked at, whichever one a synchronisation covered.
inline void check_device_asserts(int /*synchronised_device*/) { check_device_asserts(); }

}  // namespace cuda
CHORUS_NAMESPACE_END
#endif
