#pragma once
// Communicators: the collectives DataParallel needs, over one device group.
//
// Note [communicators]
// DataParallel talks to its devices only through this interface: broadcast a primary
// buffer to the other devices' buffers, and sum per-device gradients into the primary's.
// CopyCommunicator implements it with copies on the devices' streams (virtual CPU devices,
// where a reduction reads the sources in place instead, Note [host aliases]; and GPU sets
// that repeat a device, which NCCL refuses); the CUDA backend adds an NCCL
// implementation for sets of distinct GPUs; a multi-process group can implement it later.
#include <memory>
#include <string>
#include <vector>

#include "../compiled.hpp"
#include "../core/any_tensor.hpp"
#include "../ops/ops.hpp"
#if CHORUS_CUDA
#include "../backend/cuda/nccl.cuh"
#endif

CHORUS_NAMESPACE_BEGIN
namespace parallel {

namespace detail {
/// Contiguous `t` as a tensor of CPU device `device` over the same memory (Note [host aliases]).
template <class T>
Tensor<T> host_alias(const Tensor<T>& t, Device device) {
  CHORUS_CHECK(t.is_contiguous(), "host_alias: the tensor is not contiguous");
  auto impl = std::make_shared<TensorImpl<T>>();
  impl->storage = make_alias_storage(device, t.impl()->storage, static_cast<std::size_t>(t.storage_offset()) * sizeof(T),
                                     static_cast<std::size_t>(t.numel()) * sizeof(T));
  impl->shape = t.shape();
  impl->strides = contiguous_strides(t.shape());
  return Tensor<T>(impl);
}
CHORUS_INLINE AnyTensor host_alias(const AnyTensor& t, Device device);
/// `t` (any layout) as a tensor of CPU device `device` over the same memory: an alias of its
/// whole storage, with t's offset and strides. `t` is handed over (it is empty on return), so
/// where it was the only handle, the view is all that sees the memory (storage_unshared).
template <class T>
Tensor<T> host_view(Tensor<T>&& handed_over, Device device) {
  const Tensor<T> t = std::move(handed_over);
  const auto& st = t.impl()->storage;
  auto impl = std::make_shared<TensorImpl<T>>();
  impl->storage = make_alias_storage(device, st, 0, st->nbytes());
  impl->offset = t.storage_offset();
  impl->shape = t.shape();
  impl->strides = t.strides();
  return Tensor<T>(impl);
}
}  // namespace detail

/// The collectives DataParallel runs over its device group: broadcast from rank 0 and sums into
/// rank 0 (Note [communicators]).
class Communicator {
 public:
  /// A group with one rank per stream, rank r on streams[r]; at least one stream.
  explicit Communicator(std::vector<Stream*> streams);
  virtual ~Communicator() = default;
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  /// The streams of the group; rank r works on streams()[r]; rank 0 is the root.
  const std::vector<Stream*>& streams() const { return streams_; }
  /// The number of ranks (devices) in the group.
  std::size_t size() const { return streams_.size(); }

  /// dsts[r - 1] (on rank r, r = 1 … dsts.size()) = src (on rank 0); contiguous, equal sizes.
  /// Asynchronous: it is ordered before later work on each destination's stream.
  virtual void broadcast(const AnyTensor& src, const std::vector<AnyTensor>& dsts) = 0;

  /// dsts[j] (on rank 0) = sum over r = 1 … srcs.size() of srcs[r - 1][j] (on rank r).
  /// Synchronous with respect to the calling thread's stream on rank 0.
  virtual void reduce_add(const std::vector<std::vector<AnyTensor>>& srcs, const std::vector<AnyTensor>& dsts) = 0;

  /// The same sums, in tensors the communicator provides (contiguous, on rank 0, shaped as
  /// srcs[0][j]). srcs is taken: a CPU communicator may hand a source over as the sum's memory
  /// instead of copying it (Note [host aliases]).
  CHORUS_INLINE virtual std::vector<AnyTensor> reduce(std::vector<std::vector<AnyTensor>>&& srcs);

  /// The implementation's name, such as "copy" or "nccl".
  virtual std::string name() const = 0;

