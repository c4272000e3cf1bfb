#pragma once
// chorus::set_num_threads / get_num_threads (PyTorch's torch::set_num_threads): the threads the
// calling thread's CPU kernels may use.
#include "blas.hpp"
#include "onednn.hpp"

CHORUS_NAMESPACE_BEGIN

/// Lets the CPU work started from the calling thread use `n` threads: OpenBLAS's matrix
/// products (its thread count is process-wide) and this thread's oneDNN convolutions (an
/// OpenMP team of n; Note [oneDNN threads]). For a program that trains on one CPU device; under
/// DataParallel over CPU devices each device's worker keeps one thread (the devices are the
/// parallelism), so leave it at 1 there. chorus's own elementwise, pooling and normalisation
/// loops stay on the calling thread.
inline void set_num_threads(int n) {
  CHORUS_CHECK(n >= 1, "set_num_threads(", n, "): need at least one thread");
  backend::cpu::set_blas_threads(n);
  backend::cpu::detail::intra_op_threads() = n;
}

/// The calling thread's count (set_num_threads; 1 unless changed or CHORUS_ONEDNN_THREADS is set).
inline int get_num_threads() { return backend::cpu::detail::intra_op_threads(); }

CHORUS_NAMESPACE_END
