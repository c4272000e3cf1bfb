#pragma once
// Storage: one allocation on one device, shared by the tensors that view it.
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>

#include "runtime.hpp"
#if CHORUS_CUDA
#include "pinned_allocator.hpp"
#endif

CHORUS_NAMESPACE_BEGIN

namespace detail {
class BorrowedMemory;
class HostAlias;
}

/// One allocation on one device (or a view of another storage's memory), shared by the tensors
/// that view it, with the version counter of its data.
class StorageImpl {
 public:
  /// `nbytes` of fresh memory from `device`'s allocator.
  StorageImpl(Device device, std::size_t nbytes)
      : device_(device), nbytes_(nbytes), alloc_(&allocator_of(device)) {
    data_ = alloc_->allocate(nbytes);
  }
  /// Memory of `device` from another allocator (page-locked host memory for the DataLoader);
  /// the allocator must outlive the storage.
  StorageImpl(Device device, std::size_t nbytes, Allocator& alloc) : device_(device), nbytes_(nbytes), alloc_(&alloc) {
    data_ = alloc_->allocate(nbytes);
  }
  /// An alias (Note [host aliases]): `nbytes` of `base`'s memory from byte `offset`, as memory
  /// of CPU device `device`. It shares base's version counter and keeps base alive.
  StorageImpl(Device device, const std::shared_ptr<StorageImpl>& base, std::size_t offset, std::size_t nbytes);
  /// Tag that selects the slice constructors.
  struct slice_t {};
  /// A slice (Note [storage slices]): `nbytes` of `block`'s memory from byte `offset`, on
  /// block's device (any kind), with a version counter of its own; it keeps block alive.
  StorageImpl(slice_t, const std::shared_ptr<StorageImpl>& block, std::size_t offset, std::size_t nbytes);
  /// A slice of `nbytes` on `device` that views no memory until reseat_slice moves it onto a block.
  StorageImpl(slice_t, Device device, std::size_t nbytes);
  ~StorageImpl() { alloc_->deallocate(data_, nbytes_); }
  StorageImpl(const StorageImpl&) = delete;
  StorageImpl& operator=(const StorageImpl&) = delete;

  /// The first byte of the memory (null for 0 bytes, or a slice seated on no block).
  void* data() const { return data_; }
  /// The size of the memory, in bytes.
  std::size_t nbytes() const { return nbytes_; }
  /// The device the memory belongs to (for a host alias, the device it is lent to).
  Device device() const { return device_; }

  /// The version counter of the data (Note [version counter]): bumped by every in-place write
  /// through the public API, compared by backward against the version a node saved.
  std::uint64_t version() const { return counter().load(std::memory_order_relaxed); }
  /// Increments the version counter (an in-place write).
  void bump_version() { counter().fetch_add(1, std::memory_order_relaxed); }
  /// True for an alias of another storage's memory (Note [host aliases]).
  bool is_alias() const { return alloc_->alias_owner() != nullptr; }
  /// The storage whose memory this one borrows (a host alias's owner, a slice's block), or
  /// null for a storage that owns its memory.
  const std::shared_ptr<StorageImpl>* memory_owner() const;
  /// Moves a slice (Note [storage slices]) onto `nbytes()` bytes of `block` from byte `offset`,
  /// or, with a null block, onto no memory until the next move: the tensors that view the slice
  /// follow (Note [unsharded parameter memory] in parallel/shard_unit.hpp). Its version counter
  /// is unchanged.
  inline void reseat_slice(const std::shared_ptr<StorageImpl>& block, std::size_t offset);

 private:
  // The layout is kept to these five words: adding members here moved the heap layout of
  // small tensors enough to slow a single-device ResNet-20 step by 8 % (an alias keeps what
  // it needs in its allocator object instead: detail::HostAlias).
  Device device_;
  std::atomic<std::uint64_t> version_{0};
  std::size_t nbytes_;
  Allocator* alloc_;
  void* data_ = nullptr;
  std::atomic<std::uint64_t>& counter() {
    auto* owner = alloc_->alias_owner();
    return owner ? const_cast<StorageImpl*>(owner)->version_ : version_;
  }
  const std::atomic<std::uint64_t>& counter() const {
    auto* owner = alloc_->alias_owner();
    return owner ? owner->version_ : version_;
  }
  friend class detail::HostAlias;
};

