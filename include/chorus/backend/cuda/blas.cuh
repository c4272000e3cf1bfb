#pragma once
// cuBLAS and cuBLASLt for the CUDA backend: one handle per stream, TF32 opt-in.
#include <cublasLt.h>
#include <cublas_v2.h>

#include <atomic>
#include <map>
#include <mutex>

#include "launch.cuh"

#define CHORUS_CUBLAS_CHECK(expr)                                                                   \
  do {                                                                                              \
    cublasStatus_t chorus_st_ = (expr);                                                             \
    if (chorus_st_ != CUBLAS_STATUS_SUCCESS) [[unlikely]]                                           \
      ::chorus::detail::throw_error("cuBLAS error: ", cublasGetStatusName(chorus_st_), " (",         \
                                    cublasGetStatusString(chorus_st_), ") in ", #expr, " at ", __FILE__, \
                                    ":", __LINE__);                                                 \
  } while (0)

CHORUS_NAMESPACE_BEGIN
namespace cuda {
namespace detail {
inline std::atomic<bool>& tf32_flag() {
  static std::atomic<bool> on{false};
  return on;
}
}  // namespace detail
/// Lets float32 matrix products use TF32 tensor cores (off by default, as in PyTorch).
inline void set_allow_tf32(bool on) { detail::tf32_flag() = on; }
inline bool allow_tf32() { return detail::tf32_flag(); }
}  // namespace cuda

namespace backend::cuda {

/// The cuBLAS and cuBLASLt handles of one stream (made on first use, kept for the process).
struct BlasHandles {
  cublasHandle_t blas = nullptr;
  cublasLtHandle_t lt = nullptr;
  void* workspace = nullptr;
  static constexpr std::size_t kWorkspace = std::size_t{32} << 20;
};

inline BlasHandles& handles_for(Device d, cudaStream_t stream) {
  static std::mutex m;
  static std::map<cudaStream_t, BlasHandles>* all = new std::map<cudaStream_t, BlasHandles>();  // lives forever
  std::lock_guard<std::mutex> lk(m);
  auto& h = (*all)[stream];
  if (!h.blas) {
    ::chorus::cuda::DeviceGuard g(d.index);
    CHORUS_CUBLAS_CHECK(cublasCreate(&h.blas));
    CHORUS_CUBLAS_CHECK(cublasSetStream(h.blas, stream));
    CHORUS_CUBLAS_CHECK(cublasLtCreate(&h.lt));
    CHORUS_CUDA_CHECK(cudaMalloc(&h.workspace, BlasHandles::kWorkspace));
    CHORUS_CUBLAS_CHECK(cublasSetWorkspace(h.blas, h.workspace, BlasHandles::kWorkspace));
  }
  return h;
}

/// Row-major C[M,N] = alpha op(A) op(B) + beta C, as column-major C^T = op(B)^T op(A)^T.
template <class T>
void gemm(bool ta, bool tb, std::int64_t M, std::int64_t N, std::int64_t K, T alpha, const T* A, std::int64_t lda,
          const T* B, std::int64_t ldb, T beta, T* C, std::int64_t ldc, Device d) {
  if (M == 0 || N == 0) return;
  Launch launch(d);
  auto& h = handles_for(d, launch.stream);
  const auto opa = ta ? CUBLAS_OP_T : CUBLAS_OP_N, opb = tb ? CUBLAS_OP_T : CUBLAS_OP_N;
  if constexpr (std::is_same_v<T, float>) {
    CHORUS_CUBLAS_CHECK(cublasSetMathMode(
        h.blas, ::chorus::cuda::allow_tf32() ? CUBLAS_TF32_TENSOR_OP_MATH : CUBLAS_DEFAULT_MATH));
    CHORUS_CUBLAS_CHECK(cublasSgemm(h.blas, opb, opa, (int)N, (int)M, (int)K, &alpha, B, (int)ldb, A, (int)lda, &beta, C,
                                    (int)ldc));
  } else {
    CHORUS_CUBLAS_CHECK(cublasDgemm(h.blas, opb, opa, (int)N, (int)M, (int)K, &alpha, B, (int)ldb, A, (int)lda, &beta, C,
                                    (int)ldc));
  }
  ::chorus::cuda::check_launch("gemm");
}

/// out[M,N] = x[M,K] @ w[N,K]^T + bias[N] in one cuBLASLt call (bias epilogue), all row-major
/// and contiguous, float32. Returns false when cuBLASLt has no algorithm for it (the caller
/// then uses gemm + a bias kernel).
inline bool linear_bias_lt(const float* x, const float* w, const float* bias, float* out, std::int64_t M,
                           std::int64_t N, std::int64_t K, Device d) {
  Launch launch(d);
  auto& h = handles_for(d, launch.stream);
  // Column-major view: out^T[N,M] = w[N,K] (stored as K x N, transposed) * x^T (K x M).
  const auto compute = ::chorus::cuda::allow_tf32() ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t la = nullptr, lb = nullptr, lc = nullptr;
  cublasLtMatmulPreference_t pref = nullptr;
  struct Cleanup {
    cublasLtMatmulDesc_t& op;
    cublasLtMatrixLayout_t &la, &lb, &lc;
    cublasLtMatmulPreference_t& pref;
    ~Cleanup() {
      if (pref) cublasLtMatmulPreferenceDestroy(pref);
      if (lc) cublasLtMatrixLayoutDestroy(lc);
      if (lb) cublasLtMatrixLayoutDestroy(lb);
      if (la) cublasLtMatrixLayoutDestroy(la);
      if (op) cublasLtMatmulDescDestroy(op);
    }
  } cleanup{op, la, lb, lc, pref};
  CHORUS_CUBLAS_CHECK(cublasLtMatmulDescCreate(&op, compute, CUDA_R_32F));
  const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
  CHORUS_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)));
  CHORUS_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)));
  const cublasLtEpilogue_t epi = CUBLASLT_EPILOGUE_BIAS;
  CHORUS_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof(epi)));
  CHORUS_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof(bias)));
  CHORUS_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&la, CUDA_R_32F, K, N, K));  // w as stored: K x N, ld K
  CHORUS_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&lb, CUDA_R_32F, K, M, K));  // x^T: K x M, ld K
  CHORUS_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&lc, CUDA_R_32F, N, M, N));  // out^T: N x M, ld N
  CHORUS_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  const std::size_t ws = BlasHandles::kWorkspace;
  CHORUS_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws,
                                                           sizeof(ws)));
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  const auto st = cublasLtMatmulAlgoGetHeuristic(h.lt, op, la, lb, lc, lc, pref, 1, &result, &found);
  if (st == CUBLAS_STATUS_NOT_SUPPORTED || found == 0) return false;
  CHORUS_CUBLAS_CHECK(st);
  const float alpha = 1.0f, beta = 0.0f;
  CHORUS_CUBLAS_CHECK(cublasLtMatmul(h.lt, op, &alpha, w, la, x, lb, &beta, out, lc, out, lc, &result.algo, h.workspace,
                                     ws, launch.stream));
  ::chorus::cuda::check_launch("cublasLtMatmul");
  return true;
}

}  // namespace backend::cuda
CHORUS_NAMESPACE_END
