#pragma once
// Reductions (sum, mean over one dim or several), cumsum, logsumexp and softmax / log_softmax.
#include <initializer_list>
#include <vector>

#include "../compiled.hpp"
#include "../backend/index.hpp"
#include "common.hpp"
#include "dims.hpp"

CHORUS_NAMESPACE_BEGIN
namespace ops::detail {

/// Backward of sum/mean: spreads grad (shape = the reduced shape) back over `dim`.
template <class T>
class SumBackward final : public autograd::Node<T> {
 public:
  SumBackward(Shape in_shape, int dim, double scale, bool all)
      : in_(in_shape), dim_(dim), scale_(scale), all_(all) {}
  std::string name() const override { return scale_ == 1.0 ? "SumBackward" : "MeanBackward"; }
  typename autograd::Node<T>::TensorList apply(typename autograd::Node<T>::TensorList&& g) override {
    auto out = Tensor<T>::empty(in_, g[0].device());
    if (all_) {
      backend::expand_dim(g[0], 1, numel_of(in_), 1, out, scale_);
    } else {
      std::int64_t outer, n, inner;
      split_around(in_, dim_, outer, n, inner);
      backend::expand_dim(g[0], outer, n, inner, out, scale_);
    }
    return {out};
  }

 private:
  Shape in_;
  int dim_;
  double scale_;
  bool all_;
};

template <class T>
Tensor<T> reduce_all(const Tensor<T>& x, bool mean) {
  check_defined(mean ? "mean" : "sum", x);
  auto xc = contiguous_data(x);
  auto out = Tensor<T>::empty(Shape{}, x.device());
  const double scale = mean ? 1.0 / static_cast<double>(x.numel()) : 1.0;
  if (x.numel() == 0) {
    backend::fill(out, mean ? std::numeric_limits<T>::quiet_NaN() : T(0));
  } else {
    backend::sum_all(xc, out, scale);
  }
  if (autograd::needs_grad(x)) {
    auto node = autograd::make_node<SumBackward<T>, T>({&x}, x.shape(), 0, scale, true);
    autograd::set_history(out, std::shared_ptr<autograd::Node<T>>(node));
  }
  return out;
}

template <class T>
Tensor<T> reduce_dim(const Tensor<T>& x, std::int64_t dim, bool keepdim, bool mean) {
  check_defined(mean ? "mean" : "sum", x);
  CHORUS_CHECK(x.dim() > 0, mean ? "mean" : "sum", "(dim): the tensor is 0-dim");
  const int d = wrap_dim(dim, x.dim());
  auto xc = contiguous_data(x);
  std::int64_t outer, n, inner;
  split_around(x.shape(), d, outer, n, inner);
  Shape s = x.shape();
  s[d] = 1;
  const double scale = mean ? (n ? 1.0 / static_cast<double>(n) : std::numeric_limits<double>::quiet_NaN()) : 1.0;
  auto out = Tensor<T>::empty(s, x.device());
  if (n == 0) {
    backend::fill(out, mean ? std::numeric_limits<T>::quiet_NaN() : T(0));
  } else {
    backend::sum_dim(xc, outer, n, inner, out, scale);
  }
  if (!keepdim) {
    s.erase(d);
    out = view_as_shape(out, s);
  }
  if (autograd::needs_grad(x)) {
    auto node = autograd::make_node<SumBackward<T>, T>({&x}, x.shape(), d, scale, false);
    autograd::set_history(out, std::shared_ptr<autograd::Node<T>>(node));
  }
  return out;
}

template <class T>
class SoftmaxBackward final : public autograd::Node<T> {
 public:
  SoftmaxBackward(Tensor<T> out, int dim, bool log_space) : y_(std::move(out)), dim_(dim), log_(log_space) {
    this->save_version(y_);
  }
  std::string name() const override { return log_ ? "LogSoftmaxBackward" : "SoftmaxBackward"; }
  typename autograd::Node<T>::TensorList apply(typename autograd::Node<T>::TensorList&& g) override {
    auto gx = Tensor<T>::empty(y_.shape(), y_.device());
    std::int64_t outer, n, inner;
    split_around(y_.shape(), dim_, outer, n, inner);
    backend::softmax_backward(g[0], y_, outer, n, inner, gx, log_);
    return {gx};
  }
  void release_saved() override { y_ = Tensor<T>(); }

