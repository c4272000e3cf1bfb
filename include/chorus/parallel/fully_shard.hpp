#pragma once
// FullyShard(block): a module that is a unit of its own under a FullyShardedDataParallel (the
// process-group one, dist::FullyShardedDataParallel, or the one-process one,
// parallel::FullyShardedDataParallel), and how a module's units are found (Note [fully sharded
// parameters] in shard_unit.hpp).
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "../compiled.hpp"
#include "../nn/checkpoint.hpp"
#include "../nn/module.hpp"
#include "shard_unit.hpp"

CHORUS_NAMESPACE_BEGIN
namespace parallel {

namespace detail {
/// A FullyShard module's link to the unit of the FullyShardedDataParallel that adopted it (null before).
class FsdpUnitSlot {
 public:
  virtual ~FsdpUnitSlot() = default;
  std::shared_ptr<FsdpUnit> fsdp_unit;
};

/// The units of `root` (itself first, as the root unit; then each FullyShard module inside, by
/// dotted name): each gets the parameters registered in it and not in a unit inside it. Refuses
/// a parameter two units register (a tied weight) and a FullyShard another FSDP adopted.
CHORUS_INLINE std::vector<std::pair<std::string, std::vector<nn::Module::NamedTensor>>> fsdp_units(
    nn::Module& root, std::vector<FsdpUnitSlot*>& slots);
/// Builds the units of `root` on `shared` (its group set), linking the FullyShard modules: a
/// collective (each unit broadcasts member 0's values).
CHORUS_INLINE std::vector<std::shared_ptr<FsdpUnit>> make_units(nn::Module& root, FsdpShared& shared);
/// Marks the units released (a graph recorded under them refuses backward) and unlinks the
/// FullyShard modules of `root` that they were linked to (no other FSDP's).
CHORUS_INLINE void unlink_units(nn::Module& root, const std::vector<std::shared_ptr<FsdpUnit>>& units);
}  // namespace detail

/// The module `Impl`, a unit of its own under a FullyShardedDataParallel: its parameters are
/// gathered for its forward and backward only. Outside one it is `Impl` as it is (same
/// parameters, buffers and names). Made by FullyShard(block).
template <class Impl>
class FullyShardImpl : public Impl, public detail::FsdpUnitSlot {
 public:
  /// A copy of `block` (Impl's copy constructor: its tensors and submodules are shared), not yet adopted.
  explicit FullyShardImpl(const Impl& block) : Impl(block) {}
  /// A copy of `other` as Impl copies; the copy is not adopted by `other`'s FullyShardedDataParallel.
  FullyShardImpl(const FullyShardImpl& other) : Impl(other) {}  // a copy is not adopted
  FullyShardImpl& operator=(const FullyShardImpl&) = delete;

  /// Impl's forward, between the gather of the unit's parameters and their release.
  template <class... Args>
  auto forward(const Args&... args) {
    if (!fsdp_unit) return Impl::forward(args...);
    auto unit = fsdp_unit;
    return nn::detail::call_as_graph_function(
        [this](const Args&... a) { return Impl::forward(a...); },
        [&unit](auto run, std::vector<AnyTensor> inputs, std::vector<AnyTensor>) {
          return detail::run_unit(unit, std::move(run), std::move(inputs));
        },
        args...);
  }
  /// "FullyShard(" + Impl's name + ")".
  std::string name() const override { return "FullyShard(" + Impl::name() + ")"; }
};

/// `block` (a holder such as nn::TransformerEncoderLayer or a user module's holder) as a unit of
/// a FullyShardedDataParallel (PyTorch's fully_shard(block)): it shares the block's parameters
/// and buffers, under the block's own names.
template <class Holder>
class FullyShard : public nn::ModuleHolder<FullyShardImpl<typename Holder::ImplType>> {
  using Impl = typename Holder::ImplType;

 public:
  using nn::ModuleHolder<FullyShardImpl<Impl>>::ModuleHolder;
  /// Wraps the module `block` holds, sharing its parameters and buffers.
  explicit FullyShard(const Holder& block)
      : nn::ModuleHolder<FullyShardImpl<Impl>>(std::make_shared<FullyShardImpl<Impl>>(*block)) {}
};
/// Deduces Holder from the block, so `FullyShard(block)` needs no template argument.
template <class Holder>
  requires requires { typename Holder::ImplType; }
FullyShard(const Holder&) -> FullyShard<Holder>;

}  // namespace parallel
CHORUS_NAMESPACE_END

#if !CHORUS_COMPILED
#include "fully_shard_impl.hpp"
#endif
