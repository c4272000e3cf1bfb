#pragma once
// chorus::set_num_threads / get_num_threads (PyTorch's torch::set_num_threads): the threads the
// calling thread's CPU kernels may use.
#include "blas.hpp"
#include "onednn.hpp"

CHORUS_NAMESPACE_BEGIN

/// Lets the CPU work started from the calling thread use `n` threads: an OpenMP team of n for
/// this thread's oneDNN convolutions, its float matrix products (oneDNN's sgemm where chorus uses
/// oneDNN) and chorus's own elementwise, normalisation and pooling loops, and n OpenBLAS threads
/// (process-wide) for the products OpenBLAS computes (Notes [oneDNN threads], [intra-op
/// threads], [one pool of threads]). For a program that trains on one CPU device; under
/// DataParallel over CPU devices each device's worker keeps one thread (the devices are the
/// parallelism), so leave it at 1 there.
inline void set_num_threads(int n) {
  CHORUS_CHECK(n >= 1, "set_num_threads(", n, "): need at least one thread");
  backend::cpu::set_blas_threads(n);
  backend::cpu::detail::intra_op_threads() = n;
}

/// The calling thread's count (set_num_threads; 1 unless changed or CHORUS_NUM_THREADS is set).
inline int get_num_threads() { return backend::cpu::detail::intra_op_threads(); }

CHORUS_NAMESPACE_END
