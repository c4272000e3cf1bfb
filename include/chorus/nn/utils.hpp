#pragma once
// Gradient clipping, torch.nn.utils.clip_grad_norm_ / clip_grad_value_.
//
// Note [gradient clipping on the device]
// Clipping used to copy every gradient to the host and back. Now the gradients stay where they
// are: per device (all CPU devices are one host), the norm terms of all its gradients are
// accumulated by one multi-tensor reduction into one device scalar (a launch per 48
// gradients, then one block); the devices' scalars meet on the first gradient's device, where
// one kernel computes the total norm and the coefficient min(1, max_norm / (total + 1e-6));
// the coefficient goes back to each device and one multi-tensor kernel per 48 gradients
// multiplies by it (reading it from device memory, and doing nothing when it is 1). Nothing
// waits for the device, except error_if_nonfinite, which has to read the norm (PyTorch syncs
// there too), and reading the returned TotalNorm as a double.
#include <cmath>
#include <limits>
#include <vector>

#include "../core/any_tensor.hpp"
#include "../ops/ops.hpp"

CHORUS_NAMESPACE_BEGIN
namespace nn::utils {

/// The total norm clip_grad_norm_ returns: a 0-dim float64 tensor on the first gradient's
/// device (what PyTorch's Python API returns). Reading it as a double (LibTorch's C++ API
/// returns one: `double n = clip_grad_norm_(...)`) waits for the device; keeping it as a
/// tensor, or ignoring it, does not.
class TotalNorm {
 public:
  explicit TotalNorm(Tensor<double> t) : t_(std::move(t)) {}
  const Tensor<double>& tensor() const { return t_; }
  double item() const { return t_.item(); }
  operator double() const { return item(); }  // NOLINT(google-explicit-constructor): as LibTorch's double

 private:
  Tensor<double> t_;
};

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

/// The gradients of one device (every CPU device counts as the host), by dtype, as (pointer,
/// numel) lists. Gradients are contiguous (Tensor::set_grad and the engine keep them so).
struct DeviceGrads {
  Device device;
  template <class T>
  struct List {
    std::vector<T*> ptrs;
    std::vector<std::int64_t> numels;
    void add(const Tensor<T>& g) {
      CHORUS_CHECK(g.is_contiguous(), "clip_grad: a gradient of shape ", g.shape(), " is not contiguous");
      ptrs.push_back(g.data());
      numels.push_back(g.numel());
    }
  };
  List<float> f32;
  List<double> f64;
  int dtypes() const { return !f32.ptrs.empty() + !f64.ptrs.empty(); }
};

inline std::vector<DeviceGrads> device_grads(const std::vector<AnyTensor>& params) {
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
                  " gradients are not supported yet (mixed precision, issue 19)");
    else static_assert(sizeof(T) == 0, "clip_grad: add the gradient type to DeviceGrads");
  });
  return out;
}

/// The total norm (and, when `coef` is given, clip_grad_norm_'s coefficient) of every gradient,
/// on the first gradient's device (the host when there is none): no host sync.
inline Tensor<double> total_norm(std::vector<DeviceGrads>& groups, double norm_type, double max_norm,
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
}  // namespace detail

/// The norm of order `norm_type` (> 0, or infinity) of all gradients together, as if they were
/// one vector (computed in float64 on the gradients' devices; reading it waits for them).
inline double grad_norm(const std::vector<AnyTensor>& params, double norm_type = 2.0) {
  auto groups = detail::device_grads(params);
  return detail::total_norm(groups, norm_type, 0.0, nullptr).item();
}

/// Scales all gradients by min(1, max_norm / (total_norm + 1e-6)) and returns the total norm
/// (before clipping), on the device (Note [gradient clipping on the device]). With
/// error_if_nonfinite, a NaN or infinite total norm throws and leaves the gradients unchanged
/// (this reads the norm: one host sync); without it, PyTorch's behaviour: the gradients are
/// scaled by the non-finite coefficient.
inline TotalNorm clip_grad_norm_(const std::vector<AnyTensor>& params, double max_norm, double norm_type = 2.0,
                                 bool error_if_nonfinite = false) {
  CHORUS_CHECK(max_norm >= 0, "clip_grad_norm_: max_norm must be non-negative, got ", max_norm);
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

/// Clamps every gradient element into [-clip_value, clip_value] (NaN stays NaN), on the
/// gradients' devices.
inline void clip_grad_value_(const std::vector<AnyTensor>& params, double clip_value) {
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