 private:
  Tensor<T> y_;
  int dim_;
  bool log_;
};

/// `zero_dead`: rows of -inf along `dim` give zeros, not NaN (Note [fully masked rows]).
template <class T>
Tensor<T> softmax_impl(const Tensor<T>& x, std::int64_t dim, bool log_space, bool zero_dead = false) {
  check_defined(log_space ? "log_softmax" : "softmax", x);
  const int d = wrap_dim(dim, x.dim());
  auto xc = contiguous_data(x);
  std::int64_t outer, n, inner;
  split_around(x.shape(), d, outer, n, inner);
  auto out = Tensor<T>::empty(x.shape(), x.device());
  if (x.numel() > 0) backend::softmax(xc, outer, n, inner, out, log_space, zero_dead);
  if (autograd::needs_grad(x)) {
    auto node = autograd::make_node<SoftmaxBackward<T>, T>({&x}, out.detach(), d, log_space);
    autograd::set_history(out, std::shared_ptr<autograd::Node<T>>(node));
  }
  return out;
}

/// Backward of cumsum: the reversed cumulative sum of the gradient.
template <class T>
class CumsumBackward final : public autograd::Node<T> {
 public:
  CumsumBackward(Shape in_shape, int dim) : in_(in_shape), dim_(dim) {}
  std::string name() const override { return "CumsumBackward"; }
  typename autograd::Node<T>::TensorList apply(typename autograd::Node<T>::TensorList&& g) override {
    auto out = Tensor<T>::empty(in_, g[0].device());
    std::int64_t outer, n, inner;
    split_around(in_.size() ? in_ : Shape{1}, dim_, outer, n, inner);
    backend::cumsum(g[0], outer, n, inner, out, true);
    return {out};
  }

 private:
  Shape in_;
  int dim_;
};

/// Sum or mean over several dimensions: one recorded single-dim reduction per dimension.
template <class T>
Tensor<T> reduce_dims(const Tensor<T>& x, const std::vector<std::int64_t>& dims, bool keepdim, bool mean) {
  const char* op = mean ? "mean" : "sum";
  check_defined(op, x);
  const auto ds = reduction_dims(dims, x.dim(), op);
  if (x.dim() == 0 || (ds.size() == static_cast<std::size_t>(x.dim()) && !keepdim)) return reduce_all(x, mean);
  Tensor<T> r = x;
  for (auto it = ds.rbegin(); it != ds.rend(); ++it) r = reduce_dim(r, *it, true, mean);
  return keepdim ? r : r.reshape(reduced_shape(x.shape(), ds, false));
}

}  // namespace ops::detail

/// Sum of all elements (a 0-dim tensor).
template <class T>
Tensor<T> sum(const Tensor<T>& x) {
  return ops::detail::reduce_all(x, false);
}
/// Sum over `dim` (kept as size 1 with keepdim).
template <class T>
Tensor<T> sum(const Tensor<T>& x, std::int64_t dim, bool keepdim = false) {
  return ops::detail::reduce_dim(x, dim, keepdim, false);
}
/// Mean of all elements (a 0-dim tensor; NaN for an empty tensor), as torch.mean.
template <class T>
Tensor<T> mean(const Tensor<T>& x) {
  return ops::detail::reduce_all(x, true);
}
/// Mean over `dim` (kept as size 1 with keepdim), as torch.mean(x, dim, keepdim).
template <class T>
Tensor<T> mean(const Tensor<T>& x, std::int64_t dim, bool keepdim = false) {
  return ops::detail::reduce_dim(x, dim, keepdim, true);
}
/// Sum over the dimensions in `dims` (an empty list: all of them), as torch.sum(x, dims, keepdim).
template <class T>
Tensor<T> sum(const Tensor<T>& x, const std::vector<std::int64_t>& dims, bool keepdim = false) {
  return ops::detail::reduce_dims(x, dims, keepdim, false);
}
/// Mean over the dimensions in `dims` (an empty list: all of them), as torch.mean(x, dims, keepdim).
template <class T>
Tensor<T> mean(const Tensor<T>& x, const std::vector<std::int64_t>& dims, bool keepdim = false) {
  return ops::detail::reduce_dims(x, dims, keepdim, true);
}
// Note [braced dim lists]
// `sum(x, {})` must mean every dim, as PyTorch's dim=[] does, not dim 0: `{}` converts to an
// int64 dim as well as to a vector, and the int wins. A std::initializer_list parameter beats
// both (C++'s tie-breaker for list-initialisation), so each operator taking one dim or a list of
// dims has this third overload; `{1}` still means dim 1.
/// sum(x, dims, keepdim) for a braced list of dims; `{}` means all of them (Note [braced dim lists]).
template <class T>
Tensor<T> sum(const Tensor<T>& x, std::initializer_list<std::int64_t> dims, bool keepdim = false) {
  return ops::detail::reduce_dims(x, std::vector<std::int64_t>(dims), keepdim, false);
}
/// mean(x, dims, keepdim) for a braced list of dims; `{}` means all of them (Note [braced dim lists]).
template <class T>
Tensor<T> mean(const Tensor<T>& x, std::initializer_list<std::int64_t> dims, bool keepdim = false) {
  return ops::detail::reduce_dims(x, std::vector<std::int64_t>(dims), keepdim, true);
}

