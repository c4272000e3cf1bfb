#pragma once
// Device dispatch of the sequence-model operators' kernels (where, comparisons, gather,
// scatter_add, one_hot, max/min with indices, topk, cumsum, tril/triu, batched GEMM). Like
// backend.hpp: no autograd, little validation; callers pass contiguous tensors where a
// function says so. On CUDA the index kernels validate their indices (Note [device-side
// validation]); on the CPU the caller has.
#include <cstdint>

#include "../compiled.hpp"
#include "backend.hpp"
#include "cpu/index_kernels.hpp"
#if CHORUS_CUDA
#include "cuda/blas_batched.cuh"
#include "cuda/index_kernels.cuh"
#endif

CHORUS_NAMESPACE_BEGIN
namespace backend {

/// out (contiguous, out's shape) = cond ? a : b, each read through strides broadcast to out.
template <class M, class T>
void where(const Tensor<M>& cond, const Strides& cs, const Tensor<T>& a, const Strides& as, const Tensor<T>& b,
           const Strides& bs, const Tensor<T>& out) {
  CHORUS_DISPATCH(out.device(),
                  cpu::where(cond.data(), cs, a.data(), as, b.data(), bs, out.data(), out.shape()),
                  cuda::where(cond.data(), cs, a.data(), as, b.data(), bs, out.data(), out.shape(), out.device()));
}

/// out (a contiguous 0/1 mask) = op(a, b) with broadcast strides.
template <class M, class T, class Op>
void compare(const Tensor<T>& a, const Strides& as, const Tensor<T>& b, const Strides& bs, const Tensor<M>& out,
             Op op) {
  CHORUS_DISPATCH(out.device(), cpu::compare(a.data(), as, b.data(), bs, out.data(), out.shape(), op),
                  cuda::compare(a.data(), as, b.data(), bs, out.data(), out.shape(), op, out.device()));
}

/// out (contiguous, idx's shape) = in gathered along `dim` (idx contiguous).
template <class T>
void gather(const Tensor<T>& in, int dim, const Tensor<std::int64_t>& idx, const Tensor<T>& out) {
  CHORUS_DISPATCH(in.device(),
                  cpu::gather(in.data(), in.strides(), dim, idx.data(), out.data(), idx.shape()),
                  cuda::gather(in.data(), in.strides(), in.shape()[dim], dim, idx.data(), out.data(), idx.shape(),
                             in.device()));
}

/// out[.., idx[p], ..] += src[p] over idx's shape; src read through `src_strides` (idx contiguous,
/// out any strides).
template <class T>
void scatter_add(const Tensor<T>& src, const Strides& src_strides, int dim, const Tensor<std::int64_t>& idx,
                 const Tensor<T>& out) {
  CHORUS_DISPATCH_T(T, "scatter_add", out.device(),
                    cpu::scatter_add(src.data(), src_strides, dim, idx.data(), out.data(), out.strides(), idx.shape()),
                    cuda::scatter_add(src.data(), src_strides, dim, idx.data(), out.data(), out.strides(),
                                    out.shape()[dim], idx.shape(), out.device()));
}

/// out [n, classes] (contiguous) = one-hot rows of idx (contiguous, n elements).
template <class M>
void one_hot(const Tensor<std::int64_t>& idx, std::int64_t classes, const Tensor<M>& out) {
  CHORUS_DISPATCH(idx.device(), cpu::one_hot(idx.data(), idx.numel(), classes, out.data()),
                  cuda::one_hot(idx.data(), idx.numel(), classes, out.data(), idx.device()));
}

/// The first (value, index) in `order` along the middle axis of contiguous [outer, n, inner];
/// vals / idx may be null.
template <class T>
void select_extremum(const Tensor<T>& in, std::int64_t outer, std::int64_t n, std::int64_t inner, T* vals,
                     std::int64_t* idx, fn::RankOrder order) {
  CHORUS_DISPATCH_T(T, "select_extremum", in.device(),
                    cpu::select_extremum(in.data(), outer, n, inner, vals, idx, order),
                    cuda::select_extremum(in.data(), outer, n, inner, vals, idx, order, in.device()));
}

template <class T>
void topk(const Tensor<T>& in, std::int64_t outer, std::int64_t n, std::int64_t inner, std::int64_t k,
          const Tensor<T>& vals, const Tensor<std::int64_t>& idx, fn::RankOrder order) {
  CHORUS_DISPATCH_T(T, "topk", in.device(), cpu::topk(in.data(), outer, n, inner, k, vals.data(), idx.data(), order),
                    cuda::topk(in.data(), outer, n, inner, k, vals.data(), idx.data(), order, in.device()));
}

template <class T>
void cumsum(const Tensor<T>& in, std::int64_t outer, std::int64_t n, std::int64_t inner, const Tensor<T>& out,
            bool reverse) {
  if constexpr (is_reduced_floating_v<T>) {  // Note [16-bit through float]
    auto fo = detail::widened("cumsum", out, false);
    cumsum(detail::widened("cumsum", in), outer, n, inner, fo, reverse);
    detail::round_into(fo, out);
  } else {
    CHORUS_DISPATCH(in.device(), cpu::cumsum(in.data(), outer, n, inner, out.data(), reverse),
                    cuda::cumsum(in.data(), outer, n, inner, out.data(), reverse, in.device()));
  }
}

/// tril (lower) / triu of contiguous [batch, rows, cols].
template <class T>
void triangle(const Tensor<T>& in, const Tensor<T>& out, std::int64_t batch, std::int64_t rows, std::int64_t cols,
              std::int64_t diagonal, bool lower) {
  CHORUS_DISPATCH(in.device(),
                  cpu::triangle(in.data(), out.data(), batch, rows, cols, diagonal, lower),
                  cuda::triangle(in.data(), out.data(), batch, rows, cols, diagonal, lower, in.device()));
}

/// `batch` row-major GEMMs, matrix b of each operand at b * stride (0: one shared matrix).
template <class T>
void gemm_batched(bool ta, bool tb, std::int64_t M, std::int64_t N, std::int64_t K, T alpha, const T* A,
                  std::int64_t lda, std::int64_t sa, const T* B, std::int64_t ldb, std::int64_t sb, T beta, T* C,
                  std::int64_t ldc, std::int64_t sc, std::int64_t batch, Device dev) {
  if (dev.is_cpu()) {
    // CBLAS takes int sizes (Note [checked sizes]); cuBLAS's _64 API takes them as they are.
    constexpr std::int64_t kMax = INT32_MAX;
    CHORUS_CHECK(M <= kMax && N <= kMax && K <= kMax && lda <= kMax && ldb <= kMax && ldc <= kMax,
                 "gemm_batched: sizes M=", M, " N=", N, " K=", K, " (lda ", lda, ", ldb ", ldb, ", ldc ", ldc,
                 ") exceed the 32-bit BLAS interface (at most ", kMax, ")");
  }
  // 16-bit: on the CPU each product through float blocks (cpu::gemm), on CUDA one
  // cublasGemmStridedBatchedEx with float32 accumulation; each result rounded once.
  CHORUS_DISPATCH(dev,
                  cpu::gemm_batched(ta, tb, M, N, K, alpha, A, lda, sa, B, ldb, sb, beta, C, ldc, sc, batch),
                  cuda::gemm_batched(ta, tb, M, N, K, alpha, A, lda, sa, B, ldb, sb, beta, C, ldc, sc, batch, dev));
}

}  // namespace backend
CHORUS_NAMESPACE_END

