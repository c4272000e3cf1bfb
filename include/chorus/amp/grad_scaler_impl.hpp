#pragma once
// The definitions of amp/grad_scaler.hpp (GradScaler): compiled into chorus::compiled
// (src/amp/amp.cpp), included by grad_scaler.hpp itself in the header-only form (Note [compiled
// chorus]).
#include "grad_scaler.hpp"

CHORUS_NAMESPACE_BEGIN
namespace amp {

CHORUS_INLINE GradScaler::GradScaler(GradScalerOptions options) : o_(options), scale_(options.init_scale) {
  CHORUS_CHECK(o_.init_scale > 0 && std::isfinite(o_.init_scale), "GradScaler: init_scale must be positive and finite, got ",
               o_.init_scale);
  CHORUS_CHECK(o_.growth_factor > 1.0, "GradScaler: growth_factor must be > 1, got ", o_.growth_factor);
  CHORUS_CHECK(o_.backoff_factor > 0.0 && o_.backoff_factor < 1.0, "GradScaler: backoff_factor must be in (0, 1), got ",
               o_.backoff_factor);
  CHORUS_CHECK(o_.growth_interval > 0, "GradScaler: growth_interval must be positive, got ", o_.growth_interval);
}

CHORUS_INLINE void GradScaler::unscale_(optim::Optimizer& opt) {
  if (!o_.enabled) return;
  auto& st = per_opt_[&opt];
  CHORUS_CHECK(st.stage != Stage::Unscaled,
               "GradScaler::unscale_() has already been called on this optimizer since the last update()");
  CHORUS_CHECK(st.stage != Stage::Stepped, "GradScaler::unscale_() is being called after step()");
  const double inv = 1.0 / scale_;
  // Group the gradients by (device, dtype): one pass per group.
  struct Group {
    std::vector<float*> f;
    std::vector<double*> d;
    std::vector<std::int64_t> fn, dn;
  };
  std::map<Device, Group> groups;
  NoGradGuard no_grad;
  for (std::size_t i = 0; i < opt.parameters().size(); ++i) {
    opt.parameters()[i].visit([&](const auto& p) {
      using T = typename std::decay_t<decltype(p)>::value_type;
      if constexpr (is_floating_v<T>) {
        auto g = p.grad();
        if (!g.defined()) return;
        // Each rank would decide alone whether its shard's step is skipped (and move its scale
        // alone): the shards, and the ranks' loss scales, would part.
        CHORUS_CHECK(!p.impl()->grad_is_shard, "GradScaler::unscale_: parameter ", i, " is a "
                     "FullyShardedDataParallel shard, whose inf check every rank would make alone; train the "
                     "16-bit module with float32 shards in bfloat16 (shard_dtype), which needs no loss scaling");
        if constexpr (is_reduced_floating_v<T>) {
          CHORUS_FAIL("GradScaler::unscale_: parameter ", i, " has a ", dtype_name(dtype_of<T>()),
                      " gradient; keep the optimizer's parameters (master weights) in float32 "
                      "(Note [loss scaling])");
        } else {
          CHORUS_CHECK(g.is_contiguous(), "GradScaler::unscale_: the gradient of parameter ", i, " is not contiguous");
          auto& grp = groups[g.device()];
          if constexpr (std::is_same_v<T, float>) {
            grp.f.push_back(g.data());
            grp.fn.push_back(g.numel());
          } else {
            grp.d.push_back(g.data());
            grp.dn.push_back(g.numel());
          }
          g.bump_version();
        }
      }
    });
  }
  st.found_inf.clear();
  for (auto& [dev, grp] : groups) {
    auto flag = zeros<float>({1}, dev);  // 1 when any gradient on dev was inf or NaN
    if (dev.is_cpu()) {
      bool bad = false;
      for (std::size_t k = 0; k < grp.f.size(); ++k) bad |= detail::unscale_check(grp.f[k], grp.fn[k], float(inv));
      for (std::size_t k = 0; k < grp.d.size(); ++k) bad |= detail::unscale_check(grp.d[k], grp.dn[k], inv);
      flag.data()[0] = bad ? 1.0f : 0.0f;
    } else {
#if CHORUS_CUDA
      backend::cuda::foreach_unscale_check(grp.f, grp.fn, float(inv), flag.data(), dev);
      backend::cuda::foreach_unscale_check(grp.d, grp.dn, inv, flag.data(), dev);
#else
      CHORUS_FAIL("GradScaler::unscale_: gradients on ", dev, " in a build without CUDA");
#endif
    }
    st.found_inf.push_back(flag);
  }
  st.stage = Stage::Unscaled;
}

CHORUS_INLINE bool GradScaler::step(optim::Optimizer& opt) {
  if (!o_.enabled) {
    opt.step();
    return true;
  }
  auto& st = per_opt_[&opt];
  CHORUS_CHECK(st.stage != Stage::Stepped, "GradScaler::step() has already been called since the last update()");
  if (st.stage == Stage::Ready) unscale_(opt);
  CHORUS_CHECK(!st.found_inf.empty(),
               "GradScaler::step: no inf checks were recorded for this optimizer (no parameter has a gradient)");
  st.found = opt.found_inf_anywhere(any_found(st));
  const bool found = st.found;
  if (!found) opt.step();
  st.stage = Stage::Stepped;
  return !found;
}

CHORUS_INLINE void GradScaler::update(std::optional<double> new_scale) {
  if (!o_.enabled) return;
  if (new_scale) {
    CHORUS_CHECK(*new_scale > 0 && std::isfinite(*new_scale), "GradScaler::update: new_scale must be positive and finite, got ",
                 *new_scale);
    scale_ = *new_scale;
  } else {
    bool any = false, found = false;
    for (auto& [opt, st] : per_opt_) {
      if (st.stage == Stage::Ready) continue;
      any = true;
      if (st.stage == Stage::Unscaled) st.found = opt->found_inf_anywhere(any_found(st));  // unscale_ without step
      found |= st.found;
    }
    CHORUS_CHECK(any, "GradScaler::update: no inf checks were recorded prior to update() (call unscale_ or step first)");
    if (found) {
      scale_ *= o_.backoff_factor;
      growth_tracker_ = 0;
    } else if (++growth_tracker_ == o_.growth_interval) {
      scale_ *= o_.growth_factor;
      growth_tracker_ = 0;
    }
  }
  per_opt_.clear();
}

CHORUS_INLINE std::map<std::string, double> GradScaler::state_dict() const {
  if (!o_.enabled) return {};
  return {{"scale", scale_},
          {"growth_factor", o_.growth_factor},
          {"backoff_factor", o_.backoff_factor},
          {"growth_interval", double(o_.growth_interval)},
          {"_growth_tracker", double(growth_tracker_)}};
}

CHORUS_INLINE void GradScaler::load_state_dict(const std::map<std::string, double>& s) {
  CHORUS_CHECK(o_.enabled, "GradScaler::load_state_dict: the scaler is disabled");
  CHORUS_CHECK(!s.empty(), "GradScaler::load_state_dict: the state is empty (saved from a disabled scaler)");
  const auto get = [&](const char* k) {
    auto it = s.find(k);
    CHORUS_CHECK(it != s.end(), "GradScaler::load_state_dict: no '", k, "' in the state");
    return it->second;
  };
  GradScalerOptions o = o_;
  o.init_scale = get("scale");
  o.growth_factor = get("growth_factor");
  o.backoff_factor = get("backoff_factor");
  o.growth_interval = static_cast<std::int64_t>(get("growth_interval"));
  const double tracker = get("_growth_tracker");
  GradScaler check(o);  // validates the values
  CHORUS_CHECK(tracker >= 0 && tracker < double(o.growth_interval) && tracker == std::floor(tracker),
               "GradScaler::load_state_dict: _growth_tracker ", tracker, " is not in [0, growth_interval)");
  o_ = o;
  scale_ = o.init_scale;
  growth_tracker_ = static_cast<std::int64_t>(tracker);
  per_opt_.clear();
}

CHORUS_INLINE bool GradScaler::any_found(const OptState& st) {
  bool found = false;
  for (const auto& f : st.found_inf) found |= f.to(Device::cpu()).data()[0] != 0.0f;
  return found;
}

}  // namespace amp
CHORUS_NAMESPACE_END
