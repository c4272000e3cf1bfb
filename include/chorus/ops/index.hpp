#pragma once
// Selecting by a mask and indexing along a dimension: where, masked_fill, the comparisons that
// make masks (eq, ne, lt, le, gt, ge), gather, scatter_add and one_hot.
//
// Note [masks are int64]
// chorus has no bool dtype yet (core/dtype.hpp: float32, float64, int64), so a mask is a
// Tensor<std::int64_t> whose nonzero elements are true, as NumPy reads an integer condition and
// as PyTorch read uint8 masks; the comparisons return 0/1 masks of that type. The kernels are
// templates over the mask's element type: a bool or uint8 dtype, when it comes, only adds
// overloads. Floating-point masks are refused at compile time: an additive attention mask
// (0 / -inf) is added to the scores, never passed where a boolean mask is meant.
#include <vector>

#include "../compiled.hpp"
#include "../backend/index.hpp"
#include "dims.hpp"
#include "view.hpp"

CHORUS_NAMESPACE_BEGIN

/// The element type of masks (Note [masks are int64]).
using mask_t = std::int64_t;

namespace ops::detail {

/// cond ? a : b broadcast to one shape (not recorded).
template <class T>
Tensor<T> where_forward(const char* op, const Tensor<mask_t>& cond, const Tensor<T>& a, const Tensor<T>& b) {
  const Shape s = broadcast_shapes(broadcast_shapes(cond.shape(), a.shape(), op), b.shape(), op);
  auto out = Tensor<T>::empty(s, a.device());
  backend::where(cond, broadcast_strides(cond, s), a, broadcast_strides(a, s), b, broadcast_strides(b, s), out);
  return out;
}

/// The gradient goes to a where the condition holds and to b elsewhere, summed to each shape.
template <class T>
class WhereBackward final : public autograd::Node<T> {
 public:
  WhereBackward(const char* name, Tensor<mask_t> cond, Shape a_shape, Shape b_shape)
      : name_(name), cond_(std::move(cond)), a_(a_shape), b_(b_shape) {
    this->save_version(cond_);
  }
  std::string name() const override { return name_; }
  typename autograd::Node<T>::TensorList apply(typename autograd::Node<T>::TensorList&& g) override {
    auto zero = zeros<T>(Shape{}, g[0].device());
    Tensor<T> ga, gb;
    if (this->next_edges()[0].valid()) ga = sum_to(where_forward(name_, cond_, g[0], zero), a_);
    if (this->next_edges()[1].valid()) gb = sum_to(where_forward(name_, cond_, zero, g[0]), b_);
    return {ga, gb};
  }
  void release_saved() override { cond_ = Tensor<mask_t>(); }