 protected:
  std::vector<Stream*> streams_;  ///< the stream of each rank, rank 0's first
};

/// Collectives made of copies: each destination's copy is posted to its stream (so copies to
/// different devices run in parallel), and reductions copy to rank 0 and add there.
class CopyCommunicator final : public Communicator {
 public:
  /// A group with one rank per stream, rank r on streams[r].
  using Communicator::Communicator;

  CHORUS_INLINE void broadcast(const AnyTensor& src, const std::vector<AnyTensor>& dsts) override;

  CHORUS_INLINE void reduce_add(const std::vector<std::vector<AnyTensor>>& srcs, const std::vector<AnyTensor>& dsts) override;

  /// CPU devices: each sum is computed over the sources themselves, viewed on rank 0 through
  /// host aliases, by the engine's rule (autograd::detail::sum_into_unshared): into a source
  /// nothing else holds (a replica's gradient, handed over whole), else into new memory; a
  /// lone source is handed over as it is. No copy between devices, and for two devices no
  /// new memory (Note [host aliases]).
  CHORUS_INLINE std::vector<AnyTensor> reduce(std::vector<std::vector<AnyTensor>>&& srcs) override;

  /// "copy".
  std::string name() const override { return "copy"; }

 private:
  // Note [shared broadcast]
  // CPU devices: a destination's worker copies its buffer before that replica's forward, while
  // the caller already runs replica 0's forward and then waits for the slowest replica; the
  // copy (milliseconds for a few MB of buffers, or of parameters where a caller broadcasts
  // them; DataParallel aliases those, Note [host aliases]) lengthens the step by its whole duration. So
  // the calling thread copies the first 1/(k+1) of each of the k destinations itself and each
  // worker the rest: every thread copies k/(k+1) of one buffer. The caller's part is written
  // after the destination's stream has drained (nothing queued there still uses the buffer)
  // and before anything later is posted there, so the replica's next task sees both parts.
  void broadcast_shared(const AnyTensor& src, const std::vector<AnyTensor>& dsts);
};

#if CHORUS_CUDA
/// NCCL collectives for a group of distinct GPUs, on one dedicated stream per device and
/// ordered against the compute streams by events (Note [communicators]).
class NcclCommunicator final : public Communicator {
 public:
  static constexpr int kCommSlot = 63;  // the stream slot of the communication streams

  explicit NcclCommunicator(std::vector<Stream*> streams)
      : Communicator(std::move(streams)), comms_(device_indices(streams_)) {
    for (auto* s : streams_) comm_.push_back(&get_stream(s->device(), kCommSlot));
  }

  void broadcast(const AnyTensor& src, const std::vector<AnyTensor>& dsts) override {
    CHORUS_CHECK(dsts.size() + 1 == size(), "NCCL broadcast: every rank takes part (", dsts.size() + 1, " of ",
                 size(), " buffers given)");
    std::vector<void*> bufs;
    std::vector<cudaStream_t> streams;
    for (std::size_t r = 0; r < size(); ++r) {
      const AnyTensor& t = r == 0 ? src : dsts[r - 1];
      CHORUS_CHECK(t.numel() == src.numel() && t.dtype() == src.dtype(), "NCCL broadcast: buffer ", r, " differs");
      // The root waits for its producer (the optimizer step); the others for their last use.
      Event ready;
      ready.record(r == 0 ? current_stream(streams_[0]->device()) : *streams_[r]);
      ready.block(*comm_[r]);
      record_stream(data_of(t), t.device(), *comm_[r]);  // a free waits for the NCCL stream's use
      bufs.push_back(data_of(t));
      streams.push_back(comm_[r]->handle());
    }
    comms_.broadcast(bufs, static_cast<std::size_t>(src.numel()), src.dtype(), 0, streams);
    for (std::size_t r = 1; r < size(); ++r) {  // the replica's next work sees the new values
      Event done;
      done.record(*comm_[r]);
      done.block(*streams_[r]);
    }
    // The root's NCCL kernel reads the primary buffer: the root's next write to it (the
    // optimizer step, a load) must wait for that read too.
    Event read;
    read.record(*comm_[0]);
    read.block(current_stream(streams_[0]->device()));
  }

