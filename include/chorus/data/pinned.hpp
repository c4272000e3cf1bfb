#pragma once
// Page-locked ("pinned") host memory for batches bound for GPUs: host-to-device copies from it
// run at full PCIe/NVLink bandwidth without a staging copy. In a CPU-only build, or without a
// GPU, pinning is a no-op.
#include <map>
#include <mutex>
#include <vector>

#include "dataset.hpp"

CHORUS_NAMESPACE_BEGIN
namespace data {

#if CHORUS_CUDA
/// cudaHostAlloc'd blocks, cached by size (pinning is slow: a batch's block is reused by a
/// later batch of the same size). Never returned to the system before exit.
class PinnedHostAllocator final : public Allocator {
 public:
  void* allocate(std::size_t nbytes) override {
    if (nbytes == 0) return nullptr;
    {
      std::lock_guard lk(m_);
      auto& free = free_[nbytes];
      if (!free.empty()) {
        void* p = free.back();
        free.pop_back();
        stats_.on_alloc(static_cast<std::int64_t>(nbytes));
        return p;
      }
    }
    void* p = nullptr;
    CHORUS_CUDA_CHECK(cudaHostAlloc(&p, nbytes, cudaHostAllocPortable));
    stats_.on_alloc(static_cast<std::int64_t>(nbytes));
    stats_.reserved.fetch_add(static_cast<std::int64_t>(nbytes));
    stats_.num_system.fetch_add(1);
    return p;
  }
  void deallocate(void* p, std::size_t nbytes) noexcept override {
    if (!p) return;
    std::lock_guard lk(m_);
    free_[nbytes].push_back(p);
    stats_.on_free(static_cast<std::int64_t>(nbytes));
  }
  MemoryStats stats() const override { return stats_.snapshot(); }
  void reset_peak() override { stats_.reset_peak(); }

 private:
  std::mutex m_;
  std::map<std::size_t, std::vector<void*>> free_;
  chorus::detail::AtomicStats stats_;
};

inline PinnedHostAllocator& pinned_host_allocator() {
  static auto* a = new PinnedHostAllocator();  // leaked on purpose: batches may outlive statics
  return *a;
}
#endif

/// Whether pin_memory has an effect in this build on this machine.
inline bool pinning_available() {
#if CHORUS_CUDA
  return cuda_device_count() > 0;
#else
  return false;
#endif
}

/// A copy of a host tensor in pinned memory (the tensor itself where pinning is unavailable).
template <class T>
Tensor<T> pin(const Tensor<T>& t) {
  if (!pinning_available() || !t.defined() || !t.device().is_cpu()) return t;
#if CHORUS_CUDA
  auto src = t.contiguous();
  auto impl = std::make_shared<TensorImpl<T>>();
  impl->storage = make_storage(src.device(), static_cast<std::size_t>(src.numel()) * sizeof(T), pinned_host_allocator());
  impl->shape = src.shape();
  impl->strides = contiguous_strides(src.shape());
  Tensor<T> out(std::move(impl));
  if (src.numel() > 0) std::memcpy(out.data(), src.data(), static_cast<std::size_t>(src.numel()) * sizeof(T));
  return out;
#else
  return t;
#endif
}

/// Pins a batch: a tensor or an Example of tensors.
template <class T>
Tensor<T> pin_batch(Tensor<T> t) {
  return pin(t);
}
template <class A, class B>
Example<A, B> pin_batch(Example<A, B> e) {
  return {pin_batch(std::move(e.data)), pin_batch(std::move(e.target))};
}
/// Batches of other types pass through unchanged.
template <class Other>
Other pin_batch(Other o) {
  return o;
}

}  // namespace data
CHORUS_NAMESPACE_END
