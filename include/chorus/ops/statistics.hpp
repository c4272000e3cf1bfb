#pragma once
// Reductions built from the others: logsumexp, var / std (with a correction), and the vector
// p-norm with PyTorch's gradient conventions (0 at a zero norm).
#include <cmath>
#include <concepts>
#include <initializer_list>
#include <limits>
#include <vector>

#include "../compiled.hpp"
#include "dims.hpp"
#include "elementwise.hpp"
#include "minmax.hpp"
#include "reduce.hpp"

CHORUS_NAMESPACE_BEGIN
namespace ops::detail {

/// Elements of `shape` covered by a reduction over `ds` (1 for a 0-dim tensor).
inline std::int64_t reduced_count(const Shape& shape, const std::vector<int>& ds) {
  std::int64_t n = 1;
  for (int d : ds) n *= shape[d];
  return n;
}

/// `keep` (x's shape with 1s at the reduced dims) viewed as the result shape.
template <class T>
Tensor<T> finish_reduction(const Tensor<T>& keep, const Shape& in, const std::vector<int>& ds, bool keepdim) {
  return keepdim ? keep : keep.reshape(reduced_shape(in, ds, false));
}

template <class T>
Tensor<T> variance(const char* op, const Tensor<T>& x, const std::vector<std::int64_t>& dims, double correction,
                   bool keepdim) {
  static_assert(is_floating_v<T>, "var/std: floating-point tensors only");
  check_defined(op, x);
  CHORUS_CHECK(!std::isnan(correction), op, ": correction is NaN");
  const auto ds = reduction_dims(dims, x.dim(), op);
  const auto n = static_cast<double>(reduced_count(x.shape(), ds));
  // PyTorch divides by max(0, N - correction): N <= correction gives inf (or NaN for 0 / 0).
  const double denom = std::max(0.0, n - correction);
  auto centered = x - chorus::mean(x, dims, true);
  auto ss = chorus::sum(centered * centered, dims, true);
  auto var = denom > 0 ? ss * (1.0 / denom) : ss * std::numeric_limits<double>::infinity();
  return finish_reduction(var, x.shape(), ds, keepdim);
}

/// The gradient of the vector p-norm, as PyTorch's norm_backward (FunctionsManual.cpp): 0 for
/// p = 0; for ±inf shared evenly among the elements of extreme |x| (times sgn(x)); else
/// sgn(x) |x|^(p-1) g / norm^(p-1), with 0 where the norm (or, for p < 1, x) is 0.
template <class T>
class NormBackward final : public autograd::Node<T> {
 public:
  NormBackward(double p, Tensor<T> x, Tensor<T> norm_keep) : p_(p), x_(std::move(x)), n_(std::move(norm_keep)) {
    this->save_version(x_);
    this->save_version(n_);
  }
  std::string name() const override { return "NormBackward"; }
  typename autograd::Node<T>::TensorList apply(typename autograd::Node<T>::TensorList&& grads) override {
    const Shape& xs = x_.shape();
    const Shape& ks = n_.shape();
    const auto g = view_as_shape(grads[0], ks);
    if (p_ == 0.0) return {zeros<T>(xs, x_.device())};
    auto gx = Tensor<T>::empty(xs, x_.device());
    if (std::isinf(p_)) {
      auto mask = Tensor<T>::empty(xs, x_.device());
      backend::binary_broadcast(x_, x_.strides(), n_, broadcast_strides(n_, xs), mask, backend::fn::NormInfMask{});
      auto share = Tensor<T>::empty(ks, x_.device());
      backend::binary_same(g, sum_to(mask, ks), share, backend::fn::Div{});
      backend::binary_broadcast(mask, mask.strides(), share, broadcast_strides(share, xs), gx, backend::fn::Mul{});
      auto sign = Tensor<T>::empty(xs, x_.device());
      backend::unary(x_, sign, backend::fn::Sign{});
      backend::binary_same(gx, sign, gx, backend::fn::Mul{});
      return {gx};
    }
    auto scale = Tensor<T>::empty(ks, x_.device());
    backend::binary_same(g, n_, scale, backend::fn::NormScale{p_});
    backend::binary_broadcast(x_, x_.strides(), scale, broadcast_strides(scale, xs), gx, backend::fn::NormGrad{p_});
    return {gx};
  }
  void release_saved() override {
    x_ = Tensor<T>();
    n_ = Tensor<T>();
  }

