#pragma once
// Matrix products: matmul and the fused linear layer (x @ W^T + b).
#include "common.hpp"

CHORUS_NAMESPACE_BEGIN
namespace ops::detail {

/// A 2-D operand as BLAS sees it: pointer, leading dimension, transposed or not.
template <class T>
struct GemmOperand {
  Tensor<T> keep;  // owns a contiguous copy when one was needed
  const T* ptr;
  std::int64_t ld;
  bool trans;
};

/// Reads 2-D `m` (rows x cols) without copying when it is row- or column-major.
template <class T>
GemmOperand<T> gemm_operand(const Tensor<T>& m) {
  const auto& st = m.strides();
  const std::int64_t rows = m.shape()[0], cols = m.shape()[1];
  if (st[1] == 1 || cols == 1) {  // row-major, leading dimension st[0]
    const std::int64_t ld = rows == 1 ? std::max<std::int64_t>(cols, 1) : st[0];
    if (ld >= std::max<std::int64_t>(cols, 1)) return {m, m.data(), ld, false};
  }
  if (st[0] == 1 || rows == 1) {  // column-major: the transpose of a row-major matrix
    const std::int64_t ld = cols == 1 ? std::max<std::int64_t>(rows, 1) : st[1];
    if (ld >= std::max<std::int64_t>(rows, 1)) return {m, m.data(), ld, true};
  }
  auto c = contiguous_data(m);
  return {c, c.data(), std::max<std::int64_t>(cols, 1), false};
}

/// out[M,N] = alpha * a[M,K] @ b[K,N] + beta * out (out contiguous).
template <class T>
void gemm_2d(const Tensor<T>& a, const Tensor<T>& b, const Tensor<T>& out, T alpha, T beta) {
  auto A = gemm_operand(a);
  auto B = gemm_operand(b);
  const auto M = a.shape()[0], K = a.shape()[1], N = b.shape()[1];
  backend::gemm(A.trans, B.trans, M, N, K, alpha, A.ptr, A.ld, B.ptr, B.ld, beta, out.data(), std::max<std::int64_t>(N, 1),
                out.device());
}

/// Plain 2-D product (not recorded).
template <class T>
Tensor<T> mm(const Tensor<T>& a, const Tensor<T>& b) {
  auto out = Tensor<T>::empty(Shape{a.shape()[0], b.shape()[1]}, a.device());
  gemm_2d(a, b, out, T(1), T(0));
  return out;
}

/// The transpose of a 2-D tensor as a view (not recorded).
template <class T>
Tensor<T> make_view2d(const Tensor<T>& m) {
  auto impl = std::make_shared<TensorImpl<T>>();
  impl->storage = m.impl()->storage;
  impl->offset = m.storage_offset();
  impl->shape = Shape{m.shape()[1], m.shape()[0]};
  impl->strides = Strides{m.strides()[1], m.strides()[0]};
  return Tensor<T>(std::move(impl));
}

/// Flattens all but the last dimension: [..., K] -> [rows, K] (a view when contiguous).
template <class T>
Tensor<T> as_matrix(const Tensor<T>& x) {
  if (x.dim() == 2) return x;
  std::int64_t rows = 1;
  for (int i = 0; i + 1 < x.dim(); ++i) rows *= x.shape()[i];
  return view_as_shape(contiguous_data(x), Shape{rows, x.shape().back()});
}

template <class T>
class MatmulBackward final : public autograd::Node<T> {
 public:
  MatmulBackward(Tensor<T> a, Tensor<T> b) : a_(std::move(a)), b_(std::move(b)) {
    this->save_version(a_);
    this->save_version(b_);
  }
  std::string name() const override { return "MatmulBackward"; }
  typename autograd::Node<T>::TensorList apply(typename autograd::Node<T>::TensorList&& grads) override {
    const auto& g = grads[0];
    Tensor<T> ga, gb;
    if (a_.dim() == 3 && b_.dim() == 3) {  // batched
      if (this->next_edges()[0].valid()) ga = Tensor<T>::empty(a_.shape(), g.device());
      if (this->next_edges()[1].valid()) gb = Tensor<T>::empty(b_.shape(), g.device());
      for (std::int64_t i = 0; i < a_.shape()[0]; ++i) {
        auto gi = g.select(0, i), ai = a_.select(0, i), bi = b_.select(0, i);
        if (ga.defined()) gemm_2d(gi, make_view2d(bi), ga.select(0, i), T(1), T(0));
        if (gb.defined()) gemm_2d(make_view2d(ai), gi, gb.select(0, i), T(1), T(0));
      }
      return {ga, gb};
    }
    auto g2 = as_matrix(g);
    if (this->next_edges()[0].valid()) {
      ga = Tensor<T>::empty(a_.shape(), g.device());
      gemm_2d(g2, make_view2d(b_), view_as_shape(ga, Shape{g2.shape()[0], a_.shape().back()}), T(1), T(0));
    }
    if (this->next_edges()[1].valid()) {
      gb = Tensor<T>::empty(b_.shape(), g.device());
      gemm_2d(make_view2d(as_matrix(a_)), g2, gb, T(1), T(0));
    }
    return {ga, gb};
  }
  void release_saved() override {
    a_ = Tensor<T>();
    b_ = Tensor<T>();
  }

