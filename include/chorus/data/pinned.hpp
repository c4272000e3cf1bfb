#pragma once
// Pinned batches for GPUs: a batch copied into page-locked host memory (core/pinned_allocator.hpp)
// moves to a device asynchronously, at full PCIe/NVLink bandwidth, without a staging copy. In
// a CPU-only build, or without a GPU, pinning is a no-op.
#include <cstring>

#include "../compiled.hpp"
#include "../core/pinned_allocator.hpp"
#include "dataset.hpp"

CHORUS_NAMESPACE_BEGIN
namespace data {

#if CHORUS_CUDA
using ::chorus::PinnedHostAllocator;  // lives in core/ (storage's copies know it)
using ::chorus::pinned_host_allocator;
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
/// Pins an Example's data and target each.
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

// The instances chorus::compiled holds (Note [compiled chorus] in compiled.hpp).
#define CHORUS_DATA_PINNED_INSTANCES(X, T)    \
  X(Tensor<T> data::pin<T>(const Tensor<T>&)) \
  X(Tensor<T> data::pin_batch<T>(Tensor<T>))
CHORUS_EXTERN_INSTANCES(CHORUS_DATA_PINNED_INSTANCES, CHORUS_ALL_DTYPES)