namespace detail {
/// The "allocator" of a storage over another storage's memory (a host alias, a slice): it
/// allocates nothing, keeps the owning storage alive, and is deleted with the storage.
class BorrowedMemory : public Allocator {
 public:
  explicit BorrowedMemory(std::shared_ptr<StorageImpl> owner) : owner_(std::move(owner)) {}
  void* allocate(std::size_t) override { CHORUS_FAIL("a storage over another storage's memory allocates nothing"); }
  void deallocate(void*, std::size_t) noexcept override { delete this; }
  MemoryStats stats() const override { return {}; }
  void reset_peak() override {}
  const std::shared_ptr<StorageImpl>& owner() const { return owner_; }
  void set_owner(std::shared_ptr<StorageImpl> owner) { owner_ = std::move(owner); }

 protected:
  std::shared_ptr<StorageImpl> owner_;
};

/// A host alias (Note [host aliases]): shares the owner's version counter.
class HostAlias final : public BorrowedMemory {
 public:
  explicit HostAlias(std::shared_ptr<StorageImpl> owner) : BorrowedMemory(std::move(owner)) {
    alias_owner_ = owner_.get();
  }
};

/// A slice (Note [storage slices]): counts its own versions.
class StorageSlice final : public BorrowedMemory {
 public:
  using BorrowedMemory::BorrowedMemory;
};
}  // namespace detail

inline const std::shared_ptr<StorageImpl>* StorageImpl::memory_owner() const {
  const auto* borrowed = dynamic_cast<const detail::BorrowedMemory*>(alloc_);
  return borrowed ? &borrowed->owner() : nullptr;
}

inline void StorageImpl::reseat_slice(const std::shared_ptr<StorageImpl>& block, std::size_t offset) {
  auto* slice = dynamic_cast<detail::StorageSlice*>(alloc_);
  CHORUS_CHECK(slice != nullptr, "reseat_slice: the storage is not a slice of a block");
  if (!block) {
    slice->set_owner(nullptr);
    data_ = nullptr;
    return;
  }
  CHORUS_CHECK(block->device() == device_ && offset <= block->nbytes() && nbytes_ <= block->nbytes() - offset,
               "reseat_slice: bytes [", offset, ", ", offset, " + ", nbytes_, ") of a ", block->nbytes(),
               "-byte block on ", block->device(), " for a slice on ", device_);
  data_ = static_cast<char*>(block->data_) + offset;
  slice->set_owner(block);
}

inline StorageImpl::StorageImpl(slice_t, Device device, std::size_t nbytes)
    : device_(device), nbytes_(nbytes), alloc_(new detail::StorageSlice(nullptr)) {}

inline StorageImpl::StorageImpl(Device device, const std::shared_ptr<StorageImpl>& base, std::size_t offset,
                                std::size_t nbytes)
    : device_(device), nbytes_(nbytes) {
  CHORUS_CHECK(base != nullptr, "storage alias of a null storage");
  CHORUS_CHECK(device_.is_cpu() && base->device().is_cpu(), "a storage alias joins two CPU devices (",
               base->device(), " -> ", device_, "): other devices do not share memory");
  CHORUS_CHECK(offset <= base->nbytes() && nbytes <= base->nbytes() - offset, "storage alias of bytes [", offset,
               ", ", offset, " + ", nbytes, ") of a ", base->nbytes(), "-byte storage");
  data_ = base->data_ ? static_cast<char*>(base->data_) + offset : nullptr;
  // An alias of an alias aliases the owner; an alias of a slice shares the slice's counter.
  const auto& owner = base->is_alias() ? static_cast<detail::HostAlias*>(base->alloc_)->owner() : base;
  alloc_ = new detail::HostAlias(owner);
}

inline StorageImpl::StorageImpl(slice_t, const std::shared_ptr<StorageImpl>& block, std::size_t offset,
                                std::size_t nbytes)
    : device_(block ? block->device() : Device{}), nbytes_(nbytes) {
  CHORUS_CHECK(block != nullptr, "storage slice of a null storage");
  CHORUS_CHECK(offset <= block->nbytes() && nbytes <= block->nbytes() - offset, "storage slice of bytes [", offset,
               ", ", offset, " + ", nbytes, ") of a ", block->nbytes(), "-byte storage");
  data_ = block->data_ ? static_cast<char*>(block->data_) + offset : nullptr;
  alloc_ = new detail::StorageSlice(block);
}

