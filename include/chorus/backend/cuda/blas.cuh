#pragma once
// cuBLAS and cuBLASLt for the CUDA backend: one handle per stream, TF32 opt-in.
#include <cublasLt.h>
#include <cublas_v2.h>

#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <utility>

#include "../../core/dtype.hpp"
#include "host_policy.hpp"
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

// Note [per-thread lookups]
// Handles and plans are made once and kept for the process (streams are never destroyed, so a
// stream's handle value is never reused for another stream), so each thread remembers the
// ones it has used: a GEMM, a convolution or a plan lookup on the hot path takes no global
// mutex; only the first use on a thread does.
template <class Value, class Key, class Make>
Value& per_thread_lookup(std::unordered_map<Key, Value*>& mine, const Key& key, Make&& make) {
  if (auto it = mine.find(key); it != mine.end()) return *it->second;
  Value& v = make();
  mine.emplace(key, &v);
  return v;
}

inline BlasHandles& handles_for(Device d, cudaStream_t stream) {
  thread_local std::unordered_map<cudaStream_t, BlasHandles*> mine;
  return per_thread_lookup<BlasHandles>(mine, stream, [&]() -> BlasHandles& {
    static std::mutex m;
    static auto* all = new std::map<cudaStream_t, BlasHandles>();  // lives forever (stable addresses)
    std::lock_guard<std::mutex> lk(m);
    auto& h = (*all)[stream];
    if (!h.blas) {
      ::chorus::cuda::DeviceGuard g(d.index);
      BlasHandles made;  // published only once complete: a failure leaves the slot to retry
      CHORUS_CUBLAS_CHECK(cublasCreate(&made.blas));
      CHORUS_CUBLAS_CHECK(cublasSetStream(made.blas, stream));
      CHORUS_CUBLAS_CHECK(cublasLtCreate(&made.lt));
      CHORUS_CUDA_CHECK(cudaMalloc(&made.workspace, BlasHandles::kWorkspace));
      CHORUS_CUBLAS_CHECK(cublasSetWorkspace(made.blas, made.workspace, BlasHandles::kWorkspace));
      h = made;
    }
    return h;
  });
}

/// The cudaDataType of a 16-bit element type.
template <class T>
constexpr cudaDataType_t cuda_type() {
  static_assert(is_reduced_floating_v<T>, "cuda_type: bfloat16 or half");
  return std::is_same_v<T, bfloat16> ? CUDA_R_16BF : CUDA_R_16F;
}

