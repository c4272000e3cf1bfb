#pragma once
// Reductions that select elements: max/min (all, or along a dim with indices), amax/amin,
// argmax/argmin and topk. NaN propagates through max/min (a NaN is the maximum and the
// minimum, as in PyTorch); ties go to the first index.
//
// Gradients follow PyTorch: max/min/topk along a dim send the gradient to the returned index
// only; max()/min() of all elements and amax/amin share it evenly among the elements equal to
// the result (evenly_distribute_backward).
#include <optional>
#include <tuple>
#include <type_traits>
#include <vector>

#include "../compiled.hpp"
#include "../backend/index.hpp"
#include "dims.hpp"
#include "index.hpp"

CHORUS_NAMESPACE_BEGIN
namespace ops::detail {

inline backend::fn::RankOrder extremum_order(bool is_max) { return {is_max, true}; }

/// The extremum along dim d of x: values and/or indices of x's shape with size 1 at d.
template <class T>
void extremum_dim(const Tensor<T>& x, int d, bool is_max, std::type_identity_t<Tensor<T>>* vals,
                  Tensor<std::int64_t>* idx) {
  const Shape xs = at_least_1d(x.shape());
  auto xc = contiguous_data(x);
  std::int64_t outer, n, inner;
  split_around(xs, d, outer, n, inner);
  Shape ks = xs;
  ks[d] = 1;
  if (vals) *vals = Tensor<T>::empty(ks, x.device());
  if (idx) *idx = Tensor<std::int64_t>::empty(ks, x.device());
  backend::select_extremum(xc, outer, n, inner, vals ? vals->data() : nullptr, idx ? idx->data() : nullptr,
                           extremum_order(is_max));
}

inline void check_nonempty_dim(const char* op, const Shape& s, int d) {
  CHORUS_CHECK(s.size() == 0 || s[d] != 0, op, ": cannot reduce dimension ", d, " of size 0 (shape ", s,
               "): there is no element to select");
}

/// The gradient lands on the selected positions (index: x's shape with the selected count at dim).
template <class T>
class SelectBackward final : public autograd::Node<T> {
 public:
  SelectBackward(const char* name, Shape in_shape, int dim, Tensor<std::int64_t> index)
      : name_(name), in_(in_shape), dim_(dim), index_(std::move(index)) {
    this->save_version(index_);
  }
  std::string name() const override { return name_; }
  typename autograd::Node<T>::TensorList apply(typename autograd::Node<T>::TensorList&& g) override {
    auto gx = zeros<T>(at_least_1d(in_), g[0].device());
    scatter_add_into(gx, dim_, index_, view_as_shape(g[0], index_.shape()));
    return {view_as_shape(gx, in_)};
  }
  void release_saved() override { index_ = Tensor<std::int64_t>(); }

 private:
  const char* name_;
  Shape in_;
  int dim_;
  Tensor<std::int64_t> index_;
};

/// The gradient of amax/amin/max()/min() shared evenly among the elements equal to the result.
template <class T>
class EvenlyDistributeBackward final : public autograd::Node<T> {
 public:
  EvenlyDistributeBackward(const char* name, Tensor<T> x, Tensor<T> value_keep)
      : name_(name), x_(std::move(x)), v_(std::move(value_keep)) {
    this->save_version(x_);
    this->save_version(v_);
  }
  std::string name() const override { return name_; }
  typename autograd::Node<T>::TensorList apply(typename autograd::Node<T>::TensorList&& g) override {
    const Shape& xs = x_.shape();
    auto mask = Tensor<T>::empty(xs, x_.device());
    backend::binary_broadcast(x_, broadcast_strides(x_, xs), v_, broadcast_strides(v_, xs), mask,
                              backend::fn::SameValue{});
    auto count = sum_to(mask, v_.shape());
    auto share = Tensor<T>::empty(v_.shape(), x_.device());
    backend::binary_same(view_as_shape(g[0], v_.shape()), count, share, backend::fn::Div{});
    auto gx = Tensor<T>::empty(xs, x_.device());
    backend::binary_broadcast(mask, broadcast_strides(mask, xs), share, broadcast_strides(share, xs), gx,
                              backend::fn::Mul{});
    return {gx};
  }
  void release_saved() override {
    x_ = Tensor<T>();
    v_ = Tensor<T>();
  }

