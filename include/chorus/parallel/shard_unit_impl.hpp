#pragma once
// The definitions of parallel/shard_unit.hpp: compiled into chorus::compiled, or included by
// shard_unit.hpp in the header-only form (Note [compiled chorus]).
#include "shard_unit.hpp"

CHORUS_NAMESPACE_BEGIN
namespace parallel::detail {

CHORUS_INLINE AnyTensor convert_any(const AnyTensor& t, DType to) {
  if (t.dtype() == to) return t;
  return t.visit([&](const auto& x) {
    return visit_dtype(to, [&](auto tag) -> AnyTensor {
      using U = decltype(tag);
      if constexpr (is_floating_v<U>) return AnyTensor(x.detach().template to<U>());
      else CHORUS_FAIL("FullyShardedDataParallel: a ", dtype_name(to), " shard");
    });
  });
}

CHORUS_INLINE FsdpUnit::FsdpUnit(std::string name, const std::vector<nn::Module::NamedTensor>& params,
                                 FsdpShared& shared, bool root)
    : name_(std::move(name)), shared_(shared), root_(root) {
  ShardGroup& g = *shared_.group;
  const std::string who = root_ ? std::string("the root") : "unit '" + name_ + "'";
  bool trains = false;
  for (const auto& [n, t] : params) {
    CHORUS_CHECK(is_floating_dtype(t.dtype()), "FullyShardedDataParallel: parameter '", n, "' of ", who, " is ",
                 dtype_name(t.dtype()), "; parameters are floating point");
    const bool contiguous = t.visit([](const auto& x) { return x.is_contiguous() && x.storage_offset() == 0; });
    const bool grad = t.visit([](const auto& x) { return x.requires_grad(); });
    if (params_.empty()) {
      dtype_ = t.dtype();
      device_ = t.device();
      trains = grad;
    }
    CHORUS_CHECK(t.dtype() == dtype_ && t.device() == device_, "FullyShardedDataParallel: ", who,
                 " holds parameters of ", dtype_name(dtype_), " on ", device_, " and '", n, "', of ",
                 dtype_name(t.dtype()), " on ", t.device(), "; a unit's parameters share one dtype and device "
                 "(make the others a unit of their own)");
    CHORUS_CHECK(grad == trains, "FullyShardedDataParallel: ", who, " holds trained and frozen parameters ('", n,
                 "'); a unit's parameters all train or are all frozen (make the others a unit of their own)");
    CHORUS_CHECK(contiguous, "FullyShardedDataParallel: parameter '", n, "' is a view into other memory");
    offsets_.push_back(numel_);
    numel_ += t.numel();
    names_.push_back(n);
    params_.push_back(t);
  }
  if (params_.empty()) return;
  shard_dtype_ = shared_.shard_dtype.value_or(dtype_);
  CHORUS_CHECK(is_floating_dtype(shard_dtype_) && dtype_size(shard_dtype_) >= dtype_size(dtype_),
               "FullyShardedDataParallel: shards of ", dtype_name(shard_dtype_), " for parameters of ",
               dtype_name(dtype_), " (", who, "); a shard is as wide as its parameters or wider");
  const int world = g.size();
  shard_numel_ = (numel_ + world - 1) / world;
  full_ = empty_any(dtype_, Shape{shard_numel_ * world}, device_);
  full_.visit([&](const auto& full) {
    using T = typename std::decay_t<decltype(full)>::value_type;
    NoGradGuard ng;
    backend::fill(full, T(0));  // the padding
    if (g.rank() == 0)  // the others' parameters may view no memory (a replica's)
      for (std::size_t i = 0; i < params_.size(); ++i) {
        const auto& p = params_[i].template as<T>();
        backend::copy(flat_part(full, offsets_[i], p.numel(), p.shape()), p);
      }
    g.broadcast(full_);  // every rank starts from rank 0's parameters
    const auto mine = full.narrow(0, g.rank() * shard_numel_, shard_numel_).contiguous();
    shard_ = convert_any(AnyTensor(mine), shard_dtype_);
    if (shard_.template is<T>() && shard_.template as<T>().impl() == mine.impl())
      shard_ = AnyTensor(mine.clone());  // its own memory, not the gathered buffer's
    shard_.visit([&](const auto& shard) {
      shard.impl()->requires_grad = trains;  // a leaf of its own
      shard.impl()->grad_is_shard = g.spans_processes();
    });
    block_ = full.impl()->storage;
    for (std::size_t i = 0; i < params_.size(); ++i) {
      auto& impl = *params_[i].template as<T>().impl();
      impl.storage = make_slice_storage(block_, static_cast<std::size_t>(offsets_[i]) * sizeof(T),
                                        static_cast<std::size_t>(params_[i].numel()) * sizeof(T));
      impl.offset = 0;
      impl.grad.reset();
    }
  });
  reshard();
}

CHORUS_INLINE void FsdpUnit::start_unshard() {
  if (empty() || block_ || gathering_) return;
  ShardGroup& g = *shared_.group;
  full_ = empty_any(dtype_, Shape{shard_numel_ * g.size()}, device_);
  const AnyTensor part = convert_any(shard_, dtype_);  // this rank's part, in the parameters' dtype
  gathering_ = g.all_gather(full_, part.visit([](const auto& p) { return AnyTensor(p.detach()); }),
                            "FSDP all_gather of " + name_);
  if (!gathering_) gathering_ = [] {};
}

CHORUS_INLINE void FsdpUnit::unshard() {
  if (empty() || block_) return;
  start_unshard();
  auto gathering = std::move(gathering_);
  gathering_ = nullptr;
  gathering();
  install(std::move(full_));
}

CHORUS_INLINE void FsdpUnit::install(AnyTensor full) {
  if (empty()) return;
  CHORUS_CHECK(full.dtype() == dtype_ && full.device() == device_ && full.numel() >= numel_,
               "FullyShardedDataParallel: unit '", name_, "' of ", numel_, " ", dtype_name(dtype_), " elements on ",
               device_, " given ", full.numel(), " ", dtype_name(full.dtype()), " elements on ", full.device());
  full_ = std::move(full);
  full_.visit([&](const auto& f) {
    using T = typename std::decay_t<decltype(f)>::value_type;
    block_ = f.impl()->storage;
    for (std::size_t i = 0; i < params_.size(); ++i)
      params_[i].template as<T>().impl()->storage->reseat_slice(block_, static_cast<std::size_t>(offsets_[i]) *
                                                                            sizeof(T));
  });
}

CHORUS_INLINE void FsdpUnit::reshard() {
  if (empty() || shared_.summoned) return;
  if (gathering_) {  // a prefetch nobody used: finish it (every rank started it) and drop it
    auto gathering = std::move(gathering_);
    gathering_ = nullptr;
    gathering();
  }
  for (const auto& p : params_) p.visit([](const auto& t) { t.impl()->storage->reseat_slice(nullptr, 0); });
  block_.reset();
  full_ = AnyTensor();
}

CHORUS_INLINE void FsdpUnit::reduce_gradients(std::vector<AnyTensor> grads) {
  if (empty()) return;
  // One reduce-scatter in flight at a time: the last unit's ran while this one computed; its
  // full-size input is freed before this one's is made.
  finish_all_gradients(shared_);
  ShardGroup& g = *shared_.group;
  auto flat = empty_any(dtype_, Shape{shard_numel_ * g.size()}, device_);
  grad_part_ = empty_any(dtype_, Shape{shard_numel_}, device_);
  flat.visit([&](const auto& f) {
    using T = typename std::decay_t<decltype(f)>::value_type;
    NoGradGuard ng;
    for (std::size_t i = 0; i < params_.size(); ++i) {  // zeros only where no gradient goes
      const auto part = f.narrow(0, offsets_[i], params_[i].numel());
      if (grads[i].defined()) backend::copy(part.view(grads[i].shape()), grads[i].template as<T>());
      else backend::fill(part, T(0));
    }
    if (f.numel() > numel_) backend::fill(f.narrow(0, numel_, f.numel() - numel_), T(0));  // the padding
  });
  reducing_ = g.reduce_scatter(grad_part_, flat, "FSDP reduce_scatter of " + name_);
  if (!reducing_) reducing_ = [] {};
  shared_.reducing.push_back(this);
}

CHORUS_INLINE void FsdpUnit::finish_gradients() {
  if (!reducing_) return;
  auto reducing = std::move(reducing_);
  reducing_ = nullptr;
  reducing();
  shard_.visit([&](const auto& s) {
    using T = typename std::decay_t<decltype(s)>::value_type;
    NoGradGuard ng;
    const auto part = convert_any(grad_part_, shard_dtype_).template as<T>();
    if (s.grad().defined()) backend::binary_same(s.grad(), part, s.grad(), backend::fn::Add{});
    else s.set_grad(part);
  });
  grad_part_ = AnyTensor();
}

CHORUS_INLINE void FsdpUnit::entered_forward() {
  FsdpShared& sh = shared_;
  if (root_) {  // a new step: nothing of the last one stays gathered or in flight
    finish_all_gradients(sh);
    for (auto* u : sh.units) u->reshard();
    sh.recording.clear();
    return;
  }
  sh.recording.push_back(this);
  start_unshard();  // its own gather first, then the next unit's
  const std::size_t at = sh.recording.size() - 1;
  if (sh.prefetch && at + 1 < sh.order.size() && sh.order[at] == this) sh.order[at + 1]->start_unshard();
}

CHORUS_INLINE void FsdpUnit::left_forward() {
  if (root_) shared_.order = shared_.recording;
}

CHORUS_INLINE void FsdpUnit::prefetch_previous() {
  FsdpShared& sh = shared_;
  if (!sh.prefetch || sh.order.empty()) return;
  if (root_) {  // backward begins with the unit that ran forward last
    sh.order.back()->start_unshard();
    return;
  }
  for (std::size_t at = sh.order.size(); at-- > 1;)
    if (sh.order[at] == this) {
      sh.order[at - 1]->start_unshard();
      return;
    }
}

CHORUS_INLINE void finish_all_gradients(FsdpShared& shared) {
  auto reducing = std::move(shared.reducing);
  shared.reducing.clear();
  for (auto* u : reducing) u->finish_gradients();
}

CHORUS_INLINE void zero_shard_grads(const std::vector<AnyTensor>& shards, bool set_to_none) {
  NoGradGuard ng;
  for (const auto& p : shards)
    p.visit([&](const auto& t) {
      if (!t.grad().defined()) return;
      if (set_to_none) t.set_grad(std::decay_t<decltype(t)>());
      else backend::fill(t.grad(), typename std::decay_t<decltype(t)>::value_type(0));
    });
}

}  // namespace parallel::detail
CHORUS_NAMESPACE_END
