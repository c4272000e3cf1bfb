#pragma once
// The CUDA caching allocator (compiled only by nvcc).
//
// Note [CUDA allocator]
// Device memory comes from CUDA's stream-ordered allocator (cudaMallocAsync/cudaFreeAsync)
// on the device's default memory pool, whose release threshold is raised so that freed
// memory stays in the pool: after the first training step no cudaMalloc/cudaFree happens.
// A block is allocated and freed on the stream that was current when it was allocated;
// record_stream() notes other streams that use it, and the free then waits for them (as
// PyTorch's recordStream does), so memory is never reused while another stream still reads
// it. CHORUS_CUDA_CACHING_ALLOCATOR=0 switches to plain cudaMalloc/cudaFree (synchronous),
// which is what compute-sanitizer should see. (Empty unless compiled by nvcc.)
#include <atomic>
#include "../config.hpp"
#if CHORUS_CUDA
#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <string_view>
#include <map>
#include <vector>

#include "allocator.hpp"
#include "block_table.hpp"
#include "cuda_runtime.hpp"

CHORUS_NAMESPACE_BEGIN

namespace detail {
inline std::atomic<bool>& poison_flag() {
  static std::atomic<bool> on{false};
  return on;
}
inline bool caching_allocator_enabled() {
  static const bool on = [] {
    const char* v = std::getenv("CHORUS_CUDA_CACHING_ALLOCATOR");
    return !(v && std::string_view(v) == "0");
  }();
  return on;
}
// The calling thread's current CUDA stream for a device, without depending on runtime.hpp
// (which includes this header): set by runtime.hpp.
using CurrentCudaStreamFn = cudaStream_t (*)(int device);
inline CurrentCudaStreamFn& current_cuda_stream_fn() {
  static CurrentCudaStreamFn fn = nullptr;
  return fn;
}
}  // namespace detail

class CudaCachingAllocator final : public Allocator {
 public:
  explicit CudaCachingAllocator(int device) : device_(device), caching_(detail::caching_allocator_enabled()) {
    if (caching_) {
      cuda::DeviceGuard g(device_);
      CHORUS_CUDA_CHECK(cudaDeviceGetDefaultMemPool(&pool_, device_));
      std::uint64_t keep = UINT64_MAX;  // never hand cached memory back to the driver
      CHORUS_CUDA_CHECK(cudaMemPoolSetAttribute(pool_, cudaMemPoolAttrReleaseThreshold, &keep));
    }
    enable_peer_access();
  }

  /// Devices that may read and write this device's memory directly (Note [peer access]).
  const std::vector<int>& peers() const { return peers_; }

  void* allocate(std::size_t nbytes) override {
    if (nbytes == 0) return nullptr;
    cuda::DeviceGuard g(device_);
    void* p = nullptr;
    cudaStream_t s = nullptr;
    if (caching_) {
      s = detail::current_cuda_stream_fn()(device_);
      // Asking the pool what it holds costs a driver call: only when it may have to grow.
      const bool may_grow =
          stats_.allocated.load(std::memory_order_relaxed) + static_cast<std::int64_t>(nbytes) > known_reserved_.load();
      const std::int64_t before = may_grow ? reserved() : 0;
      cudaError_t e = cudaMallocAsync(&p, nbytes, s);
      if (e == cudaErrorMemoryAllocation) {  // give the pool's unused memory back and retry once
        (void)cuda::tolerate(e);
        CHORUS_CUDA_CHECK(cudaDeviceSynchronize());
        CHORUS_CUDA_CHECK(cudaMemPoolTrimTo(pool_, 0));
        e = cudaMallocAsync(&p, nbytes, s);
      }
      CHORUS_CHECK(e == cudaSuccess, "CUDA out of memory on cuda:", device_, " allocating ", nbytes,
                   " bytes: ", cudaGetErrorString(e), " (", stats_.allocated.load(), " bytes in use)");
      if (may_grow) {
        const std::int64_t after = reserved();
        known_reserved_.store(after);
        if (after > before) stats_.num_system.fetch_add(1, std::memory_order_relaxed);
      }
    } else {
      cudaError_t e = cuda::tolerate(cudaMalloc(&p, nbytes));
      CHORUS_CHECK(e == cudaSuccess, "CUDA out of memory on cuda:", device_, " allocating ", nbytes,
                   " bytes: ", cudaGetErrorString(e));
      stats_.num_system.fetch_add(1, std::memory_order_relaxed);
      stats_.reserved.fetch_add(static_cast<std::int64_t>(nbytes), std::memory_order_relaxed);
    }
    {
      std::lock_guard<std::mutex> lk(m_);
      blocks_.add(reinterpret_cast<std::uintptr_t>(p), s, nbytes);
    }
    stats_.on_alloc(static_cast<std::int64_t>(nbytes));
    if (detail::poison_flag().load(std::memory_order_relaxed)) {  // all-ones bytes: NaN in every float type
      CHORUS_CUDA_CHECK(cudaMemsetAsync(p, 0xFF, nbytes, s ? s : detail::current_cuda_stream_fn()(device_)));
    }
    return p;
  }