 private:
  const char* name_;
  Tensor<T> x_, v_;
};

/// amax/amin over `dims` (empty: all), as torch.amax.
template <class T>
Tensor<T> extremum_dims(const char* op, const char* node, const Tensor<T>& x, const std::vector<std::int64_t>& dims,
                        bool keepdim, bool is_max) {
  check_defined(op, x);
  const auto ds = reduction_dims(dims, x.dim(), op);
  for (int d : ds) check_nonempty_dim(op, x.shape(), d);
  // keep: x's shape with 1 at each reduced dim (a 0-dim tensor is its own extremum).
  Tensor<T> keep = ds.empty() ? x.detach().clone() : contiguous_data(x.detach());
  if (ds.size() > 1 && ds.size() == static_cast<std::size_t>(x.dim())) {  // all of them: one pass
    Tensor<T> flat;
    extremum_dim(view_as_shape(keep, Shape{x.numel()}), 0, is_max, &flat, nullptr);
    keep = view_as_shape(flat, Shape::filled(x.dim(), 1));
  } else {
    for (auto it = ds.rbegin(); it != ds.rend(); ++it) {
      Tensor<T> next;
      extremum_dim(keep, *it, is_max, &next, nullptr);
      keep = next;
    }
  }
  auto out = view_as_shape(keep, reduced_shape(x.shape(), ds, keepdim));
  if constexpr (is_floating_v<T>) {
    if (autograd::needs_grad(x)) {
      auto n = autograd::make_node<EvenlyDistributeBackward<T>, T>({&x}, node, contiguous_data(x.detach()), keep);
      autograd::set_history(out, std::shared_ptr<autograd::Node<T>>(n));
    }
  }
  return out;
}

template <class T>
std::tuple<Tensor<T>, Tensor<std::int64_t>> extremum_with_index(const char* op, const char* node, const Tensor<T>& x,
                                                                std::int64_t dim, bool keepdim, bool is_max) {
  check_defined(op, x);
  const int d = wrap_op_dim(dim, x.dim(), op);
  check_nonempty_dim(op, x.shape(), d);
  Tensor<T> vals;
  Tensor<std::int64_t> idx;
  extremum_dim(x, d, is_max, &vals, &idx);
  const Shape out_shape = x.dim() == 0 ? Shape{} : reduced_shape(x.shape(), {d}, keepdim);
  Tensor<T> v = view_as_shape(vals, out_shape);
  Tensor<std::int64_t> i = view_as_shape(idx, out_shape);
  if constexpr (is_floating_v<T>) {
    if (autograd::needs_grad(x)) {
      auto n = autograd::make_node<SelectBackward<T>, T>({&x}, node, x.shape(), d, idx);
      autograd::set_history(v, std::shared_ptr<autograd::Node<T>>(n));
    }
  }
  return {v, i};
}

template <class T>
Tensor<std::int64_t> arg_extremum(const char* op, const Tensor<T>& x, std::optional<std::int64_t> dim, bool keepdim,
                                  bool is_max) {
  check_defined(op, x);
  if (dim) {
    const int d = wrap_op_dim(*dim, x.dim(), op);
    check_nonempty_dim(op, x.shape(), d);
    Tensor<std::int64_t> idx;
    extremum_dim(x.detach(), d, is_max, nullptr, &idx);
    return view_as_shape(idx, x.dim() == 0 ? Shape{} : reduced_shape(x.shape(), {d}, keepdim));
  }
  CHORUS_CHECK(x.numel() > 0, op, ": the input (shape ", x.shape(), ") is empty; there is no element to select");
  auto flat = view_as_shape(contiguous_data(x.detach()), Shape{x.numel()});  // the index into the flattened tensor
  Tensor<std::int64_t> idx;
  extremum_dim(flat, 0, is_max, nullptr, &idx);
  return view_as_shape(idx, keepdim ? Shape::filled(x.dim(), 1) : Shape{});
}

}  // namespace ops::detail

