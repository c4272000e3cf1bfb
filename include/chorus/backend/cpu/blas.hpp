#pragma once
// Matrix products on the CPU: oneDNN's sgemm and bfloat16 matmul where chorus has oneDNN,
// OpenBLAS (CBLAS) for double, the smallest products and builds without oneDNN.
//
// Note [which GEMM]
// Measured on a 2-vCPU Sapphire Rapids class VM (avx512_bf16, amx_bf16; the CPU reports a
// generic model name), one thread, GFLOP/s (a scratch program timing each call over 0.1 s, best
// of 5):
//   shape M x N x K          OpenBLAS 0.3.21   OpenBLAS forced   dnnl_sgemm   oneDNN matmul
//                            (its guess)       to SkylakeX       (AVX-512)    bf16 (AMX)
//   2048 x 2048 x 2048         45                221               225          755
//   512 x 1024 x 1024 (NT)     45                214               221          853
//   64 x 1024 x 256 (NT)       42                157               203          871
//   64 x 64 x 64               39                232               201          394
//   32 x 32 x 32 (NT)          31                 68                93           78
//   30 x 2 x 5 (NT)             3.0                3.9               1.7          1.3
// Debian's OpenBLAS is built for every x86 core (DYNAMIC_ARCH) and picks one from the CPU's
// model: on a VM that hides the model it falls back to Prescott's SSE3 kernels, a fifth of the
// machine (openblas_get_corename() says which it took). oneDNN dispatches on the CPU's feature
// flags and is never slower than OpenBLAS above 32^3 even when OpenBLAS knows the core (its
// small NN products aside, by at most 15 %). So a float product goes to dnnl_sgemm, on the
// calling thread's intra-op team (Note [one pool of threads]), unless M·N·K < 32^3, where
// OpenBLAS's lighter call wins; double goes to OpenBLAS (oneDNN has no dgemm). bfloat16
// products go to oneDNN's matmul in bfloat16 with float accumulation (AMX or avx512_bf16
// instructions: 3 to 5 times the float32 rate) where the CPU has those instructions; elsewhere,
// and for half, the operands are widened to float around sgemm. Both round C once from the
// float sum, as cuBLAS's 16-bit products with a float compute type do. gemm_route() names the
// route; set_gemm_route(GemmRoute::openblas) (or CHORUS_GEMM=openblas) sends every product to
// OpenBLAS, which the tests and benchmarks compare against.
//
// Note [one pool of threads]
// With set_num_threads(n > 1), chorus's loops and oneDNN's convolutions run on the calling
// thread's OpenMP team (Note [intra-op threads]). OpenBLAS's pthreads build keeps threads of
// its own, and both pools spin-wait between calls: a team thread spinning after an elementwise
// loop holds the core that OpenBLAS's helper needs for the next product, and the other way
// round. On 2 cores that made the mlp-medium step at 2 threads as slow as one thread (139.7 ms
// against 75.0 ms with libgomp told not to spin, OMP_WAIT_POLICY=passive). oneDNN's sgemm
// runs on that same team, as PyTorch runs its products on its OpenMP pool (MKL).
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

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>
#include <thread>
#include <type_traits>
#include <vector>

#include "../../compiled.hpp"
#include "../../core/half.hpp"
#include "../../error.hpp"
#include "parallel.hpp"

// Products go to oneDNN (Note [which GEMM]) where chorus has oneDNN (CHORUS_ONEDNN_API,
// config.hpp) and oneDNN runs on libgomp, the team chorus sizes.
#if CHORUS_ONEDNN_API && CHORUS_HAS_GOMP
#include <oneapi/dnnl/dnnl.h>
#if DNNL_CPU_RUNTIME == DNNL_RUNTIME_OMP
#define CHORUS_GEMM_ONEDNN 1
#endif
#endif
#ifndef CHORUS_GEMM_ONEDNN
#define CHORUS_GEMM_ONEDNN 0
#endif

