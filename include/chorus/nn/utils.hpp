#pragma once
// Gradient clipping, torch.nn.utils.clip_grad_norm_ / clip_grad_value_.
//
// Note [gradient clipping on the device]
// The gradients stay where they are: per device (all CPU devices are one host), the norm terms
// of all its gradients are accumulated by one multi-tensor reduction into one device scalar (a
// launch per 48 gradients, then one block); the devices' scalars meet on the first gradient's device, where
// one kernel computes the total norm and the coefficient min(1, max_norm / (total + 1e-6));
// the coefficient goes back to each device and one multi-tensor kernel per 48 gradients
// multiplies by it (reading it from device memory, and doing nothing when it is 1). Nothing
// waits for the device, except error_if_nonfinite, which has to read the norm (PyTorch syncs
// there too), and reading the returned TotalNorm as a double.
#include <cmath>
#include <limits>
#include <vector>

#include "../compiled.hpp"
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
  /// Wraps the 0-dim norm tensor `t`.
  explicit TotalNorm(Tensor<double> t) : t_(std::move(t)) {}
  /// The norm as a 0-dim float64 tensor on its device (no host sync).
  const Tensor<double>& tensor() const { return t_; }
  /// The norm as a double (waits for the device).
  double item() const { return t_.item(); }
  /// The norm as a double, as LibTorch returns it (waits for the device).
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

CHORUS_INLINE std::vector<DeviceGrads> device_grads(const std::vector<AnyTensor>& params);

/// The total norm (and, when `coef` is given, clip_grad_norm_'s coefficient) of every gradient,
/// on the first gradient's device (the host when there is none): no host sync.
CHORUS_INLINE Tensor<double> total_norm(std::vector<DeviceGrads>& groups, double norm_type, double max_norm,
                                        Tensor<double>* coef);
}  // namespace detail

/// The norm of order `norm_type` (> 0, or infinity) of all gradients together, as if they were
/// one vector (computed in float64 on the gradients' devices; reading it waits for them).
CHORUS_INLINE double grad_norm(const std::vector<AnyTensor>& params, double norm_type = 2.0);

/// Scales all gradients by min(1, max_norm / (total_norm + 1e-6)) and returns the total norm
/// (before clipping), on the device (Note [gradient clipping on the device]). With
/// error_if_nonfinite, a NaN or infinite total norm throws and leaves the gradients unchanged
/// (this reads the norm: one host sync); without it, PyTorch's behaviour: the gradients are
/// scaled by the non-finite coefficient.
CHORUS_INLINE TotalNorm clip_grad_norm_(const std::vector<AnyTensor>& params, double max_norm, double norm_type = 2.0,
                                        bool error_if_nonfinite = false);

/// Clamps every gradient element into [-clip_value, clip_value] (NaN stays NaN), on the
/// gradients' devices.
CHORUS_INLINE void clip_grad_value_(const std::vector<AnyTensor>& params, double clip_value);

}  // namespace nn::utils
CHORUS_NAMESPACE_END

#if !CHORUS_COMPILED
#include "utils_impl.hpp"
#endif
