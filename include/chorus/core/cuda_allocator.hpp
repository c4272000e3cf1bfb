#pragma once
// The CUDA caching allocator (compiled only by nvcc).
//
// Note [CUDA allocator]
// Device memory comes from CUDA's stream-ordered allocator (cudaMallocAsync/cudaFreeAsync)
// on the device's default memory pool, whose release threshold is raised so that freed
// memory stays in the pool: after the first training step no cudaMalloc/cudaFree happens.
// A block is allocated and freed on the stream that was current when it was allocated;
// record_stream() notes other streams that use it, and the free then makes that stream wait
// for them (as PyTorch's recordStream does), so memory is never reused while another stream
// still reads it. Freed blocks stay in a host-side cache for their stream (Note [CUDA block
// cache] in block_table.hpp): the steady state makes no driver call per allocation. Memory
// allocated on stream A and first written on stream B needs B ordered after A (an event), or
// the allocation made under B (a StreamGuard): the block may be one whose last reader on A
// has not run yet. CHORUS_CUDA_CACHING_ALLOCATOR=0 switches to plain cudaMalloc/cudaFree (synchronous),
// which is what compute-sanitizer should see. (Empty unless compiled by nvcc.)
#include <atomic>
#include "../config.hpp"
#if CHORUS_CUDA
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <optional>
#include <string_view>
#include <utility>
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
  /// The most freed memory the host-side cache keeps per device (Note [CUDA block cache]).
  static constexpr std::size_t kMaxCachedBytes = std::size_t{1} << 30;

  explicit CudaCachingAllocator(int device) : device_(device), caching_(detail::caching_allocator_enabled()) {
    if (caching_) {
      cuda::DeviceGuard g(device_);
      CHORUS_CUDA_CHECK(cudaDeviceGetDefaultMemPool(&pool_, device_));
      std::uint64_t keep = UINT64_MAX;  // never hand cached memory back to the driver
      CHORUS_CUDA_CHECK(cudaMemPoolSetAttribute(pool_, cudaMemPoolAttrReleaseThreshold, &keep));
    }
  }

  /// Devices this one shares memory with directly, either way (Note [peer access]).
  std::vector<int> peers() const {
    std::lock_guard<std::mutex> lk(m_);
    return peers_;
  }

  /// Enables peer access between this device and `other`'s, each way the hardware allows (Note
  /// [peer access]): the runtime calls it when the process starts using a second device.
  void connect(CudaCachingAllocator& other) {
    open_to(other.device_);
    other.open_to(device_);
  }

  void* allocate(std::size_t nbytes) override {
    if (nbytes == 0) return nullptr;
    void* p = nullptr;
    cudaStream_t s = nullptr;
    if (caching_) {
      s = detail::current_cuda_stream_fn()(device_);
      const std::size_t size = Cache::round(nbytes);
      {  // the hot path: no driver call (Note [CUDA block cache])
        std::lock_guard<std::mutex> lk(m_);
        p = cache_.take(s, size);
        if (p) blocks_.add(reinterpret_cast<std::uintptr_t>(p), s, size);
      }
      if (!p) {
        p = allocate_from_pool(size, nbytes, s);
        misses_.fetch_add(1, std::memory_order_relaxed);
      }
    } else {
      cuda::DeviceGuard g(device_);
      cudaError_t e = cuda::tolerate(cudaMalloc(&p, nbytes));
      CHORUS_CHECK(e == cudaSuccess, "CUDA out of memory on cuda:", device_, " allocating ", nbytes,
                   " bytes: ", cudaGetErrorString(e));
      stats_.num_system.fetch_add(1, std::memory_order_relaxed);
      stats_.reserved.fetch_add(static_cast<std::int64_t>(nbytes), std::memory_order_relaxed);
      std::lock_guard<std::mutex> lk(m_);
      blocks_.add(reinterpret_cast<std::uintptr_t>(p), s, nbytes);
    }
    stats_.on_alloc(static_cast<std::int64_t>(nbytes));
    if (detail::poison_flag().load(std::memory_order_relaxed)) {  // all-ones bytes: NaN in every float type
      cuda::DeviceGuard g(device_);
      CHORUS_CUDA_CHECK(cudaMemsetAsync(p, 0xFF, nbytes, s ? s : detail::current_cuda_stream_fn()(device_)));
    }
    return p;
  }

  void deallocate(void* p, std::size_t nbytes) noexcept override {
    if (!p) return;
    std::optional<Blocks::Block> taken;
    {
      std::lock_guard<std::mutex> lk(m_);
      taken = blocks_.take(reinterpret_cast<std::uintptr_t>(p));
    }
    stats_.on_free(static_cast<std::int64_t>(nbytes));
    if (!caching_) {
      int prev = 0;
      (void)cuda::tolerate(cudaGetDevice(&prev));
      (void)cuda::tolerate(cudaSetDevice(device_));
      (void)cuda::tolerate(cudaFree(p));
      (void)cuda::tolerate(cudaSetDevice(prev));
      stats_.reserved.fetch_sub(static_cast<std::int64_t>(nbytes), std::memory_order_relaxed);
      return;
    }
    if (!taken) {  // not ours (cannot happen through StorageImpl): the pool takes it back
      int prev = 0;
      (void)cuda::tolerate(cudaGetDevice(&prev));
      (void)cuda::tolerate(cudaSetDevice(device_));
      (void)cuda::tolerate(cudaFreeAsync(p, nullptr));
      (void)cuda::tolerate(cudaSetDevice(prev));
      return;
    }
    // Best effort (a destructor cannot throw), but every tolerated code is cleared
    // (Note [tolerated CUDA errors]). Without other streams' uses: no driver call at all.
    if (!taken->used_on.empty()) order_after_uses(*taken);
    try {
      std::lock_guard<std::mutex> lk(m_);
      cache_.put(taken->stream, taken->size, p);
    } catch (...) {  // out of host memory growing the cache: the pool takes it back
      int prev = 0;
      (void)cuda::tolerate(cudaGetDevice(&prev));
      (void)cuda::tolerate(cudaSetDevice(device_));
      (void)cuda::tolerate(cudaFreeAsync(p, taken->stream));
      (void)cuda::tolerate(cudaSetDevice(prev));
    }
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
    release_cached();
    cuda::DeviceGuard g(device_);
    CHORUS_CUDA_CHECK(cudaDeviceSynchronize());
    CHORUS_CUDA_CHECK(cudaMemPoolTrimTo(pool_, 0));
  }

  /// Allocations the host-side cache could not serve (tests: the steady state has none).
  std::int64_t cache_misses() const { return misses_.load(std::memory_order_relaxed); }
  /// Freed bytes the host-side cache holds.
  std::size_t cached_bytes() const {
    std::lock_guard<std::mutex> lk(m_);
    return cache_.bytes();
  }

 private:
  using Blocks = detail::BlockTable<cudaStream_t>;
  using Cache = detail::BlockCache<cudaStream_t>;

  /// A new block from the driver's pool, on stream `s` (a cache miss).
  void* allocate_from_pool(std::size_t size, std::size_t nbytes, cudaStream_t s) {
    bool flush = false;
    {
      std::lock_guard<std::mutex> lk(m_);
      flush = cache_.bytes() > kMaxCachedBytes;
    }
    if (flush) release_cached(kMaxCachedBytes / 2);
    cuda::DeviceGuard g(device_);
    void* p = nullptr;
    // Asking the pool what it holds costs a driver call: only when it may have to grow.
    const bool may_grow =
        stats_.allocated.load(std::memory_order_relaxed) + static_cast<std::int64_t>(size) > known_reserved_.load();
    const std::int64_t before = may_grow ? reserved() : 0;
    cudaError_t e = cuda::tolerate(cudaMallocAsync(&p, size, s));
    if (e == cudaErrorMemoryAllocation) {  // give every cached and unused block back, and retry once
      release_cached();
      e = cuda::tolerate(cudaDeviceSynchronize());
      if (e == cudaSuccess) e = cuda::tolerate(cudaMemPoolTrimTo(pool_, 0));
      if (e == cudaSuccess) e = cuda::tolerate(cudaMallocAsync(&p, size, s));
    }
    // Every failure is cleared from the last-error slot before the throw (Note [tolerated CUDA
    // errors]): a caught out-of-memory must not be blamed on the next, unrelated kernel.
    CHORUS_CHECK(e == cudaSuccess, "CUDA out of memory on cuda:", device_, " allocating ", nbytes,
                 " bytes: ", cudaGetErrorString(e), " (", stats_.allocated.load(), " bytes in use)");
    if (may_grow) {
      const std::int64_t after = reserved();
      known_reserved_.store(after);
      if (after > before) stats_.num_system.fetch_add(1, std::memory_order_relaxed);
    }
    try {
      std::lock_guard<std::mutex> lk(m_);
      blocks_.add(reinterpret_cast<std::uintptr_t>(p), s, size);
    } catch (...) {
      (void)cuda::tolerate(cudaFreeAsync(p, s));
      throw;
    }
    return p;
  }

  /// Makes the block's own stream wait for every other stream that used it, each recorded
  /// under its own device (Note [cross-device stream uses]); a later allocation on that stream
  /// is then ordered after those uses. If an event cannot be recorded the free waits for the
  /// using streams on the host instead of risking reuse under a reader.
  void order_after_uses(const Blocks::Block& b) noexcept {
    int prev = 0;
    (void)cuda::tolerate(cudaGetDevice(&prev));
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
    if (!ordered) {
      for (const auto& use : b.used_on) {
        (void)cuda::tolerate(cudaSetDevice(use.device));
        (void)cuda::tolerate(cudaStreamSynchronize(use.stream));
      }
    }
    (void)cuda::tolerate(cudaSetDevice(prev));
  }

  /// Gives blocks of the host-side cache back to the driver's pool until at most `keep` bytes
  /// stay cached (0: all), each freed on the stream it was last freed on (stream order keeps the
  /// pool's reuse safe).
  void release_cached(std::size_t keep = 0) noexcept {
    std::vector<std::pair<cudaStream_t, void*>> all;
    try {
      std::lock_guard<std::mutex> lk(m_);
      cache_.drain([&](cudaStream_t s, std::size_t, void* p) { all.emplace_back(s, p); }, keep);
    } catch (...) {
      return;  // out of host memory listing them: keep them cached
    }
    int prev = 0;
    (void)cuda::tolerate(cudaGetDevice(&prev));
    (void)cuda::tolerate(cudaSetDevice(device_));
    for (auto& [s, p] : all) (void)cuda::tolerate(cudaFreeAsync(p, s));
    (void)cuda::tolerate(cudaSetDevice(prev));
  }

  std::int64_t reserved() const {
    std::uint64_t r = 0;
    if (pool_) (void)cuda::tolerate(cudaMemPoolGetAttribute(pool_, cudaMemPoolAttrReservedMemCurrent, &r));
    return static_cast<std::int64_t>(r);
  }

  // Note [peer access]: copies between GPUs go through the copy engines directly only when peer
  // access is on, and memory from a stream-ordered pool is accessible to another device only
  // once the pool grants it (cudaDeviceEnablePeerAccess does not cover pools). Without either,
  // cudaMemcpyPeerAsync stages through the host and NCCL falls back to slower paths. It is
  // enabled only between the devices the process uses (those with an allocator, connected as
  // each next one is made): enabling it creates the peer's context, and a DDP rank per GPU that
  // enabled it to every visible GPU would hold a context, hundreds of MiB, on all of them.
  void open_to(int peer) {
    cuda::DeviceGuard g(device_);
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
    std::lock_guard<std::mutex> lk(m_);
    if ((can || peer_can) && std::find(peers_.begin(), peers_.end(), peer) == peers_.end()) {
      peers_.push_back(peer);
      std::sort(peers_.begin(), peers_.end());
    }
  }

  int device_;
  bool caching_;
  cudaMemPool_t pool_ = nullptr;
  mutable std::mutex m_;  // per device: the live blocks and the cache
  Blocks blocks_;
  Cache cache_;
  std::vector<int> peers_;
  detail::AtomicStats stats_;
  std::atomic<std::int64_t> known_reserved_{0};  // the pool's size when last asked
  std::atomic<std::int64_t> misses_{0};
};

namespace cuda {
/// Tests: fill every new CUDA allocation with NaN bytes, so elements a kernel failed to
/// write show up in comparisons.
inline void set_poison_allocations(bool on) { ::chorus::detail::poison_flag() = on; }
}  // namespace cuda

CHORUS_NAMESPACE_END
#endif  // CHORUS_CUDA
