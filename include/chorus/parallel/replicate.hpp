#pragma once
// Replication: the replicas of a module on the other devices, built once, refreshed from the
// primary at every step, and wired into autograd so that their gradients are summed into the
// primary's parameters, bucket by bucket, while the backward pass is still running.
//
// Note [flat replication]
// At construction the primary's parameters and buffers are re-seated, in place, into flat
// buffers, one per dtype for the parameters and one per dtype for the buffers (the tensors
// keep their identity; only their storage moves), and each replica is a deep copy (Note [deep
// copy through copy constructors]) whose parameters and buffers lie in the same layout on its
// device. Refreshing a replica is then one broadcast per group, not one copy per tensor.
// Each tensor's storage is a slice of its flat buffer, with a version counter of its own
// (Note [storage slices]): an in-place write marks only the tensor it writes. On CPU devices
// a replica's parameters are host aliases of the primary's slices (Note [host aliases],
// sharing their counters): nothing in forward or backward writes a parameter, so a step
// broadcasts only the buffers (which replicas do write: BatchNorm's running statistics).
//
// Note [gradient buckets]
// A replica's parameters are not leaves: each step their grad_fn is set to a
// BroadcastBackward node, one per bucket of primary parameters (a few MB, in reverse
// registration order, which is about the order backward produces them). The engine runs a
// bucket's node as soon as every replica has produced that bucket's gradients, so reducing
// the late layers overlaps the backward of the early ones; the node sums the replicas'
// gradients into the primary device (through the Communicator) and hands the sums to the
// primary parameters' AccumulateGrad, which also receives replica 0's own gradients. On CPU
// devices a replica's gradient is handed over as the sum's memory, not copied (Note [host
// aliases]), so the only pass over a bucket is AccumulateGrad's addition, and each parameter
// is its own bucket by default (kDefaultCpuBucketBytes): a layer's gradients are added while
// the replicas still work on the layers below it, and only the first layer's addition is
// left after backward (with 8 MB buckets mlp-medium added 8 MB there, about 0.6 ms).
#include <functional>
#include <memory>
#include <optional>
#include <unordered_map>
#include <vector>

#include "../compiled.hpp"
#include "../core/profiler.hpp"
#include "../nn/module.hpp"
#include "comm.hpp"

CHORUS_NAMESPACE_BEGIN
namespace parallel {
namespace detail {

/// Replica r's forward span on `device` while alive, its layers named from the replica's root
/// (Note [layer spans]); the device's allocated memory is sampled when it ends.
class ReplicaSpan {
 public:
  /// Enters replica `r`'s forward of `module` on `device`.
  template <class M>
  ReplicaSpan(const M& module, std::size_t r, Device device)
      : span_(profiler::Category::forward, [&] { return "forward replica " + std::to_string(r); }),
        root_(nn::module_of(module)) {
    span_.set_device(device);
    span_.sample_memory_at_end(device);
  }

 private:
  profiler::Scope span_;
  nn::detail::RootFrame root_;
};

/// Sums one bucket's gradients from replicas 1 … n-1 into the primary device.
template <class T>
class BroadcastBackward final : public autograd::Node<T> {
 public:
  BroadcastBackward(std::shared_ptr<Communicator> comm, std::vector<Shape> shapes, Device primary, std::size_t replicas)
      : comm_(std::move(comm)), shapes_(std::move(shapes)), primary_(primary), replicas_(replicas) {}
  std::string name() const override { return "BroadcastBackward"; }
  typename autograd::Node<T>::TensorList apply(typename autograd::Node<T>::TensorList&& grads) override {
    const std::size_t m = shapes_.size();
    std::vector<std::vector<AnyTensor>> srcs(replicas_);
    for (std::size_t r = 0; r < replicas_; ++r)
      for (std::size_t j = 0; j < m; ++j) srcs[r].push_back(AnyTensor(std::move(grads[r * m + j])));
    profiler::Scope span(profiler::Category::communication, "reduce gradients");
    if (span.active()) {
      std::int64_t bytes = 0;
      for (const auto& s : shapes_) bytes += numel_of(s) * static_cast<std::int64_t>(sizeof(T));
      span.set_bytes(bytes);
      span.set_device(primary_);
      span.set_detail(std::to_string(m) + (m == 1 ? " gradient" : " gradients") + " from " + std::to_string(replicas_) +
                      (replicas_ == 1 ? " replica" : " replicas"));
    }
    typename autograd::Node<T>::TensorList out;
    for (auto& sum : comm_->reduce(std::move(srcs))) {
      CHORUS_CHECK(sum.device() == primary_ && sum.shape() == shapes_[out.size()], "BroadcastBackward: the ",
                   comm_->name(), " communicator returned a sum of shape ", sum.shape(), " on ", sum.device(),
                   " for ", shapes_[out.size()], " on ", primary_);
      out.push_back(std::move(sum.as<T>()));
    }
    return out;
  }

