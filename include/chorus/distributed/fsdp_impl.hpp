#pragma once
// The definitions of distributed/fsdp.hpp that do not depend on the module type: compiled into
// chorus::compiled and the MPI library, or included by fsdp.hpp in the header-only form (Note
// [compiled chorus]).
#include <unordered_set>

#include "ddp.hpp"
#include "fsdp.hpp"

CHORUS_NAMESPACE_BEGIN
namespace dist {
inline namespace CHORUS_DIST_NS {
namespace detail {

CHORUS_INLINE void ProcessShardGroup::broadcast(const AnyTensor& t) {
  t.visit([&](const auto& x) { group_.broadcast(x, 0); });
}

CHORUS_INLINE parallel::detail::Pending ProcessShardGroup::all_gather(const AnyTensor& full, const AnyTensor& part,
                                                                      const std::string& what) {
  return full.visit([&](const auto& f) -> parallel::detail::Pending {
    using T = typename std::decay_t<decltype(f)>::value_type;
    auto work = group_.all_gather_into_async(f, part.template as<T>(), what);
    return [work, this] { work->wait(group_.timeout()); };
  });
}

CHORUS_INLINE parallel::detail::Pending ProcessShardGroup::reduce_scatter(const AnyTensor& part, const AnyTensor& full,
                                                                          const std::string& what) {
  return full.visit([&](const auto& f) -> parallel::detail::Pending {
    using T = typename std::decay_t<decltype(f)>::value_type;
    auto work = group_.reduce_scatter_async(part.template as<T>(), f, ReduceOp::Avg, what);
    return [work, this] { work->wait(group_.timeout()); };
  });
}

CHORUS_INLINE std::vector<std::shared_ptr<FsdpUnit>> setup_fsdp(nn::Module& root, FsdpShared& shared,
                                                                ProcessGroup& g) {
  g.check_usable("FullyShardedDataParallel");
  const auto params = root.named_parameters();
  const auto buffers = root.named_buffers();
  Device device = params.empty() ? Device::cpu(0) : params[0].tensor.device();
  for (const auto& p : params)
    CHORUS_CHECK(p.tensor.device() == device, "FullyShardedDataParallel: the module's parameters are on ", device,
                 " and ", p.tensor.device(), " ('", p.name, "'); move the module to one device first");
  ::chorus::dist::detail::verify_same_model(g, params, buffers);
  ::chorus::dist::detail::sync_from(g, 0, {}, buffers, /*buffers_only=*/true);
  return parallel::detail::make_units(root, shared);
}

CHORUS_INLINE std::vector<nn::Module::NamedTensor> fsdp_full_state_dict(
    nn::Module& root, const std::vector<std::shared_ptr<FsdpUnit>>& units) {
  NoGradGuard ng;
  std::unordered_map<const void*, AnyTensor> copies;
  for (const auto& u : units) {
    const bool was = u->gathered();
    u->unshard();
    for (const auto& p : u->params())
      p.visit([&](const auto& t) { copies.emplace(p.impl_key(), AnyTensor(t.detach().clone())); });
    if (!was) u->reshard();
  }
  std::vector<nn::Module::NamedTensor> out;
  for (const auto& [name, t] : root.named_parameters()) out.push_back({name, copies.at(t.impl_key())});
  for (const auto& buffer : root.named_buffers())
    buffer.tensor.visit([&](const auto& b) { out.push_back({buffer.name, AnyTensor(b.detach().clone())}); });
  return out;
}

CHORUS_INLINE void release_fsdp(nn::Module& root, const std::vector<std::shared_ptr<FsdpUnit>>& units, bool gather) {
  if (gather) {
    try {
      finish_all_gradients(units.front()->shared());
      for (const auto& u : units) u->unshard();  // the slices keep the gathered buffers
    } catch (...) {  // a destructor must not throw: the module then holds no parameters
    }
  }
  parallel::detail::unlink_units(root, units);
}

}  // namespace detail
}  // namespace CHORUS_DIST_NS
}  // namespace dist
CHORUS_NAMESPACE_END