 private:
  double p_;
  Tensor<T> x_, n_;
};

template <class T>
Tensor<T> vector_norm(const Tensor<T>& x, double p, const std::vector<std::int64_t>& dims, bool keepdim) {
  static_assert(is_floating_v<T>, "norm: floating-point tensors only");
  check_defined("norm", x);
  CHORUS_CHECK(!std::isnan(p), "norm: the order p is NaN");
  const auto ds = reduction_dims(dims, x.dim(), "norm");
  Tensor<T> keep;
  {
    NoGradGuard no_grad;
    const auto xd = contiguous_data(x.detach());
    if (std::isinf(p)) {
      for (int d : ds) check_nonempty_dim(p > 0 ? "norm (p = inf)" : "norm (p = -inf)", x.shape(), d);
      keep = p > 0 ? chorus::amax(chorus::abs(xd), dims, true) : chorus::amin(chorus::abs(xd), dims, true);
    } else if (p == 0.0) {
      keep = chorus::sum(unary_forward(xd, backend::fn::NonZero{}), dims, true);
    } else if (p == 1.0) {
      keep = chorus::sum(chorus::abs(xd), dims, true);
    } else if (p == 2.0) {
      keep = chorus::sqrt(chorus::sum(xd * xd, dims, true));
    } else {
      keep = chorus::pow(chorus::sum(unary_forward(xd, backend::fn::AbsPow{p}), dims, true), 1.0 / p);
    }
    keep = contiguous_data(keep.reshape(reduced_shape(x.shape(), ds, true)));
  }
  auto out = view_as_shape(keep, reduced_shape(x.shape(), ds, keepdim));
  if (autograd::needs_grad(x)) {
    auto node = autograd::make_node<NormBackward<T>, T>({&x}, p, contiguous_data(x.detach()), keep);
    autograd::set_history(out, std::shared_ptr<autograd::Node<T>>(node));
  }
  return out;
}

}  // namespace ops::detail

/// log(sum(exp(x))) over `dims`, computed stably (the maximum is subtracted first), as
/// torch.logsumexp; an all -inf slice gives -inf.
template <class T>
Tensor<T> logsumexp(const Tensor<T>& x, const std::vector<std::int64_t>& dims, bool keepdim = false) {
  static_assert(is_floating_v<T>, "logsumexp: floating-point tensors only");
  ops::detail::check_defined("logsumexp", x);
  const auto ds = ops::detail::reduction_dims(dims, x.dim(), "logsumexp");
  Tensor<T> shift;
  {
    NoGradGuard no_grad;
    for (int d : ds) ops::detail::check_nonempty_dim("logsumexp", x.shape(), d);
    shift = ops::detail::unary_forward(ops::detail::contiguous_data(chorus::amax(x.detach(), dims, true)),
                                       backend::fn::InfToZero{});
  }
  auto keep = chorus::log(chorus::sum(chorus::exp(x - shift), dims, true)) + shift;
  return ops::detail::finish_reduction(keep, x.shape(), ds, keepdim);
}
/// logsumexp over the one dimension `dim`.
template <class T>
Tensor<T> logsumexp(const Tensor<T>& x, std::int64_t dim, bool keepdim = false) {
  return logsumexp(x, std::vector<std::int64_t>{dim}, keepdim);
}
/// logsumexp(x, dims, keepdim) for a braced list of dims; `{}` means all of them.
template <class T>  // Note [braced dim lists]
Tensor<T> logsumexp(const Tensor<T>& x, std::initializer_list<std::int64_t> dims, bool keepdim = false) {
  return logsumexp(x, std::vector<std::int64_t>(dims), keepdim);
}

/// Variance over `dims` (an empty list: all) divided by N - correction: correction 1 is the
/// unbiased estimate (the default), 0 the population variance. A bool passes as 1 or 0, so
/// var(x, dims, /*unbiased=*/false) means what it says.
template <class T>
Tensor<T> var(const Tensor<T>& x, const std::vector<std::int64_t>& dims, double correction = 1.0,
              bool keepdim = false) {
  return ops::detail::variance("var", x, dims, correction, keepdim);
}
/// Variance over the one dimension `dim`, divided by N - correction.
template <class T>
Tensor<T> var(const Tensor<T>& x, std::int64_t dim, double correction = 1.0, bool keepdim = false) {
  return var(x, std::vector<std::int64_t>{dim}, correction, keepdim);
}
/// var(x, dims, correction, keepdim) for a braced list of dims; `{}` means all of them.
template <class T>  // Note [braced dim lists]
Tensor<T> var(const Tensor<T>& x, std::initializer_list<std::int64_t> dims, double correction = 1.0,
              bool keepdim = false) {
  return var(x, std::vector<std::int64_t>(dims), correction, keepdim);
}
/// Over all elements.
template <class T>
Tensor<T> var(const Tensor<T>& x) {
  return var(x, std::vector<std::int64_t>{});
}
/// Over all elements, as torch.var(x, unbiased): only a bool (an int means a dim).
template <class T, class B>
  requires std::same_as<B, bool>