// Note [host aliases]
// Virtual CPU devices (Note [virtual CPU devices]) are one memory. Moving data between them
// is a real copy in general (so each device's allocator and statistics stay its own), but
// where the data will not be written on the other side, an alias serves without copying: a
// storage of device B over bytes of a storage of device A. It shares A's version counter (an
// in-place write through either side is seen by backward on both) and keeps A's memory alive.
// DataParallel uses it on CPU devices for the replicas' parameters (read-only in forward and
// backward, Note [flat replication]) and for handing a replica's gradient to the primary
// (Note [gradient buckets]): a step then copies no parameter and no gradient between devices.
// The memory stays counted by the allocator that gave it (a primary gradient handed over by
// replica 1 shows in memory_stats(cpu:1)). Aliases never join a CUDA device.

// Note [version counter]
// As in PyTorch, a tensor saved for backward must not change before backward reads it: an
// in-place write in between (`y = (w * x).sum(); x.fill_(0); y.backward()`) would otherwise
// give a silently wrong gradient. The counter lives on the storage, so every view of the data
// (narrow, reshape, detach, ...) shares it, as PyTorch's views share their base's counter.
// In-place writes through the API (fill_, zero_, copy_, optimizer steps, checkpoint loads)
// bump it; a node records the versions of what it saved (Node::save_version) and the engine
// compares them before running the node, failing with PyTorch's wording.

// Note [storage slices]
// A slice is a storage over bytes of another storage (its block) on the same device, of any
// kind, with a version counter of its own. DataParallel keeps a module's parameters and
// buffers in flat blocks (Note [flat replication]) but gives each tensor a slice: with one
// counter per block, an in-place write to one parameter (or a buffer written in forward, as
// BatchNorm's running statistics are) marked every tensor that backward saved from the
// block as modified. A host alias of a slice shares that slice's counter, so a replica's
// view of a parameter and the parameter itself still agree. Writes through the block itself
// (the broadcast that refreshes a replica) bump no slice's counter: they are not writes
// through the API that a saved tensor could observe.
/// A shared handle to a StorageImpl; the tensors that view the same memory share one.
using Storage = std::shared_ptr<StorageImpl>;

/// True when nothing but `s` sees its memory: `s` is held once and, for a storage over
/// another's memory (a host alias, a slice), every owner up the chain is held only by the
/// storage that borrows from it.
inline bool storage_unshared(const Storage& s) {
  if (!s || s.use_count() != 1) return false;
  for (const auto* owner = s->memory_owner(); owner; owner = (*owner)->memory_owner())
    if (owner->use_count() != 1) return false;
  return true;
}

/// The device whose allocator holds `s`'s bytes, through host aliases and slices (an alias's
/// own device is the one it lends them to).
inline Device memory_device(const Storage& s) {
  const StorageImpl* at = s.get();
  while (const auto* owner = at->memory_owner()) {
    if (!*owner) break;
    at = owner->get();
  }
  return at->device();
}

/// A new storage of `nbytes` fresh bytes from `device`'s allocator.
inline Storage make_storage(Device device, std::size_t nbytes) {
  return std::make_shared<StorageImpl>(device, nbytes);
}
/// A new storage of `nbytes` bytes of `device` from `alloc`, which must outlive it.
inline Storage make_storage(Device device, std::size_t nbytes, Allocator& alloc) {
  return std::make_shared<StorageImpl>(device, nbytes, alloc);
}
/// `nbytes` of `base` from byte `offset`, as memory of CPU device `device` (Note [host aliases]).
inline Storage make_alias_storage(Device device, const Storage& base, std::size_t offset, std::size_t nbytes) {
  return std::make_shared<StorageImpl>(device, base, offset, nbytes);
}
/// `nbytes` of `block` from byte `offset`, with a version counter of its own (Note [storage slices]).
inline Storage make_slice_storage(const Storage& block, std::size_t offset, std::size_t nbytes) {
  return std::make_shared<StorageImpl>(StorageImpl::slice_t{}, block, offset, nbytes);
}