/// The largest element (0-dim); NaN if any element is NaN.
template <class T>
Tensor<T> max(const Tensor<T>& x) {
  ops::detail::check_defined("max", x);
  CHORUS_CHECK(x.numel() > 0, "max: the input (shape ", x.shape(),
               ") is empty; reduce an empty tensor along a dim with amax or give max a dim");
  return ops::detail::extremum_dims("max", "MaxBackward", x, {}, false, true);
}
/// The smallest element (0-dim); NaN if any element is NaN.
template <class T>
Tensor<T> min(const Tensor<T>& x) {
  ops::detail::check_defined("min", x);
  CHORUS_CHECK(x.numel() > 0, "min: the input (shape ", x.shape(),
               ") is empty; reduce an empty tensor along a dim with amin or give min a dim");
  return ops::detail::extremum_dims("min", "MinBackward", x, {}, false, false);
}
/// (values, indices) of the maxima along `dim`, as torch.max(input, dim, keepdim).
template <class T>
std::tuple<Tensor<T>, Tensor<std::int64_t>> max(const Tensor<T>& x, std::int64_t dim, bool keepdim = false) {
  return ops::detail::extremum_with_index("max", "MaxBackward", x, dim, keepdim, true);
}
/// (values, indices) of the minima along `dim`, as torch.min(input, dim, keepdim).
template <class T>
std::tuple<Tensor<T>, Tensor<std::int64_t>> min(const Tensor<T>& x, std::int64_t dim, bool keepdim = false) {
  return ops::detail::extremum_with_index("min", "MinBackward", x, dim, keepdim, false);
}
/// The maximum over `dims` (empty: all dims), as torch.amax.
template <class T>
Tensor<T> amax(const Tensor<T>& x, const std::vector<std::int64_t>& dims = {}, bool keepdim = false) {
  return ops::detail::extremum_dims("amax", "AmaxBackward", x, dims, keepdim, true);
}
/// The minimum over `dims` (empty: all dims), as torch.amin.
template <class T>
Tensor<T> amin(const Tensor<T>& x, const std::vector<std::int64_t>& dims = {}, bool keepdim = false) {
  return ops::detail::extremum_dims("amin", "AminBackward", x, dims, keepdim, false);
}
/// The index of the first maximum along `dim`, or into the flattened tensor without a dim.
template <class T>
Tensor<std::int64_t> argmax(const Tensor<T>& x, std::optional<std::int64_t> dim = std::nullopt, bool keepdim = false) {
  return ops::detail::arg_extremum("argmax", x, dim, keepdim, true);
}
/// The index of the first minimum along `dim`, or into the flattened tensor without a dim.
template <class T>
Tensor<std::int64_t> argmin(const Tensor<T>& x, std::optional<std::int64_t> dim = std::nullopt, bool keepdim = false) {
  return ops::detail::arg_extremum("argmin", x, dim, keepdim, false);
}