 private:
  std::shared_ptr<Communicator> comm_;
  std::vector<Shape> shapes_;
  Device primary_;
  std::size_t replicas_;
};

/// Note [flat offsets are 256-byte aligned]: every tensor in a flat buffer starts at a multiple
/// of 256 bytes, the alignment cudaMalloc gives a standalone tensor. cuBLASLt (and vectorised
/// kernels) pick faster or only-valid paths for aligned operands; at raw element offsets
/// Linear(5, 2)'s bias sat at +40 bytes (Note [cuBLASLt alignment] in backend/cuda/host_policy.hpp).
inline constexpr std::size_t kFlatAlignmentBytes = 256;

/// The first element offset at or after `numel` that is 256-byte aligned for `elem_size` bytes.
inline std::int64_t aligned_flat_offset(std::int64_t numel, std::size_t elem_size) {
  const auto step = static_cast<std::int64_t>(kFlatAlignmentBytes / elem_size);
  return (numel + step - 1) / step * step;
}

/// Where one primary tensor lives in the flat layout.
struct FlatSlot {
  std::size_t index;     // of the tensor (parameters, then buffers, in registry order)
  std::size_t group;     // index of the dtype group
  std::int64_t offset;   // in elements
};

/// The CloneScope that builds a replica: registered tensors get the storage `storage_of`
/// makes for them (a slice of the replica's flat buffer, or a host alias of the primary's
/// tensor); anything else is deep-copied to the replica's device.
class ReplicaScope final : public CloneScope {
 public:
  ReplicaScope(Device device, const std::unordered_map<const void*, FlatSlot>& slots,
               std::function<Storage(std::size_t)> storage_of, std::unordered_map<const void*, AnyTensor>& made)
      : device_(device), slots_(slots), storage_of_(std::move(storage_of)), made_(made) {}

 protected:
  CHORUS_INLINE std::shared_ptr<void> copy_tensor(const void* impl, DType dtype) override;

 private:
  template <class T>
  std::shared_ptr<void> copy(const void* p) {
    const auto& src = *static_cast<const TensorImpl<T>*>(p);
    auto it = slots_.find(p);
    if (it == slots_.end()) return nn::detail::deep_copy(src, device_);  // not registered
    auto impl = std::make_shared<TensorImpl<T>>();
    impl->storage = storage_of_(it->second.index);
    impl->shape = src.shape;
    impl->strides = contiguous_strides(src.shape);
    made_.emplace(p, AnyTensor(Tensor<T>(impl)));
    return impl;
  }

  Device device_;
  const std::unordered_map<const void*, FlatSlot>& slots_;
  std::function<Storage(std::size_t)> storage_of_;
  std::unordered_map<const void*, AnyTensor>& made_;
};

}  // namespace detail

// Note [replicator core]
// Nothing of replication but making a replica (a copy of M) and handing out M pointers depends
// on the module's type: ReplicatorCore holds the flat layout, the buckets and the autograd
// wiring over nn::Module, and Replicator<M> adds the copies. A program with several models
// (every test file has a few) then compiles the layout code once, not once per model type.

/// The part of Replicator that works on any module (Note [replicator core]).
class ReplicatorCore {
 protected:
  /// One registered tensor of the primary module.
  struct Entry {
    std::string name;  ///< its dotted name in the module
    AnyTensor tensor;  ///< the primary's tensor
    bool is_param;     ///< a parameter (else a buffer)
    Shape shape;       ///< its shape at construction: the flat layout has room for this many elements
  };

  /// Tensors whose replica gradients are summed by one BroadcastBackward node (Note [gradient buckets]).
  struct Bucket {
    DType dtype;                       ///< the dtype of every member
    std::vector<std::size_t> members;  ///< indices into tensors_, latest registered first
  };

  /// What building replica r needs: its flat buffers, and the tensors its copy made.
  struct ReplicaBuild {
    std::vector<AnyTensor> flats;  ///< the replica's flat buffer of each group (undefined: aliased)
    std::unordered_map<const void*, AnyTensor> made;  ///< the replica's tensor for each primary tensor impl
  };