#if CHORUS_CUDA
namespace detail {
/// Note [cross-stream copies]
/// A copy between two CUDA allocations whose users are on different streams (two devices, or
/// two streams of one device) runs on `dst_stream`, after the work on `src_stream` so far (which
/// produced the source); and later work on `src_stream` waits for the copy, so that an in-place
/// write to the source (an optimizer step after the broadcast read it) cannot overtake the copy's
/// read. The destination's stream is recorded as a user of both blocks (Note [cross-device
/// stream uses]), so that neither is reused before the copy has run.
inline void copy_between_streams(void* dst, Device dst_dev, Stream& dst_stream, const void* src, Device src_dev,
                                 Stream& src_stream, std::size_t nbytes) {
  cuda::DeviceGuard g(dst_dev.index);
  const bool other = &dst_stream != &src_stream;
  if (other) {
    Event produced;
    produced.record(src_stream);
    produced.block(dst_stream);
  }
  record_stream(src, src_dev, dst_stream);  // dst_stream is a stream of dst_dev
  record_stream(dst, dst_dev, dst_stream);
  if (dst_dev == src_dev) {
    CHORUS_CUDA_CHECK(cudaMemcpyAsync(dst, src, nbytes, cudaMemcpyDeviceToDevice, dst_stream.handle()));
  } else {
    CHORUS_CUDA_CHECK(cudaMemcpyPeerAsync(dst, dst_dev.index, src, src_dev.index, nbytes, dst_stream.handle()));
  }
  if (other) {
    Event copied;
    copied.record(dst_stream);
    copied.block(src_stream);
  }
}
}  // namespace detail
#endif

// Note [async host-to-device copies]
// A copy from host memory to a GPU returns before the copy has run when the host memory is
// page-locked memory of chorus's pinned allocator (the DataLoader's pin_memory batches, as
// PyTorch's non_blocking copies from pinned memory): the copy records an event into the host
// block, and the block is reused only after it (Note [deferred host frees]). The host memory
// must therefore not be written on the host until the copy is done (Event/synchronize on the
// destination's stream); a batch handed to to() and then dropped is the intended use. From
// pageable memory the copy waits: CUDA does not promise that it has read the host buffer on
// return.

/// Copies `nbytes` between two allocations, on any pair of devices. CPU↔CPU is a memcpy (a real
/// copy between virtual devices); anything involving CUDA is ordered on the current stream of
/// the CUDA side (the destination when both are GPUs, Note [cross-stream copies]) and uses peer
/// copies between GPUs.
inline void copy_bytes(void* dst, Device dst_dev, const void* src, Device src_dev, std::size_t nbytes) {
  if (nbytes == 0) return;
  if (dst_dev.is_cpu() && src_dev.is_cpu()) {
    std::memcpy(dst, src, nbytes);
    return;
  }
#if CHORUS_CUDA
  if (dst_dev.is_cuda() && src_dev.is_cuda()) {
    detail::copy_between_streams(dst, dst_dev, current_stream(dst_dev), src, src_dev, current_stream(src_dev), nbytes);
    return;
  }
  if (dst_dev.is_cuda()) {  // host -> device (Note [async host-to-device copies])
    Stream& s = current_stream(dst_dev);
    cuda::DeviceGuard g(dst_dev.index);
    record_stream(dst, dst_dev, s);
    CHORUS_CUDA_CHECK(cudaMemcpyAsync(dst, src, nbytes, cudaMemcpyHostToDevice, s.handle()));
    bool pinned = false;
    try {
      pinned = pinned_host_allocator().record_use(src, s.handle(), dst_dev.index);
    } catch (...) {  // no event for the block to wait for: the copy is waited for here instead
      pinned = false;
    }
    if (!pinned) CHORUS_CUDA_CHECK(cudaStreamSynchronize(s.handle()));  // the host buffer is free to change on return
    return;
  }
  {  // device -> host: the values are on the host on return
    Stream& s = current_stream(src_dev);
    cuda::DeviceGuard g(src_dev.index);
    record_stream(src, src_dev, s);
    CHORUS_CUDA_CHECK(cudaMemcpyAsync(dst, src, nbytes, cudaMemcpyDeviceToHost, s.handle()));
    CHORUS_CUDA_CHECK(cudaStreamSynchronize(s.handle()));
    cuda::check_device_asserts();  // Note [device-side validation]
    return;
  }
#else
  check_device(dst_dev.is_cuda() ? dst_dev : src_dev);
#endif
}

CHORUS_NAMESPACE_END