CHORUS_NAMESPACE_BEGIN
namespace backend::cpu {

/// Where CPU matrix products go (Note [which GEMM]): `automatic` is the measured rule
/// (oneDNN, OpenBLAS for double and the smallest products); `openblas` sends every product to
/// OpenBLAS, 16-bit ones widened to float.
enum class GemmRoute { automatic, openblas };

namespace detail {
/// CHORUS_GEMM's value as a route.
inline GemmRoute parse_gemm_route(std::string_view v) {
  CHORUS_CHECK(v == "auto" || v == "openblas", "CHORUS_GEMM=", v, ": expected auto or openblas");
  return v == "openblas" ? GemmRoute::openblas : GemmRoute::automatic;
}
inline std::atomic<int>& gemm_route_switch() {
  static std::atomic<int> route{[] {
    const char* e = std::getenv("CHORUS_GEMM");
    return e && parse_gemm_route(e) == GemmRoute::openblas ? 1 : 0;
  }()};
  return route;
}
/// Whether float products of this size go to oneDNN's sgemm (Note [which GEMM]).
inline bool sgemm_on_onednn(std::int64_t M, std::int64_t N, std::int64_t K) {
  if (!CHORUS_GEMM_ONEDNN || gemm_route_switch().load(std::memory_order_relaxed) != 0) return false;
  return static_cast<double>(M) * static_cast<double>(N) * static_cast<double>(K) >= 32768.0;
}
}  // namespace detail

/// Selects the route of CPU products (process-wide; CHORUS_GEMM=openblas or auto in the
/// environment sets it at start).
inline void set_gemm_route(GemmRoute r) { detail::gemm_route_switch().store(r == GemmRoute::openblas ? 1 : 0); }
inline GemmRoute gemm_route_choice() {
  return detail::gemm_route_switch().load() != 0 ? GemmRoute::openblas : GemmRoute::automatic;
}
/// Where this build and CPU send float, bfloat16 and double products, in words (the benchmarks
/// print it), e.g. "float: oneDNN sgemm (avx512_core_amx) from 32^3, OpenBLAS (Prescott) below;
/// bfloat16: oneDNN matmul; double: OpenBLAS (Prescott)".
CHORUS_INLINE std::string gemm_route();

namespace onednn {
/// C = alpha·op(A)·op(B) + beta·C in bfloat16 through oneDNN's matmul with float accumulation
/// (row-major, as gemm). Returns false, computing nothing, where the CPU has no bfloat16
/// instructions or the route is `openblas`: the caller widens to float then.
CHORUS_INLINE bool gemm_bf16(bool trans_a, bool trans_b, std::int64_t M, std::int64_t N, std::int64_t K, float alpha,
                             const bfloat16* A, std::int64_t lda, const bfloat16* B, std::int64_t ldb, float beta,
                             bfloat16* C, std::int64_t ldc);
}  // namespace onednn

inline CBLAS_TRANSPOSE cblas_op(bool trans) { return trans ? CblasTrans : CblasNoTrans; }

/// Row-major C[M,N] = alpha * op(A)[M,K] @ op(B)[K,N] + beta * C (Note [which GEMM]).
template <class T>
void gemm(bool trans_a, bool trans_b, std::int64_t M, std::int64_t N, std::int64_t K, T alpha,
          const T* A, std::int64_t lda, const T* B, std::int64_t ldb, T beta, T* C, std::int64_t ldc) {
  if (M == 0 || N == 0) return;
  if (K == 0) {  // BLAS leaves C untouched when K == 0 only if beta == 1; be explicit
    for (std::int64_t i = 0; i < M; ++i)
      for (std::int64_t j = 0; j < N; ++j) C[i * ldc + j] = beta == T(0) ? T(0) : beta * C[i * ldc + j];
    return;
  }
  if constexpr (is_reduced_floating_v<T>) {
#if CHORUS_GEMM_ONEDNN
    if constexpr (std::is_same_v<T, bfloat16>)
      if (onednn::gemm_bf16(trans_a, trans_b, M, N, K, static_cast<float>(alpha), A, lda, B, ldb,
                            static_cast<float>(beta), C, ldc))
        return;
#endif
    // Widen the operands to float, multiply with sgemm (float accumulation), round C once.
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
    gemm<float>(trans_a, trans_b, M, N, K, static_cast<float>(alpha), a.data(), trans_a ? M : K, b.data(),
                trans_b ? K : N, fb, c.data(), N);
    for (std::int64_t i = 0; i < M; ++i)
      for (std::int64_t j = 0; j < N; ++j) C[i * ldc + j] = T(c[i * N + j]);
  } else if constexpr (std::is_same_v<T, float>) {
#if CHORUS_GEMM_ONEDNN
    if (detail::sgemm_on_onednn(M, N, K)) {
      detail::set_omp_team_size(detail::intra_op_threads());  // the team dnnl_sgemm runs on
      const dnnl_status_t st = dnnl_sgemm(trans_a ? 'T' : 'N', trans_b ? 'T' : 'N', M, N, K, alpha, A, lda, B, ldb,
                                          beta, C, ldc);
      CHORUS_CHECK(st == dnnl_success, "oneDNN sgemm failed (status ", static_cast<int>(st), ") for ", M, "x", K,
                   " @ ", K, "x", N);
      return;
    }
#endif
    cblas_sgemm(CblasRowMajor, cblas_op(trans_a), cblas_op(trans_b), (int)M, (int)N, (int)K, alpha, A, (int)lda, B,
                (int)ldb, beta, C, (int)ldc);
  } else {
    cblas_dgemm(CblasRowMajor, cblas_op(trans_a), cblas_op(trans_b), (int)M, (int)N, (int)K, alpha, A, (int)lda, B,
                (int)ldb, beta, C, (int)ldc);
  }
}

namespace detail {
/// Whether the program chose OpenBLAS's thread count: set_blas_threads/set_num_threads, or
/// OPENBLAS_NUM_THREADS / OMP_NUM_THREADS in the environment.
inline std::atomic<bool>& blas_threads_chosen() {
  static std::atomic<bool> chosen{std::getenv("OPENBLAS_NUM_THREADS") != nullptr ||
                                  std::getenv("OMP_NUM_THREADS") != nullptr};
  return chosen;
}
}  // namespace detail

/// Threads OpenBLAS uses for one call (process-wide). Set, it is the program's choice:
/// share_blas_threads leaves it alone.
inline void set_blas_threads(int n) {
  CHORUS_CHECK(n >= 1, "set_blas_threads(", n, "): need at least one thread");
  detail::blas_threads_chosen() = true;
  openblas_set_num_threads(n);
}
inline int blas_threads() { return openblas_get_num_threads(); }

/// Note [BLAS threads shared by devices]
/// The products that go to oneDNN run on the calling thread's intra-op team: one thread on
/// each DataParallel device's worker and in each DDP rank unless the program sets more. OpenBLAS
/// (double, the smallest products, builds without oneDNN) starts a thread per core for each
/// product by default. Devices that compute at once on one machine (DataParallel over several
/// CPU devices, DDP ranks of one node on the CPU) would each do so, and the oversubscribed cores
/// ran a step 1.5 to 13 times slower. DataParallel and dist::init therefore give each of `sharers` its share of the cores
/// (OpenBLAS's count is process-wide: cores / sharers, at least 1), unless the program chose
/// the count (set_blas_threads, set_num_threads, OPENBLAS_NUM_THREADS, OMP_NUM_THREADS).
inline void share_blas_threads(int sharers) {
  if (sharers <= 1 || detail::blas_threads_chosen()) return;
  const int cores = std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  openblas_set_num_threads(std::max(1, cores / sharers));
}

}  // namespace backend::cpu
CHORUS_NAMESPACE_END

// The oneDNN matmul and the route's description: compiled into chorus::compiled
// (src/backend/blas.cpp), or here in the header-only form (Note [compiled chorus]).
#if !CHORUS_COMPILED
#include "blas_impl.hpp"
#endif
