#pragma once
// Layer normalisation, as torch.nn.functional.layer_norm.
//
// Note [fused layer norm]
// Composed of differentiable ops, a layer norm is nine of them (two means, a subtraction, a
// square, a power, three products and a sum) and its backward twice as many, each a pass over
// the activations with its own allocation; a Transformer layer has two of them over every
// token. On the CPU, layer_norm runs as one node: the forward computes each row's mean and
// 1/sqrt(var + eps) and writes y; the backward forms, per row,
//     dx = rstd · (dŷ - mean(dŷ) - x̂ · mean(dŷ · x̂)),   dŷ = dy · weight,  x̂ = (x - mean) · rstd,
// and sums dy · x̂ and dy over the rows into the gradients of weight and bias. It saves x and
// the per-row statistics, as PyTorch's native_layer_norm does. The statistics are those of the
// row shifted by its first element, x - x₀ (exact when the values are close), and the variance
// that of the centred values: a row of mean 1000 and spread 0.01 keeps its digits in float
// (a plain float mean is off by ulp(1000)/2 = 3e-5, 0.3% of that spread; E[x²] - E[x]² by
// everything). Row arithmetic is in opmath_t<T> (float for 16-bit types), the weight and bias
// sums in acc_t<T> (double for float). On a GPU the composed form runs (its kernels are the
// elementwise and reduction ones); a fused CUDA kernel is later work.
#include <algorithm>
#include <cmath>
#include <vector>

#include "../compiled.hpp"
#include "../backend/cpu/vmath.hpp"
#include "elementwise.hpp"
#include "reduce.hpp"

CHORUS_NAMESPACE_BEGIN
namespace ops::detail {

template <class T>
class LayerNormBackward final : public autograd::Node<T> {
  using O = backend::fn::opmath_t<T>;

 public:
  LayerNormBackward(Tensor<T> x, Tensor<T> weight, std::vector<O> shift, std::vector<O> mean, std::vector<O> rstd,
                    Shape shape, Shape normalized_shape)
      : x_(std::move(x)), w_(std::move(weight)), shift_(std::move(shift)), mean_(std::move(mean)), rstd_(std::move(rstd)),
        shape_(std::move(shape)), norm_shape_(std::move(normalized_shape)), D_(numel_of(norm_shape_)) {
    this->save_version(x_);
    if (w_.defined()) this->save_version(w_);
  }
  std::string name() const override { return "LayerNormBackward"; }

  typename autograd::Node<T>::TensorList apply(typename autograd::Node<T>::TensorList&& grads) override {
    using Acc = backend::cpu::acc_t<T>;
    const auto& e = this->next_edges();
    const std::int64_t D = D_, R = D == 0 ? 0 : x_.numel() / D;
    const Device dev = x_.device();
    const auto gc = contiguous_data(grads[0]);
    const T* dy = gc.data();
    const T* x = x_.data();
    const T* w = w_.defined() ? w_.data() : nullptr;
    const bool want_x = e[0].valid(), want_w = e[1].valid(), want_b = e[2].valid();
    Tensor<T> dx = want_x ? Tensor<T>::empty(shape_, dev) : Tensor<T>();
    std::vector<Acc> dw(want_w ? D : 0), db(want_b ? D : 0);
    std::vector<O> xhat(D), dyw(D), prod(D);
    backend::cpu::at_cpu_width([&] {
      for (std::int64_t r = 0; r < R; ++r) {
        const T* xr = x + r * D;
        const T* gr = dy + r * D;
        const O k = shift_[r], mu = mean_[r], rs = rstd_[r];
        for (std::int64_t j = 0; j < D; ++j) {
          xhat[j] = ((O(xr[j]) - k) - mu) * rs;
          dyw[j] = w ? O(gr[j]) * O(w[j]) : O(gr[j]);
        }
        if (want_w)
          for (std::int64_t j = 0; j < D; ++j) dw[j] += Acc(O(gr[j]) * xhat[j]);
        if (want_b)
          for (std::int64_t j = 0; j < D; ++j) db[j] += Acc(O(gr[j]));
        if (!want_x) continue;
        for (std::int64_t j = 0; j < D; ++j) prod[j] = dyw[j] * xhat[j];  // dŷ · x̂
        const O c1 = backend::cpu::vmath::sum<O>(prod.data(), D) / O(D), c2 = backend::cpu::vmath::sum<O>(dyw.data(), D) / O(D);
        T* dxr = dx.data() + r * D;
        for (std::int64_t j = 0; j < D; ++j) dxr[j] = T(rs * (dyw[j] - c2 - xhat[j] * c1));
      }
    });
    const auto to_tensor = [&](const std::vector<Acc>& v) {
      auto t = Tensor<T>::empty(norm_shape_, dev);
      std::transform(v.begin(), v.end(), t.data(), [](Acc a) { return T(a); });
      return t;
    };
    return {dx, want_w ? to_tensor(dw) : Tensor<T>(), want_b ? to_tensor(db) : Tensor<T>()};
  }
  void release_saved() override {
    x_ = w_ = Tensor<T>();
    shift_ = mean_ = rstd_ = {};
  }