/// Row-major C[M,N] = alpha op(A) op(B) + beta C, as column-major C^T = op(B)^T op(A)^T.
/// The 64-bit cuBLAS API takes the sizes as they are: nothing is narrowed to int.
template <class T>
void gemm(bool ta, bool tb, std::int64_t M, std::int64_t N, std::int64_t K, T alpha, const T* A, std::int64_t lda,
          const T* B, std::int64_t ldb, T beta, T* C, std::int64_t ldc, Device d) {
  if (M == 0 || N == 0) return;
  Launch launch(d);
  auto& h = handles_for(d, launch.stream);
  const auto opa = ta ? CUBLAS_OP_T : CUBLAS_OP_N, opb = tb ? CUBLAS_OP_T : CUBLAS_OP_N;
  if constexpr (is_reduced_floating_v<T>) {
    // 16-bit operands and result, float32 accumulation (PyTorch's numerics for autocast's
    // products); chorus's 16-bit types have CUDA's bit layouts.
    const float fa = static_cast<float>(alpha), fb = static_cast<float>(beta);
    CHORUS_CUBLAS_CHECK(cublasSetMathMode(h.blas, CUBLAS_DEFAULT_MATH));
    CHORUS_CUBLAS_CHECK(cublasGemmEx_64(h.blas, opb, opa, N, M, K, &fa, B, cuda_type<T>(), ldb, A, cuda_type<T>(), lda,
                                        &fb, C, cuda_type<T>(), ldc, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  } else if constexpr (std::is_same_v<T, float>) {
    CHORUS_CUBLAS_CHECK(cublasSetMathMode(
        h.blas, ::chorus::cuda::allow_tf32() ? CUBLAS_TF32_TENSOR_OP_MATH : CUBLAS_DEFAULT_MATH));
    CHORUS_CUBLAS_CHECK(cublasSgemm_64(h.blas, opb, opa, N, M, K, &alpha, B, ldb, A, lda, &beta, C, ldc));
  } else {
    CHORUS_CUBLAS_CHECK(cublasDgemm_64(h.blas, opb, opa, N, M, K, &alpha, B, ldb, A, lda, &beta, C, ldc));
  }
  ::chorus::cuda::check_launch("gemm");
}

/// Which path the fused Linear took (tests assert on it; the counts only grow).
struct LtStats {
  std::atomic<std::int64_t> lt_calls{0};      // products done by cublasLtMatmul with the bias epilogue
  std::atomic<std::int64_t> fallbacks{0};     // refused (alignment, no algorithm, NOT_SUPPORTED): plain cuBLAS
  std::atomic<std::int64_t> plans_built{0};   // heuristic queries (Note [cuBLASLt plan cache])
};
inline LtStats& lt_stats() {
  static LtStats* s = new LtStats();
  return *s;
}

// Note [cuBLASLt plan cache]
// Creating the matmul descriptor and layouts and asking the heuristic for an algorithm costs
// tens of microseconds of host time, every call. A plan (descriptors + algorithm, or "no
// algorithm") is built once per LtKey: device, sizes, dtype, TF32, the operands' alignments
// (Note [cuBLASLt alignment] in host_policy.hpp) and the epilogue. The bias pointer is the one
// per-call attribute of the shared descriptor; a plan's mutex covers setting it and enqueueing
// the product (cublasLtMatmul reads the descriptor before it returns).
struct LtPlan {
  std::atomic<bool> supported{false};
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t la = nullptr, lb = nullptr, lc = nullptr;
  cublasLtMatmulAlgo_t algo{};
  std::mutex m;
  LtPlan() = default;
  LtPlan(const LtPlan&) = delete;
  LtPlan& operator=(const LtPlan&) = delete;
  ~LtPlan() {
    if (lc) (void)cublasLtMatrixLayoutDestroy(lc);
    if (lb) (void)cublasLtMatrixLayoutDestroy(lb);
    if (la) (void)cublasLtMatrixLayoutDestroy(la);
    if (op) (void)cublasLtMatmulDescDestroy(op);
  }
};

/// out^T[N,M] = w (K x N as stored, transposed) * x^T (K x M), bias epilogue, float32.
inline std::shared_ptr<LtPlan> build_lt_plan(const LtKey& key, cublasLtHandle_t lt) {
  auto plan = std::make_shared<LtPlan>();
  lt_stats().plans_built.fetch_add(1, std::memory_order_relaxed);
  const auto compute = key.tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
  CHORUS_CUBLAS_CHECK(cublasLtMatmulDescCreate(&plan->op, compute, CUDA_R_32F));
  const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
  CHORUS_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)));
  CHORUS_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)));
  const cublasLtEpilogue_t epi = key.epilogue == 1 ? CUBLASLT_EPILOGUE_BIAS : CUBLASLT_EPILOGUE_DEFAULT;
  CHORUS_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof(epi)));
  CHORUS_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan->la, CUDA_R_32F, key.k, key.n, key.k));  // w: K x N, ld K
  CHORUS_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan->lb, CUDA_R_32F, key.k, key.m, key.k));  // x^T: K x M, ld K
  CHORUS_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan->lc, CUDA_R_32F, key.n, key.m, key.n));  // out^T: N x M
  cublasLtMatmulPreference_t pref = nullptr;
  CHORUS_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  struct PrefGuard {
    cublasLtMatmulPreference_t p;
    ~PrefGuard() { (void)cublasLtMatmulPreferenceDestroy(p); }
  } pref_guard{pref};
  const std::size_t ws = BlasHandles::kWorkspace;
  CHORUS_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws,
                                                           sizeof(ws)));
  // The real alignments, not the 256 bytes the heuristic otherwise assumes (Note [cuBLASLt alignment]).
  const std::pair<cublasLtMatmulPreferenceAttributes_t, std::uint32_t> aligns[] = {
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, key.align_a},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, key.align_b},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, key.align_c},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, key.align_d}};
  for (const auto& [attr, bytes] : aligns)
    CHORUS_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, attr, &bytes, sizeof(bytes)));
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  const auto st = cublasLtMatmulAlgoGetHeuristic(lt, plan->op, plan->la, plan->lb, plan->lc, plan->lc, pref, 1,
                                                 &result, &found);
  if (st == CUBLAS_STATUS_NOT_SUPPORTED || (st == CUBLAS_STATUS_SUCCESS && found == 0)) return plan;  // unsupported
  CHORUS_CUBLAS_CHECK(st);
  plan->algo = result.algo;
  plan->supported.store(true);
  return plan;
}

