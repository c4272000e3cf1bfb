#pragma once
// Allocators: one per device, each with its own statistics.
//
// Note [virtual CPU devices]
// chorus can present the host as N devices cpu:0 … cpu:N-1 (CHORUS_CPU_DEVICES, or
// set_cpu_device_count()). Each has its own allocator (so allocations and statistics are
// per device), its own streams (worker threads) and real copies between them. They make the
// whole multi-device path run, and be tested, on a machine without a GPU, the way JAX's host
// platform device count does.
#include <atomic>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <mutex>
#include <new>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "device.hpp"

CHORUS_NAMESPACE_BEGIN

/// Per-device memory statistics, in bytes.
struct MemoryStats {
  std::int64_t allocated = 0;       ///< bytes in live tensors
  std::int64_t peak_allocated = 0;  ///< high-water mark of `allocated` since the last reset
  std::int64_t reserved = 0;        ///< bytes held from the system (>= allocated when caching)
  std::int64_t num_allocs = 0;      ///< allocations served
  std::int64_t num_system_allocs = 0;  ///< allocations that went to the system (malloc/cudaMalloc)
};

class Allocator {
 public:
  virtual ~Allocator() = default;
  virtual void* allocate(std::size_t nbytes) = 0;
  virtual void deallocate(void* p, std::size_t nbytes) noexcept = 0;
  virtual MemoryStats stats() const = 0;
  virtual void reset_peak() = 0;
  /// Returns cached blocks to the system (no-op for non-caching allocators).
  virtual void empty_cache() {}
};

namespace detail {
/// Lock-free running statistics shared by the allocators.
struct AtomicStats {
  std::atomic<std::int64_t> allocated{0}, peak{0}, reserved{0}, num_allocs{0}, num_system{0};

  void on_alloc(std::int64_t n) {
    auto now = allocated.fetch_add(n, std::memory_order_relaxed) + n;
    auto p = peak.load(std::memory_order_relaxed);
    while (now > p && !peak.compare_exchange_weak(p, now, std::memory_order_relaxed)) {
    }
    num_allocs.fetch_add(1, std::memory_order_relaxed);
  }
  void on_free(std::int64_t n) { allocated.fetch_sub(n, std::memory_order_relaxed); }
  MemoryStats snapshot() const {
    return {allocated.load(), peak.load(), reserved.load(), num_allocs.load(), num_system.load()};
  }
  void reset_peak() { peak.store(allocated.load()); }
};
}  // namespace detail

// Note [CPU block cache]
// Large host blocks (kCacheMinBytes and up: activations, gradients, reduction buffers) are
// kept when freed and handed out again for the next request of the same size class, as the
// CUDA allocator keeps device memory (Note [CUDA allocator]). Without it every training step
// returns its large temporaries to malloc, which unmaps them (or trims its heap) and faults
// them back in zeroed on the next step: about 1,000 page faults per step per device for a
// batch-256 MLP here, a few percent of the step. A size class rounds a request up to the next
// eighth of its power of two (at most 12.5 % slack); a block is reused only for its own class.
// Cached bytes are bounded per device (kMaxCachedBytes): a block freed beyond that goes back
// to the system. empty_cache(device) releases every cached block, and an allocation that
// fails releases them and retries. CHORUS_CPU_CACHING_ALLOCATOR=0 turns the cache off, and it
// is off under AddressSanitizer, which must see every free to find use-after-free.
// Small blocks go straight to the system allocator, whose own free lists serve them well.
namespace detail {
inline bool cpu_cache_enabled() {
#if defined(__SANITIZE_ADDRESS__)
  return false;
#else
#if defined(__has_feature)
#if __has_feature(address_sanitizer)
  return false;
#endif
#endif
  static const bool on = [] {
    const char* v = std::getenv("CHORUS_CPU_CACHING_ALLOCATOR");
    return !(v && std::string_view(v) == "0");
  }();
  return on;
#endif
}
}  // namespace detail

