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

#include "../compiled.hpp"
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

  void set_cpu_device_count(int n);

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

  void check(Device d);

  Allocator& allocator(Device d) {
    if (d.is_cpu()) {
      // The fast path checks the current count too: a device beyond a reduced count keeps its
      // allocator, but must be refused like any other unavailable device.
      if (d.index >= 0 && d.index < kMaxCpuDevices && d.index < cpu_count_.load(std::memory_order_acquire)) {
        if (auto* a = cpu_alloc_[d.index].load(std::memory_order_acquire)) return *a;
      }
      return create_allocator(d);
    }
#if CHORUS_CUDA
    if (d.index >= 0 && d.index < kMaxCudaDevices) {
      if (auto* a = cuda_alloc_[d.index].load(std::memory_order_acquire)) return *a;
    }
#endif
    return create_allocator(d);
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
    return create_stream(d, slot);
  }

 private:
  Runtime() {
#if CHORUS_CUDA
    current_cuda_stream_fn() = [](int device) { return current_stream(Device::cuda(device)).handle(); };
#endif
  }

  static int count_from_env();

  // The slow paths of allocator() and stream(), out of line: check `d`, then create the
  // allocator or stream under the lock if no other thread has.
  Allocator& create_allocator(Device d);
  Stream& create_stream(Device d, int slot);

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
CHORUS_INLINE std::vector<Device> available_devices();

/// Throws chorus::Error when `d` does not exist in this process.
inline void check_device(Device d) { detail::Runtime::get().check(d); }

/// The allocator of device `d` (its statistics: memory_stats()).
inline Allocator& allocator_of(Device d) { return detail::Runtime::get().allocator(d); }

/// Memory statistics of device `d`.
inline MemoryStats memory_stats(Device d) { return allocator_of(d).stats(); }

/// Caps what live tensors may hold on virtual CPU device `d` at `bytes` (0 lifts the cap): an
/// allocation past it throws chorus::Error naming the device, as a GPU whose memory is full
/// does. A machine without GPUs thus tests what does not fit one device (activation
/// checkpointing, sharded training). Allocations racing on several threads may pass it together.
inline void set_memory_limit(Device d, std::int64_t bytes) {
  CHORUS_CHECK(d.is_cpu(), "set_memory_limit: ", d, " is not a virtual CPU device (a GPU's memory is its limit)");
  CHORUS_CHECK(bytes >= 0, "set_memory_limit: a limit of ", bytes, " bytes (0 lifts it)");
  static_cast<CpuAllocator&>(allocator_of(d)).set_limit(bytes);
}

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

#if !CHORUS_COMPILED
#include "runtime_impl.hpp"
#endif
