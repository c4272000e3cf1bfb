#pragma once
// Page-locked ("pinned") host memory for data bound for GPUs (the DataLoader's pin_memory):
// host-to-device copies from it run asynchronously at full bandwidth, without a staging copy
// (Note [async host-to-device copies] in storage.hpp). Compiled only by nvcc.
#include "../config.hpp"
#if CHORUS_CUDA
#include <cstddef>
#include <cstdint>
#include <mutex>

#include "allocator.hpp"
#include "block_table.hpp"
#include "cuda_runtime.hpp"

CHORUS_NAMESPACE_BEGIN

/// cudaHostAlloc'd blocks, cached by size (pinning is slow: a batch's block is reused by a
/// later batch of the same size). A block that a device copy read is reused only once that
/// copy has finished (Note [deferred host frees] in block_table.hpp). Never returned to the
/// system before exit.
class PinnedHostAllocator final : public Allocator {
 public:
  void* allocate(std::size_t nbytes) override {
    if (nbytes == 0) return nullptr;
    {
      std::lock_guard<std::mutex> lk(m_);
      if (void* p = blocks_.take(nbytes, done, release)) {
        stats_.on_alloc(static_cast<std::int64_t>(nbytes));
        return p;
      }
    }
    void* p = nullptr;
    CHORUS_CUDA_CHECK(cudaHostAlloc(&p, nbytes, cudaHostAllocPortable));
    try {
      std::lock_guard<std::mutex> lk(m_);
      blocks_.add(p, nbytes);
    } catch (...) {
      (void)cuda::tolerate(cudaFreeHost(p));
      throw;
    }
    stats_.on_alloc(static_cast<std::int64_t>(nbytes));
    stats_.reserved.fetch_add(static_cast<std::int64_t>(nbytes));
    stats_.num_system.fetch_add(1);
    return p;
  }

  void deallocate(void* p, std::size_t nbytes) noexcept override {
    if (!p) return;
    {
      std::lock_guard<std::mutex> lk(m_);
      (void)blocks_.free(p);  // waits for its copies, if any, before it is reused
    }
    stats_.on_free(static_cast<std::int64_t>(nbytes));
  }

  /// Notes that work just enqueued on `stream` (of `device`, the current device) reads the block
  /// holding `p`: the block is not reused before that work is done. Returns false when `p` is
  /// not memory of this allocator (pageable memory: the caller must wait for the copy itself).
  bool record_use(const void* p, cudaStream_t stream, int device) {
    {
      std::lock_guard<std::mutex> lk(m_);
      if (!blocks_.contains(p)) return false;
    }
    cudaEvent_t e = cuda::EventPool::get().acquire(device);
    // Recorded under the lock: the events of one stream enter the block in the order they were
    // recorded, so the one that supersedes the others is the latest (Note [deferred host frees]).
    std::lock_guard<std::mutex> lk(m_);
    const cudaError_t rec = cuda::tolerate(cudaEventRecord(e, stream));
    if (rec != cudaSuccess) {
      cuda::EventPool::get().release(device, e);
      CHORUS_FAIL("recording the use of pinned memory on cuda:", device, ": ", cudaGetErrorString(rec));
    }
    // The caller holds the block: still live. An earlier use on this stream ends before this
    // one does: its event goes back to the pool.
    (void)blocks_.record(p, Use{device, e, stream}, same_stream, release);
    return true;
  }

  /// Freed blocks still waiting for a copy (tests).
  std::size_t pending() const {
    std::lock_guard<std::mutex> lk(m_);
    return blocks_.pending();
  }

  MemoryStats stats() const override { return stats_.snapshot(); }
  void reset_peak() override { stats_.reset_peak(); }

 private:
  struct Use {
    int device = 0;
    cudaEvent_t event = nullptr;
    cudaStream_t stream = nullptr;  // the event was recorded here
  };
  static bool same_stream(const Use& later, const Use& earlier) {
    return later.stream == earlier.stream && later.device == earlier.device;
  }
  // cudaErrorNotReady (and any failure, on a broken device) leaves the block waiting.
  static bool done(const Use& u) { return cuda::tolerate(cudaEventQuery(u.event)) == cudaSuccess; }
  static void release(const Use& u) { cuda::EventPool::get().release(u.device, u.event); }

  mutable std::mutex m_;
  detail::HostBlockPool<Use> blocks_;
  detail::AtomicStats stats_;
};

/// The process's pinned host allocator.
inline PinnedHostAllocator& pinned_host_allocator() {
  static auto* a = new PinnedHostAllocator();  // leaked on purpose: batches may outlive statics
  return *a;
}

CHORUS_NAMESPACE_END
#endif  // CHORUS_CUDA
