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

#include "../nn/module.hpp"
#include "comm.hpp"

CHORUS_NAMESPACE_BEGIN
namespace parallel {
namespace detail {

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
  std::shared_ptr<void> copy_tensor(const void* impl, DType dtype) override {
    return visit_dtype(dtype, [&](auto tag) { return copy<decltype(tag)>(impl); });
  }

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
  struct Entry {
    std::string name;
    AnyTensor tensor;
    bool is_param;
    Shape shape;  // at construction: the flat layout has room for this many elements
  };

  struct Bucket {
    DType dtype;
    std::vector<std::size_t> members;  // indices into tensors_
  };

  /// What building replica r needs: its flat buffers, and the tensors its copy made.
  struct ReplicaBuild {
    std::vector<AnyTensor> flats;
    std::unordered_map<const void*, AnyTensor> made;
  };

  ReplicatorCore(nn::Module& primary, const std::vector<Device>& devices, std::shared_ptr<Communicator> comm,
                 std::size_t bucket_bytes)
      : root_(primary), devices_(devices), comm_(std::move(comm)), bucket_bytes_(bucket_bytes) {
    for (auto& p : root_.named_parameters()) tensors_.push_back({p.name, p.tensor, true, p.tensor.shape()});
    for (auto& b : root_.named_buffers()) tensors_.push_back({b.name, b.tensor, false, b.tensor.shape()});
    check_on_primary();
    build_layout();
    flatten_primary();
    build_buckets();
  }
  ~ReplicatorCore() = default;
  ReplicatorCore(const ReplicatorCore&) = delete;
  ReplicatorCore& operator=(const ReplicatorCore&) = delete;

  /// Makes replicas 1 … used-1 current with the primary and wires them into autograd for
  /// this step (see Replicator::prepare).
  void prepare_core(std::size_t used, bool on_caller) {
    check_on_primary();
    if (!primary_is_flat()) {  // the user moved or replaced a tensor
      flatten_primary();
      realias();
    }
    if (trainable() != bucketed_) build_buckets();  // requires_grad changed (a layer frozen or unfrozen)
    if (used <= 1) return;
    if (on_caller) {
      refresh_on_caller(used);
    } else {
      // Every replica is refreshed, also those this step leaves idle: a collective such as an
      // NCCL broadcast needs every rank.
      for (std::size_t g = 0; g < flats_.size(); ++g) {
        if (aliased(g)) continue;  // the replicas read the primary's memory (Note [host aliases])
        std::vector<AnyTensor> dsts;
        for (std::size_t r = 1; r < devices_.size(); ++r) dsts.push_back(replica_flats_[r - 1][g]);
        comm_->broadcast(flats_[g], dsts);
      }
      join_idle(used);
    }
    const bool training = root_.is_training();
    for (std::size_t r = 1; r < used; ++r) {
      auto& rep = *replica_roots_[r - 1];
      if (rep.is_training() != training) rep.train(training);
    }
    wire_autograd(used);
  }

  /// The scope a copy of the primary is made under to become replica r (Note [flat
  /// replication]); `build` receives its flat buffers and the tensors it made.
  std::unique_ptr<CloneScope> replica_scope(std::size_t r, ReplicaBuild& build) const {
    for (std::size_t g = 0; g < group_dtypes_.size(); ++g) build.flats.push_back(replica_flat(g, r));
    return std::make_unique<detail::ReplicaScope>(
        devices_[r], slots_, [this, r, &build](std::size_t k) { return replica_storage(r, k, build.flats); },
        build.made);
  }

  /// Records replica r (made under replica_scope(r, build)), whose root module is `module`.
  void add_replica(std::size_t r, ReplicaBuild&& build, nn::Module& module) {
    std::vector<AnyTensor> views;
    for (const auto& e : tensors_) {
      auto it = build.made.find(e.tensor.impl_key());
      CHORUS_CHECK(it != build.made.end(), "DataParallel: replica ", r, " has no copy of '", e.name,
                   "' (is the tensor registered but not reachable from a copy of the module?)");
      views.push_back(it->second);
    }
    replica_roots_.push_back(&module);
    replica_flats_.push_back(std::move(build.flats));
    replica_tensors_.push_back(std::move(views));
  }

 public:
  /// The version counters of the parameters the replicas alias (Note [host aliases]).
  std::vector<std::uint64_t> aliased_versions() const {
    std::vector<std::uint64_t> v;
    for (std::size_t k = 0; k < tensors_.size(); ++k)
      if (aliased(groups_[k])) v.push_back(storages_[k]->version());
    return v;
  }
  /// Replicas read the primary's parameter memory: a forward that wrote a parameter through
  /// the API (the version moved) raced with the other replicas' reads. Refuse it.
  void check_parameters_unwritten(const std::vector<std::uint64_t>& before) const {
    CHORUS_CHECK(aliased_versions() == before,
                 "DataParallel: a parameter was written in place during forward; on CPU devices the replicas "
                 "read the primary's parameters in place (Note [host aliases]), so forward must not write "
                 "parameters (keep such state in a buffer: register_buffer)");
  }

