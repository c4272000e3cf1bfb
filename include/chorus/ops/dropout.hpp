#pragma once
// dropout and dropout2d: masks drawn from Philox where the tensor lives (Note [dropout random
// numbers], core/generator.hpp).
#include <cstdint>

#include "../compiled.hpp"
#include "../backend/nn.hpp"
#include "elementwise.hpp"
#include "factory.hpp"

CHORUS_NAMESPACE_BEGIN

namespace ops::detail {
/// dropout's backward: dy times the forward's multiplier, recomputed from the same Philox
/// inputs instead of a saved mask (Note [dropout random numbers]).
template <class T>
class DropoutBackward final : public autograd::Node<T> {
 public:
  DropoutBackward(PhiloxLayout layout, std::uint64_t threshold, T scale)
      : layout_(layout), threshold_(threshold), scale_(scale) {}
  std::string name() const override { return "DropoutBackward"; }
  typename autograd::Node<T>::TensorList apply(typename autograd::Node<T>::TensorList&& grads) override {
    auto gy = contiguous_data(grads[0]);
    auto gx = Tensor<T>::empty(gy.shape(), gy.device());
    backend::dropout_apply(gy.data(), gx.data(), gy.numel(), layout_, threshold_, scale_, gy.device());
    return {gx};
  }

 private:
  PhiloxLayout layout_;
  std::uint64_t threshold_;
  T scale_;
};
}  // namespace ops::detail

/// Zeroes each element with probability p and scales the rest by 1/(1-p) when training (as
/// torch.nn.functional.dropout: y = x · mask / (1 - p), so a NaN stays NaN). The mask comes from
/// Philox evaluated on x's device at the generator's seed and offset; a seed gives the same
/// mask on every device and every device count (Note [dropout random numbers]).
template <class T>
Tensor<T> dropout(const Tensor<T>& x, double p, bool training, Generator& gen = default_generator()) {
  static_assert(is_floating_v<T>, "dropout: floating-point tensors only");
  CHORUS_CHECK(p >= 0.0 && p <= 1.0, "dropout: probability must be in [0, 1], got ", p);
  if (!training || p == 0.0) return x;
  ops::detail::check_defined("dropout", x);
  if constexpr (is_reduced_floating_v<T>) {  // Note [16-bit CNN operators] (ops/nn.hpp)
    return dropout(x.template to<float>(), p, training, gen).template to<T>();
  } else {
    const double keep = 1.0 - p;
    const PhiloxLayout layout = philox_layout(gen, x.shape());
    const std::uint64_t threshold = keep_threshold(keep);
    const T scale = keep > 0 ? static_cast<T>(1.0 / keep) : T(0);
    auto xc = ops::detail::contiguous_data(x.detach());
    auto out = Tensor<T>::empty(x.shape(), x.device());
    backend::dropout_apply(xc.data(), out.data(), x.numel(), layout, threshold, scale, x.device());
    if (autograd::needs_grad(x)) {
      auto node = autograd::make_node<ops::detail::DropoutBackward<T>, T>({&x}, layout, threshold, scale);
      autograd::set_history(out, std::shared_ptr<autograd::Node<T>>(node));
    }
    return out;
  }
}

/// Zeroes whole channels (dim 1 of x [N, C, *]) with probability p while training, scaling
/// the rest by 1/(1-p) (as torch.nn.functional.dropout2d on batched input).
template <class T>
Tensor<T> dropout2d(const Tensor<T>& x, double p, bool training, Generator& gen = default_generator()) {
  CHORUS_CHECK(p >= 0.0 && p <= 1.0, "dropout2d: probability must be in [0, 1], got ", p);
  ops::detail::check_defined("dropout2d", x);
  CHORUS_CHECK(x.dim() >= 2, "dropout2d: expected an input [N, C, *], got shape ", x.shape());
  if (!training || p == 0.0) return x;
  Shape ms = Shape::filled(x.dim(), 1);
  ms[0] = x.shape()[0];
  ms[1] = x.shape()[1];
  auto mask = dropout(ones<T>(ms, x.device()), p, true, gen);  // a constant: ones() needs no grad
  return mul(x, mask);
}

CHORUS_NAMESPACE_END

// The instances chorus::compiled holds (Note [compiled chorus] in compiled.hpp).
#define CHORUS_OPS_DROPOUT_FLOAT_INSTANCES(X, T)                        \
  X(Tensor<T> dropout<T>(const Tensor<T>&, double, bool, Generator&))   \
  X(Tensor<T> dropout2d<T>(const Tensor<T>&, double, bool, Generator&))
CHORUS_EXTERN_INSTANCES(CHORUS_OPS_DROPOUT_FLOAT_INSTANCES, CHORUS_FLOATING_DTYPES)