  /// Re-seats `primary`'s parameters and buffers into flat buffers on devices[0] and groups them
  /// into buckets of about `bucket_bytes`; the replicas are added by add_replica().
  ReplicatorCore(nn::Module& primary, const std::vector<Device>& devices, std::shared_ptr<Communicator> comm,
                 std::size_t bucket_bytes);
  ~ReplicatorCore() = default;
  ReplicatorCore(const ReplicatorCore&) = delete;
  ReplicatorCore& operator=(const ReplicatorCore&) = delete;

  /// Makes replicas 1 … used-1 current with the primary and wires them into autograd for
  /// this step (see Replicator::prepare).
  void prepare_core(std::size_t used, bool on_caller);

  /// The scope a copy of the primary is made under to become replica r (Note [flat
  /// replication]); `build` receives its flat buffers and the tensors it made.
  std::unique_ptr<CloneScope> replica_scope(std::size_t r, ReplicaBuild& build) const;

  /// Records replica r (made under replica_scope(r, build)), whose root module is `module`.
  void add_replica(std::size_t r, ReplicaBuild&& build, nn::Module& module);

 public:
  /// The version counters of the parameters the replicas alias (Note [host aliases]).
  std::vector<std::uint64_t> aliased_versions() const;
  /// Replicas read the primary's parameter memory: a forward that wrote a parameter through
  /// the API (the version moved) raced with the other replicas' reads. Refuse it.
  void check_parameters_unwritten(const std::vector<std::uint64_t>& before) const;

  /// Elements of the parameters (the work of a step grows with it).
  std::int64_t parameter_numel() const;

 private:
  /// Copies the primary's flat buffers into replicas 1 … used-1 on the calling thread, after
  /// whatever their streams still had queued (a drained stream's next work is ours).
  void refresh_on_caller(std::size_t used);

  // Note [idle replicas]
  // The broadcast to a replica that this step leaves idle (batch smaller than the device
  // count) reads the primary's flat buffers on that replica's stream, and no forward task
  // follows it there for parallel_apply to wait on: without a join, the optimizer step that
  // writes the primary next races with the copy. So the caller waits for the idle replicas'
  // streams here (CPU: on the host; CUDA: an event the primary's current stream waits on).
  // The marker runs on the worker, after the broadcast's posted work, so it also covers
  // CUDA work that the worker had not yet launched when the broadcast returned.
  void join_idle(std::size_t used);

  void check_on_primary() const;

  void build_layout();

  static Storage storage_of(const AnyTensor& t);
  std::size_t nbytes_of(std::size_t k) const {
    return static_cast<std::size_t>(numel_of(tensors_[k].shape)) * dtype_size(group_dtypes_[groups_[k]]);
  }
  std::size_t byte_offset_of(std::size_t k) const {
    return static_cast<std::size_t>(offsets_[k]) * dtype_size(group_dtypes_[groups_[k]]);
  }

  /// Re-seats every primary tensor into the flat buffers (values kept, identity kept), each
  /// as a slice of its group's buffer (Note [storage slices]).
  void flatten_primary();

  bool primary_is_flat() const;

  /// Which tensors train now: floating parameters and buffers that require grad (Note
  /// [gradient buckets]; a buffer that requires grad gets its replicas' gradients too, as
  /// PyTorch's replicate broadcasts such buffers with autograd).
  std::vector<bool> trainable() const;

  void build_buckets();

  /// A group whose replicas alias the primary's flat buffer instead of holding a copy: the
  /// parameters, on CPU devices (Note [host aliases]). Buffers are copied: replicas write them
  /// in forward (BatchNorm's running statistics), and only the primary's writes count.
  bool aliased(std::size_t g) const { return group_params_[g] && devices_[0].is_cpu(); }

  /// The flat buffer of group g for replica r: memory of its own, or none for an aliased group
  /// (its tensors alias the primary's).
  AnyTensor replica_flat(std::size_t g, std::size_t r) const {
    if (aliased(g)) return {};
    return empty_any(group_dtypes_[g], Shape{group_numel_[g]}, devices_[r]);
  }

  /// The storage of tensor k in replica r: a host alias of the primary's tensor (sharing its
  /// version counter), or a slice of the replica's flat buffer.
  Storage replica_storage(std::size_t r, std::size_t k, const std::vector<AnyTensor>& flats) const {
    if (aliased(groups_[k])) return make_alias_storage(devices_[r], storages_[k], 0, nbytes_of(k));
    return make_slice_storage(storage_of(flats[groups_[k]]), byte_offset_of(k), nbytes_of(k));
  }

