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
#include <cstddef>
#include <cstdint>
#include <new>

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

class StorageImpl;

/// The memory of one device: hands out and takes back raw blocks and counts them (MemoryStats).
class Allocator {
 public:
  virtual ~Allocator() = default;
  /// A block of `nbytes` bytes (null for 0); throws when out of memory.
  virtual void* allocate(std::size_t nbytes) = 0;
  /// Returns the block `p` of `nbytes` bytes (as passed to allocate()).
  virtual void deallocate(void* p, std::size_t nbytes) noexcept = 0;
  /// A snapshot of this device's memory statistics.
  virtual MemoryStats stats() const = 0;
  /// Restarts the high-water mark (MemoryStats::peak_allocated) at what is allocated now.
  virtual void reset_peak() = 0;
  /// Returns cached blocks to the system (no-op for non-caching allocators).
  virtual void empty_cache() {}
  /// For the allocator of a host alias (Note [host aliases]): the storage that owns the memory.
  const StorageImpl* alias_owner() const { return alias_owner_; }

 protected:
  const StorageImpl* alias_owner_ = nullptr;  ///< the owning storage, set by a host alias's allocator (else null)
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

/// Host memory for one virtual CPU device: 64-byte aligned, counted per device, optionally
/// capped (set_memory_limit).
class CpuAllocator final : public Allocator {
 public:
  static constexpr std::size_t kAlignment = 64;  ///< alignment of every block, in bytes

  /// The allocator of cpu:`index` (no limit).
  explicit CpuAllocator(int index = 0) : index_(index) {}

  /// A 64-byte aligned block of `nbytes` (null for 0); throws when it would pass the limit.
  void* allocate(std::size_t nbytes) override {
    if (nbytes == 0) return nullptr;
    if (const auto cap = limit_.load(std::memory_order_relaxed); cap > 0) {
      const auto now = stats_.allocated.load(std::memory_order_relaxed);
      CHORUS_CHECK(now + static_cast<std::int64_t>(nbytes) <= cap, "out of memory on cpu:", index_, ": allocating ",
                   nbytes, " bytes with ", now, " allocated of its ", cap, "-byte limit (set_memory_limit)");
    }
    void* p = ::operator new(round_up(nbytes), std::align_val_t(kAlignment), std::nothrow);
    CHORUS_CHECK(p != nullptr, "out of host memory allocating ", nbytes, " bytes");
    stats_.on_alloc(static_cast<std::int64_t>(nbytes));
    stats_.reserved.fetch_add(static_cast<std::int64_t>(nbytes), std::memory_order_relaxed);
    stats_.num_system.fetch_add(1, std::memory_order_relaxed);
    return p;
  }
  /// Frees the block `p` of `nbytes` bytes (nothing for null).
  void deallocate(void* p, std::size_t nbytes) noexcept override {
    if (!p) return;
    ::operator delete(p, std::align_val_t(kAlignment));
    stats_.on_free(static_cast<std::int64_t>(nbytes));
    stats_.reserved.fetch_sub(static_cast<std::int64_t>(nbytes), std::memory_order_relaxed);
  }
  /// A snapshot of this device's memory statistics (reserved equals allocated: nothing is cached).
  MemoryStats stats() const override { return stats_.snapshot(); }
  /// Restarts the high-water mark at what is allocated now.
  void reset_peak() override { stats_.reset_peak(); }
  /// The most live tensors may hold (0: no limit).
  void set_limit(std::int64_t bytes) { limit_.store(bytes, std::memory_order_relaxed); }
  /// The most live tensors may hold, in bytes (0: no limit).
  std::int64_t limit() const { return limit_.load(std::memory_order_relaxed); }

 private:
  static std::size_t round_up(std::size_t n) { return (n + kAlignment - 1) / kAlignment * kAlignment; }
  detail::AtomicStats stats_;
  std::atomic<std::int64_t> limit_{0};
  int index_;
};

CHORUS_NAMESPACE_END