  void reduce_add(const std::vector<std::vector<AnyTensor>>& srcs, const std::vector<AnyTensor>& dsts) override {
    CHORUS_CHECK(srcs.size() < size(), "NCCL reduce: ", srcs.size(), " sources for a group of ", size());
    if (dsts.empty()) return;
    const DType dt = dsts[0].dtype();
    std::int64_t total = 0;
    for (const auto& d : dsts) {
      CHORUS_CHECK(d.dtype() == dt, "NCCL reduce: a bucket mixes dtypes");
      total += d.numel();
    }
    // Pack each rank's gradients into one flat buffer on its communication stream; ranks
    // without gradients this step (rank 0, unused replicas) send zeros. Note [allocate on the
    // stream that writes]: the flat buffers and `recv` are allocated under the communication
    // stream that writes them. Allocated on the caller's stream, the pool could hand out a block
    // whose last reader there has not run yet, and the communication stream, not ordered after
    // that stream, would overwrite it under the reader (silently wrong gradients).
    std::vector<AnyTensor> flats;
    std::vector<const void*> send;
    std::vector<cudaStream_t> streams;
    for (std::size_t r = 0; r < size(); ++r) {
      const Device dev = streams_[r]->device();
      Stream& cs = *comm_[r];
      AnyTensor flat;
      {
        StreamGuard on_comm(cs);
        flat = empty_any(dt, Shape{total}, dev);
      }
      ::chorus::cuda::DeviceGuard g(dev.index);
      if (r >= 1 && r <= srcs.size()) {
        Event produced;  // the gradients came from the replica's stream
        produced.record(*streams_[r]);
        produced.block(cs);
        std::size_t off = 0;
        for (const auto& t : srcs[r - 1]) {
          const std::size_t bytes = t.nbytes();
          CHORUS_CHECK(t.device() == dev, "NCCL reduce: a gradient of rank ", r, " is on ", t.device());
          record_stream(data_of(t), dev, cs);
          CHORUS_CUDA_CHECK(cudaMemcpyAsync(static_cast<char*>(data_of(flat)) + off, data_of(t), bytes,
                                            cudaMemcpyDeviceToDevice, cs.handle()));
          off += bytes;
        }
      } else {
        CHORUS_CUDA_CHECK(cudaMemsetAsync(data_of(flat), 0, flat.nbytes(), cs.handle()));
      }
      send.push_back(data_of(flat));
      streams.push_back(cs.handle());
      flats.push_back(std::move(flat));
    }
    const Device root = streams_[0]->device();
    AnyTensor recv;
    {
      StreamGuard on_comm(*comm_[0]);
      recv = empty_any(dt, Shape{total}, root);
    }
    comms_.reduce(send, data_of(recv), static_cast<std::size_t>(total), dt, 0, streams);
    // Unpack into the outputs on rank 0, then order the caller's stream after it. The outputs
    // belong to the caller's stream (reduce() allocates them there, a caller may still read
    // them there): the unpack waits for that stream first.
    Event outputs_ready;
    outputs_ready.record(current_stream(root));
    outputs_ready.block(*comm_[0]);
    ::chorus::cuda::DeviceGuard g(root.index);
    std::size_t off = 0;
    for (const auto& d : dsts) {
      record_stream(data_of(d), d.device(), *comm_[0]);
      CHORUS_CUDA_CHECK(cudaMemcpyAsync(data_of(d), static_cast<char*>(data_of(recv)) + off, d.nbytes(),
                                        cudaMemcpyDeviceToDevice, comm_[0]->handle()));
      off += d.nbytes();
    }
    Event done;
    done.record(*comm_[0]);
    done.block(current_stream(root));
  }

  std::string name() const override { return "nccl"; }

 private:
  static std::vector<int> device_indices(const std::vector<Stream*>& streams) {
    std::vector<int> d;
    for (auto* s : streams) d.push_back(s->device().index);
    return d;
  }
  static void* data_of(const AnyTensor& t) {
    return t.visit([](const auto& x) -> void* { return static_cast<void*>(x.data()); });
  }

  backend::cuda::NcclComms comms_;
  std::vector<Stream*> comm_;
};
#endif

}  // namespace parallel
CHORUS_NAMESPACE_END

// The definitions: compiled into chorus::compiled, or here in the header-only form (Note
// [compiled chorus] in compiled.hpp).
#if !CHORUS_COMPILED
#include "comm_impl.hpp"
#endif
