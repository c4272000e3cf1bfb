#pragma once
// Gradient clipping, torch.nn.utils.clip_grad_norm_ / clip_grad_value_.
#include <cmath>
#include <limits>
#include <vector>

#include "../core/any_tensor.hpp"
#include "../ops/ops.hpp"

CHORUS_NAMESPACE_BEGIN
namespace nn::utils {

namespace detail {
/// Calls f(grad) with the typed gradient of each floating parameter that has one.
template <class F>
void for_each_grad(const std::vector<AnyTensor>& params, F&& f) {
  for (const auto& p : params)
    p.visit([&](const auto& t) {
      using T = typename std::decay_t<decltype(t)>::value_type;
      if constexpr (is_floating_v<T>) {
        auto g = t.grad();
        if (g.defined()) f(g);
      }
    });
}
}  // namespace detail

/// The norm of order `norm_type` (> 0, or infinity) of all gradients together, as if they were
/// one vector. Gradients are read on the host (in float64), whatever device they live on.
inline double grad_norm(const std::vector<AnyTensor>& params, double norm_type = 2.0) {
  const bool inf = std::isinf(norm_type) && norm_type > 0;
  CHORUS_CHECK(inf || norm_type > 0, "clip_grad_norm_: norm_type must be positive or infinity, got ", norm_type);
  double acc = 0;
  detail::for_each_grad(params, [&](const auto& g) {
    for (auto v : g.to_vector()) {
      const double a = std::abs(static_cast<double>(v));
      if (inf) acc = (a > acc || std::isnan(a)) ? a : acc;
      else if (norm_type == 2.0) acc += a * a;
      else if (norm_type == 1.0) acc += a;
      else acc += std::pow(a, norm_type);
    }
  });
  if (inf || norm_type == 1.0) return acc;
  return norm_type == 2.0 ? std::sqrt(acc) : std::pow(acc, 1.0 / norm_type);
}

/// Scales all gradients by min(1, max_norm / (total_norm + 1e-6)) and returns the total norm
/// (before clipping). With error_if_nonfinite, a NaN or infinite total norm throws and leaves
/// the gradients unchanged; without it, PyTorch's behaviour: the gradients are scaled by the
/// non-finite coefficient.
inline double clip_grad_norm_(const std::vector<AnyTensor>& params, double max_norm, double norm_type = 2.0,
                              bool error_if_nonfinite = false) {
  CHORUS_CHECK(max_norm >= 0, "clip_grad_norm_: max_norm must be non-negative, got ", max_norm);
  const double total = grad_norm(params, norm_type);
  CHORUS_CHECK(!error_if_nonfinite || std::isfinite(total), "clip_grad_norm_: the total norm of order ", norm_type,
               " of the gradients is ", total, " (non-finite), so it cannot be clipped");
  double coef = max_norm / (total + 1e-6);
  coef = coef < 1.0 || std::isnan(coef) ? coef : 1.0;
  if (coef == 1.0) return total;  // multiplying by one changes nothing
  NoGradGuard no_grad;
  detail::for_each_grad(params, [&](auto g) { g.copy_(g * coef); });
  return total;
}

/// Clamps every gradient element into [-clip_value, clip_value] (NaN stays NaN).
inline void clip_grad_value_(const std::vector<AnyTensor>& params, double clip_value) {
  CHORUS_CHECK(clip_value >= 0, "clip_grad_value_: clip_value must be non-negative, got ", clip_value);
  NoGradGuard no_grad;
  detail::for_each_grad(params, [&](auto g) {
    using T = typename decltype(g)::value_type;
    auto v = g.to_vector();
    const T hi = static_cast<T>(clip_value);
    for (auto& x : v) x = x > hi ? hi : (x < -hi ? -hi : x);
    g.copy_(from_vector<T>(v, g.shape(), g.device()));
  });
}

}  // namespace nn::utils
CHORUS_NAMESPACE_END