 private:
  const char* name_;
  Tensor<mask_t> cond_;
  Shape a_, b_;
};

template <class T>
Tensor<T> where_impl(const char* op, const char* node, const Tensor<mask_t>& cond, const Tensor<T>& a,
                     const Tensor<T>& b) {
  check_defined(op, cond, "condition");
  check_defined(op, a, "first value");
  check_defined(op, b, "second value");
  check_same_device(op, cond, a);
  check_same_device(op, a, b);
  auto out = where_forward(op, cond, a, b);
  if constexpr (is_floating_v<T>) {
    if (autograd::needs_grad(a, b)) {
      auto n = autograd::make_node<WhereBackward<T>, T>({&a, &b}, node, cond.detach(), a.shape(), b.shape());
      autograd::set_history(out, std::shared_ptr<autograd::Node<T>>(n));
    }
  }
  return out;
}

template <class T, class Op>
Tensor<mask_t> compare(const char* op, const Tensor<T>& a, const Tensor<T>& b, Op fn) {
  check_defined(op, a, "left operand");
  check_defined(op, b, "right operand");
  check_same_device(op, a, b);
  const Shape s = broadcast_shapes(a.shape(), b.shape(), op);
  auto out = Tensor<mask_t>::empty(s, a.device());
  backend::compare(a, broadcast_strides(a, s), b, broadcast_strides(b, s), out, fn);
  return out;
}

/// Checks the shapes of gather / scatter_add: index has the tensor's dimensions and fits in
/// it apart from `dim` (and in src everywhere, for scatter_add).
template <class T>
int check_index_shapes(const char* op, const Tensor<T>& self, std::int64_t dim, const Tensor<std::int64_t>& index,
                       const Tensor<T>* src) {
  check_defined(op, self);
  check_defined(op, index, "index");
  check_same_device(op, self, index);
  CHORUS_CHECK(index.dim() == self.dim(), op, ": index tensor must have the same number of dimensions as the input (",
               "index shape ", index.shape(), ", input shape ", self.shape(), ")");
  const int d = wrap_op_dim(dim, self.dim(), op);
  for (int i = 0; i < self.dim(); ++i)
    CHORUS_CHECK(i == d || index.shape()[i] <= self.shape()[i], op, ": size of index ", index.shape(),
                 " exceeds the input's ", self.shape(), " at dimension ", i, " (only dimension ", d,
                 ", the indexed one, may be larger)");
  if (src) {
    check_defined(op, *src, "src");
    check_same_device(op, self, *src);
    CHORUS_CHECK(src->dim() == self.dim(), op, ": src must have the same number of dimensions as the input (src shape ",
                 src->shape(), ", input shape ", self.shape(), ")");
    for (int i = 0; i < self.dim(); ++i)
      CHORUS_CHECK(index.shape()[i] <= src->shape()[i], op, ": size of index ", index.shape(), " exceeds src's ",
                   src->shape(), " at dimension ", i);
  }
  return d;
}

/// CPU indices are checked here; CUDA kernels check their own (Note [device-side validation]).
inline void check_indices(const char* op, const Tensor<std::int64_t>& idx, std::int64_t size, int dim) {
  if (!idx.device().is_cpu()) return;
  const std::int64_t* p = idx.data();
  for (std::int64_t i = 0; i < idx.numel(); ++i)
    CHORUS_CHECK(p[i] >= 0 && p[i] < size, op, ": index ", p[i], " at position ", i, " is out of range for dimension ",
                 dim, " of size ", size);
}

/// A shape with a 0-dim tensor's one element made a dimension (gather and scatter_add
/// treat a 0-dim tensor as 1-D).
inline Shape at_least_1d(const Shape& s) { return s.size() ? s : Shape{1}; }

template <class T>
Tensor<T> gather_forward(const Tensor<T>& x, int d, const Tensor<std::int64_t>& idx) {
  auto out = Tensor<T>::empty(idx.shape(), x.device());
  if (out.numel() > 0) backend::gather(x, d, idx, out);
  return out;
}

/// out (contiguous) += src scattered by idx along d.
template <class T>
void scatter_add_into(const Tensor<T>& out, int d, const Tensor<std::int64_t>& idx, const Tensor<T>& src) {
  if (idx.numel() > 0) backend::scatter_add(src, src.strides(), d, idx, out);
}

template <class T>
class GatherBackward final : public autograd::Node<T> {
 public:
  GatherBackward(Shape in_shape, Shape view_shape, int dim, Tensor<std::int64_t> index)
      : in_(in_shape), view_(view_shape), dim_(dim), index_(std::move(index)) {
    this->save_version(index_);
  }
  std::string name() const override { return "GatherBackward"; }
  typename autograd::Node<T>::TensorList apply(typename autograd::Node<T>::TensorList&& g) override {
    auto gx = zeros<T>(view_, g[0].device());
    scatter_add_into(gx, dim_, index_, view_as_shape(g[0], index_.shape()));
    return {view_as_shape(gx, in_)};
  }
  void release_saved() override { index_ = Tensor<std::int64_t>(); }

 private:
  Shape in_, view_;
  int dim_;
  Tensor<std::int64_t> index_;
};

template <class T>
class ScatterAddBackward final : public autograd::Node<T> {
 public:
  ScatterAddBackward(Shape src_shape, Shape view_shape, int dim, Tensor<std::int64_t> index)
      : src_(src_shape), view_(view_shape), dim_(dim), index_(std::move(index)) {
    this->save_version(index_);
  }
  std::string name() const override { return "ScatterAddBackward"; }
  typename autograd::Node<T>::TensorList apply(typename autograd::Node<T>::TensorList&& g) override {
    Tensor<T> gself, gsrc;
    if (this->next_edges()[0].valid()) gself = g[0];
    if (this->next_edges()[1].valid()) {
      auto part = gather_forward(view_as_shape(g[0], view_), dim_, index_);
      if (part.shape() == at_least_1d(src_)) {
        gsrc = view_as_shape(part, src_);
      } else {  // src is larger than index: the rest of src took no part
        gsrc = zeros<T>(at_least_1d(src_), g[0].device());
        backend::copy(make_view(gsrc, part.shape(), gsrc.strides(), 0), part);
        gsrc = view_as_shape(gsrc, src_);
      }
    }
    return {gself, gsrc};
  }
  void release_saved() override { index_ = Tensor<std::int64_t>(); }

 private:
  Shape src_, view_;
  int dim_;
  Tensor<std::int64_t> index_;
};

}  // namespace ops::detail

