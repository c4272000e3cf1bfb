#pragma once
// The definitions of nn/utils.hpp (gradient clipping): compiled into chorus::compiled
// (src/nn/utils.cpp), included by utils.hpp itself only in the header-only form (Note [compiled
// chorus]).
#include <unordered_set>

#include "utils.hpp"

CHORUS_NAMESPACE_BEGIN
namespace nn::utils {

namespace detail {
CHORUS_INLINE std::vector<DeviceGrads> device_grads(const std::vector<AnyTensor>& params) {
  std::unordered_set<const void*> seen;
  for (std::size_t i = 0; i < params.size(); ++i)
    CHORUS_CHECK(!params[i].defined() || seen.insert(params[i].impl_key()).second, "clip_grad: parameter ", i,
                 " appears more than once in the list (its gradient would count twice); module.parameters() lists "
                 "a tied parameter once");
  std::vector<DeviceGrads> out;
  for_each_grad(params, [&](const auto& g) {
    using T = typename std::decay_t<decltype(g)>::value_type;
    const Device d = g.device().is_cpu() ? Device::cpu() : g.device();
    DeviceGrads* dg = nullptr;
    for (auto& e : out)
      if (e.device == d) dg = &e;
    if (!dg) dg = &out.emplace_back(DeviceGrads{d, {}, {}});
    if constexpr (std::is_same_v<T, float>) dg->f32.add(g);
    else if constexpr (std::is_same_v<T, double>) dg->f64.add(g);
    else if constexpr (is_reduced_floating_v<T>)
      CHORUS_FAIL("clip_grad: ", dtype_name(dtype_of<T>()),
                  " gradients: clip the float32 master weights' instead, in the step: "
                  "master.step(opt, {.max_norm = ...}) (amp::MasterWeights)");
    else static_assert(sizeof(T) == 0, "clip_grad: add the gradient type to DeviceGrads");
  });
  return out;
}

CHORUS_INLINE Tensor<double> total_norm(std::vector<DeviceGrads>& groups, double norm_type, double max_norm,
                                        Tensor<double>* coef) {
  const bool inf = std::isinf(norm_type) && norm_type > 0;
  CHORUS_CHECK(inf || norm_type > 0, "clip_grad_norm_: norm_type must be positive or infinity, got ", norm_type);
  const auto spec = backend::norm_spec(norm_type);
  const Device home = groups.empty() ? Device::cpu() : groups[0].device;
  std::int64_t parts_n = 0;
  for (const auto& g : groups) parts_n += g.dtypes();
  // Each (device, dtype) accumulates its terms into one scalar on its device; they meet at home.
  auto parts = Tensor<double>::empty(Shape{std::max<std::int64_t>(parts_n, 1)}, home);
  std::int64_t at = 0;
  for (auto& g : groups) {
    auto raw = g.device == home ? parts.narrow(0, at, g.dtypes()) : Tensor<double>::empty(Shape{g.dtypes()}, g.device);
    int k = 0;
    if (!g.f32.ptrs.empty()) backend::foreach_norm(g.f32.ptrs, g.f32.numels, spec, raw.data() + k++, g.device);
    if (!g.f64.ptrs.empty()) backend::foreach_norm(g.f64.ptrs, g.f64.numels, spec, raw.data() + k++, g.device);
    if (g.device != home) backend::copy(parts.narrow(0, at, g.dtypes()), raw);
    at += g.dtypes();
  }
  auto total = Tensor<double>::empty(Shape{}, home);
  auto c = Tensor<double>::empty(Shape{}, home);
  backend::norm_finish(parts.data(), parts_n, spec, max_norm, total.data(), c.data(), home);
  if (coef) *coef = c;
  return total;
}

/// Refuses parameters whose gradient another process keeps (ZeRO-2): `who`'s norm would miss it.
CHORUS_INLINE void check_grads_here(const std::vector<AnyTensor>& params, const char* who) {
  for (const auto& p : params)
    p.visit([&](const auto& t) {
      CHORUS_CHECK(!t.defined() || t.grad().defined() || !t.impl()->grad_on_other_rank, who,
                   ": a parameter's gradient is kept by another rank (DistributedDataParallel::shard_gradients), so "
                   "the norm of this rank's gradients is not the model's; call the ZeroRedundancyOptimizer's "
                   "clip_grad_norm_, which takes the norm over every rank");
      CHORUS_CHECK(!t.defined() || !t.impl()->grad_is_shard, who,
                   ": a parameter is one rank's shard of a FullyShardedDataParallel's parameters, so the norm of "
                   "this rank's gradients is not the model's; call the FullyShardedDataParallel's clip_grad_norm_, "
                   "which takes the norm over every rank");
    });
}
}  // namespace detail

CHORUS_INLINE double grad_norm(const std::vector<AnyTensor>& params, double norm_type) {
  detail::check_grads_here(params, "grad_norm");
  auto groups = detail::device_grads(params);
  return detail::total_norm(groups, norm_type, 0.0, nullptr).item();
}

CHORUS_INLINE TotalNorm clip_grad_norm_(const std::vector<AnyTensor>& params, double max_norm, double norm_type,
                                        bool error_if_nonfinite) {
  CHORUS_CHECK(max_norm >= 0, "clip_grad_norm_: max_norm must be non-negative, got ", max_norm);
  detail::check_grads_here(params, "clip_grad_norm_");
  auto groups = detail::device_grads(params);
  Tensor<double> coef;
  auto total = detail::total_norm(groups, norm_type, max_norm, &coef);
  if (error_if_nonfinite) {
    const double t = total.item();
    CHORUS_CHECK(std::isfinite(t), "clip_grad_norm_: the total norm of order ", norm_type, " of the gradients is ",
                 t, " (non-finite), so it cannot be clipped");
  }
  NoGradGuard no_grad;
  for (auto& g : groups) {
    auto c = g.device == coef.device() ? coef : coef.to(g.device);
    if (!g.f32.ptrs.empty()) backend::foreach_scale(g.f32.ptrs, g.f32.numels, c.data(), g.device);
    if (!g.f64.ptrs.empty()) backend::foreach_scale(g.f64.ptrs, g.f64.numels, c.data(), g.device);
  }
  return TotalNorm(std::move(total));
}

CHORUS_INLINE void clip_grad_value_(const std::vector<AnyTensor>& params, double clip_value) {
  CHORUS_CHECK(clip_value >= 0, "clip_grad_value_: clip_value must be non-negative, got ", clip_value);
  NoGradGuard no_grad;
  for (auto& g : detail::device_grads(params)) {
    if (!g.f32.ptrs.empty())
      backend::foreach_clamp(g.f32.ptrs, g.f32.numels, static_cast<float>(clip_value), g.device);
    if (!g.f64.ptrs.empty()) backend::foreach_clamp(g.f64.ptrs, g.f64.numels, clip_value, g.device);
  }
}

}  // namespace nn::utils
CHORUS_NAMESPACE_END
