#pragma once
// In-place arithmetic: add_, sub_, mul_, div_ and the compound assignments +=, -=, *=, /=.
#include "elementwise.hpp"
#include "view.hpp"

// Note [in-place arithmetic]
// `x.add_(y)` writes into x's elements what `x + y` computes, y broadcast to x's shape (never
// x to y's: the shape written is x's, as in PyTorch), in one pass where x is contiguous. The
// invariant is bit for bit: `x op= y` leaves x equal to `x op y`, the same functors on the same
// operands (`x.div_(s)` is `x * (1/s)` as `x / s` is). `add_(y, alpha)` and `sub_(y, alpha)`
// compute x + alpha*y in the element type's opmath (float for the 16-bit types) and round to the
// element type once (fn::AddScaled); chorus has no out-of-place add with alpha to equal.
//
// Autograd records no in-place operation. Where grad mode would have to record one, the call is
// refused with an error, and nothing is written: on a leaf that requires grad (PyTorch refuses
// it too), on a tensor with history, or with an operand that requires grad. Under NoGradGuard,
// or on `p.detach()`, they write, as PyTorch's manual updates `p.add_(g, -lr)` do. A graph that
// saved x is refused at backward, through x's version counter (Note [version counter]).
//
// An operand that shares x's storage without being exactly x's elements (`x.add_(x[0])`, a
// shifted slice) is copied first: reading elements the loop has already written would make
// the result depend on the order of the loop.
CHORUS_NAMESPACE_BEGIN
namespace ops::detail {

template <class T>
void check_inplace_operand(std::string_view op, const Tensor<T>& self, const Tensor<T>& other) {
  check_defined(op, self, "the tensor written");
  check_defined(op, other, "the other operand");
  check_same_device(op, self, other);
  check_inplace(self, op.data());
  CHORUS_CHECK(!(autograd::is_grad_enabled() && other.requires_grad()), op,
               ": the other operand requires grad, and autograd records no in-place operation (use the "
               "out-of-place form, or NoGradGuard)");
  if (other.shape() != self.shape()) {
    const Shape s = broadcast_shapes(self.shape(), other.shape(), op.data());
    CHORUS_CHECK(s == self.shape(), op, ": the other operand of shape ", other.shape(),
                 " broadcasts the result to shape ", s, ", which cannot be written into the tensor of shape ",
                 self.shape());
  }
}

/// `other` as the loop may read it while writing `self`: a copy where it overlaps self's
/// elements other than one for one.
template <class T>
Tensor<T> unaliased_operand(const Tensor<T>& self, const Tensor<T>& other) {
  if (other.numel() == 0 || !self.same_storage(other)) return other;
  if (other.storage_offset() == self.storage_offset() && other.shape() == self.shape() &&
      other.strides() == self.strides())
    return other;  // x.add_(x): each element reads only itself
  auto c = Tensor<T>::empty(other.shape(), other.device());
  backend::copy(c, other);
  return c;
}

template <class T, class Op>
Tensor<T>& binary_inplace(std::string_view op, Tensor<T>& self, const Tensor<T>& other, Op f) {
  check_inplace_operand(op, self, other);
  const Tensor<T> b = unaliased_operand(self, other);
  const Shape& s = self.shape();
  if (self.is_contiguous() && b.shape() == s && b.is_contiguous()) {
    backend::binary_same(self, b, self, f);
  } else if (self.is_contiguous()) {
    backend::binary_broadcast(self, self.strides(), b, broadcast_strides(b, s), self, f);
  } else {  // the loops write contiguous outputs: compute, then copy into x's strides
    auto out = Tensor<T>::empty(s, self.device());
    backend::binary_broadcast(self, self.strides(), b, broadcast_strides(b, s), out, f);
    backend::copy(self, out);
  }
  self.bump_version();  // Note [version counter]
  return self;
}

template <class T, class Op>
Tensor<T>& unary_inplace(std::string_view op, Tensor<T>& self, Op f) {
  check_defined(op, self, "the tensor written");
  check_inplace(self, op.data());
  if (self.is_contiguous()) {
    backend::unary(self, self, f);
  } else {
    auto out = Tensor<T>::empty(self.shape(), self.device());
    backend::unary(contiguous_data(self), out, f);
    backend::copy(self, out);
  }
  self.bump_version();  // Note [version counter]
  return self;
}

}  // namespace ops::detail

template <class T>
Tensor<T>& Tensor<T>::add_(const Tensor& other, double alpha) {
  if (alpha == 1.0) return ops::detail::binary_inplace("add_", *this, other, backend::fn::Add{});
  if constexpr (is_floating_v<T>) {
    return ops::detail::binary_inplace("add_", *this, other, backend::fn::AddScaled{alpha});
  } else {
    CHORUS_FAIL("add_: alpha must be 1 for an integer tensor, got ", alpha);
  }
}
template <class T>
Tensor<T>& Tensor<T>::sub_(const Tensor& other, double alpha) {
  if (alpha == 1.0) return ops::detail::binary_inplace("sub_", *this, other, backend::fn::Sub{});
  if constexpr (is_floating_v<T>) {
    return ops::detail::binary_inplace("sub_", *this, other, backend::fn::AddScaled{-alpha});
  } else {
    CHORUS_FAIL("sub_: alpha must be 1 for an integer tensor, got ", alpha);
  }
}
template <class T>
Tensor<T>& Tensor<T>::mul_(const Tensor& other) {
  return ops::detail::binary_inplace("mul_", *this, other, backend::fn::Mul{});
}
template <class T>
Tensor<T>& Tensor<T>::div_(const Tensor& other) {
  static_assert(is_floating_v<T>, "div_: integer tensors have no in-place true division");
  return ops::detail::binary_inplace("div_", *this, other, backend::fn::Div{});
}
template <class T>
Tensor<T>& Tensor<T>::add_(double s) {
  ops::detail::check_scalar_for<T>("add_", s);
  return ops::detail::unary_inplace("add_", *this, backend::fn::AddScalar{s});
}
template <class T>
Tensor<T>& Tensor<T>::sub_(double s) {
  ops::detail::check_scalar_for<T>("sub_", s);
  return ops::detail::unary_inplace("sub_", *this, backend::fn::AddScalar{-s});  // as x - s
}
template <class T>
Tensor<T>& Tensor<T>::mul_(double s) {
  ops::detail::check_scalar_for<T>("mul_", s);
  return ops::detail::unary_inplace("mul_", *this, backend::fn::MulScalar{s});
}
template <class T>
Tensor<T>& Tensor<T>::div_(double s) {
  static_assert(is_floating_v<T>, "div_: integer tensors have no in-place true division");
  return ops::detail::unary_inplace("div_", *this, backend::fn::MulScalar{1.0 / s});  // as x / s
}

CHORUS_NAMESPACE_END