  /// After flatten_primary() made new flat buffers: the replicas' aliases follow them.
  void realias();

  void wire_autograd(std::size_t used);

  template <class T>
  void wire_bucket(const Bucket& bucket, std::size_t used, Stream* stream) {
    std::vector<Shape> shapes;
    for (auto k : bucket.members) shapes.push_back(tensors_[k].tensor.shape());
    auto node = std::make_shared<detail::BroadcastBackward<T>>(comm_, shapes, devices_[0], used - 1);
    node->set_stream(stream);
    for (auto k : bucket.members) node->add_next_edge(autograd::gradient_edge(tensors_[k].tensor.template as<T>()));
    std::shared_ptr<autograd::Node<T>> base = node;
    for (std::size_t r = 1; r < used; ++r) {
      for (auto k : bucket.members) {
        auto& impl = *replica_tensors_[r - 1][k].template as<T>().impl();
        impl.output_nr = node->add_input(impl.shape, devices_[r]);
        impl.grad_fn = base;
        impl.requires_grad = true;
      }
    }
  }

  nn::Module& root_;
  std::vector<const void*> registered_;  // the root's tensors when built (Note [tied parameters])
  std::vector<Device> devices_;
  std::shared_ptr<Communicator> comm_;
  std::size_t bucket_bytes_;
  std::vector<Entry> tensors_;  // parameters, then buffers, in registry order
  std::vector<Storage> storages_;  // [tensor]: the primary's slice of its flat buffer
  std::vector<DType> group_dtypes_;
  std::vector<bool> group_params_;  // a group holds parameters (else buffers)
  std::vector<std::int64_t> group_numel_;
  std::vector<std::size_t> groups_;
  std::vector<std::int64_t> offsets_;
  std::unordered_map<const void*, detail::FlatSlot> slots_;
  std::vector<AnyTensor> flats_;                               // [group], on the primary
  std::vector<Bucket> buckets_;
  std::vector<bool> bucketed_;  // [tensor]: trainable() when buckets_ was built
  std::vector<nn::Module*> replica_roots_;                     // replica r at r - 1
  std::vector<std::vector<AnyTensor>> replica_flats_;          // [r - 1][group] (undefined: aliased)
  std::vector<std::vector<AnyTensor>> replica_tensors_;        // [r - 1][tensor index]
};

/// Replicas of module M on devices[1 …], kept in step with the primary (devices[0]).
template <class M>
class Replicator : public ReplicatorCore {
 public:
  /// Builds a replica of `primary` on each of devices[1 …] (Note [flat replication]); `comm` is
  /// the devices' communicator, `bucket_bytes` the gradient bucket size (Note [gradient buckets]).
  Replicator(M& primary, const std::vector<Device>& devices, std::shared_ptr<Communicator> comm,
             std::size_t bucket_bytes)
      : ReplicatorCore(nn::module_of(primary), devices, std::move(comm), bucket_bytes), primary_(primary) {
    for (std::size_t r = 1; r < devices.size(); ++r) {
      ReplicaBuild build;
      M copy = nn::detail::copy_checked(primary_, [&] { return replica_scope(r, build); });
      replicas_.push_back(std::make_unique<M>(std::move(copy)));
      add_replica(r, std::move(build), nn::module_of(*replicas_.back()));
    }
  }

  /// Makes replicas 1 … used-1 current with the primary and wires them into autograd for
  /// this step; returns the modules of replicas 0 … used-1 (replica 0 is the primary).
  /// `on_caller`: CPU devices only; the calling thread copies the parameters itself, for a
  /// step that runs every replica on the calling thread (Note [inline small steps]).
  std::vector<M*> prepare(std::size_t used, bool on_caller = false) {
    prepare_core(used, on_caller);
    std::vector<M*> out{&primary_};
    for (std::size_t r = 1; r < used; ++r) out.push_back(replicas_[r - 1].get());
    return out;
  }

  /// Replica `r`: the primary for 0, else the copy on devices[r].
  const M& replica(std::size_t r) const { return r == 0 ? primary_ : *replicas_[r - 1]; }

 private:
  M& primary_;
  std::vector<std::unique_ptr<M>> replicas_;  // replica r at r - 1
};

}  // namespace parallel
CHORUS_NAMESPACE_END

// The definitions: compiled into chorus::compiled, or here in the header-only form (Note
// [compiled chorus] in compiled.hpp).
#if !CHORUS_COMPILED
#include "replicate_impl.hpp"
#endif