  /// Elements of the parameters (the work of a step grows with it).
  std::int64_t parameter_numel() const {
    std::int64_t n = 0;
    for (const auto& e : tensors_) n += e.is_param ? e.tensor.numel() : 0;
    return n;
  }

 private:
  /// Copies the primary's flat buffers into replicas 1 … used-1 on the calling thread, after
  /// whatever their streams still had queued (a drained stream's next work is ours).
  void refresh_on_caller(std::size_t used) {
    const auto& streams = comm_->streams();
    for (std::size_t r = 1; r < used; ++r) {
      CHORUS_CHECK(streams[r]->device().is_cpu(), "DataParallel: a refresh on the calling thread is for CPU devices");
      streams[r]->synchronize();
      for (std::size_t g = 0; g < flats_.size(); ++g)
        if (!aliased(g))
          flats_[g].visit([&](const auto& src) {
          using T = typename std::decay_t<decltype(src)>::value_type;
          backend::copy(replica_flats_[r - 1][g].template as<T>(), src);
        });
    }
  }

  // Note [idle replicas]
  // The broadcast to a replica that this step leaves idle (batch smaller than the device
  // count) reads the primary's flat buffers on that replica's stream, and no forward task
  // follows it there for parallel_apply to wait on: without a join, the optimizer step that
  // writes the primary next races with the copy. So the caller waits for the idle replicas'
  // streams here (CPU: on the host; CUDA: an event the primary's current stream waits on).
  // The marker runs on the worker, after the broadcast's posted work, so it also covers
  // CUDA work that the worker had not yet launched when the broadcast returned.
  void join_idle(std::size_t used) {
    const auto& streams = comm_->streams();
    std::vector<Future<std::optional<Event>>> marks;
    for (std::size_t r = used; r < streams.size(); ++r)
      marks.push_back(streams[r]->async([s = streams[r]] {
        std::optional<Event> done;
        if (s->device().is_cuda()) done.emplace().record(*s);
        return done;
      }));
    for (auto& m : marks)
      if (auto done = m.get()) done->block(current_stream(devices_[0]));
  }

  void check_on_primary() const {
    for (const auto& e : tensors_) {
      CHORUS_CHECK(e.tensor.device() == devices_[0], "DataParallel: ", e.is_param ? "parameter '" : "buffer '", e.name,
                   "' is on ", e.tensor.device(), " but the primary device is ", devices_[0],
                   " (move the module there first)");
      CHORUS_CHECK(e.tensor.shape() == e.shape, "DataParallel: ", e.is_param ? "parameter '" : "buffer '", e.name,
                   "' has shape ", e.tensor.shape(), " but had shape ", e.shape,
                   " when the DataParallel was built (its replicas have that shape); build a new DataParallel");
    }
  }

  void build_layout() {
    for (std::size_t i = 0; i < tensors_.size(); ++i) {
      const DType dt = tensors_[i].tensor.dtype();
      const bool param = tensors_[i].is_param;
      std::size_t g = 0;
      while (g < group_dtypes_.size() && (group_dtypes_[g] != dt || group_params_[g] != param)) ++g;
      if (g == group_dtypes_.size()) {
        group_dtypes_.push_back(dt);
        group_params_.push_back(param);
        group_numel_.push_back(0);
      }
      group_numel_[g] = detail::aligned_flat_offset(group_numel_[g], dtype_size(dt));
      slots_.emplace(tensors_[i].tensor.impl_key(), detail::FlatSlot{i, g, group_numel_[g]});
      offsets_.push_back(group_numel_[g]);
      groups_.push_back(g);
      group_numel_[g] += tensors_[i].tensor.numel();
    }
  }

  static Storage storage_of(const AnyTensor& t) {
    return t.visit([](const auto& x) { return x.impl()->storage; });
  }
  std::size_t nbytes_of(std::size_t k) const {
    return static_cast<std::size_t>(numel_of(tensors_[k].shape)) * dtype_size(group_dtypes_[groups_[k]]);
  }
  std::size_t byte_offset_of(std::size_t k) const {
    return static_cast<std::size_t>(offsets_[k]) * dtype_size(group_dtypes_[groups_[k]]);
  }

