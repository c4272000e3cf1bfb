#pragma once
// amp::GradScaler: dynamic loss scaling, as torch.amp.GradScaler.
//
// Note [loss scaling]
// float16 has 5 exponent bits: gradients below 6e-8 flush to zero. The loss is multiplied by a
// large scale S before backward (scale()), so the gradients are S times larger and stay
// representable; unscale_() multiplies them by 1/S again and records on each device whether any
// was inf or NaN (the scale was too large). step() then runs the optimizer only when no device
// found one, and update() grows S by growth_factor after growth_interval good steps in a row
// and shrinks it by backoff_factor after a bad one. PyTorch's defaults: S = 2^16, ×2 every
// 2000 good steps, ×0.5 on a bad one.
//
// The check and the unscaling are one pass over each device's gradients (a multi-tensor
// kernel on a GPU: backend/cuda/amp.cuh), writing one flag per device in that device's memory:
// nothing waits per gradient. step() reads the flags once (one wait per device per step, as
// PyTorch's step() does with found_inf.item()). Under DataParallel the replicas' gradients are
// already summed into the primary's parameters, so an inf on any replica reaches the flag; under
// DistributedDataParallel the all-reduce spreads an inf to every rank's gradients, so every rank
// skips the same steps. The gradients being unscaled are float or double: the optimizer's
// master weights (PyTorch refuses to unscale float16 gradients too). The scale is a host double.
#include <cmath>
#include <limits>
#include <map>
#include <optional>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <vector>

#include "../ops/ops.hpp"
#include "../optim/optimizer.hpp"
#if CHORUS_CUDA
#include "../backend/cuda/amp.cuh"
#endif

CHORUS_NAMESPACE_BEGIN
namespace amp {

namespace detail {
/// x *= inv for every element; true when any element was inf or NaN before (the CPU loop).
template <class T>
bool unscale_check(T* x, std::int64_t n, T inv) {
  bool bad = false;
  for (std::int64_t i = 0; i < n; ++i) {
    bad |= !std::isfinite(x[i]);
    x[i] *= inv;
  }
  return bad;
}
}  // namespace detail

/// GradScaler's options (torch.amp.GradScaler's arguments).
struct GradScalerOptions {
  double init_scale = 65536.0;  // 2^16
  double growth_factor = 2.0;
  double backoff_factor = 0.5;
  std::int64_t growth_interval = 2000;
  bool enabled = true;
};

/// Dynamic loss scaling (Note [loss scaling]). The loop:
///     auto loss = criterion(model(x), y);
///     scaler.scale(loss).backward();
///     scaler.unscale_(opt);                        // optional: before clipping
///     nn::utils::clip_grad_norm_(model->parameters(), 1.0);
///     scaler.step(opt);                            // skipped when a gradient is inf/NaN
///     scaler.update();
class GradScaler {
 public:
  explicit GradScaler(GradScalerOptions options = {}) : o_(options), scale_(options.init_scale) {
    CHORUS_CHECK(o_.init_scale > 0 && std::isfinite(o_.init_scale), "GradScaler: init_scale must be positive and finite, got ",
                 o_.init_scale);
    CHORUS_CHECK(o_.growth_factor > 1.0, "GradScaler: growth_factor must be > 1, got ", o_.growth_factor);
    CHORUS_CHECK(o_.backoff_factor > 0.0 && o_.backoff_factor < 1.0, "GradScaler: backoff_factor must be in (0, 1), got ",
                 o_.backoff_factor);
    CHORUS_CHECK(o_.growth_interval > 0, "GradScaler: growth_interval must be positive, got ", o_.growth_interval);
  }

  bool is_enabled() const { return o_.enabled; }
  const GradScalerOptions& options() const { return o_; }
  /// The current scale (1 when disabled, as PyTorch's get_scale()).
  double get_scale() const { return o_.enabled ? scale_ : 1.0; }
  double get_growth_factor() const { return o_.growth_factor; }
  double get_backoff_factor() const { return o_.backoff_factor; }
  std::int64_t get_growth_interval() const { return o_.growth_interval; }

  /// loss * scale (recorded: backward gives scaled gradients); the loss itself when disabled.
  template <class T>
  Tensor<T> scale(const Tensor<T>& loss) const {
    if (!o_.enabled) return loss;
    CHORUS_CHECK(loss.defined(), "GradScaler::scale: the loss is an undefined tensor");
    return mul(loss, scale_);
  }

  /// Divides the gradients of `opt`'s parameters by the scale, in place, and records per device
  /// whether any was inf or NaN. At most once per optimizer between two update() calls, and
  /// before step() (PyTorch's rules).
  void unscale_(optim::Optimizer& opt) {
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

  /// Unscales (when unscale_ was not called) and runs opt.step() unless a gradient was inf or
  /// NaN on any device. Returns whether the optimizer stepped.
  bool step(optim::Optimizer& opt) {
    if (!o_.enabled) {
      opt.step();
      return true;
    }
    auto& st = per_opt_[&opt];
    CHORUS_CHECK(st.stage != Stage::Stepped, "GradScaler::step() has already been called since the last update()");
    if (st.stage == Stage::Ready) unscale_(opt);
    CHORUS_CHECK(!st.found_inf.empty(),
                 "GradScaler::step: no inf checks were recorded for this optimizer (no parameter has a gradient)");
    st.found = any_found(st);
    const bool found = st.found;
    if (!found) opt.step();
    st.stage = Stage::Stepped;
    return !found;
  }

  /// Adjusts the scale for the next iteration from this one's inf checks (or sets it to
  /// `new_scale`), and forgets the per-optimizer state.
  void update(std::optional<double> new_scale = std::nullopt) {
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
        if (st.stage == Stage::Unscaled) st.found = any_found(st);  // unscale_ without step: read its flags here
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

  /// PyTorch's state_dict keys: scale, growth_factor, backoff_factor, growth_interval,
  /// _growth_tracker (empty when disabled, as PyTorch).
  std::map<std::string, double> state_dict() const {
    if (!o_.enabled) return {};
    return {{"scale", scale_},
            {"growth_factor", o_.growth_factor},
            {"backoff_factor", o_.backoff_factor},
            {"growth_interval", double(o_.growth_interval)},
            {"_growth_tracker", double(growth_tracker_)}};
  }
  void load_state_dict(const std::map<std::string, double>& s) {
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

 private:
  enum class Stage { Ready, Unscaled, Stepped };
  struct OptState {
    Stage stage = Stage::Ready;
    std::vector<Tensor<float>> found_inf;  // one flag per device
    bool found = false;
  };
  /// Whether any device's flag is set (one wait per device).
  static bool any_found(const OptState& st) {
    bool found = false;
    for (const auto& f : st.found_inf) found |= f.to(Device::cpu()).data()[0] != 0.0f;
    return found;
  }

  GradScalerOptions o_;
  double scale_;
  std::int64_t growth_tracker_ = 0;
  std::unordered_map<const optim::Optimizer*, OptState> per_opt_;
};

}  // namespace amp
CHORUS_NAMESPACE_END