 private:
  Tensor<T> x_, w_;
  std::vector<O> shift_, mean_, rstd_;
  Shape shape_, norm_shape_;
  std::int64_t D_;
};

/// The CPU layer norm of x over its trailing `normalized_shape` (Note [fused layer norm]).
template <class T>
Tensor<T> layer_norm_cpu(const Tensor<T>& x_in, const Shape& normalized_shape, const Tensor<T>& weight,
                         const Tensor<T>& bias, double eps) {
  using O = backend::fn::opmath_t<T>;
  const auto x = contiguous_data(x_in.detach());
  const auto wc = weight.defined() ? contiguous_data(weight.detach()) : Tensor<T>();
  const auto bc = bias.defined() ? contiguous_data(bias.detach()) : Tensor<T>();
  const std::int64_t D = numel_of(normalized_shape), R = x.numel() / D;
  auto y = Tensor<T>::empty(x.shape(), x.device());
  std::vector<O> shift(R), mean(R), rstd(R), xc(D), sq(D);
  const T* w = wc.defined() ? wc.data() : nullptr;
  const T* b = bc.defined() ? bc.data() : nullptr;
  backend::cpu::at_cpu_width([&] {
    for (std::int64_t r = 0; r < R; ++r) {
      const T* xr = x.data() + r * D;
      T* yr = y.data() + r * D;
      const O k = O(xr[0]);  // the shift (Note [fused layer norm])
      for (std::int64_t j = 0; j < D; ++j) xc[j] = O(xr[j]) - k;
      const O mu = backend::cpu::vmath::sum<O>(xc.data(), D) / O(D);
      for (std::int64_t j = 0; j < D; ++j) {
        xc[j] -= mu;
        sq[j] = xc[j] * xc[j];
      }
      const O rs = O(1) / std::sqrt(backend::cpu::vmath::sum<O>(sq.data(), D) / O(D) + O(eps));
      shift[r] = k;
      mean[r] = mu;
      rstd[r] = rs;
      for (std::int64_t j = 0; j < D; ++j) {
        O v = xc[j] * rs;
        if (w) v *= O(w[j]);
        if (b) v += O(b[j]);
        yr[j] = T(v);
      }
    }
  });
  if (autograd::needs_grad(x_in, weight, bias)) {
    auto node = autograd::make_node<LayerNormBackward<T>, T>(
        {&x_in, weight.defined() ? &weight : nullptr, bias.defined() ? &bias : nullptr}, x, wc, std::move(shift),
        std::move(mean), std::move(rstd), x_in.shape(), normalized_shape);
    autograd::set_history(y, std::shared_ptr<autograd::Node<T>>(node));
  }
  return y;
}

}  // namespace ops::detail

/// Layer normalisation over the trailing dimensions `normalized_shape` (as
/// torch.nn.functional.layer_norm; biased variance). One fused node on the CPU (Note [fused
/// layer norm]), composed of differentiable ops elsewhere.
template <class T>
Tensor<T> layer_norm(const Tensor<T>& x, const Shape& normalized_shape, const Tensor<T>& weight = Tensor<T>(),
                     const Tensor<T>& bias = Tensor<T>(), double eps = 1e-5) {
  static_assert(is_floating_v<T>, "layer_norm: floating-point tensors only");
  ops::detail::check_defined("layer_norm", x);
  const int k = normalized_shape.size();
  bool ok = k > 0 && x.dim() >= k;
  for (int i = 0; ok && i < k; ++i) ok = x.shape()[x.dim() - k + i] == normalized_shape[i];
  CHORUS_CHECK(ok, "layer_norm: input of shape ", x.shape(), " does not end in normalized_shape ", normalized_shape);
  for (const auto* t : {&weight, &bias})
    if (t->defined()) {
      CHORUS_CHECK(t->shape() == normalized_shape, "layer_norm: weight/bias of shape ", t->shape(),
                   " differs from normalized_shape ", normalized_shape);
      ops::detail::check_same_device("layer_norm", x, *t);
    }
  const std::int64_t D = numel_of(normalized_shape);
  CHORUS_CHECK(D > 0, "layer_norm: normalized_shape ", normalized_shape, " is empty");
  if (x.device().is_cpu()) return ops::detail::layer_norm_cpu(x, normalized_shape, weight, bias, eps);
  auto x2 = x.reshape(Shape{x.numel() / D, D});
  auto xc = sub(x2, mean(x2, 1, true));
  auto y = mul(xc, pow(add(mean(mul(xc, xc), 1, true), eps), -0.5)).reshape(x.shape());
  if (weight.defined()) y = mul(y, weight);
  if (bias.defined()) y = add(y, bias);
  return y;
}

CHORUS_NAMESPACE_END

// The instances chorus::compiled holds (Note [compiled chorus] in compiled.hpp).
#define CHORUS_OPS_LAYER_NORM_FLOAT_INSTANCES(X, T)                                                      \
  X(Tensor<T> layer_norm<T>(const Tensor<T>&, const Shape&, const Tensor<T>&, const Tensor<T>&, double))
CHORUS_EXTERN_INSTANCES(CHORUS_OPS_LAYER_NORM_FLOAT_INSTANCES, CHORUS_FLOATING_DTYPES)
