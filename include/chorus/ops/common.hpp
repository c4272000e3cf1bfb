#pragma once
// Helpers shared by the differentiable operations.
#include <string_view>

#include "../autograd/engine.hpp"
#include "factory.hpp"

CHORUS_NAMESPACE_BEGIN
namespace ops::detail {

template <class T, class U>
void check_same_device(std::string_view op, const Tensor<T>& a, const Tensor<U>& b) {
  CHORUS_CHECK(a.device() == b.device(), op, ": expected all tensors on one device, got ", a.device(), " and ",
               b.device(), " (move them with .to(device))");
}

template <class T>
void check_defined(std::string_view op, const Tensor<T>& t, const char* what = "input") {
  CHORUS_CHECK(t.defined(), op, ": ", what, " is an undefined tensor");
}

/// Strides that read `t` as if broadcast to `out` (0 on broadcast dimensions).
template <class T>
Strides broadcast_strides(const Tensor<T>& t, const Shape& out) {
  const Shape& s = t.shape();
  const int lead = out.size() - s.size();
  Strides st = Strides::filled(out.size(), 0);
  for (int i = lead; i < out.size(); ++i) {
    const int j = i - lead;
    st[i] = (s[j] == 1 && out[i] != 1) ? 0 : t.strides()[j];
  }
  return st;
}

/// A contiguous version of t (t itself when already contiguous); not recorded.
template <class T>
Tensor<T> contiguous_data(const Tensor<T>& t) {
  if (t.is_contiguous()) return t;
  auto c = Tensor<T>::empty(t.shape(), t.device());
  backend::copy(c, t);
  return c;
}

/// Sums gradient `g` down to `shape` (the inverse of broadcasting `shape` to g's shape).
template <class T>
Tensor<T> sum_to(const Tensor<T>& g, const Shape& shape) {
  if (g.shape() == shape) return g;
  auto out = zeros<T>(shape, g.device());
  Tensor<T> gc = contiguous_data(g);
  backend::reduce_add_broadcast(gc, out, broadcast_strides(out, g.shape()));
  return out;
}

/// Views a contiguous tensor's data with another shape of the same numel (not recorded).
template <class T>
Tensor<T> view_as_shape(const Tensor<T>& t, const Shape& shape) {
  auto impl = std::make_shared<TensorImpl<T>>();
  impl->storage = t.impl()->storage;
  impl->offset = t.storage_offset();
  impl->shape = shape;
  impl->strides = contiguous_strides(shape);
  return Tensor<T>(std::move(impl));
}

/// Sizes of [outer, n, inner] around dimension `dim` of `shape`.
inline void split_around(const Shape& shape, int dim, std::int64_t& outer, std::int64_t& n, std::int64_t& inner) {
  outer = 1;
  inner = 1;
  for (int i = 0; i < dim; ++i) outer *= shape[i];
  n = shape.size() ? shape[dim] : 1;
  for (int i = dim + 1; i < shape.size(); ++i) inner *= shape[i];
}

/// Passes the gradient through unchanged (clone, contiguous).
template <class T>
class IdentityBackward final : public autograd::Node<T> {
 public:
  explicit IdentityBackward(const char* name) : name_(name) {}
  std::string name() const override { return name_; }
  typename autograd::Node<T>::TensorList apply(typename autograd::Node<T>::TensorList&& g) override {
    return {std::move(g[0])};
  }

 private:
  const char* name_;
};

}  // namespace ops::detail
CHORUS_NAMESPACE_END
