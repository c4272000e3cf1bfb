#pragma once
// BLAS for the CPU backend: OpenBLAS through its CBLAS interface.
// OpenBLAS's openblas_config.h declares a global `typedef uint16_t bfloat16;` (its sbgemm
// storage), which would make `bfloat16` ambiguous for a user of `using namespace chorus;`.
// Its prototypes are C functions, so the typedef is renamed while the header is read. (A
// program that includes <cblas.h> before chorus still sees OpenBLAS's name: write
// chorus::bfloat16 there.)
#if defined(bfloat16)
#include <cblas.h>
#else
#define bfloat16 chorus_openblas_bfloat16
#include <cblas.h>
#undef bfloat16
#endif

#include <cstdint>
#include <type_traits>
#include <vector>

#include "../../core/half.hpp"
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
  if constexpr (is_reduced_floating_v<T>) {
    // Debian's OpenBLAS has no sbgemm/hgemm: widen the operands to float, multiply with sgemm
    // (float accumulation, as cuBLAS's 16-bit GEMMs with a float compute type), round C once.
    auto widen = [](const T* p, std::int64_t rows, std::int64_t cols, std::int64_t ld) {
      std::vector<float> w(static_cast<std::size_t>(rows * cols));
      for (std::int64_t r = 0; r < rows; ++r)
        for (std::int64_t c = 0; c < cols; ++c) w[r * cols + c] = static_cast<float>(p[r * ld + c]);
      return w;
    };
    const auto a = trans_a ? widen(A, K, M, lda) : widen(A, M, K, lda);
    const auto b = trans_b ? widen(B, N, K, ldb) : widen(B, K, N, ldb);
    const float fb = static_cast<float>(beta);
    std::vector<float> c = fb == 0.0f ? std::vector<float>(static_cast<std::size_t>(M * N)) : widen(C, M, N, ldc);
    cblas_sgemm(CblasRowMajor, ta, tb, (int)M, (int)N, (int)K, static_cast<float>(alpha), a.data(),
                (int)(trans_a ? M : K), b.data(), (int)(trans_b ? K : N), fb, c.data(), (int)N);
    for (std::int64_t i = 0; i < M; ++i)
      for (std::int64_t j = 0; j < N; ++j) C[i * ldc + j] = T(c[i * N + j]);
  } else if constexpr (std::is_same_v<T, float>) {
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
