#pragma once
// The process-wide runtime: which devices exist, their allocators and their streams.
#include <array>
#include <atomic>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "allocator.hpp"
#include "stream.hpp"
#if CHORUS_CUDA
#include "cuda_allocator.hpp"
#endif

CHORUS_NAMESPACE_BEGIN

class Stream;
inline Stream& current_stream(Device d);

namespace detail {

class Runtime {
 public:
  static constexpr int kMaxCpuDevices = 256;

  // Never destroyed: tensors with static storage duration may outlive any static object,
  // and their storage must still find its allocator (see Note [virtual CPU devices]).
  static Runtime& get() {
    static Runtime* rt = new Runtime();
    return *rt;
  }

  int cpu_device_count() {
    int n = cpu_count_.load(std::memory_order_acquire);
    if (n > 0) return n;
    std::lock_guard<std::mutex> lk(m_);
    if (cpu_count_.load() == 0) cpu_count_.store(count_from_env());
    return cpu_count_.load();
  }

  void set_cpu_device_count(int n) {
    CHORUS_CHECK(n >= 1 && n <= kMaxCpuDevices, "set_cpu_device_count(", n,
                 "): the number of virtual CPU devices must be in [1, ", kMaxCpuDevices, "]");
    cpu_count_.store(n, std::memory_order_release);
  }

  int cuda_device_count() {
#if CHORUS_CUDA
    static const int n = [] {
      int c = 0;
      if (cudaGetDeviceCount(&c) != cudaSuccess) {
        (void)cudaGetLastError();
        return 0;
      }
      return c;
    }();
    return n;
#else
    return 0;
#endif
  }

  void check(Device d) {
    if (d.is_cpu()) {
      int n = cpu_device_count();
      CHORUS_CHECK(d.index >= 0 && d.index < n, d, " is not available: there ",
                   n == 1 ? "is 1 virtual CPU device" : "are " + std::to_string(n) + " virtual CPU devices",
                   " (set CHORUS_CPU_DEVICES or call chorus::set_cpu_device_count)");
    } else {
#if CHORUS_CUDA
      int n = cuda_device_count();
      CHORUS_CHECK(d.index >= 0 && d.index < n, d, " is not available: ", n, " CUDA device(s) visible");
#else
      CHORUS_FAIL(d, " is not available: this translation unit was compiled without CUDA "
                     "(compile it with nvcc to use the CUDA backend)");
#endif
    }
  }

  Allocator& allocator(Device d) {
    if (d.is_cpu()) {
      // The fast path checks the current count too: a device beyond a reduced count keeps its
      // allocator, but must be refused like any other unavailable device.
      if (d.index >= 0 && d.index < kMaxCpuDevices && d.index < cpu_count_.load(std::memory_order_acquire)) {
        if (auto* a = cpu_alloc_[d.index].load(std::memory_order_acquire)) return *a;
      }
      check(d);
      std::lock_guard<std::mutex> lk(m_);
      auto* a = cpu_alloc_[d.index].load();
      if (!a) {
        a = new CpuAllocator();  // lives as long as the runtime
        cpu_alloc_[d.index].store(a, std::memory_order_release);
      }
      return *a;
    }
#if CHORUS_CUDA
    if (d.index >= 0 && d.index < kMaxCudaDevices) {
      if (auto* a = cuda_alloc_[d.index].load(std::memory_order_acquire)) return *a;
    }
    check(d);
    CHORUS_CHECK(d.index < kMaxCudaDevices, d, ": chorus supports at most ", kMaxCudaDevices, " GPUs");
    std::lock_guard<std::mutex> lk(m_);
    auto* a = cuda_alloc_[d.index].load();
    if (!a) {
      a = new CudaCachingAllocator(d.index);  // lives as long as the runtime
      cuda_alloc_[d.index].store(a, std::memory_order_release);
    }
    return *a;
#else
    check(d);
    CHORUS_FAIL("unreachable");
#endif
  }

  /// The default stream of a CPU device whose worker is lent and idle right now, and is not
  /// the calling thread (Note [idle workers help]); nullptr when there is none.
  Stream* idle_cpu_stream() {
    const int n = cpu_count_.load(std::memory_order_acquire);
    for (int i = 0; i < n && i < kMaxCpuDevices; ++i) {
      Stream* s = cpu_default_[i].load(std::memory_order_acquire);
      if (s && !s->is_worker_thread() && s->idle_and_lent()) return s;
    }
    return nullptr;
  }