Tensor<T> var(const Tensor<T>& x, B unbiased) {
  return var(x, std::vector<std::int64_t>{}, unbiased ? 1.0 : 0.0);
}

/// The standard deviation: sqrt(var) with var's arguments.
template <class T>
Tensor<T> std(const Tensor<T>& x, const std::vector<std::int64_t>& dims, double correction = 1.0,
              bool keepdim = false) {
  return chorus::sqrt(ops::detail::variance("std", x, dims, correction, keepdim));
}
/// Standard deviation over the one dimension `dim`: sqrt(var(x, dim, correction, keepdim)).
template <class T>
Tensor<T> std(const Tensor<T>& x, std::int64_t dim, double correction = 1.0, bool keepdim = false) {
  return chorus::std(x, std::vector<std::int64_t>{dim}, correction, keepdim);
}
/// std(x, dims, correction, keepdim) for a braced list of dims; `{}` means all of them.
template <class T>  // Note [braced dim lists]
Tensor<T> std(const Tensor<T>& x, std::initializer_list<std::int64_t> dims, double correction = 1.0,
              bool keepdim = false) {
  return chorus::std(x, std::vector<std::int64_t>(dims), correction, keepdim);
}
/// Standard deviation over all elements, unbiased (correction 1).
template <class T>
Tensor<T> std(const Tensor<T>& x) {
  return chorus::std(x, std::vector<std::int64_t>{});
}
/// Over all elements, as torch.std(x, unbiased): only a bool (an int means a dim).
template <class T, class B>
  requires std::same_as<B, bool>
Tensor<T> std(const Tensor<T>& x, B unbiased) {
  return chorus::std(x, std::vector<std::int64_t>{}, unbiased ? 1.0 : 0.0);
}

/// The vector p-norm over `dims` (an empty list: all), as torch.norm / linalg.vector_norm:
/// (sum |x|^p)^(1/p); p = inf / -inf the largest / smallest |x|; p = 0 the count of nonzeros.
template <class T>
Tensor<T> norm(const Tensor<T>& x, double p, const std::vector<std::int64_t>& dims, bool keepdim = false) {
  return ops::detail::vector_norm(x, p, dims, keepdim);
}
/// The vector p-norm over the one dimension `dim`.
template <class T>
Tensor<T> norm(const Tensor<T>& x, double p, std::int64_t dim, bool keepdim = false) {
  return ops::detail::vector_norm(x, p, std::vector<std::int64_t>{dim}, keepdim);
}
/// norm(x, p, dims, keepdim) for a braced list of dims; `{}` means all of them.
template <class T>  // Note [braced dim lists]
Tensor<T> norm(const Tensor<T>& x, double p, std::initializer_list<std::int64_t> dims, bool keepdim = false) {
  return ops::detail::vector_norm(x, p, std::vector<std::int64_t>(dims), keepdim);
}
/// The vector p-norm over all elements (p = 2 by default: the Euclidean norm), as torch.norm(x, p).
template <class T>
Tensor<T> norm(const Tensor<T>& x, double p = 2.0) {
  return ops::detail::vector_norm(x, p, {}, false);
}