  /// Re-seats every primary tensor into the flat buffers (values kept, identity kept), each
  /// as a slice of its group's buffer (Note [storage slices]).
  void flatten_primary() {
    std::vector<AnyTensor> flats;
    std::vector<Storage> storages;
    for (std::size_t g = 0; g < group_dtypes_.size(); ++g)
      flats.push_back(empty_any(group_dtypes_[g], Shape{group_numel_[g]}, devices_[0]));
    NoGradGuard ng;
    for (std::size_t i = 0; i < tensors_.size(); ++i) {
      tensors_[i].tensor.visit([&](const auto& t) {
        using T = typename std::decay_t<decltype(t)>::value_type;
        const auto& flat = flats[groups_[i]].template as<T>();
        backend::copy(flat.narrow(0, offsets_[i], t.numel()).view(t.shape()), t);
      });
      storages.push_back(make_slice_storage(storage_of(flats[groups_[i]]), byte_offset_of(i), nbytes_of(i)));
    }
    // Every copy is made: seat them (nothing below throws).
    for (std::size_t i = 0; i < tensors_.size(); ++i)
      tensors_[i].tensor.visit([&](const auto& t) {
        auto& impl = *t.impl();
        impl.storage = storages[i];
        impl.offset = 0;
        impl.strides = contiguous_strides(impl.shape);
      });
    flats_ = std::move(flats);
    storages_ = std::move(storages);
  }

  bool primary_is_flat() const {
    for (std::size_t i = 0; i < tensors_.size(); ++i) {
      const bool ok = tensors_[i].tensor.visit([&](const auto& t) {
        return t.impl()->storage == storages_[i] && t.storage_offset() == 0 && t.is_contiguous();
      });
      if (!ok) return false;
    }
    return true;
  }

  /// Which tensors train now: floating parameters and buffers that require grad (Note
  /// [gradient buckets]; a buffer that requires grad gets its replicas' gradients too, as
  /// PyTorch's replicate broadcasts such buffers with autograd).
  std::vector<bool> trainable() const {
    std::vector<bool> on;
    on.reserve(tensors_.size());
    for (const auto& e : tensors_) on.push_back(e.tensor.dtype() != DType::Int64 && e.tensor.requires_grad());
    return on;
  }

  void build_buckets() {
    const std::size_t bucket_bytes = bucket_bytes_;
    bucketed_ = trainable();
    buckets_.clear();
    // Tensors that train, latest registered first (backward produces those first).
    std::vector<std::size_t> current;
    std::size_t bytes = 0;
    DType dt = DType::Float32;
    auto flush = [&] {
      if (!current.empty()) buckets_.push_back({dt, current});
      current.clear();
      bytes = 0;
    };
    for (std::size_t k = tensors_.size(); k-- > 0;) {
      const auto& e = tensors_[k];
      if (!bucketed_[k]) continue;
      if (!current.empty() && (e.tensor.dtype() != dt || bytes >= bucket_bytes)) flush();
      dt = e.tensor.dtype();
      current.push_back(k);
      bytes += e.tensor.nbytes();
    }
    flush();
  }

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
  void realias() {
    for (std::size_t r = 1; r < devices_.size(); ++r)
      for (std::size_t k = 0; k < tensors_.size(); ++k)
        if (aliased(groups_[k]))
          replica_tensors_[r - 1][k].visit(
              [&](auto& t) { t.impl()->storage = replica_storage(r, k, replica_flats_[r - 1]); });
  }

  void wire_autograd(std::size_t used) {
    const bool grad = autograd::is_grad_enabled();
    // Clear last step's wiring (a replica parameter with no bucket this step is a plain leaf).
    for (std::size_t r = 1; r < devices_.size(); ++r)
      for (auto& t : replica_tensors_[r - 1])
        t.visit([](auto& x) {
          x.impl()->grad_fn = nullptr;
          x.impl()->requires_grad = false;
        });
    if (!grad) return;
    // Note [where buckets reduce]: each bucket's reduction runs on one of the other replicas'
    // streams, round-robin, not on the primary's: the primary's thread already carries
    // replica 0's backward, the loss and the AccumulateGrad sums, so this balances the load.
    for (std::size_t b = 0; b < buckets_.size(); ++b) {
      Stream* stream = comm_->streams()[1 + b % (used - 1)];
      visit_dtype(buckets_[b].dtype, [&](auto tag) {  // buckets hold floating tensors (trainable())
        using T = decltype(tag);
        if constexpr (is_floating_v<T>) wire_bucket<T>(buckets_[b], used, stream);
      });
    }
  }

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

  const M& replica(std::size_t r) const { return r == 0 ? primary_ : *replicas_[r - 1]; }

 private:
  M& primary_;
  std::vector<std::unique_ptr<M>> replicas_;  // replica r at r - 1
};

}  // namespace parallel
CHORUS_NAMESPACE_END
