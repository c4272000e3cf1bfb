#pragma once
// Batched GEMM on the GPU: one cuBLAS strided-batched call (64-bit API) for a batch of
// products whose matrices lie a fixed stride apart (a stride of 0 reuses one matrix: the
// broadcast operand of a batched matmul). Kept apart from blas.cuh (handles, cuBLASLt).
#include <cstdint>

#include "blas.cuh"

CHORUS_NAMESPACE_BEGIN
namespace backend::cuda {

/// Row-major C_b = alpha op(A_b) op(B_b) + beta C_b for b < batch, as column-major
/// C_b^T = op(B_b)^T op(A_b)^T (see gemm in blas.cuh).
template <class T>
void gemm_batched(bool ta, bool tb, std::int64_t M, std::int64_t N, std::int64_t K, T alpha, const T* A,
                  std::int64_t lda, std::int64_t sa, const T* B, std::int64_t ldb, std::int64_t sb, T beta, T* C,
                  std::int64_t ldc, std::int64_t sc, std::int64_t batch, Device d) {
  if (M == 0 || N == 0 || batch == 0) return;
  Launch launch(d);
  auto& h = handles_for(d, launch.stream);
  const auto opa = ta ? CUBLAS_OP_T : CUBLAS_OP_N, opb = tb ? CUBLAS_OP_T : CUBLAS_OP_N;
  if constexpr (is_reduced_floating_v<T>) {  // as gemm: 16-bit operands, float32 accumulation
    const float fa = static_cast<float>(alpha), fb = static_cast<float>(beta);
    CHORUS_CUBLAS_CHECK(cublasSetMathMode(h.blas, CUBLAS_DEFAULT_MATH));
    CHORUS_CUBLAS_CHECK(cublasGemmStridedBatchedEx_64(h.blas, opb, opa, N, M, K, &fa, B, cuda_type<T>(), ldb, sb, A,
                                                      cuda_type<T>(), lda, sa, &fb, C, cuda_type<T>(), ldc, sc, batch,
                                                      CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  } else if constexpr (std::is_same_v<T, float>) {
    CHORUS_CUBLAS_CHECK(cublasSetMathMode(
        h.blas, ::chorus::cuda::allow_tf32() ? CUBLAS_TF32_TENSOR_OP_MATH : CUBLAS_DEFAULT_MATH));
    CHORUS_CUBLAS_CHECK(cublasSgemmStridedBatched_64(h.blas, opb, opa, N, M, K, &alpha, B, ldb, sb, A, lda, sa, &beta,
                                                     C, ldc, sc, batch));
  } else {
    static_assert(std::is_same_v<T, double>, "gemm_batched: float or double");
    CHORUS_CUBLAS_CHECK(cublasDgemmStridedBatched_64(h.blas, opb, opa, N, M, K, &alpha, B, ldb, sb, A, lda, sa, &beta,
                                                     C, ldc, sc, batch));
  }
  ::chorus::cuda::check_launch("gemm_batched");
}

#if CHORUS_CUDA_PRECOMPILED  // Note [precompiled CUDA kernels]
CHORUS_CUDA_BLAS_BATCHED_INSTANCES(CHORUS_CUDA_EXTERN_INSTANCE)
#endif

}  // namespace backend::cuda
CHORUS_NAMESPACE_END