/// Inclusive cumulative sum along `dim` (accumulated in double for float), as torch.cumsum.
template <class T>
Tensor<T> cumsum(const Tensor<T>& x, std::int64_t dim) {
  ops::detail::check_defined("cumsum", x);
  const int d = ops::detail::wrap_op_dim(dim, x.dim(), "cumsum");
  auto xc = ops::detail::contiguous_data(x);
  std::int64_t outer, n, inner;
  ops::detail::split_around(x.dim() ? x.shape() : Shape{1}, d, outer, n, inner);
  auto out = Tensor<T>::empty(x.shape(), x.device());
  backend::cumsum(xc, outer, n, inner, out, false);
  if constexpr (is_floating_v<T>) {
    if (autograd::needs_grad(x)) {
      auto node = autograd::make_node<ops::detail::CumsumBackward<T>, T>({&x}, x.shape(), d);
      autograd::set_history(out, std::shared_ptr<autograd::Node<T>>(node));
    }
  }
  return out;
}

/// exp(x) normalised to sum to 1 along `dim` (torch.softmax).
template <class T>
Tensor<T> softmax(const Tensor<T>& x, std::int64_t dim) {
  return ops::detail::softmax_impl(x, dim, false);
}
/// The logarithm of softmax(x, dim), computed in log space (torch.log_softmax).
template <class T>
Tensor<T> log_softmax(const Tensor<T>& x, std::int64_t dim) {
  return ops::detail::softmax_impl(x, dim, true);
}
template <class T>
Tensor<T> Tensor<T>::softmax(std::int64_t dim) const {
  return ::chorus::softmax(*this, dim);
}
template <class T>
Tensor<T> Tensor<T>::log_softmax(std::int64_t dim) const {
  return ::chorus::log_softmax(*this, dim);
}

template <class T>
Tensor<T> Tensor<T>::sum() const {
  return chorus::sum(*this);
}
template <class T>
Tensor<T> Tensor<T>::sum(std::int64_t dim, bool keepdim) const {
  return chorus::sum(*this, dim, keepdim);
}
template <class T>
Tensor<T> Tensor<T>::mean() const {
  return chorus::mean(*this);
}
template <class T>
Tensor<T> Tensor<T>::mean(std::int64_t dim, bool keepdim) const {
  return chorus::mean(*this, dim, keepdim);
}
template <class T>
Tensor<T> Tensor<T>::sum(const std::vector<std::int64_t>& dims, bool keepdim) const {
  return chorus::sum(*this, dims, keepdim);
}
template <class T>
Tensor<T> Tensor<T>::mean(const std::vector<std::int64_t>& dims, bool keepdim) const {
  return chorus::mean(*this, dims, keepdim);
}
template <class T>
Tensor<T> Tensor<T>::sum(std::initializer_list<std::int64_t> dims, bool keepdim) const {
  return chorus::sum(*this, dims, keepdim);
}
template <class T>
Tensor<T> Tensor<T>::mean(std::initializer_list<std::int64_t> dims, bool keepdim) const {
  return chorus::mean(*this, dims, keepdim);
}
template <class T>
Tensor<T> Tensor<T>::cumsum(std::int64_t dim) const {
  return chorus::cumsum(*this, dim);
}

CHORUS_NAMESPACE_END

// The instances chorus::compiled holds (Note [compiled chorus] in compiled.hpp).
#define CHORUS_OPS_REDUCE_INSTANCES(X, T)                                           \
  X(Tensor<T> sum<T>(const Tensor<T>&))                                             \
  X(Tensor<T> sum<T>(const Tensor<T>&, std::int64_t, bool))                         \
  X(Tensor<T> mean<T>(const Tensor<T>&))                                            \
  X(Tensor<T> mean<T>(const Tensor<T>&, std::int64_t, bool))                        \
  X(Tensor<T> sum<T>(const Tensor<T>&, const std::vector<std::int64_t>&, bool))     \
  X(Tensor<T> mean<T>(const Tensor<T>&, const std::vector<std::int64_t>&, bool))    \
  X(Tensor<T> sum<T>(const Tensor<T>&, std::initializer_list<std::int64_t>, bool))  \
  X(Tensor<T> mean<T>(const Tensor<T>&, std::initializer_list<std::int64_t>, bool)) \
  X(Tensor<T> cumsum<T>(const Tensor<T>&, std::int64_t))                            \
  X(Tensor<T> softmax<T>(const Tensor<T>&, std::int64_t))                           \
  X(Tensor<T> log_softmax<T>(const Tensor<T>&, std::int64_t))
CHORUS_EXTERN_INSTANCES(CHORUS_OPS_REDUCE_INSTANCES, CHORUS_ALL_DTYPES)
