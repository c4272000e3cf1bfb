#pragma once
// The definitions of parallel/fully_sharded_data_parallel.hpp that do not depend on the module
// type: compiled into chorus::compiled, or included by the header in the header-only form (Note
// [compiled chorus]).
#include "fully_sharded_data_parallel.hpp"

CHORUS_NAMESPACE_BEGIN
namespace parallel::detail {

/// f(typed tensor) for a floating-point tensor; a unit's tensors are never of another dtype.
template <class F>
void visit_floating(const AnyTensor& t, F&& f) {
  t.visit([&](const auto& x) {
    using T = typename std::decay_t<decltype(x)>::value_type;
    if constexpr (is_floating_v<T>) f(x);
    else CHORUS_FAIL("FullyShardedDataParallel: a collective over a ", dtype_name(t.dtype()), " tensor");
  });
}

CHORUS_INLINE void ReplicaShardGroup::broadcast(const AnyTensor& t) {
  visit_floating(t, [&](const auto& x) { step->broadcast(rank_, x); });
}

CHORUS_INLINE Pending ReplicaShardGroup::all_gather(const AnyTensor& full, const AnyTensor& part, const std::string&) {
  visit_floating(full, [&](const auto& f) {
    using T = typename std::decay_t<decltype(f)>::value_type;
    step->all_gather(rank_, part.template as<T>(), f);
  });
  return {};  // done: the replicas met
}

CHORUS_INLINE Pending ReplicaShardGroup::reduce_scatter(const AnyTensor& part, const AnyTensor& full,
                                                        const std::string&) {
  visit_floating(full, [&](const auto& f) {
    using T = typename std::decay_t<decltype(f)>::value_type;
    step->reduce_scatter(rank_, f, part.template as<T>());
  });
  return {};
}

CHORUS_INLINE std::shared_ptr<void> ShardReplicaScope::copy_tensor(const void* impl, DType dtype) {
  return visit_dtype(dtype, [&](auto tag) -> std::shared_ptr<void> {
    using T = decltype(tag);
    const auto& src = *static_cast<const TensorImpl<T>*>(impl);
    if (!params_.count(impl)) return nn::detail::deep_copy(src, device_);
    auto out = std::make_shared<TensorImpl<T>>();
    out->storage = std::make_shared<StorageImpl>(StorageImpl::slice_t{}, device_,
                                                 static_cast<std::size_t>(numel_of(src.shape)) * sizeof(T));
    out->shape = src.shape;
    out->strides = contiguous_strides(src.shape);
    out->requires_grad = src.requires_grad;
    return out;
  });
}

/// Each replica's units with parameters, in order.
inline std::vector<UnitList> unit_lists(const std::vector<std::vector<std::shared_ptr<FsdpUnit>>>& units) {
  std::vector<UnitList> lists(units.size());
  for (std::size_t r = 0; r < units.size(); ++r)
    for (const auto& u : units[r])
      if (!u->empty()) lists[r].push_back(u.get());
  return lists;
}

CHORUS_INLINE void save_replica_shards(const std::vector<std::vector<std::shared_ptr<FsdpUnit>>>& units,
                                       const std::vector<nn::Module::NamedTensor>& buffers,
                                       const optim::Optimizer& opt, const std::string& dir,
                                       const io::TrainingState& with, const io::Metadata& metadata) {
  CHORUS_CHECK(with.master == nullptr, "FullyShardedDataParallel::save_sharded: the wrapper keeps float32 master "
                                      "shards itself (shard_dtype); there are no amp::MasterWeights to save");
  const auto lists = unit_lists(units);
  const std::size_t n = lists.size(), k_units = lists[0].size();
  const auto params = opt.parameters();
  CHORUS_CHECK(params.size() == k_units * n, "FullyShardedDataParallel::save_sharded: the optimizer steps ",
               params.size(), " tensors; it must step the wrapper's parameters() (", k_units * n, " shards)");
  for (std::size_t k = 0; k < k_units; ++k)
    for (std::size_t r = 0; r < n; ++r)
      CHORUS_CHECK(params[k * n + r].impl_key() == lists[r][k]->shard().impl_key(),
                   "FullyShardedDataParallel::save_sharded: the optimizer's parameter ", k * n + r,
                   " is not the shard of '", lists[r][k]->shard_name(), "' on device ", r,
                   "; build it over parameters()");
  for (std::size_t r = 0; r < n; ++r) {
    const int rank = static_cast<int>(r), world = static_cast<int>(n);
    write_shard_file(dir, lists[r], rank, world, r == 0 ? buffers : std::vector<nn::Module::NamedTensor>{});
    std::vector<std::pair<std::size_t, const optim::Optimizer::State*>> states;
    for (std::size_t k = 0; k < k_units; ++k) states.emplace_back(k, &opt.state()[k * n + r]);
    io::detail::write_atomically(io::detail::shard_file(dir, "optim", rank, world),
                                 io::detail::optimizer_image(opt, states, with, k_units));
  }
  io::detail::write_index(dir, shard_index(lists[0], static_cast<int>(n), metadata));  // last: the files are whole
}

CHORUS_INLINE io::Metadata load_replica_shards(const std::vector<std::vector<std::shared_ptr<FsdpUnit>>>& units,
                                               const std::vector<nn::Module::NamedTensor>& buffers,
                                               optim::Optimizer& opt, const std::string& dir,
                                               const io::TrainingState& with) {
  const auto lists = unit_lists(units);
  const std::size_t n = lists.size();
  ShardReader reader(dir, lists[0], "load_sharded");
  std::vector<nn::Module::NamedTensor> state;
  std::vector<std::vector<AnyTensor>> shards;
  for (std::size_t r = 0; r < n; ++r)
    shards.push_back(reader.read(lists[r], static_cast<int>(r), [&](std::size_t k) { return k * n + r; }, state));
  io::Metadata meta = reader.first_optim().metadata;  // the groups, scheduler and scaler (the same in every file)
  meta["parameters"] = std::to_string(opt.parameters().size());
  chorus::load(opt, io::parse(io::detail::serialise(state, meta)), with);  // refuses, changing nothing, on a mismatch
  for (std::size_t r = 0; r < n; ++r) set_shards(lists[r], shards[r]);
  reader.read_buffers(buffers);
  return io::detail::index_metadata(reader.index());
}

CHORUS_INLINE ChunkPlan even_chunks(std::int64_t batch, std::size_t devices) {
  const auto k = static_cast<std::int64_t>(devices);
  ChunkPlan plan;
  std::int64_t at = 0;
  for (std::int64_t r = 0; r < k; ++r) {
    plan.offsets.push_back(at);
    plan.sizes.push_back(batch / k + (r < batch % k ? 1 : 0));
    at += plan.sizes.back();
  }
  return plan;
}

CHORUS_INLINE AnyTensor whole_flat(const std::vector<std::vector<std::shared_ptr<FsdpUnit>>>& units, std::size_t u,
                                   Device device) {
  const FsdpUnit& first = *units[0][u];
  const std::int64_t s = first.shard_numel();
  AnyTensor full = empty_any(first.dtype(), Shape{s * static_cast<std::int64_t>(units.size())}, device);
  NoGradGuard ng;
  full.visit([&](const auto& f) {
    using T = typename std::decay_t<decltype(f)>::value_type;
    for (std::size_t r = 0; r < units.size(); ++r) {
      const auto part = convert_any(units[r][u]->shard(), first.dtype()).template as<T>();
      backend::copy(f.narrow(0, static_cast<std::int64_t>(r) * s, s), part.to(device));
    }
  });
  return full;
}

}  // namespace parallel::detail
CHORUS_NAMESPACE_END
