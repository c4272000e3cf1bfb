#pragma once
// The CUDA launchers chorus::cuda_kernels compiles once (Note [precompiled CUDA kernels]).
//
// Note [precompiled CUDA kernels]
// Every kernel of the CUDA backend is a template instantiated by its launcher (a function
// template in backend/cuda/*.cuh), and every launcher is instantiated where backend/ calls it
// for a dtype (and functor). Header-only, each nvcc translation unit compiles those kernels
// again, and, costlier, nvcc's front ends parse and instantiate all of chorus twice besides the
// host compiler (the CUDA tutorial: cudafe++ 10 s, cicc 16 s, gcc 31 s, with no kernel of its
// own). So the kernels are offered compiled once, in the static library chorus::cuda_kernels
// (src/cuda_kernels/*.cu), and what links it gets CHORUS_CUDA_PRECOMPILED=1, which
//  - declares the launcher instances listed below `extern template` (each .cuh ends with
//    `CHORUS_CUDA_<FILE>_INSTANCES(CHORUS_CUDA_EXTERN_INSTANCE)`): a translation unit
//    instantiates none of them, and the library's sources define them from the same lists;
//  - turns the CUDA backend on in a C++ translation unit too (config.hpp): g++ sees the
//    launchers' host code, while the kernels and __device__ helpers sit behind
//    `#if defined(__CUDACC__)` and CHORUS_LAUNCH/CHORUS_LAUNCH_GRID (launch.cuh) launch nothing
//    there. A user's training code is then plain C++: the tutorial compiles in half the time
//    of its header-only nvcc build (39 s against 79 s, docs/getting-started.md, "Compile time").
// Structs that host code names (reduce_all's functors, the batch-norm reduction ops) stay
// outside the device-only regions, with __device__ members g++ ignores. A launcher instance
// missing from the lists is compiled by an nvcc translation unit itself (as header-only code
// does) and fails to link from a C++ one, naming the launcher and
// launcher_missing_from_cuda_kernels_instances_hpp; the test cuda_kernels_precompiled checks
// that the nvcc test programs compile no chorus kernel, so lists that fall behind the code are
// caught in CI. The g++ and nvcc views of the headers make the same symbols in the same ABI
// namespace (v0_1_cuda; Note [ABI namespace]): a program may mix both kinds of translation
// units, and header-only use (chorus::cuda alone) is unchanged.
//
// Each list is X(name, template arguments...) with the dtype groups below; the launchers and
// their argument order are those of the .cuh named in the list's comment.

#include <cstdint>

#ifndef CHORUS_CUDA_PRECOMPILED
#define CHORUS_CUDA_PRECOMPILED 0
#endif

#define CHORUS_CUDA_EXTERN_INSTANCE(f, ...) extern template decltype(f<__VA_ARGS__>) f<__VA_ARGS__>;
#define CHORUS_CUDA_DEFINE_INSTANCE(f, ...) template decltype(f<__VA_ARGS__>) f<__VA_ARGS__>;

// X(f, T, rest...) for T in a dtype group.
#define CHORUS_CUDA_WIDE(X, f, ...) X(f, float __VA_OPT__(, ) __VA_ARGS__) X(f, double __VA_OPT__(, ) __VA_ARGS__)
#define CHORUS_CUDA_FLOATS(X, f, ...)   \
  CHORUS_CUDA_WIDE(X, f, __VA_ARGS__) \
  X(f, bfloat16 __VA_OPT__(, ) __VA_ARGS__) X(f, half __VA_OPT__(, ) __VA_ARGS__)
#define CHORUS_CUDA_DTYPES(X, f, ...) \
  CHORUS_CUDA_FLOATS(X, f, __VA_ARGS__) X(f, std::int64_t __VA_OPT__(, ) __VA_ARGS__)
#define CHORUS_CUDA_WIDE_INT(X, f, ...) \
  CHORUS_CUDA_WIDE(X, f, __VA_ARGS__) X(f, std::int64_t __VA_OPT__(, ) __VA_ARGS__)

