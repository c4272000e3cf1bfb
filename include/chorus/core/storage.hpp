#pragma once
// Storage: one allocation on one device, shared by the tensors that view it.
#include <cstddef>
#include <cstring>
#include <memory>

#include "runtime.hpp"

CHORUS_NAMESPACE_BEGIN

class StorageImpl {
 public:
  StorageImpl(Device device, std::size_t nbytes)
      : device_(device), nbytes_(nbytes), alloc_(&allocator_of(device)) {
    data_ = alloc_->allocate(nbytes);
  }
  /// Memory of `device` from another allocator (page-locked host memory for the DataLoader);
  /// the allocator must outlive the storage.
  StorageImpl(Device device, std::size_t nbytes, Allocator& alloc) : device_(device), nbytes_(nbytes), alloc_(&alloc) {
    data_ = alloc_->allocate(nbytes);
  }
  ~StorageImpl() { alloc_->deallocate(data_, nbytes_); }
  StorageImpl(const StorageImpl&) = delete;
  StorageImpl& operator=(const StorageImpl&) = delete;

  void* data() const { return data_; }
  std::size_t nbytes() const { return nbytes_; }
  Device device() const { return device_; }

 private:
  Device device_;
  std::size_t nbytes_;
  Allocator* alloc_;
  void* data_ = nullptr;
};

using Storage = std::shared_ptr<StorageImpl>;

inline Storage make_storage(Device device, std::size_t nbytes) {
  return std::make_shared<StorageImpl>(device, nbytes);
}
inline Storage make_storage(Device device, std::size_t nbytes, Allocator& alloc) {
  return std::make_shared<StorageImpl>(device, nbytes, alloc);
}

/// Copies `nbytes` between two allocations, on any pair of devices. CPU↔CPU is a memcpy (a real
/// copy between virtual devices); anything involving CUDA is ordered on the current stream of
/// the CUDA side (the destination when both are GPUs) and uses peer copies between GPUs.
inline void copy_bytes(void* dst, Device dst_dev, const void* src, Device src_dev, std::size_t nbytes) {
  if (nbytes == 0) return;
  if (dst_dev.is_cpu() && src_dev.is_cpu()) {
    std::memcpy(dst, src, nbytes);
    return;
  }
#if CHORUS_CUDA
  if (dst_dev.is_cuda() && src_dev.is_cuda()) {
    Stream& s = current_stream(dst_dev);
    cuda::DeviceGuard g(dst_dev.index);
    if (dst_dev != src_dev) {
      // The source was produced on the source device's current stream: order after it.
      Event ev;
      ev.record(current_stream(src_dev));
      ev.block(s);
    }
    record_stream(src, src_dev, s);
    record_stream(dst, dst_dev, s);
    if (dst_dev == src_dev) {
      CHORUS_CUDA_CHECK(cudaMemcpyAsync(dst, src, nbytes, cudaMemcpyDeviceToDevice, s.handle()));
    } else {
      CHORUS_CUDA_CHECK(cudaMemcpyPeerAsync(dst, dst_dev.index, src, src_dev.index, nbytes, s.handle()));
    }
    return;
  }
  if (dst_dev.is_cuda()) {  // host -> device: the host buffer is free to change on return
    Stream& s = current_stream(dst_dev);
    cuda::DeviceGuard g(dst_dev.index);
    record_stream(dst, dst_dev, s);
    CHORUS_CUDA_CHECK(cudaMemcpyAsync(dst, src, nbytes, cudaMemcpyHostToDevice, s.handle()));
    CHORUS_CUDA_CHECK(cudaStreamSynchronize(s.handle()));
    return;
  }
  {  // device -> host: the values are on the host on return
    Stream& s = current_stream(src_dev);
    cuda::DeviceGuard g(src_dev.index);
    record_stream(src, src_dev, s);
    CHORUS_CUDA_CHECK(cudaMemcpyAsync(dst, src, nbytes, cudaMemcpyDeviceToHost, s.handle()));
    CHORUS_CUDA_CHECK(cudaStreamSynchronize(s.handle()));
    return;
  }
#else
  check_device(dst_dev.is_cuda() ? dst_dev : src_dev);
#endif
}

CHORUS_NAMESPACE_END
