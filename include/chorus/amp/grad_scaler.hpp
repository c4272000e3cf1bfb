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
// skips the same steps; where each rank keeps a shard of the gradients (ZeRO-2), the optimizer
// asks the other ranks (Optimizer::found_inf_anywhere), and every rank skips alike. The gradients being unscaled are float or double: the optimizer's
// master weights (PyTorch refuses to unscale float16 gradients too). The scale is a host double.
#include <cmath>
#include <limits>
#include <map>
#include <optional>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <vector>

#include "../compiled.hpp"
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
  double init_scale = 65536.0;          ///< The initial scale (default 2^16; positive and finite).
  double growth_factor = 2.0;           ///< update() multiplies the scale by it after growth_interval good steps (> 1).
  double backoff_factor = 0.5;          ///< update() multiplies the scale by it after an inf/NaN step, in (0, 1).
  std::int64_t growth_interval = 2000;  ///< Consecutive steps without inf/NaN gradients before the scale grows.
  bool enabled = true;                  ///< False: a pass-through (scale(loss) is the loss, step() just steps).
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
  /// A scaler starting at options.init_scale; throws on an invalid option.
  explicit GradScaler(GradScalerOptions options = {});

  /// Whether loss scaling is on (GradScalerOptions::enabled).
  bool is_enabled() const { return o_.enabled; }
  /// The options (after load_state_dict(), its init_scale is the loaded scale).
  const GradScalerOptions& options() const { return o_; }
  /// The current scale (1 when disabled, as PyTorch's get_scale()).
  double get_scale() const { return o_.enabled ? scale_ : 1.0; }
  /// The factor the scale grows by (PyTorch's get_growth_factor()).
  double get_growth_factor() const { return o_.growth_factor; }
  /// The factor the scale shrinks by (PyTorch's get_backoff_factor()).
  double get_backoff_factor() const { return o_.backoff_factor; }
  /// The good steps in a row before the scale grows (PyTorch's get_growth_interval()).
  std::int64_t get_growth_interval() const { return o_.growth_interval; }

  /// loss * scale (recorded: backward gives scaled gradients); the loss itself when disabled.
  /// A 16-bit loss is scaled in float32, as PyTorch's float32 scale promotes it (65536 times a
  /// float16 loss would overflow): the result is then a Tensor<float>, disabled or not.
  template <class T>
  auto scale(const Tensor<T>& loss) const {
    CHORUS_CHECK(loss.defined(), "GradScaler::scale: the loss is an undefined tensor");
    if constexpr (is_reduced_floating_v<T>) {
      auto wide = loss.template to<float>();
      return o_.enabled ? mul(wide, scale_) : wide;
    } else {
      return o_.enabled ? mul(loss, scale_) : loss;
    }
  }

  /// Divides the gradients of `opt`'s parameters by the scale, in place, and records per device
  /// whether any was inf or NaN. At most once per optimizer between two update() calls, and
  /// before step() (PyTorch's rules).
  void unscale_(optim::Optimizer& opt);

  /// Unscales (when unscale_ was not called) and runs opt.step() unless a gradient was inf or
  /// NaN on any device. Returns whether the optimizer stepped.
  bool step(optim::Optimizer& opt);

  /// Adjusts the scale for the next iteration from this one's inf checks (or sets it to
  /// `new_scale`), and forgets the per-optimizer state.
  void update(std::optional<double> new_scale = std::nullopt);

  /// PyTorch's state_dict keys: scale, growth_factor, backoff_factor, growth_interval,
  /// _growth_tracker (empty when disabled, as PyTorch).
  std::map<std::string, double> state_dict() const;
  /// Restores a state_dict() (all five keys); throws, changing nothing, when the scaler is
  /// disabled, the state is empty or a value is invalid.
  void load_state_dict(const std::map<std::string, double>& s);

 private:
  enum class Stage { Ready, Unscaled, Stepped };
  struct OptState {
    Stage stage = Stage::Ready;
    std::vector<Tensor<float>> found_inf;  // one flag per device
    bool found = false;
  };
  /// Whether any device's flag is set (one wait per device).
  static bool any_found(const OptState& st);

  GradScalerOptions o_;
  double scale_;
  std::int64_t growth_tracker_ = 0;
  std::unordered_map<const optim::Optimizer*, OptState> per_opt_;
};

}  // namespace amp
CHORUS_NAMESPACE_END

// The definitions: compiled into chorus::compiled, or here in the header-only form (Note
// [compiled chorus] in compiled.hpp).
#if !CHORUS_COMPILED
#include "grad_scaler_impl.hpp"
#endif