/// Elements of a where cond is nonzero, of b elsewhere; the three broadcast together.
template <class T>
Tensor<T> where(const Tensor<mask_t>& condition, const Tensor<T>& a, const Tensor<T>& b) {
  return ops::detail::where_impl("where", "WhereBackward", condition, a, b);
}
/// where() with the scalar `b` (converted to T) as the value where cond is zero.
template <class T>
Tensor<T> where(const Tensor<mask_t>& condition, const Tensor<T>& a, double b) {
  ops::detail::check_defined("where", a, "first value");
  return where(condition, a, full<T>(Shape{}, static_cast<T>(b), a.device()));
}
/// where() with the scalar `a` (converted to T) as the value where cond is nonzero.
template <class T>
Tensor<T> where(const Tensor<mask_t>& condition, double a, const Tensor<T>& b) {
  ops::detail::check_defined("where", b, "second value");
  return where(condition, full<T>(Shape{}, static_cast<T>(a), b.device()), b);
}

/// x with `value` where mask is nonzero (mask and x broadcast together, as torch.masked_fill).
template <class T>
Tensor<T> masked_fill(const Tensor<T>& x, const Tensor<mask_t>& mask, double value) {
  ops::detail::check_defined("masked_fill", x);
  return ops::detail::where_impl("masked_fill", "MaskedFillBackward", mask,
                                 full<T>(Shape{}, static_cast<T>(value), x.device()), x);
}
/// With a 0-dim tensor value (which receives the gradient of the filled elements).
template <class T>
Tensor<T> masked_fill(const Tensor<T>& x, const Tensor<mask_t>& mask, const Tensor<T>& value) {
  ops::detail::check_defined("masked_fill", value, "value");
  CHORUS_CHECK(value.dim() == 0, "masked_fill: only a 0-dimensional value tensor is supported, got one of shape ",
               value.shape());
  return ops::detail::where_impl("masked_fill", "MaskedFillBackward", mask, value, x);
}

