#pragma once
// BLAS for the CPU backend: OpenBLAS through its CBLAS interface.
#include <cblas.h>

#include <cstdint>

#include "../../error.hpp"

CHORUS_NAMESPACE_BEGIN
namespace backend::cpu {

/// Row-major C[M,N] = alpha * op(A)[M,K] @ op(B)[K,N] + beta * C.
template <class T>
void gemm(bool trans_a, bool trans_b, std::int64_t M, std::int64_t N, std::int64_t K, T alpha,
          const T* A, std::int64_t lda, const T* B, std::int64_t ldb, T beta, T* C, std::int64_t ldc) {
  if (M == 0 || N == 0) return;
  if (K == 0) {  // BLAS leaves C untouched when K == 0 only if beta == 1; be explicit
    for (std::int64_t i = 0; i < M; ++i)
      for (std::int64_t j = 0; j < N; ++j) C[i * ldc + j] = beta == T(0) ? T(0) : beta * C[i * ldc + j];
    return;
  }
  auto ta = trans_a ? CblasTrans : CblasNoTrans;
  auto tb = trans_b ? CblasTrans : CblasNoTrans;
  if constexpr (std::is_same_v<T, float>) {
    cblas_sgemm(CblasRowMajor, ta, tb, (int)M, (int)N, (int)K, alpha, A, (int)lda, B, (int)ldb, beta, C, (int)ldc);
  } else {
    cblas_dgemm(CblasRowMajor, ta, tb, (int)M, (int)N, (int)K, alpha, A, (int)lda, B, (int)ldb, beta, C, (int)ldc);
  }
}

/// Threads OpenBLAS uses for one call (process-wide).
inline void set_blas_threads(int n) {
  CHORUS_CHECK(n >= 1, "set_blas_threads(", n, "): need at least one thread");
  openblas_set_num_threads(n);
}
inline int blas_threads() { return openblas_get_num_threads(); }

}  // namespace backend::cpu
CHORUS_NAMESPACE_END