// ---- backend/cuda/kernels.cuh ----
// Elementwise functors (backend/functors.hpp) by arity; every floating dtype has every one.
#define CHORUS_CUDA_UNARY_OPS(X, f, T)                                                                       \
  X(f, T, fn::Neg) X(f, T, fn::Exp) X(f, T, fn::Log) X(f, T, fn::Sqrt) X(f, T, fn::Relu) X(f, T, fn::Gelu) \
  X(f, T, fn::Tanh) X(f, T, fn::Sigmoid) X(f, T, fn::AddScalar) X(f, T, fn::MulScalar)                    \
  X(f, T, fn::PowScalar) X(f, T, fn::Abs) X(f, T, fn::Sign) X(f, T, fn::InfToZero) X(f, T, fn::Sin)      \
  X(f, T, fn::Cos) X(f, T, fn::Clamp) X(f, T, fn::NonZero) X(f, T, fn::AbsPow) X(f, T, fn::Scale)      \
  X(f, T, fn::DivScalar)
#define CHORUS_CUDA_BINARY_OPS(X, f, T)                                                                      \
  X(f, T, fn::Add) X(f, T, fn::Sub) X(f, T, fn::Mul) X(f, T, fn::Div) X(f, T, fn::Maximum)                 \
  X(f, T, fn::ReluBackward) X(f, T, fn::GeluBackward) X(f, T, fn::TanhBackward)                            \
  X(f, T, fn::SigmoidBackward) X(f, T, fn::LogBackward) X(f, T, fn::SqrtBackward) X(f, T, fn::PowBackward) \
  X(f, T, fn::AbsBackward) X(f, T, fn::SinBackward) X(f, T, fn::CosBackward) X(f, T, fn::ClampBackward)    \
  X(f, T, fn::NormScale) X(f, T, fn::AddThenScale) X(f, T, fn::AddScaled)
#define CHORUS_CUDA_BROADCAST_OPS(X, f, T)                                                                 \
  X(f, T, fn::Add) X(f, T, fn::Sub) X(f, T, fn::Mul) X(f, T, fn::Div) X(f, T, fn::NormGrad)              \
  X(f, T, fn::NormInfMask) X(f, T, fn::SameValue) X(f, T, fn::AddScaled)
#define CHORUS_CUDA_EACH_FLOAT_T(M, X, f) M(X, f, float) M(X, f, double) M(X, f, bfloat16) M(X, f, half)
#define CHORUS_CUDA_CONVERT_FROM(X, f, T) \
  X(f, T, float) X(f, T, double) X(f, T, bfloat16) X(f, T, half) X(f, T, std::int64_t)

#define CHORUS_CUDA_KERNELS_INSTANCES(X)                                                                          \
  CHORUS_CUDA_DTYPES(X, fill) CHORUS_CUDA_DTYPES(X, arange) CHORUS_CUDA_DTYPES(X, copy_strided)                  \
  CHORUS_CUDA_CONVERT_FROM(X, convert, float) CHORUS_CUDA_CONVERT_FROM(X, convert, double)                      \
  CHORUS_CUDA_CONVERT_FROM(X, convert, bfloat16) CHORUS_CUDA_CONVERT_FROM(X, convert, half)                     \
  CHORUS_CUDA_CONVERT_FROM(X, convert, std::int64_t)                                                            \
  CHORUS_CUDA_EACH_FLOAT_T(CHORUS_CUDA_UNARY_OPS, X, unary) X(unary, std::int64_t, fn::AddScalar)                \
  X(unary, std::int64_t, fn::MulScalar) X(unary, std::int64_t, fn::Neg) X(unary, std::int64_t, fn::DivScalar)  \
  CHORUS_CUDA_EACH_FLOAT_T(CHORUS_CUDA_BINARY_OPS, X, binary_same) X(binary_same, std::int64_t, fn::Add)         \
  X(binary_same, std::int64_t, fn::Sub) X(binary_same, std::int64_t, fn::Mul)                                    \
  CHORUS_CUDA_EACH_FLOAT_T(CHORUS_CUDA_BROADCAST_OPS, X, binary_broadcast)                                       \
  X(binary_broadcast, std::int64_t, fn::Add) X(binary_broadcast, std::int64_t, fn::Sub)                          \
  X(binary_broadcast, std::int64_t, fn::Mul)                                                                     \
  CHORUS_CUDA_DTYPES(X, sum_dim) CHORUS_CUDA_DTYPES(X, expand_dim) CHORUS_CUDA_DTYPES(X, index_select)           \
  CHORUS_CUDA_WIDE(X, reduce_add_broadcast) CHORUS_CUDA_WIDE(X, index_add) CHORUS_CUDA_FLOATS(X, broadcast_rows) \
  CHORUS_CUDA_WIDE(X, softmax) CHORUS_CUDA_WIDE(X, softmax_backward) CHORUS_CUDA_WIDE(X, squared_error_sum)       \
  CHORUS_CUDA_WIDE(X, squared_error_backward) CHORUS_CUDA_WIDE(X, cross_entropy_forward)                         \
  CHORUS_CUDA_WIDE(X, cross_entropy_backward) CHORUS_CUDA_WIDE(X, nll_forward)                                   \
  CHORUS_CUDA_WIDE(X, nll_backward) CHORUS_CUDA_WIDE(X, count_not_ignored) CHORUS_CUDA_WIDE(X, sgd_step)         \
  CHORUS_CUDA_WIDE(X, adam_step)