// ---- comparisons: 0/1 masks (Note [masks are int64]), broadcasting ----
#define CHORUS_COMPARISON(name, Op)                                                             \
  template <class T>                                                                            \
  Tensor<mask_t> name(const Tensor<T>& a, const Tensor<T>& b) {                                 \
    return ops::detail::compare(#name, a, b, backend::fn::Op{});                                \
  }                                                                                             \
  template <class T>                                                                            \
  Tensor<mask_t> name(const Tensor<T>& a, double b) {                                           \
    ops::detail::check_defined(#name, a, "left operand");                                       \
    return ops::detail::compare(#name, a, full<T>(Shape{}, static_cast<T>(b), a.device()), backend::fn::Op{}); \
  }
CHORUS_COMPARISON(eq, Eq)
CHORUS_COMPARISON(ne, Ne)
CHORUS_COMPARISON(lt, Lt)
CHORUS_COMPARISON(le, Le)
CHORUS_COMPARISON(gt, Gt)
CHORUS_COMPARISON(ge, Ge)
#undef CHORUS_COMPARISON

/// out[i][j][k] = x[i][index[i][j][k]][k] for dim 1 (and likewise for other dims); index has
/// x's number of dimensions and fits in x apart from `dim`, as torch.gather.
template <class T>
Tensor<T> gather(const Tensor<T>& x, std::int64_t dim, const Tensor<std::int64_t>& index) {
  const int d = ops::detail::check_index_shapes<T>("gather", x, dim, index, nullptr);
  const Shape xs = ops::detail::at_least_1d(x.shape());
  auto idx = ops::detail::view_as_shape(ops::detail::contiguous_data(index), ops::detail::at_least_1d(index.shape()));
  ops::detail::check_indices("gather", idx, xs[d], d);
  auto xv = ops::detail::make_view(x, xs, x.dim() ? x.strides() : Strides{1}, x.storage_offset());
  auto out = ops::detail::view_as_shape(ops::detail::gather_forward(xv, d, idx), index.shape());
  if constexpr (is_floating_v<T>) {
    if (autograd::needs_grad(x)) {
      auto node = autograd::make_node<ops::detail::GatherBackward<T>, T>({&x}, x.shape(), xs, d, idx);
      autograd::set_history(out, std::shared_ptr<autograd::Node<T>>(node));
    }
  }
  return out;
}

/// x with src added at the positions index names along `dim`: out[i][index[i][j][k]][k] +=
/// src[i][j][k] for dim 1, as torch.scatter_add (out of place; repeated indices add up).
template <class T>
Tensor<T> scatter_add(const Tensor<T>& x, std::int64_t dim, const Tensor<std::int64_t>& index, const Tensor<T>& src) {
  const int d = ops::detail::check_index_shapes("scatter_add", x, dim, index, &src);
  const Shape xs = ops::detail::at_least_1d(x.shape());
  auto idx = ops::detail::view_as_shape(ops::detail::contiguous_data(index), ops::detail::at_least_1d(index.shape()));
  ops::detail::check_indices("scatter_add", idx, xs[d], d);
  auto out = Tensor<T>::empty(xs, x.device());
  backend::copy(out, ops::detail::make_view(x, xs, x.dim() ? x.strides() : Strides{1}, x.storage_offset()));
  auto sv = ops::detail::make_view(src, ops::detail::at_least_1d(src.shape()), src.dim() ? src.strides() : Strides{1},
                                   src.storage_offset());
  ops::detail::scatter_add_into(out, d, idx, sv);
  out = ops::detail::view_as_shape(out, x.shape());
  if constexpr (is_floating_v<T>) {
    if (autograd::needs_grad(x, src)) {
      auto node = autograd::make_node<ops::detail::ScatterAddBackward<T>, T>({&x, &src}, src.shape(), xs, d, idx);
      autograd::set_history(out, std::shared_ptr<autograd::Node<T>>(node));
    }
  }
  return out;
}

/// One-hot rows: shape indices.shape + [num_classes], 1 at each index (int64, as PyTorch).
/// num_classes = -1 takes max(indices) + 1, which reads the indices on the host (a
/// synchronisation on a GPU); pass it to keep the GPU's queue running.
template <class M = std::int64_t>
Tensor<M> one_hot(const Tensor<std::int64_t>& indices, std::int64_t num_classes = -1) {
  ops::detail::check_defined("one_hot", indices, "indices");
  CHORUS_CHECK(num_classes >= -1, "one_hot: num_classes must be -1 (inferred) or non-negative, got ", num_classes);
  auto idx = ops::detail::contiguous_data(indices);
  const bool on_cpu = idx.device().is_cpu();
  if (num_classes == -1 || on_cpu) {
    std::vector<std::int64_t> host;
    if (on_cpu) {
      host.assign(idx.data(), idx.data() + idx.numel());
    } else {
      host = idx.to_vector();
    }
    if (num_classes == -1) {
      CHORUS_CHECK(!host.empty(), "one_hot: cannot infer the number of classes from an empty tensor");
      num_classes = *std::max_element(host.begin(), host.end()) + 1;
    }
    for (std::size_t i = 0; i < host.size(); ++i)
      CHORUS_CHECK(host[i] >= 0 && host[i] < num_classes, "one_hot: class value ", host[i], " at position ", i,
                   " is out of range for ", num_classes, " classes");
  }
  Shape s = indices.shape();
  s.push_back(num_classes);
  auto out = Tensor<M>::empty(s, indices.device());
  if (out.numel() > 0) backend::one_hot(idx, num_classes, out);
  return out;
}

template <class T>
Tensor<T> Tensor<T>::gather(std::int64_t dim, const Tensor<std::int64_t>& index) const {
  return chorus::gather(*this, dim, index);
}
template <class T>
Tensor<T> Tensor<T>::scatter_add(std::int64_t dim, const Tensor<std::int64_t>& index, const Tensor& src) const {
  return chorus::scatter_add(*this, dim, index, src);
}
template <class T>
Tensor<T> Tensor<T>::masked_fill(const Tensor<std::int64_t>& mask, double value) const {
  return chorus::masked_fill(*this, mask, value);
}

CHORUS_NAMESPACE_END

// The instances chorus::compiled holds (Note [compiled chorus] in compiled.hpp).
#define CHORUS_OPS_INDEX_INSTANCES(X, T)                                                                     \
  X(Tensor<T> where<T>(const Tensor<mask_t>&, const Tensor<T>&, const Tensor<T>&))                           \
  X(Tensor<T> where<T>(const Tensor<mask_t>&, const Tensor<T>&, double))                                     \
  X(Tensor<T> where<T>(const Tensor<mask_t>&, double, const Tensor<T>&))                                     \
  X(Tensor<T> masked_fill<T>(const Tensor<T>&, const Tensor<mask_t>&, double))                               \
  X(Tensor<T> masked_fill<T>(const Tensor<T>&, const Tensor<mask_t>&, const Tensor<T>&))                     \
  X(Tensor<T> gather<T>(const Tensor<T>&, std::int64_t, const Tensor<std::int64_t>&))                        \
  X(Tensor<T> scatter_add<T>(const Tensor<T>&, std::int64_t, const Tensor<std::int64_t>&, const Tensor<T>&))
CHORUS_EXTERN_INSTANCES(CHORUS_OPS_INDEX_INSTANCES, CHORUS_ALL_DTYPES)