/// The plan for `key` (plans live forever: Note [per-thread lookups]).
inline LtPlan& lt_plan(const LtKey& key, cublasLtHandle_t lt) {
  thread_local std::unordered_map<LtKey, LtPlan*, LtKeyHash> mine;
  if (auto it = mine.find(key); it != mine.end()) return *it->second;
  static std::mutex m;
  static auto* cache = new std::unordered_map<LtKey, std::shared_ptr<LtPlan>, LtKeyHash>();  // lives forever
  LtPlan* found = nullptr;
  {
    std::lock_guard<std::mutex> lk(m);
    if (auto it = cache->find(key); it != cache->end()) found = it->second.get();
  }
  if (!found) {
    auto plan = build_lt_plan(key, lt);  // outside the lock: the heuristic is the slow part
    std::lock_guard<std::mutex> lk(m);
    found = cache->emplace(key, std::move(plan)).first->second.get();  // a racing builder's plan wins: same result
  }
  mine.emplace(key, found);
  return *found;
}

/// out[M,N] = x[M,K] @ w[N,K]^T + bias[N] in one cuBLASLt call (bias epilogue), all row-major
/// and contiguous, float32. Returns false when cuBLASLt cannot do it here (misaligned bias, no
/// algorithm for these alignments, CUBLAS_STATUS_NOT_SUPPORTED); the caller then uses plain
/// cuBLAS and a bias kernel.
inline bool linear_bias_lt(const float* x, const float* w, const float* bias, float* out, std::int64_t M,
                           std::int64_t N, std::int64_t K, Device d) {
  auto addr = [](const void* p) { return reinterpret_cast<std::uintptr_t>(p); };
  if (!lt_bias_epilogue_ok(addr(bias), M)) {
    lt_stats().fallbacks.fetch_add(1, std::memory_order_relaxed);
    return false;
  }
  Launch launch(d);
  auto& h = handles_for(d, launch.stream);
  LtKey key;
  key.device = d.index;
  key.m = M;
  key.n = N;
  key.k = K;
  key.dtype = static_cast<int>(DType::Float32);
  key.tf32 = ::chorus::cuda::allow_tf32();
  key.align_a = lt_alignment(addr(w));
  key.align_b = lt_alignment(addr(x));
  key.align_c = key.align_d = lt_alignment(addr(out));
  key.epilogue = 1;
  LtPlan& plan = lt_plan(key, h.lt);
  if (!plan.supported.load(std::memory_order_acquire)) {
    lt_stats().fallbacks.fetch_add(1, std::memory_order_relaxed);
    return false;
  }
  const float alpha = 1.0f, beta = 0.0f;
  cublasStatus_t st;
  {
    std::lock_guard<std::mutex> lk(plan.m);  // per plan: the bias pointer is the descriptor's one per-call attribute
    CHORUS_CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(plan.op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof(bias)));
    st = cublasLtMatmul(h.lt, plan.op, &alpha, w, plan.la, x, plan.lb, &beta, out, plan.lc, out, plan.lc,
                        &plan.algo, h.workspace, BlasHandles::kWorkspace, launch.stream);
  }
  if (st == CUBLAS_STATUS_NOT_SUPPORTED) {  // refused at launch: never again for this key
    plan.supported.store(false);
    lt_stats().fallbacks.fetch_add(1, std::memory_order_relaxed);
    return false;
  }
  CHORUS_CUBLAS_CHECK(st);
  ::chorus::cuda::check_launch("cublasLtMatmul");
  lt_stats().lt_calls.fetch_add(1, std::memory_order_relaxed);
  return true;
}

#if CHORUS_CUDA_PRECOMPILED  // Note [precompiled CUDA kernels]
CHORUS_CUDA_BLAS_INSTANCES(CHORUS_CUDA_EXTERN_INSTANCE)
#endif

}  // namespace backend::cuda
CHORUS_NAMESPACE_END