  void deallocate(void* p, std::size_t nbytes) noexcept override {
    if (!p) return;
    Blocks::Block b;
    {
      std::lock_guard<std::mutex> lk(m_);
      if (auto taken = blocks_.take(reinterpret_cast<std::uintptr_t>(p))) b = std::move(*taken);
    }
    // Best effort (a destructor cannot throw), but every tolerated code is cleared
    // (Note [tolerated CUDA errors]).
    int prev = 0;
    (void)cuda::tolerate(cudaGetDevice(&prev));
    if (caching_) {
      // Wait for every other stream that used it, each recorded under its own device
      // (Note [cross-device stream uses]). If an event cannot be recorded the free waits for
      // the whole device instead of risking reuse under a reader.
      bool ordered = true;
      for (const auto& use : b.used_on) {
        try {
          cudaEvent_t ev = cuda::EventPool::get().acquire(use.device);
          (void)cuda::tolerate(cudaSetDevice(use.device));
          const cudaError_t rec = cuda::tolerate(cudaEventRecord(ev, use.stream));
          (void)cuda::tolerate(cudaSetDevice(device_));
          const cudaError_t wait = rec == cudaSuccess ? cuda::tolerate(cudaStreamWaitEvent(b.stream, ev, 0)) : rec;
          cuda::EventPool::get().release(use.device, ev);
          ordered = ordered && wait == cudaSuccess;
        } catch (...) {
          ordered = false;
        }
      }
      (void)cuda::tolerate(cudaSetDevice(device_));
      if (!ordered) {
        for (const auto& use : b.used_on) {
          (void)cuda::tolerate(cudaSetDevice(use.device));
          (void)cuda::tolerate(cudaStreamSynchronize(use.stream));
        }
        (void)cuda::tolerate(cudaSetDevice(device_));
      }
      (void)cuda::tolerate(cudaFreeAsync(p, b.stream));
    } else {
      (void)cuda::tolerate(cudaSetDevice(device_));
      (void)cuda::tolerate(cudaFree(p));
      stats_.reserved.fetch_sub(static_cast<std::int64_t>(nbytes), std::memory_order_relaxed);
    }
    (void)cuda::tolerate(cudaSetDevice(prev));
    stats_.on_free(static_cast<std::int64_t>(nbytes));
  }

  /// Notes that stream `s`, of device `stream_device`, uses the block holding address `p`
  /// (Note [CUDA allocator], Note [cross-device stream uses]).
  void record_stream(const void* p, cudaStream_t s, int stream_device) {
    if (!caching_ || !p) return;
    std::lock_guard<std::mutex> lk(m_);
    (void)blocks_.record(reinterpret_cast<std::uintptr_t>(p), s, stream_device);
  }

  MemoryStats stats() const override {
    auto s = stats_.snapshot();
    if (caching_) s.reserved = reserved();
    return s;
  }
  void reset_peak() override { stats_.reset_peak(); }
  void empty_cache() override {
    if (!caching_) return;
    cuda::DeviceGuard g(device_);
    CHORUS_CUDA_CHECK(cudaDeviceSynchronize());
    CHORUS_CUDA_CHECK(cudaMemPoolTrimTo(pool_, 0));
  }

 private:
  using Blocks = detail::BlockTable<cudaStream_t>;

  std::int64_t reserved() const {
    std::uint64_t r = 0;
    if (pool_) (void)cuda::tolerate(cudaMemPoolGetAttribute(pool_, cudaMemPoolAttrReservedMemCurrent, &r));
    return static_cast<std::int64_t>(r);
  }

  // Note [peer access]: copies between GPUs go through the copy engines directly only when peer
  // access is on, and memory from a stream-ordered pool is accessible to another device only
  // once the pool grants it (cudaDeviceEnablePeerAccess does not cover pools). Without either,
  // cudaMemcpyPeerAsync stages through the host and NCCL falls back to slower paths.
  void enable_peer_access() {
    int n = 0;
    if (cuda::tolerate(cudaGetDeviceCount(&n)) != cudaSuccess) return;
    cuda::DeviceGuard g(device_);
    for (int peer = 0; peer < n; ++peer) {
      if (peer == device_) continue;
      int can = 0;
      CHORUS_CUDA_CHECK(cudaDeviceCanAccessPeer(&can, device_, peer));
      if (can) {  // this device reads and writes the peer's memory
        const cudaError_t e = cuda::tolerate(cudaDeviceEnablePeerAccess(peer, 0));
        CHORUS_CHECK(e == cudaSuccess || e == cudaErrorPeerAccessAlreadyEnabled, "enabling peer access cuda:", device_,
                     " -> cuda:", peer, ": ", cudaGetErrorString(e));
      }
      int peer_can = 0;
      CHORUS_CUDA_CHECK(cudaDeviceCanAccessPeer(&peer_can, peer, device_));
      if (peer_can && pool_) {  // the peer reads and writes this device's pool
        cudaMemAccessDesc desc{};
        desc.location.type = cudaMemLocationTypeDevice;
        desc.location.id = peer;
        desc.flags = cudaMemAccessFlagsProtReadWrite;
        CHORUS_CUDA_CHECK(cudaMemPoolSetAccess(pool_, &desc, 1));
      }
      if (can || peer_can) peers_.push_back(peer);
    }
  }

  int device_;
  bool caching_;
  cudaMemPool_t pool_ = nullptr;
  std::mutex m_;
  Blocks blocks_;
  std::vector<int> peers_;
  detail::AtomicStats stats_;
  std::atomic<std::int64_t> known_reserved_{0};  // the pool's size when last asked
};

namespace cuda {
/// Tests: fill every new CUDA allocation with NaN bytes, so elements a kernel failed to
/// write show up in comparisons.
inline void set_poison_allocations(bool on) { ::chorus::detail::poison_flag() = on; }
}  // namespace cuda

CHORUS_NAMESPACE_END
#endif  // CHORUS_CUDA