  Stream& stream(Device d, int slot) {
    CHORUS_CHECK(slot >= 0 && slot < kSlots, "stream slot ", slot, " out of range [0, ", kSlots, ")");
    if (d.is_cpu() && slot == 0 && d.index >= 0 && d.index < kMaxCpuDevices &&
        d.index < cpu_count_.load(std::memory_order_acquire)) {
      if (auto* s = cpu_default_[d.index].load(std::memory_order_acquire)) return *s;
    }
#if CHORUS_CUDA
    // Every kernel launch and allocation looks up its stream: lock-free once it exists (CUDA
    // devices never go away, so no count check is needed here).
    if (d.is_cuda() && d.index >= 0 && d.index < kMaxCudaDevices) {
      if (auto* s = cuda_streams_[d.index * kSlots + slot].load(std::memory_order_acquire)) return *s;
    }
#endif
    check(d);
    std::lock_guard<std::mutex> lk(m_);
    auto& p = streams_[{d, slot}];
    if (!p) {
      p = std::make_unique<Stream>(d, slot);
      if (d.is_cpu() && slot == 0) cpu_default_[d.index].store(p.get(), std::memory_order_release);
#if CHORUS_CUDA
      if (d.is_cuda() && d.index < kMaxCudaDevices)
        cuda_streams_[d.index * kSlots + slot].store(p.get(), std::memory_order_release);
#endif
    }
    return *p;
  }

 private:
  Runtime() {
#if CHORUS_CUDA
    current_cuda_stream_fn() = [](int device) { return current_stream(Device::cuda(device)).handle(); };
#endif
  }

  static int count_from_env() {
    const char* v = std::getenv("CHORUS_CPU_DEVICES");
    if (!v || !*v) return 1;
    char* end = nullptr;
    long n = std::strtol(v, &end, 10);
    CHORUS_CHECK(end && *end == '\0' && n >= 1 && n <= kMaxCpuDevices, "CHORUS_CPU_DEVICES='", v,
                 "' is not a device count in [1, ", kMaxCpuDevices, "]");
    return static_cast<int>(n);
  }

  static constexpr int kSlots = 64;
  std::mutex m_;
  std::atomic<int> cpu_count_{0};
  std::array<std::atomic<CpuAllocator*>, kMaxCpuDevices> cpu_alloc_{};
  std::array<std::atomic<Stream*>, kMaxCpuDevices> cpu_default_{};
  std::map<std::pair<Device, int>, std::unique_ptr<Stream>> streams_;
#if CHORUS_CUDA
  static constexpr int kMaxCudaDevices = 64;
  std::array<std::atomic<CudaCachingAllocator*>, kMaxCudaDevices> cuda_alloc_{};
  std::array<std::atomic<Stream*>, kMaxCudaDevices * kSlots> cuda_streams_{};
#endif
};

}  // namespace detail

/// Number of virtual CPU devices (CHORUS_CPU_DEVICES, default 1; see Note [virtual CPU devices]).
inline int cpu_device_count() { return detail::Runtime::get().cpu_device_count(); }

/// Sets the number of virtual CPU devices (1 … 256). Tensors on devices beyond the new count
/// stay valid; new work on them is refused.
inline void set_cpu_device_count(int n) { detail::Runtime::get().set_cpu_device_count(n); }

/// Number of visible CUDA devices (0 in a CPU-only build).
inline int cuda_device_count() { return detail::Runtime::get().cuda_device_count(); }

/// All GPUs when there are any, else the virtual CPU devices.
inline std::vector<Device> available_devices() {
  std::vector<Device> out;
  if (int n = cuda_device_count(); n > 0) {
    for (int i = 0; i < n; ++i) out.push_back(Device::cuda(i));
  } else {
    for (int i = 0, n2 = cpu_device_count(); i < n2; ++i) out.push_back(Device::cpu(i));
  }
  return out;
}

/// Throws chorus::Error when `d` does not exist in this process.
inline void check_device(Device d) { detail::Runtime::get().check(d); }

/// The allocator of device `d` (its statistics: memory_stats()).
inline Allocator& allocator_of(Device d) { return detail::Runtime::get().allocator(d); }

/// Memory statistics of device `d`.
inline MemoryStats memory_stats(Device d) { return allocator_of(d).stats(); }

/// Stream `slot` of device `d` (slot 0 is the device's default stream).
inline Stream& get_stream(Device d, int slot = 0) { return detail::Runtime::get().stream(d, slot); }

/// The calling thread's current stream for device `d` (see Note [streams]).
inline Stream& current_stream(Device d) {
  auto& ov = detail::current_stream_overrides();
  for (auto it = ov.rbegin(); it != ov.rend(); ++it)
    if ((*it)->device() == d) return **it;
  return get_stream(d, 0);
}

/// Notes that `stream` reads or writes the memory at `p` on device `d`, so that the memory is
/// not reused before that work finishes (Note [CUDA allocator]; a no-op for CPU devices).
inline void record_stream(const void* p, Device d, Stream& stream) {
#if CHORUS_CUDA
  if (d.is_cuda())
    static_cast<CudaCachingAllocator&>(allocator_of(d)).record_stream(p, stream.handle(), stream.device().index);
#else
  (void)p;
  (void)d;
  (void)stream;
#endif
}

/// Waits for all work on every stream of device `d`.
inline void synchronize(Device d) {
  get_stream(d, 0).synchronize();
#if CHORUS_CUDA
  if (d.is_cuda()) {
    cuda::DeviceGuard g(d.index);
    CHORUS_CUDA_CHECK(cudaDeviceSynchronize());
    cuda::check_device_asserts();  // Note [device-side validation]
  }
#endif
}

CHORUS_NAMESPACE_END
