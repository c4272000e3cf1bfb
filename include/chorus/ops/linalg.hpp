#pragma once
// Matrix products: matmul (broadcasting batches, as torch.matmul), bmm and the fused linear
// layer (x @ W^T + b).
#include <span>
#include <vector>

#include "../compiled.hpp"
#include "../backend/index.hpp"
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

/// How BLAS reads a rows x cols matrix with strides (rs, cs) without a copy: row-major with
/// leading dimension ld (trans false) or column-major (trans true). False when it cannot.
inline bool matrix_layout(std::int64_t rows, std::int64_t cols, std::int64_t rs, std::int64_t cs, std::int64_t& ld,
                          bool& trans) {
  if (cs == 1 || cols == 1) {  // row-major, leading dimension rs
    ld = rows == 1 ? std::max<std::int64_t>(cols, 1) : rs;
    trans = false;
    if (ld >= std::max<std::int64_t>(cols, 1)) return true;
  }
  if (rs == 1 || rows == 1) {  // column-major: the transpose of a row-major matrix
    ld = cols == 1 ? std::max<std::int64_t>(rows, 1) : cs;
    trans = true;
    if (ld >= std::max<std::int64_t>(rows, 1)) return true;
  }
  return false;
}

/// Reads 2-D `m` (rows x cols) without copying when it is row- or column-major.
template <class T>
GemmOperand<T> gemm_operand(const Tensor<T>& m) {
  std::int64_t ld = 0;
  bool trans = false;
  if (matrix_layout(m.shape()[0], m.shape()[1], m.strides()[0], m.strides()[1], ld, trans))
    return {m, m.data(), ld, trans};
  auto c = contiguous_data(m);
  return {c, c.data(), std::max<std::int64_t>(m.shape()[1], 1), false};
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

/// A batch of matrices as BLAS sees it: matrix b at ptr + b * stride (0: one shared matrix), or
/// at ptr + offsets[b] when `offsets` is not empty (CPU operands whose batch dimensions have no
/// one stride, such as the heads of attention's [N, H, L, d] views of [L, N, 3E]: a GEMM per
/// matrix reads them where they are, instead of a copy of the whole operand first).
template <class T>
struct BatchOperand {
  Tensor<T> keep;  // owns a contiguous copy when one was needed
  const T* ptr;
  std::int64_t ld, stride;
  bool trans;
  std::vector<std::int64_t> offsets = {};
};

/// The one stride between consecutive matrices of batch dimensions [0, nb), when there is one
/// (size-1 dimensions are skipped; broadcast dimensions have stride 0).
inline bool collapse_batch(const Shape& shape, const Strides& st, int nb, std::int64_t& stride) {
  stride = 0;
  std::int64_t span = 0;  // matrices covered by the dimensions after i
  for (int i = nb - 1; i >= 0; --i) {
    if (shape[i] == 1) continue;
    if (span == 0) {
      stride = st[i];
      span = shape[i];
    } else {
      if (st[i] != stride * span) return false;
      span *= shape[i];
    }
  }
  return true;
}

/// `m` ([..., R, C]) broadcast over `batch` (its leading dimensions broadcast to `batch`), read
/// without a copy where the batch has one stride and each matrix a BLAS layout; else copied.
template <class T>
BatchOperand<T> batch_operand(const Tensor<T>& m, const Shape& batch) {
  const int nb = batch.size(), md = m.dim();
  const std::int64_t R = m.shape()[md - 2], C = m.shape()[md - 1];
  Shape full = batch;
  full.push_back(R);
  full.push_back(C);
  Strides st = Strides::filled(nb + 2, 0);
  for (int i = 0; i < nb; ++i) {
    const int j = i - (nb - (md - 2));
    if (j >= 0 && m.shape()[j] != 1) st[i] = m.strides()[j];
  }
  st[nb] = m.strides()[md - 2];
  st[nb + 1] = m.strides()[md - 1];
  std::int64_t stride = 0, ld = 0;
  bool trans = false;
  const bool layout = matrix_layout(R, C, st[nb], st[nb + 1], ld, trans);
  if (layout && collapse_batch(full, st, nb, stride)) return {m, m.data(), ld, stride, trans};
  if (layout && m.device().is_cpu()) {  // each matrix in place, found by its batch index
    std::vector<std::int64_t> offsets(static_cast<std::size_t>(numel_of(batch)));
    std::vector<std::int64_t> idx(nb, 0);
    for (auto& off : offsets) {
      off = 0;
      for (int i = 0; i < nb; ++i) off += idx[i] * st[i];
      for (int i = nb - 1; i >= 0 && ++idx[i] == batch[i]; --i) idx[i] = 0;
    }
    return {m, m.data(), ld, 0, trans, std::move(offsets)};
  }
  auto impl = std::make_shared<TensorImpl<T>>();
  impl->storage = m.impl()->storage;
  impl->offset = m.storage_offset();
  impl->shape = full;
  impl->strides = st;
  auto c = Tensor<T>::empty(full, m.device());
  backend::copy(c, Tensor<T>(std::move(impl)));
  return {c, c.data(), std::max<std::int64_t>(C, 1), R * C, false};
}

/// The last two dimensions swapped, as a view (not recorded).
template <class T>
Tensor<T> transpose_last(const Tensor<T>& m) {
  auto impl = std::make_shared<TensorImpl<T>>();
  impl->storage = m.impl()->storage;
  impl->offset = m.storage_offset();
  impl->shape = m.shape();
  impl->strides = m.strides();
  const int d = m.dim();
  std::swap(impl->shape[d - 2], impl->shape[d - 1]);
  std::swap(impl->strides[d - 2], impl->strides[d - 1]);
  return Tensor<T>(std::move(impl));
}

/// x [..., M, K] @ y [..., K, N] with the leading dimensions broadcast (not recorded): one
/// strided-batched GEMM into a fresh contiguous [batch..., M, N].
template <class T>
Tensor<T> batched_mm(const Tensor<T>& x, const Tensor<T>& y) {
  const int xd = x.dim(), yd = y.dim();
  const Shape xb(std::span<const std::int64_t>(x.shape().begin(), x.shape().begin() + xd - 2));
  const Shape yb(std::span<const std::int64_t>(y.shape().begin(), y.shape().begin() + yd - 2));
  Shape batch = broadcast_shapes(xb, yb, "matmul");
  const std::int64_t M = x.shape()[xd - 2], K = x.shape()[xd - 1], N = y.shape()[yd - 1];
  Shape os = batch;
  os.push_back(M);
  os.push_back(N);
  auto out = Tensor<T>::empty(os, x.device());
  if (out.numel() == 0) return out;
  if (K == 0) {  // an empty sum: zeros (BLAS may leave C untouched)
    backend::fill(out, T(0));
    return out;
  }
  auto A = batch_operand(x, batch);
  auto B = batch_operand(y, batch);
  if (!A.offsets.empty() || !B.offsets.empty()) {  // CPU: one GEMM per matrix, read in place
    const std::int64_t nbatch = numel_of(batch);
    for (std::int64_t b = 0; b < nbatch; ++b) {
      const auto at = [b](const BatchOperand<T>& o) {
        return o.ptr + (o.offsets.empty() ? b * o.stride : o.offsets[static_cast<std::size_t>(b)]);
      };
      backend::gemm(A.trans, B.trans, M, N, K, T(1), at(A), A.ld, at(B), B.ld, T(0), out.data() + b * M * N,
                    std::max<std::int64_t>(N, 1), x.device());
    }
    return out;
  }
  backend::gemm_batched(A.trans, B.trans, M, N, K, T(1), A.ptr, A.ld, A.stride, B.ptr, B.ld, B.stride, T(0),
                        out.data(), std::max<std::int64_t>(N, 1), M * N, numel_of(batch), x.device());
  return out;
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
    if (b_.dim() != 2) {  // batched: the gradients of broadcast operands are summed over the batch
      if (this->next_edges()[0].valid()) ga = sum_to(batched_mm(g, transpose_last(b_)), a_.shape());
      if (this->next_edges()[1].valid()) gb = sum_to(batched_mm(transpose_last(a_), g), b_.shape());
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

/// Matrix product with torch.matmul's semantics: 1-D·1-D is a dot product (0-dim); a 1-D
/// operand is a row (left) or a column (right) vector whose dimension is removed from the
/// result; N-D operands are batches of matrices whose leading dimensions broadcast
/// ([2, 1, M, K] @ [3, K, N] -> [2, 3, M, N]). [..., M, K] @ [K, N] is one GEMM over all rows.
template <class T>
Tensor<T> matmul(const Tensor<T>& a, const Tensor<T>& b) {
  static_assert(is_floating_v<T>, "matmul: floating-point tensors only");
  ops::detail::check_defined("matmul", a, "left operand");
  ops::detail::check_defined("matmul", b, "right operand");
  ops::detail::check_same_device("matmul", a, b);
  CHORUS_CHECK(a.dim() >= 1 && b.dim() >= 1, "matmul: both arguments need to be at least 1-D, but they are ",
               a.dim(), "-D and ", b.dim(), "-D");
  if (a.dim() == 1 || b.dim() == 1) {  // vectors as [1, K] / [K, 1] matrices, the extra dimension removed after
    auto out = matmul(a.dim() == 1 ? a.unsqueeze(0) : a, b.dim() == 1 ? b.unsqueeze(-1) : b);
    if (b.dim() == 1) out = out.squeeze(-1);
    if (a.dim() == 1) out = out.squeeze(b.dim() == 1 ? -1 : -2);
    return out;
  }
  const std::int64_t K = a.shape().back(), K2 = b.shape()[b.dim() - 2];
  CHORUS_CHECK(K == K2, "matmul: shapes ", a.shape(), " and ", b.shape(), " cannot be multiplied (", K, " columns vs ",
               K2, " rows)");
  Tensor<T> out;
  if (b.dim() == 2) {  // [..., M, K] @ [K, N]: the rows of every batch in one GEMM
    auto a2 = ops::detail::as_matrix(a.detach());
    Shape s = a.shape();
    s[s.size() - 1] = b.shape()[1];
    out = Tensor<T>::empty(s, a.device());
    ops::detail::gemm_2d(a2, b.detach(), ops::detail::view_as_shape(out, Shape{a2.shape()[0], b.shape()[1]}), T(1),
                         T(0));
  } else {
    out = ops::detail::batched_mm(a.detach(), b.detach());
  }
  if (autograd::needs_grad(a, b)) {
    auto node = autograd::make_node<ops::detail::MatmulBackward<T>, T>({&a, &b}, a.detach(), b.detach());
    autograd::set_history(out, std::shared_ptr<autograd::Node<T>>(node));
  }
  return out;
}

/// Batched matrix product of [B, M, K] and [B, K, N] (no broadcasting), as torch.bmm.
template <class T>
Tensor<T> bmm(const Tensor<T>& a, const Tensor<T>& b) {
  ops::detail::check_defined("bmm", a, "left operand");
  ops::detail::check_defined("bmm", b, "right operand");
  CHORUS_CHECK(a.dim() == 3, "bmm: batch1 must be a 3-D tensor, got shape ", a.shape());
  CHORUS_CHECK(b.dim() == 3, "bmm: batch2 must be a 3-D tensor, got shape ", b.shape());
  CHORUS_CHECK(a.shape()[0] == b.shape()[0] && a.shape()[2] == b.shape()[1], "bmm: batch1 of shape ", a.shape(),
               " and batch2 of shape ", b.shape(), " cannot be multiplied (expected batch2 of shape [", a.shape()[0],
               ", ", a.shape()[2], ", *])");
  return matmul(a, b);
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
template <class T>
Tensor<T> Tensor<T>::bmm(const Tensor<T>& other) const {
  return chorus::bmm(*this, other);
}

CHORUS_NAMESPACE_END

// The instances chorus::compiled holds (Note [compiled chorus] in compiled.hpp).
#define CHORUS_OPS_LINALG_FLOAT_INSTANCES(X, T)                                \
  X(Tensor<T> matmul<T>(const Tensor<T>&, const Tensor<T>&))                   \
  X(Tensor<T> bmm<T>(const Tensor<T>&, const Tensor<T>&))                      \
  X(Tensor<T> linear<T>(const Tensor<T>&, const Tensor<T>&, const Tensor<T>&))
CHORUS_EXTERN_INSTANCES(CHORUS_OPS_LINALG_FLOAT_INSTANCES, CHORUS_FLOATING_DTYPES)
