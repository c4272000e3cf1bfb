#pragma once
// CPU kernels of the sequence-model operators: selection by condition (where, comparisons),
// indexing along a dimension (gather, scatter_add, one_hot), reductions that return indices
// (max/min, topk), scans (cumsum), triangular masks (tril/triu) and batched GEMM. Shapes,
// strides and indices arrive validated by ops/.
#include <algorithm>
#include <array>
#include <cstdint>
#include <numeric>
#include <vector>

#include "../functors.hpp"
#include "blas.hpp"
#include "kernels.hpp"

CHORUS_NAMESPACE_BEGIN
namespace backend::cpu {

/// out (contiguous, `shape`) = cond ? a : b, each operand read through broadcast strides. M is
/// the mask's element type (nonzero is true).
template <class M, class T>
void where(const M* cond, const Strides& cs, const T* a, const Strides& as, const T* b, const Strides& bs, T* out,
           const Shape& shape) {
  nd_apply<4>(shape, {cs, as, bs, contiguous_strides(shape)}, [&](const auto& off, std::int64_t n, const auto& st) {
    const M* c = cond + off[0];
    const T* pa = a + off[1];
    const T* pb = b + off[2];
    T* po = out + off[3];
    for (std::int64_t i = 0; i < n; ++i) po[i] = c[i * st[0]] != M(0) ? pa[i * st[1]] : pb[i * st[2]];
  });
}

/// out (contiguous mask, `shape`) = op(a, b) ? 1 : 0 with broadcast strides.
template <class M, class T, class Op>
void compare(const T* a, const Strides& as, const T* b, const Strides& bs, M* out, const Shape& shape, Op op) {
  nd_apply<3>(shape, {as, bs, contiguous_strides(shape)}, [&](const auto& off, std::int64_t n, const auto& st) {
    const T* pa = a + off[0];
    const T* pb = b + off[1];
    M* po = out + off[2];
    for (std::int64_t i = 0; i < n; ++i) po[i] = op(pa[i * st[0]], pb[i * st[1]]) ? M(1) : M(0);
  });
}

/// Strides with dimension `dim` set to 0 (the indexed dimension is addressed through the index).
inline Strides without_dim(Strides s, int dim) {
  s[dim] = 0;
  return s;
}

/// out[p] = in[p with p[dim] replaced by idx[p]] for every position p of idx's shape (idx and
/// out contiguous; in read through its strides).
template <class T>
void gather(const T* in, const Strides& in_strides, int dim, const std::int64_t* idx, T* out, const Shape& shape) {
  const std::int64_t sd = in_strides[dim];
  nd_apply<2>(shape, {without_dim(in_strides, dim), contiguous_strides(shape)},
              [&](const auto& off, std::int64_t n, const auto& st) {
                const T* base = in + off[0];
                const std::int64_t* ix = idx + off[1];
                T* po = out + off[1];
                for (std::int64_t i = 0; i < n; ++i) po[i] = base[i * st[0] + ix[i] * sd];
              });
}

/// out[p with p[dim] replaced by idx[p]] += src[p] for every position p of idx's shape (idx
/// contiguous; src and out through their strides). Positions are visited in row-major order,
/// so the sums are deterministic.
template <class T>
void scatter_add(const T* src, const Strides& src_strides, int dim, const std::int64_t* idx, T* out,
                 const Strides& out_strides, const Shape& shape) {
  const std::int64_t sd = out_strides[dim];
  nd_apply<3>(shape, {src_strides, without_dim(out_strides, dim), contiguous_strides(shape)},
              [&](const auto& off, std::int64_t n, const auto& st) {
                const T* ps = src + off[0];
                T* base = out + off[1];
                const std::int64_t* ix = idx + off[2];
                for (std::int64_t i = 0; i < n; ++i) base[i * st[1] + ix[i] * sd] += ps[i * st[0]];
              });
}

/// out[i, c] = (idx[i] == c) for contiguous out [n, classes] (indices validated).
template <class M>
void one_hot(const std::int64_t* idx, std::int64_t n, std::int64_t classes, M* out) {
  std::fill(out, out + n * classes, M(0));
  for (std::int64_t i = 0; i < n; ++i) out[i * classes + idx[i]] = M(1);
}

/// The first (value, index) in `order` along the middle axis of contiguous [outer, n, inner]
/// (n > 0): values (may be null) and indices (may be null), both [outer, inner].
template <class T>
void select_extremum(const T* in, std::int64_t outer, std::int64_t n, std::int64_t inner, T* vals,
                     std::int64_t* idx, fn::RankOrder order) {
  for (std::int64_t o = 0; o < outer; ++o)
    for (std::int64_t j = 0; j < inner; ++j) {
      const T* x = in + o * n * inner + j;
      T best = x[0];
      std::int64_t bi = 0;
      for (std::int64_t i = 1; i < n; ++i)
        if (order.before(x[i * inner], i, best, bi)) {
          best = x[i * inner];
          bi = i;
        }
      if (vals) vals[o * inner + j] = best;
      if (idx) idx[o * inner + j] = bi;
    }
}

/// The first k of each row in `order` (sorted), as [outer, k, inner] values and indices.
template <class T>
void topk(const T* in, std::int64_t outer, std::int64_t n, std::int64_t inner, std::int64_t k, T* vals,
          std::int64_t* idx, fn::RankOrder order) {
  std::vector<std::int64_t> perm(static_cast<std::size_t>(n));
  for (std::int64_t o = 0; o < outer; ++o)
    for (std::int64_t j = 0; j < inner; ++j) {
      const T* x = in + o * n * inner + j;
      std::iota(perm.begin(), perm.end(), std::int64_t{0});
      std::partial_sort(perm.begin(), perm.begin() + k, perm.end(), [&](std::int64_t a, std::int64_t b) {
        return order.before(x[a * inner], a, x[b * inner], b);
      });
      for (std::int64_t r = 0; r < k; ++r) {
        vals[(o * k + r) * inner + j] = x[perm[r] * inner];
        idx[(o * k + r) * inner + j] = perm[r];
      }
    }
}

/// Inclusive prefix sums along the middle axis of contiguous [outer, n, inner], from the end
/// when `reverse` (the backward of cumsum), accumulated in acc_t<T>.
template <class T>
void cumsum(const T* in, std::int64_t outer, std::int64_t n, std::int64_t inner, T* out, bool reverse) {
  std::vector<acc_t<T>> acc(static_cast<std::size_t>(inner));
  for (std::int64_t o = 0; o < outer; ++o) {
    std::fill(acc.begin(), acc.end(), acc_t<T>(0));
    for (std::int64_t s = 0; s < n; ++s) {
      const std::int64_t i = reverse ? n - 1 - s : s;
      const T* x = in + (o * n + i) * inner;
      T* y = out + (o * n + i) * inner;
      for (std::int64_t j = 0; j < inner; ++j) {
        acc[j] += static_cast<acc_t<T>>(x[j]);
        y[j] = static_cast<T>(acc[j]);
      }
    }
  }
}

/// out = in with the elements outside the lower (or upper) triangle zeroed, for contiguous
/// [batch, rows, cols]: tril keeps j - i <= diagonal, triu keeps j - i >= diagonal.
template <class T>
void triangle(const T* in, T* out, std::int64_t batch, std::int64_t rows, std::int64_t cols, std::int64_t diagonal,
              bool lower) {
  for (std::int64_t b = 0; b < batch; ++b)
    for (std::int64_t i = 0; i < rows; ++i) {
      const T* x = in + (b * rows + i) * cols;
      T* y = out + (b * rows + i) * cols;
      for (std::int64_t j = 0; j < cols; ++j) {
        const std::int64_t d = j - i;
        y[j] = (lower ? d <= diagonal : d >= diagonal) ? x[j] : T(0);
      }
    }
}

/// `batch` row-major products C_b = alpha op(A_b) op(B_b) + beta C_b, matrix b of each operand
/// at b * stride (a stride of 0 reuses one matrix).
template <class T>
void gemm_batched(bool ta, bool tb, std::int64_t M, std::int64_t N, std::int64_t K, T alpha, const T* A,
                  std::int64_t lda, std::int64_t sa, const T* B, std::int64_t ldb, std::int64_t sb, T beta, T* C,
                  std::int64_t ldc, std::int64_t sc, std::int64_t batch) {
  for (std::int64_t b = 0; b < batch; ++b)
    gemm(ta, tb, M, N, K, alpha, A + b * sa, lda, B + b * sb, ldb, beta, C + b * sc, ldc);
}

}  // namespace backend::cpu
CHORUS_NAMESPACE_END
