#pragma once
// The definitions of parallel/replicate.hpp (ReplicatorCore, detail::ReplicaScope): compiled into
// chorus::compiled (src/parallel/parallel.cpp), included by replicate.hpp itself in the
// header-only form (Note [compiled chorus]).
#include "replicate.hpp"

CHORUS_NAMESPACE_BEGIN
namespace parallel {
namespace detail {

CHORUS_INLINE std::shared_ptr<void> ReplicaScope::copy_tensor(const void* impl, DType dtype) {
  return visit_dtype(dtype, [&](auto tag) { return copy<decltype(tag)>(impl); });
}

}  // namespace detail

CHORUS_INLINE ReplicatorCore::ReplicatorCore(nn::Module& primary, const std::vector<Device>& devices,
                                             std::shared_ptr<Communicator> comm, std::size_t bucket_bytes)
    : root_(primary),
      registered_(nn::detail::registered_keys(primary)),
      devices_(devices),
      comm_(std::move(comm)),
      bucket_bytes_(bucket_bytes) {
  for (auto& p : root_.named_parameters()) tensors_.push_back({p.name, p.tensor, true, p.tensor.shape()});
  for (auto& b : root_.named_buffers()) tensors_.push_back({b.name, b.tensor, false, b.tensor.shape()});
  check_on_primary();
  build_layout();
  flatten_primary();
  build_buckets();
}

CHORUS_INLINE void ReplicatorCore::prepare_core(std::size_t used, bool on_caller) {
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

CHORUS_INLINE std::unique_ptr<CloneScope> ReplicatorCore::replica_scope(std::size_t r, ReplicaBuild& build) const {
  for (std::size_t g = 0; g < group_dtypes_.size(); ++g) build.flats.push_back(replica_flat(g, r));
  return std::make_unique<detail::ReplicaScope>(
      devices_[r], slots_, [this, r, &build](std::size_t k) { return replica_storage(r, k, build.flats); },
      build.made);
}

CHORUS_INLINE void ReplicatorCore::add_replica(std::size_t r, ReplicaBuild&& build, nn::Module& module) {
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

CHORUS_INLINE std::vector<std::uint64_t> ReplicatorCore::aliased_versions() const {
  std::vector<std::uint64_t> v;
  for (std::size_t k = 0; k < tensors_.size(); ++k)
    if (aliased(groups_[k])) v.push_back(storages_[k]->version());
  return v;
}

CHORUS_INLINE void ReplicatorCore::check_parameters_unwritten(const std::vector<std::uint64_t>& before) const {
  CHORUS_CHECK(aliased_versions() == before,
               "DataParallel: a parameter was written in place during forward; on CPU devices the replicas "
               "read the primary's parameters in place (Note [host aliases]), so forward must not write "
               "parameters (keep such state in a buffer: register_buffer)");
}

CHORUS_INLINE std::int64_t ReplicatorCore::parameter_numel() const {
  std::int64_t n = 0;
  for (const auto& e : tensors_) n += e.is_param ? e.tensor.numel() : 0;
  return n;
}

CHORUS_INLINE void ReplicatorCore::refresh_on_caller(std::size_t used) {
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

CHORUS_INLINE void ReplicatorCore::join_idle(std::size_t used) {
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

CHORUS_INLINE void ReplicatorCore::check_on_primary() const {
  nn::detail::check_registry_unchanged(root_, registered_, "DataParallel");
  for (const auto& e : tensors_) {
    CHORUS_CHECK(e.tensor.device() == devices_[0], "DataParallel: ", e.is_param ? "parameter '" : "buffer '", e.name,
                 "' is on ", e.tensor.device(), " but the primary device is ", devices_[0],
                 " (move the module there first)");
    CHORUS_CHECK(e.tensor.shape() == e.shape, "DataParallel: ", e.is_param ? "parameter '" : "buffer '", e.name,
                 "' has shape ", e.tensor.shape(), " but had shape ", e.shape,
                 " when the DataParallel was built (its replicas have that shape); build a new DataParallel");
  }
}

CHORUS_INLINE void ReplicatorCore::build_layout() {
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

CHORUS_INLINE Storage ReplicatorCore::storage_of(const AnyTensor& t) {
  return t.visit([](const auto& x) { return x.impl()->storage; });
}

CHORUS_INLINE void ReplicatorCore::flatten_primary() {
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

CHORUS_INLINE bool ReplicatorCore::primary_is_flat() const {
  for (std::size_t i = 0; i < tensors_.size(); ++i) {
    const bool ok = tensors_[i].tensor.visit([&](const auto& t) {
      return t.impl()->storage == storages_[i] && t.storage_offset() == 0 && t.is_contiguous();
    });
    if (!ok) return false;
  }
  return true;
}

CHORUS_INLINE std::vector<bool> ReplicatorCore::trainable() const {
  std::vector<bool> on;
  on.reserve(tensors_.size());
  for (const auto& e : tensors_) on.push_back(e.tensor.dtype() != DType::Int64 && e.tensor.requires_grad());
  return on;
}

CHORUS_INLINE void ReplicatorCore::build_buckets() {
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

CHORUS_INLINE void ReplicatorCore::realias() {
  for (std::size_t r = 1; r < devices_.size(); ++r)
    for (std::size_t k = 0; k < tensors_.size(); ++k)
      if (aliased(groups_[k]))
        replica_tensors_[r - 1][k].visit(
            [&](auto& t) { t.impl()->storage = replica_storage(r, k, replica_flats_[r - 1]); });
}

CHORUS_INLINE void ReplicatorCore::wire_autograd(std::size_t used) {
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

}  // namespace parallel
CHORUS_NAMESPACE_END