 private:
  Tensor<T> a_, b_;
};

template <class T>
class LinearBackward final : public autograd::Node<T> {
 public:
  LinearBackward(Tensor<T> x, Tensor<T> w, bool has_bias) : x_(std::move(x)), w_(std::move(w)), bias_(has_bias) {
    this->save_version(x_);
    this->save_version(w_);
  }
  std::string name() const override { return "LinearBackward"; }
  typename autograd::Node<T>::TensorList apply(typename autograd::Node<T>::TensorList&& grads) override {
    const auto& g = grads[0];
    auto g2 = as_matrix(g);  // [rows, out]
    Tensor<T> gx, gw, gb;
    const auto& e = this->next_edges();
    if (e[0].valid()) {  // gx = g @ W
      gx = Tensor<T>::empty(x_.shape(), g.device());
      gemm_2d(g2, w_, view_as_shape(gx, Shape{g2.shape()[0], w_.shape()[1]}), T(1), T(0));
    }
    if (e[1].valid()) {  // gW = g^T @ x
      gw = Tensor<T>::empty(w_.shape(), g.device());
      gemm_2d(make_view2d(g2), as_matrix(x_), gw, T(1), T(0));
    }
    if (bias_ && e[2].valid()) {  // gb = column sums of g
      gb = Tensor<T>::empty(Shape{w_.shape()[0]}, g.device());
      if (g2.shape()[0] == 0) {
        backend::fill(gb, T(0));
      } else {
        backend::sum_dim(g2, 1, g2.shape()[0], g2.shape()[1], gb, 1.0);
      }
    }
    if (bias_) return {gx, gw, gb};
    return {gx, gw};
  }
  void release_saved() override {
    x_ = Tensor<T>();
    w_ = Tensor<T>();
  }

 private:
  Tensor<T> x_, w_;
  bool bias_;
};

}  // namespace ops::detail