/// The k largest (or smallest) elements along `dim` and their indices, as torch.topk. The
/// result is always sorted (sorted = false allows any order, and sorted is one); NaN counts as
/// larger than every number; equal values come in index order.
template <class T>
std::tuple<Tensor<T>, Tensor<std::int64_t>> topk(const Tensor<T>& x, std::int64_t k, std::int64_t dim = -1,
                                                 bool largest = true, bool sorted = true) {
  (void)sorted;
  ops::detail::check_defined("topk", x);
  const int d = ops::detail::wrap_op_dim(dim, x.dim(), "topk");
  const Shape xs = ops::detail::at_least_1d(x.shape());
  CHORUS_CHECK(k >= 0 && k <= xs[d], "topk: k (", k, ") is out of range for dimension ", d, " of size ", xs[d],
               " (shape ", x.shape(), ")");
  std::int64_t outer, n, inner;
  ops::detail::split_around(xs, d, outer, n, inner);
  Shape s = xs;
  s[d] = k;
  auto vals = Tensor<T>::empty(s, x.device());
  auto idx = Tensor<std::int64_t>::empty(s, x.device());
  backend::topk(ops::detail::contiguous_data(x), outer, n, inner, k, vals, idx,
                backend::fn::RankOrder{largest, largest});
  const Shape out_shape = x.dim() == 0 && k == 1 ? Shape{} : s;  // a 0-dim input keeps its rank
  Tensor<T> v = ops::detail::view_as_shape(vals, out_shape);
  if constexpr (is_floating_v<T>) {
    if (autograd::needs_grad(x)) {
      auto node = autograd::make_node<ops::detail::SelectBackward<T>, T>({&x}, "TopkBackward", x.shape(), d, idx);
      autograd::set_history(v, std::shared_ptr<autograd::Node<T>>(node));
    }
  }
  return {v, ops::detail::view_as_shape(idx, out_shape)};
}

template <class T>
Tensor<T> Tensor<T>::max() const {
  return chorus::max(*this);
}
template <class T>
Tensor<T> Tensor<T>::min() const {
  return chorus::min(*this);
}
template <class T>
std::tuple<Tensor<T>, Tensor<std::int64_t>> Tensor<T>::max(std::int64_t dim, bool keepdim) const {
  return chorus::max(*this, dim, keepdim);
}
template <class T>
std::tuple<Tensor<T>, Tensor<std::int64_t>> Tensor<T>::min(std::int64_t dim, bool keepdim) const {
  return chorus::min(*this, dim, keepdim);
}
template <class T>
Tensor<T> Tensor<T>::amax(const std::vector<std::int64_t>& dims, bool keepdim) const {
  return chorus::amax(*this, dims, keepdim);
}
template <class T>
Tensor<T> Tensor<T>::amin(const std::vector<std::int64_t>& dims, bool keepdim) const {
  return chorus::amin(*this, dims, keepdim);
}
template <class T>
Tensor<std::int64_t> Tensor<T>::argmax(std::optional<std::int64_t> dim, bool keepdim) const {
  return chorus::argmax(*this, dim, keepdim);
}
template <class T>
Tensor<std::int64_t> Tensor<T>::argmin(std::optional<std::int64_t> dim, bool keepdim) const {
  return chorus::argmin(*this, dim, keepdim);
}
template <class T>
std::tuple<Tensor<T>, Tensor<std::int64_t>> Tensor<T>::topk(std::int64_t k, std::int64_t dim, bool largest,
                                                            bool sorted) const {
  return chorus::topk(*this, k, dim, largest, sorted);
}

CHORUS_NAMESPACE_END

// The instances chorus::compiled holds (Note [compiled chorus] in compiled.hpp).
#define CHORUS_OPS_MINMAX_INSTANCES(X, T)                                                                          \
  X(Tensor<T> min<T>(const Tensor<T>&))                                                                            \
  X(std::tuple<Tensor<T>, Tensor<std::int64_t>> min<T>(const Tensor<T>&, std::int64_t, bool))                      \
  X(Tensor<std::int64_t> argmax<T>(const Tensor<T>&, std::optional<std::int64_t>, bool))                           \
  X(Tensor<std::int64_t> argmin<T>(const Tensor<T>&, std::optional<std::int64_t>, bool))                           \
  X(std::tuple<Tensor<T>, Tensor<std::int64_t>> topk<T>(const Tensor<T>&, std::int64_t, std::int64_t, bool, bool))
CHORUS_EXTERN_INSTANCES(CHORUS_OPS_MINMAX_INSTANCES, CHORUS_ALL_DTYPES)
