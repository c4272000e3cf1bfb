#pragma once
// BLAS for the CPU backend: OpenBLAS through its CBLAS interface, and oneDNN's sgemm for float
// products of a thread with several intra-op threads.
//
// Note [one pool of threads]
// With set_num_threads(n > 1), chorus's loops and oneDNN's convolutions run on the calling
// thread's OpenMP team (Note [intra-op threads]). OpenBLAS's pthreads build keeps threads of
// its own, and both pools spin-wait between calls: a team thread spinning after an elementwise
// loop holds the core that OpenBLAS's helper needs for the next product, and the other way
// round. On 2 cores that made the mlp-medium step at 2 threads as slow as one thread (139.7 ms
// against 75.0 ms with libgomp told not to spin, OMP_WAIT_POLICY=passive). So a float product
// of a thread with n > 1 intra-op threads runs in oneDNN's sgemm (dnnl_sgemm, row-major, on
// the same team), and OpenBLAS serves the rest: one thread's products, double, and builds
// without oneDNN. PyTorch runs its products on its OpenMP pool the same way (MKL).
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
#include <thread>
#include <type_traits>
#include <vector>

#include "../../core/half.hpp"
#include "../../error.hpp"
#include "parallel.hpp"

#ifndef CHORUS_HAS_ONEDNN
#define CHORUS_HAS_ONEDNN 0
#endif
// oneDNN's sgemm on the intra-op team (Note [one pool of threads]): where chorus calls oneDNN
// (onednn.hpp: not in translation units with the CUDA backend) and oneDNN runs on libgomp.
#if CHORUS_HAS_ONEDNN && !CHORUS_CUDA && CHORUS_HAS_GOMP
#include <oneapi/dnnl/dnnl.h>
#if DNNL_CPU_RUNTIME == DNNL_RUNTIME_OMP
#define CHORUS_GEMM_ON_TEAM 1
#endif
#endif
#ifndef CHORUS_GEMM_ON_TEAM
#define CHORUS_GEMM_ON_TEAM 0
#endif

CHORUS_NAMESPACE_BEGIN
namespace backend::cpu {

inline CBLAS_TRANSPOSE cblas_op(bool trans) { return trans ? CblasTrans : CblasNoTrans; }

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
    gemm<float>(trans_a, trans_b, M, N, K, static_cast<float>(alpha), a.data(), trans_a ? M : K, b.data(),
                trans_b ? K : N, fb, c.data(), N);
    for (std::int64_t i = 0; i < M; ++i)
      for (std::int64_t j = 0; j < N; ++j) C[i * ldc + j] = T(c[i * N + j]);
  } else if constexpr (std::is_same_v<T, float>) {
#if CHORUS_GEMM_ON_TEAM
    if (const int threads = detail::intra_op_threads(); threads > 1) {  // Note [one pool of threads]
      detail::set_omp_team_size(threads);  // the team dnnl_sgemm runs on
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
/// OpenBLAS starts a thread per core for each product by default. Devices that compute at
/// once on one machine (DataParallel over several CPU devices, DDP ranks of one node on the
/// CPU) would each do so, and the oversubscribed cores run a step 1.5 to 13 times slower.
/// DataParallel and dist::init therefore give each of `sharers` its share of the cores
/// (OpenBLAS's count is process-wide: cores / sharers, at least 1), unless the program chose
/// the count (set_blas_threads, set_num_threads, OPENBLAS_NUM_THREADS, OMP_NUM_THREADS).
inline void share_blas_threads(int sharers) {
  if (sharers <= 1 || detail::blas_threads_chosen()) return;
  const int cores = std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  openblas_set_num_threads(std::max(1, cores / sharers));
}

}  // namespace backend::cpu
CHORUS_NAMESPACE_END