/// Matrix product: [M,K]@[K,N], [...,K]@[K,N] (leading dimensions batched) or [B,M,K]@[B,K,N].
template <class T>
Tensor<T> matmul(const Tensor<T>& a, const Tensor<T>& b) {
  static_assert(is_floating_v<T>, "matmul: floating-point tensors only");
  ops::detail::check_defined("matmul", a, "left operand");
  ops::detail::check_defined("matmul", b, "right operand");
  ops::detail::check_same_device("matmul", a, b);
  Tensor<T> out;
  if (a.dim() == 3 && b.dim() == 3) {
    CHORUS_CHECK(a.shape()[0] == b.shape()[0] && a.shape()[2] == b.shape()[1], "matmul: shapes ", a.shape(), " and ",
                 b.shape(), " cannot be multiplied");
    out = Tensor<T>::empty(Shape{a.shape()[0], a.shape()[1], b.shape()[2]}, a.device());
    for (std::int64_t i = 0; i < a.shape()[0]; ++i)
      ops::detail::gemm_2d(a.detach().select(0, i), b.detach().select(0, i), out.select(0, i), T(1), T(0));
  } else {
    CHORUS_CHECK(a.dim() >= 2 && b.dim() == 2 && a.shape().back() == b.shape()[0], "matmul: shapes ", a.shape(),
                 " and ", b.shape(), " cannot be multiplied");
    auto a2 = ops::detail::as_matrix(a.detach());
    Shape s = a.shape();
    s[s.size() - 1] = b.shape()[1];
    out = Tensor<T>::empty(s, a.device());
    ops::detail::gemm_2d(a2, b.detach(), ops::detail::view_as_shape(out, Shape{a2.shape()[0], b.shape()[1]}), T(1),
                         T(0));
  }
  if (autograd::needs_grad(a, b)) {
    auto node = autograd::make_node<ops::detail::MatmulBackward<T>, T>({&a, &b}, a.detach(), b.detach());
    autograd::set_history(out, std::shared_ptr<autograd::Node<T>>(node));
  }
  return out;
}

/// y = x @ weight^T + bias, x: [..., in], weight: [out, in], bias: [out] or undefined.
template <class T>
Tensor<T> linear(const Tensor<T>& x, const Tensor<T>& weight, const Tensor<T>& bias = Tensor<T>()) {
  static_assert(is_floating_v<T>, "linear: floating-point tensors only");
  ops::detail::check_defined("linear", x);
  ops::detail::check_defined("linear", weight, "weight");
  ops::detail::check_same_device("linear", x, weight);
  CHORUS_CHECK(weight.dim() == 2, "linear: weight must be 2-D, got shape ", weight.shape());
  CHORUS_CHECK(x.dim() >= 1 && x.shape().back() == weight.shape()[1], "linear: input of shape ", x.shape(),
               " does not match weight of shape ", weight.shape(), " (expected last dimension ", weight.shape()[1],
               ")");
  if (bias.defined()) {
    ops::detail::check_same_device("linear", x, bias);
    CHORUS_CHECK(bias.dim() == 1 && bias.shape()[0] == weight.shape()[0], "linear: bias of shape ", bias.shape(),
                 " does not match weight of shape ", weight.shape());
  }
  const auto outf = weight.shape()[0];
  auto x2 = ops::detail::contiguous_data(ops::detail::as_matrix(x.dim() == 1 ? x.detach().unsqueeze(0) : x.detach()));
  Shape s = x.shape();
  s[s.size() - 1] = outf;
  auto out = Tensor<T>::empty(s, x.device());
  auto w = ops::detail::contiguous_data(weight.detach());
  Tensor<T> b = bias.defined() ? ops::detail::contiguous_data(bias.detach()) : Tensor<T>();
  backend::linear_forward(x2, w, b.defined() ? &b : nullptr, ops::detail::view_as_shape(out, Shape{x2.shape()[0], outf}));
  if (autograd::needs_grad(x, weight, bias)) {
    auto node = autograd::make_node<ops::detail::LinearBackward<T>, T>(
        {&x, &weight, bias.defined() ? &bias : nullptr}, x.detach(), weight.detach(), bias.defined());
    if (!bias.defined()) node->mutable_next_edges().pop_back();
    autograd::set_history(out, std::shared_ptr<autograd::Node<T>>(node));
  }
  return out;
}

template <class T>
Tensor<T> Tensor<T>::matmul(const Tensor<T>& other) const {
  return chorus::matmul(*this, other);
}

CHORUS_NAMESPACE_END
