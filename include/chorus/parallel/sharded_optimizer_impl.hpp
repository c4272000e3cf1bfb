#pragma once
// The definitions of parallel/sharded_optimizer.hpp that do not depend on the optimizer type
// (the shards, their handles, the copies in and out): compiled into chorus::compiled
// (src/parallel/parallel.cpp), included by sharded_optimizer.hpp itself in the header-only form
// (Note [compiled chorus]).
#include "sharded_optimizer.hpp"

CHORUS_NAMESPACE_BEGIN
namespace parallel {
namespace detail {

CHORUS_INLINE void partition_shards(const std::vector<AnyTensor>& params, std::size_t k,
                                    std::vector<std::vector<std::size_t>>& members, std::vector<std::size_t>& shard_of) {
  const std::size_t P = params.size();
  std::int64_t total = 0;
  for (const auto& p : params) total += p.numel();
  members.assign(k, {});
  shard_of.assign(P, 0);
  std::size_t i = 0;
  std::int64_t before = 0;
  for (std::size_t r = 0; r < k; ++r) {
    // Up to the r-th k-th of the elements (a parameter goes where its middle element falls;
    // 2x to stay in integers), at least one parameter each while they last.
    const std::int64_t bound = 2 * total * static_cast<std::int64_t>(r + 1);
    const std::size_t leave = k - 1 - r;  // one parameter for each shard after this one
    for (bool first = true; i < P; first = false) {
      const std::int64_t n = params[i].numel();
      if (r + 1 < k && !first && ((2 * before + n) * static_cast<std::int64_t>(k) > bound || P - i <= leave)) break;
      shard_of[i] = r;
      members[r].push_back(i);
      before += n;
      ++i;
    }
  }
}

CHORUS_INLINE AnyTensor shard_handle(const AnyTensor& p, Device device) {
  return p.visit([&](const auto& t) {
    if (device.is_cpu() && t.device().is_cpu()) return AnyTensor(detail::host_alias(t, device));
    return AnyTensor(t.detach().to(device));
  });
}

CHORUS_INLINE void keep_grads_on_shards(const std::vector<AnyTensor>& params, const std::vector<AnyTensor>& handles,
                                        const std::vector<bool>& away) {
  NoGradGuard ng;
  // Every move made before any parameter changes (a failed copy leaves them as they were).
  std::vector<AnyTensor> moved(params.size());
  for (std::size_t i = 0; i < params.size(); ++i)
    if (away[i])
      params[i].visit([&](const auto& p) {
        const auto g = p.grad();  // on the primary: away[i] means another device
        if (g.defined()) moved[i] = AnyTensor(g.to(handles[i].device()));
      });
  for (std::size_t i = 0; i < params.size(); ++i)
    if (away[i])
      params[i].visit([&](const auto& p) {
        using T = typename std::decay_t<decltype(p)>::value_type;
        const auto& h = handles[i].template as<T>();
        h.set_grad(moved[i].defined() ? moved[i].template as<T>() : Tensor<T>());
        p.set_grad(Tensor<T>());
        p.impl()->grad_keeper = h.impl();
      });
}

CHORUS_INLINE void return_kept_grads(const std::vector<AnyTensor>& params, const std::vector<AnyTensor>& handles) noexcept {
  NoGradGuard ng;
  for (std::size_t i = 0; i < params.size(); ++i)
    params[i].visit([&](const auto& p) {
      using T = typename std::decay_t<decltype(p)>::value_type;
      auto& impl = *p.impl();
      if (!impl.grad_keeper || impl.grad_keeper != handles[i].template as<T>().impl()) return;
      const auto kept = Tensor<T>(impl.grad_keeper).grad();
      impl.grad_keeper = nullptr;
      try {
        impl.grad = kept.defined() ? kept.to(impl.device()).contiguous().impl() : nullptr;
      } catch (...) {
        impl.grad = nullptr;  // no memory for it on the parameter's device: as after zero_grad()
      }
    });
}

CHORUS_INLINE void check_shard_grads(const std::vector<AnyTensor>& params) {
  for (std::size_t i = 0; i < params.size(); ++i)
    params[i].visit([&](const auto& p) {
      using T = typename std::decay_t<decltype(p)>::value_type;
      if constexpr (is_floating_v<T>) {
        const auto grad = p.grad();
        if (!grad.defined()) return;
        CHORUS_CHECK(p.is_contiguous() && grad.is_contiguous(), "optimizer: parameter ", i,
                     " or its gradient is not contiguous");
        CHORUS_CHECK(grad.shape() == p.shape(), "optimizer: gradient of parameter ", i, " has shape ", grad.shape(),
                     ", the parameter has shape ", p.shape());
        CHORUS_CHECK(grad.device() == p.grad_device(), "optimizer: gradient of parameter ", i, " is on ",
                     grad.device(), ", the parameter on ", p.device());
      }
    });
}

CHORUS_INLINE void bring_to_shard(const std::vector<std::size_t>& members, const std::vector<AnyTensor>& params,
                                  const std::vector<AnyTensor>& handles, Device device) {
  for (auto i : members) {
    params[i].visit([&](const auto& p) {
      using T = typename std::decay_t<decltype(p)>::value_type;
      auto h = handles[i].template as<T>();
      // A gradient kept on the shard (Note [sharded gradients in one process]) is already h's.
      const bool kept = p.impl()->grad_keeper == h.impl();
      auto grad = kept ? Tensor<T>() : p.grad();
      if (p.device() == device) {
        // The shard's device is the parameter's own (shard 0, or a repeated GPU): the handle
        // views the parameter's memory and its gradient, re-pointed every step (DataParallel::to
        // may have given the parameter new memory); a copy would copy each onto itself.
        h.impl()->storage = p.impl()->storage;
        h.impl()->offset = p.impl()->offset;
        h.set_grad(grad);
      } else if (device.is_cpu() && p.device().is_cpu()) {
        // Re-aliased every step: DataParallel::to may have given the parameter new memory.
        h.impl()->storage = make_alias_storage(device, p.impl()->storage,
                                               static_cast<std::size_t>(p.storage_offset()) * sizeof(T),
                                               static_cast<std::size_t>(p.numel()) * sizeof(T));
        if (!kept) h.set_grad(grad.defined() ? detail::host_alias(grad, device) : Tensor<T>());
      } else {
        backend::copy(h, p);
        if (kept) return;  // h's own gradient, accumulated there in backward
        if (!grad.defined()) {
          h.set_grad(Tensor<T>());
        } else {
          auto hg = h.grad();
          if (!hg.defined()) hg = Tensor<T>::empty(h.shape(), device);
          backend::copy(hg, grad);
          h.set_grad(hg);
        }
      }
    });
  }
}

CHORUS_INLINE void return_from_shard(const std::vector<std::size_t>& members, const std::vector<AnyTensor>& params,
                                     const std::vector<AnyTensor>& handles, Device device, Device primary) {
  if (device.is_cpu() && primary.is_cpu()) return;  // written in place through the aliases
  for (auto i : members)
    params[i].visit([&](const auto& p) {
      using T = typename std::decay_t<decltype(p)>::value_type;
      if (p.device() != device) backend::copy(p, handles[i].template as<T>());  // else: its own memory
      p.bump_version();  // an in-place update (Note [version counter])
    });
}

}  // namespace detail
}  // namespace parallel
CHORUS_NAMESPACE_END