template <class T>
Tensor<T> Tensor<T>::logsumexp(const std::vector<std::int64_t>& dims, bool keepdim) const {
  return chorus::logsumexp(*this, dims, keepdim);
}
template <class T>
Tensor<T> Tensor<T>::logsumexp(std::int64_t dim, bool keepdim) const {
  return chorus::logsumexp(*this, dim, keepdim);
}
template <class T>
Tensor<T> Tensor<T>::var(const std::vector<std::int64_t>& dims, double correction, bool keepdim) const {
  return chorus::var(*this, dims, correction, keepdim);
}
template <class T>
Tensor<T> Tensor<T>::var(std::int64_t dim, double correction, bool keepdim) const {
  return chorus::var(*this, dim, correction, keepdim);
}
template <class T>
Tensor<T> Tensor<T>::std(const std::vector<std::int64_t>& dims, double correction, bool keepdim) const {
  return chorus::std(*this, dims, correction, keepdim);
}
template <class T>
Tensor<T> Tensor<T>::std(std::int64_t dim, double correction, bool keepdim) const {
  return chorus::std(*this, dim, correction, keepdim);
}
template <class T>
Tensor<T> Tensor<T>::logsumexp(std::initializer_list<std::int64_t> dims, bool keepdim) const {
  return chorus::logsumexp(*this, dims, keepdim);
}
template <class T>
Tensor<T> Tensor<T>::var(std::initializer_list<std::int64_t> dims, double correction, bool keepdim) const {
  return chorus::var(*this, dims, correction, keepdim);
}
template <class T>
Tensor<T> Tensor<T>::std(std::initializer_list<std::int64_t> dims, double correction, bool keepdim) const {
  return chorus::std(*this, dims, correction, keepdim);
}
template <class T>
Tensor<T> Tensor<T>::norm(double p, std::initializer_list<std::int64_t> dims, bool keepdim) const {
  return chorus::norm(*this, p, dims, keepdim);
}
/// The variance over all elements, unbiased or not (PyTorch's x.var(unbiased)); a bool only, an int is a dim.
template <class T>
template <class B>
  requires std::is_same_v<B, bool>
Tensor<T> Tensor<T>::var(B unbiased) const {
  return chorus::var(*this, unbiased);
}
/// The standard deviation over all elements, unbiased or not (torch.std(unbiased)); only a bool.
template <class T>
template <class B>
  requires std::is_same_v<B, bool>
Tensor<T> Tensor<T>::std(B unbiased) const {
  return chorus::std(*this, unbiased);
}
template <class T>
Tensor<T> Tensor<T>::norm(double p) const {
  return chorus::norm(*this, p);
}
template <class T>
Tensor<T> Tensor<T>::norm(double p, const std::vector<std::int64_t>& dims, bool keepdim) const {
  return chorus::norm(*this, p, dims, keepdim);
}
template <class T>
Tensor<T> Tensor<T>::norm(double p, std::int64_t dim, bool keepdim) const {
  return chorus::norm(*this, p, dim, keepdim);
}

CHORUS_NAMESPACE_END

// The instances chorus::compiled holds (Note [compiled chorus] in compiled.hpp).
#define CHORUS_OPS_STATISTICS_FLOAT_INSTANCES(X, T)                                         \
  X(Tensor<T> logsumexp<T>(const Tensor<T>&, const std::vector<std::int64_t>&, bool))       \
  X(Tensor<T> logsumexp<T>(const Tensor<T>&, std::int64_t, bool))                           \
  X(Tensor<T> logsumexp<T>(const Tensor<T>&, std::initializer_list<std::int64_t>, bool))    \
  X(Tensor<T> var<T>(const Tensor<T>&, const std::vector<std::int64_t>&, double, bool))     \
  X(Tensor<T> var<T>(const Tensor<T>&, std::int64_t, double, bool))                         \
  X(Tensor<T> var<T>(const Tensor<T>&, std::initializer_list<std::int64_t>, double, bool))  \
  X(Tensor<T> var<T>(const Tensor<T>&))                                                     \
  X(Tensor<T> std<T>(const Tensor<T>&, const std::vector<std::int64_t>&, double, bool))     \
  X(Tensor<T> std<T>(const Tensor<T>&, std::int64_t, double, bool))                         \
  X(Tensor<T> norm<T>(const Tensor<T>&, double, const std::vector<std::int64_t>&, bool))    \
  X(Tensor<T> norm<T>(const Tensor<T>&, double, std::int64_t, bool))                        \
  X(Tensor<T> norm<T>(const Tensor<T>&, double, std::initializer_list<std::int64_t>, bool)) \
  X(Tensor<T> norm<T>(const Tensor<T>&, double))                                            \
  X(Tensor<T> std<T>(const Tensor<T>&, std::initializer_list<std::int64_t>, double, bool))  \
  X(Tensor<T> std<T>(const Tensor<T>&))
CHORUS_EXTERN_INSTANCES(CHORUS_OPS_STATISTICS_FLOAT_INSTANCES, CHORUS_FLOATING_DTYPES)