// ---- backend/cuda/blas.cuh, blas_batched.cuh (host code around cuBLAS: no kernels, but
// instantiated once all the same) ----
#define CHORUS_CUDA_BLAS_INSTANCES(X) CHORUS_CUDA_FLOATS(X, gemm)
#define CHORUS_CUDA_BLAS_BATCHED_INSTANCES(X) CHORUS_CUDA_FLOATS(X, gemm_batched)

// ---- backend/cuda/nn_kernels.cuh ----
#define CHORUS_CUDA_NN_INSTANCES(X)                                                                               \
  CHORUS_CUDA_WIDE(X, im2col) CHORUS_CUDA_WIDE(X, col2im) CHORUS_CUDA_WIDE(X, max_pool2d)                        \
  CHORUS_CUDA_WIDE(X, max_pool2d_backward) CHORUS_CUDA_WIDE(X, avg_pool2d) CHORUS_CUDA_WIDE(X, avg_pool2d_backward) \
  CHORUS_CUDA_WIDE(X, adaptive_avg_pool2d) CHORUS_CUDA_WIDE(X, adaptive_avg_pool2d_backward)                     \
  CHORUS_CUDA_WIDE(X, channel_sums) CHORUS_CUDA_WIDE(X, bn_apply) CHORUS_CUDA_WIDE(X, dropout_apply)             \
  CHORUS_CUDA_WIDE(X, bn_stats, double) CHORUS_CUDA_WIDE(X, bn_finish, double)                                   \
  CHORUS_CUDA_WIDE(X, bn_backward_reduce, double) CHORUS_CUDA_WIDE(X, bn_backward_input, double)                 \
  X(bn_sync_stats, double)

// ---- backend/cuda/index_kernels.cuh ----
#define CHORUS_CUDA_COMPARE_OPS(X, f, M, T) \
  X(f, M, T, fn::Eq) X(f, M, T, fn::Ne) X(f, M, T, fn::Lt) X(f, M, T, fn::Le) X(f, M, T, fn::Gt) X(f, M, T, fn::Ge)
#define CHORUS_CUDA_INDEX_INSTANCES(X)                                                                            \
  X(where, std::int64_t, float) X(where, std::int64_t, double) X(where, std::int64_t, std::int64_t)              \
  CHORUS_CUDA_COMPARE_OPS(X, compare, std::int64_t, float) CHORUS_CUDA_COMPARE_OPS(X, compare, std::int64_t, double) \
  CHORUS_CUDA_COMPARE_OPS(X, compare, std::int64_t, std::int64_t)                                                \
  CHORUS_CUDA_WIDE(X, gather) CHORUS_CUDA_WIDE_INT(X, scatter_add) CHORUS_CUDA_WIDE_INT(X, one_hot)               \
  CHORUS_CUDA_WIDE_INT(X, select_extremum) CHORUS_CUDA_WIDE_INT(X, topk) CHORUS_CUDA_WIDE_INT(X, cumsum)          \
  CHORUS_CUDA_WIDE_INT(X, triangle)

// ---- backend/cuda/foreach.cuh, amp.cuh ----
#define CHORUS_CUDA_FOREACH_INSTANCES(X)                                                        \
  CHORUS_CUDA_WIDE(X, foreach_norm) CHORUS_CUDA_WIDE(X, foreach_scale) CHORUS_CUDA_WIDE(X, foreach_clamp) \
  X(norm_finish, double)
#define CHORUS_CUDA_AMP_INSTANCES(X) CHORUS_CUDA_WIDE(X, foreach_unscale_check)

// ---- backend/cuda/cudnn.cuh (host code around cuDNN) ----
#define CHORUS_CUDA_CUDNN_INSTANCES(X) \
  CHORUS_CUDA_FLOATS(X, conv_forward) CHORUS_CUDA_FLOATS(X, conv_backward_data) CHORUS_CUDA_FLOATS(X, conv_backward_filter)