// The instances chorus::compiled holds (Note [compiled chorus] in compiled.hpp).
#define CHORUS_BACKEND_INDEX_INSTANCES(X, T)                                                                                                                       \
  X(void backend::gather<T>(const Tensor<T>&, int, const Tensor<std::int64_t>&, const Tensor<T>&))                                                                 \
  X(void backend::scatter_add<T>(const Tensor<T>&, const Strides&, int, const Tensor<std::int64_t>&, const Tensor<T>&))                                            \
  X(void backend::select_extremum<T>(const Tensor<T>&, std::int64_t, std::int64_t, std::int64_t, T*, std::int64_t*, fn::RankOrder))                                \
  X(void backend::topk<T>(const Tensor<T>&, std::int64_t, std::int64_t, std::int64_t, std::int64_t, const Tensor<T>&, const Tensor<std::int64_t>&, fn::RankOrder)) \
  X(void backend::cumsum<T>(const Tensor<T>&, std::int64_t, std::int64_t, std::int64_t, const Tensor<T>&, bool))                                                   \
  X(void backend::triangle<T>(const Tensor<T>&, const Tensor<T>&, std::int64_t, std::int64_t, std::int64_t, std::int64_t, bool))
CHORUS_EXTERN_INSTANCES(CHORUS_BACKEND_INDEX_INSTANCES, CHORUS_ALL_DTYPES)
#define CHORUS_BACKEND_INDEX_FLOAT_INSTANCES(X, T)                                                                                                                                                                               \
  X(void backend::gemm_batched<T>(bool, bool, std::int64_t, std::int64_t, std::int64_t, T, const T*, std::int64_t, std::int64_t, const T*, std::int64_t, std::int64_t, T, T*, std::int64_t, std::int64_t, std::int64_t, Device))
CHORUS_EXTERN_INSTANCES(CHORUS_BACKEND_INDEX_FLOAT_INSTANCES, CHORUS_FLOATING_DTYPES)
