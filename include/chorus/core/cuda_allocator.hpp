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
  }

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
        (void)cudaGetLastError();
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
      cudaError_t e = cudaMalloc(&p, nbytes);
      CHORUS_CHECK(e == cudaSuccess, "CUDA out of memory on cuda:", device_, " allocating ", nbytes,
                   " bytes: ", cudaGetErrorString(e));
      stats_.num_system.fetch_add(1, std::memory_order_relaxed);
      stats_.reserved.fetch_add(static_cast<std::int64_t>(nbytes), std::memory_order_relaxed);
    }
    {
      std::lock_guard<std::mutex> lk(m_);
      blocks_[reinterpret_cast<std::uintptr_t>(p)] = Block{s, nbytes, {}};
    }
    stats_.on_alloc(static_cast<std::int64_t>(nbytes));
    if (detail::poison_flag().load(std::memory_order_relaxed)) {  // all-ones bytes: NaN in every float type
      CHORUS_CUDA_CHECK(cudaMemsetAsync(p, 0xFF, nbytes, s ? s : detail::current_cuda_stream_fn()(device_)));
    }
    return p;
  }

  void deallocate(void* p, std::size_t nbytes) noexcept override {
    if (!p) return;
    Block b;
    {
      std::lock_guard<std::mutex> lk(m_);
      auto it = blocks_.find(reinterpret_cast<std::uintptr_t>(p));
      if (it != blocks_.end()) {
        b = std::move(it->second);
        blocks_.erase(it);
      }
    }
    int prev = 0;
    (void)cudaGetDevice(&prev);
    (void)cudaSetDevice(device_);
    if (caching_) {
      for (cudaStream_t other : b.used_on) {  // wait for every other stream that used it
        cudaEvent_t ev;
        if (cudaEventCreateWithFlags(&ev, cudaEventDisableTiming) == cudaSuccess) {
          (void)cudaEventRecord(ev, other);
          (void)cudaStreamWaitEvent(b.stream, ev, 0);
          (void)cudaEventDestroy(ev);
        }
      }
      (void)cudaFreeAsync(p, b.stream);
    } else {
      (void)cudaFree(p);
      stats_.reserved.fetch_sub(static_cast<std::int64_t>(nbytes), std::memory_order_relaxed);
    }
    (void)cudaSetDevice(prev);
    stats_.on_free(static_cast<std::int64_t>(nbytes));
  }

  /// Notes that stream `s` uses the block holding address `p` (Note [CUDA allocator]).
  void record_stream(const void* p, cudaStream_t s) {
    if (!caching_ || !p) return;
    const auto addr = reinterpret_cast<std::uintptr_t>(p);
    std::lock_guard<std::mutex> lk(m_);
    auto it = blocks_.upper_bound(addr);
    if (it == blocks_.begin()) return;
    --it;
    if (addr >= it->first + it->second.size || it->second.stream == s) return;
    for (auto x : it->second.used_on)
      if (x == s) return;
    it->second.used_on.push_back(s);
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
  struct Block {
    cudaStream_t stream = nullptr;  // allocated (and freed) on this stream
    std::size_t size = 0;
    std::vector<cudaStream_t> used_on;  // other streams that used it
  };
  std::int64_t reserved() const {
    std::uint64_t r = 0;
    if (pool_) (void)cudaMemPoolGetAttribute(pool_, cudaMemPoolAttrReservedMemCurrent, &r);
    return static_cast<std::int64_t>(r);
  }

  int device_;
  bool caching_;
  cudaMemPool_t pool_ = nullptr;
  std::mutex m_;
  std::map<std::uintptr_t, Block> blocks_;  // by start address
  detail::AtomicStats stats_;
  std::atomic<std::int64_t> known_reserved_{0};  // the pool's size when last asked
};

namespace cuda {
/// Tests: fill every new CUDA allocation with NaN bytes, so elements a kernel failed to
/// write show up in comparisons.
inline void set_poison_allocations(bool on) { detail::poison_flag() = on; }
}  // namespace cuda

CHORUS_NAMESPACE_END
#endif  // CHORUS_CUDA