/// Host memory for one virtual CPU device: 64-byte aligned, counted per device, large blocks
/// cached (Note [CPU block cache]).
class CpuAllocator final : public Allocator {
 public:
  static constexpr std::size_t kAlignment = 64;
  static constexpr std::size_t kCacheMinBytes = std::size_t{256} << 10;
  static constexpr std::size_t kMaxCachedBytes = std::size_t{512} << 20;

  CpuAllocator() : caching_(detail::cpu_cache_enabled()) {}
  ~CpuAllocator() override { empty_cache(); }
  CpuAllocator(const CpuAllocator&) = delete;
  CpuAllocator& operator=(const CpuAllocator&) = delete;

  void* allocate(std::size_t nbytes) override {
    if (nbytes == 0) return nullptr;
    const std::size_t held = held_bytes(nbytes);
    void* p = nullptr;
    if (cached_class(held)) {
      std::lock_guard<std::mutex> lk(m_);
      auto it = free_.find(held);
      if (it != free_.end() && !it->second.empty()) {
        p = it->second.back();
        it->second.pop_back();
        cached_ -= held;
      }
    }
    if (!p) {
      p = ::operator new(held, std::align_val_t(kAlignment), std::nothrow);
      if (!p && caching_) {  // the cache may hold what the system lacks
        empty_cache();
        p = ::operator new(held, std::align_val_t(kAlignment), std::nothrow);
      }
      CHORUS_CHECK(p != nullptr, "out of host memory allocating ", nbytes, " bytes");
      stats_.reserved.fetch_add(static_cast<std::int64_t>(held), std::memory_order_relaxed);
      stats_.num_system.fetch_add(1, std::memory_order_relaxed);
    }
    stats_.on_alloc(static_cast<std::int64_t>(nbytes));
    return p;
  }
  void deallocate(void* p, std::size_t nbytes) noexcept override {
    if (!p) return;
    const std::size_t held = held_bytes(nbytes);
    stats_.on_free(static_cast<std::int64_t>(nbytes));
    if (cached_class(held)) {
      std::lock_guard<std::mutex> lk(m_);
      if (cached_ + held <= kMaxCachedBytes) {
        try {
          free_[held].push_back(p);
          cached_ += held;
          return;
        } catch (...) {  // no memory for the list entry: give the block back instead
        }
      }
    }
    release(p, held);
  }
  MemoryStats stats() const override { return stats_.snapshot(); }
  void reset_peak() override { stats_.reset_peak(); }
  /// Returns every cached block to the system.
  void empty_cache() override {
    std::unordered_map<std::size_t, std::vector<void*>> blocks;
    {
      std::lock_guard<std::mutex> lk(m_);
      blocks.swap(free_);
      cached_ = 0;
    }
    for (auto& [held, list] : blocks)
      for (void* p : list) release(p, held);
  }
  /// Bytes held in the cache (freed, not yet reused or released).
  std::size_t cached_bytes() const {
    std::lock_guard<std::mutex> lk(m_);
    return cached_;
  }

 private:
  /// The bytes a request of `n` holds: 64-byte multiples; large ones rounded up to their size
  /// class when caching (Note [CPU block cache]).
  std::size_t held_bytes(std::size_t n) const {
    n = (n + kAlignment - 1) / kAlignment * kAlignment;
    if (!caching_ || n < kCacheMinBytes) return n;
    const std::size_t step = std::bit_floor(n) / 8;  // an eighth of n's power of two
    return n > std::numeric_limits<std::size_t>::max() - step ? n : (n + step - 1) / step * step;
  }
  bool cached_class(std::size_t held) const { return caching_ && held >= kCacheMinBytes; }
  void release(void* p, std::size_t held) noexcept {
    ::operator delete(p, std::align_val_t(kAlignment));
    stats_.reserved.fetch_sub(static_cast<std::int64_t>(held), std::memory_order_relaxed);
  }

  const bool caching_;
  detail::AtomicStats stats_;
  mutable std::mutex m_;
  std::unordered_map<std::size_t, std::vector<void*>> free_;  // size class -> cached blocks
  std::size_t cached_ = 0;
};

CHORUS_NAMESPACE_END
