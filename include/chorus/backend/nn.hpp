#pragma once
// Device dispatch of the convolution, pooling and normalisation kernels (NCHW, contiguous
// tensors). ops/nn.hpp calls these.
#include "../compiled.hpp"
#include "backend.hpp"
#include "cpu/nn_kernels.hpp"
#include "cpu/onednn.hpp"
#include "cpu/threads.hpp"
#if CHORUS_CUDA
#include "cuda/nn_kernels.cuh"
#if CHORUS_HAS_CUDNN
#include "cuda/cudnn.cuh"
#endif
#endif

CHORUS_NAMESPACE_BEGIN
namespace backend {

/// col = im2col of one image at x (see cpu::im2col).
template <class T>
void im2col(const T* x, const Window2d& g, T* col, Device d) {
  if constexpr (is_reduced_floating_v<T>) {
    detail::no_reduced_kernel<T>("im2col");
  } else {
    CHORUS_DISPATCH(d, cpu::im2col(x, g, col), cuda::im2col(x, g, col, d));
  }
}
/// x += col2im(col).
template <class T>
void col2im(const T* col, const Window2d& g, T* x, Device d) {
  if constexpr (is_reduced_floating_v<T>) {
    detail::no_reduced_kernel<T>("col2im");
  } else {
    CHORUS_DISPATCH(d, cpu::col2im(col, g, x), cuda::col2im(col, g, x, d));
  }
}
template <class T>
void max_pool2d(const T* x, std::int64_t planes, const Window2d& g, T* out, std::int64_t* idx, Device d) {
  if constexpr (is_reduced_floating_v<T>) {
    detail::no_reduced_kernel<T>("max_pool2d");
  } else {
    CHORUS_DISPATCH(d, cpu::max_pool2d(x, planes, g, out, idx), cuda::max_pool2d(x, planes, g, out, idx, d));
  }
}
template <class T>
void max_pool2d_backward(const T* gy, const std::int64_t* idx, std::int64_t planes, const Window2d& g, T* gx,
                         Device d) {
  if constexpr (is_reduced_floating_v<T>) {
    detail::no_reduced_kernel<T>("max_pool2d_backward");
  } else {
    CHORUS_DISPATCH(d, cpu::max_pool2d_backward(gy, idx, planes, g, gx),
                    cuda::max_pool2d_backward(gy, idx, planes, g, gx, d));
  }
}
template <class T>
void avg_pool2d(const T* x, std::int64_t planes, const Window2d& g, bool inc, std::int64_t div, T* out, Device d) {
  if constexpr (is_reduced_floating_v<T>) {
    detail::no_reduced_kernel<T>("avg_pool2d");
  } else {
    CHORUS_DISPATCH(d, cpu::avg_pool2d(x, planes, g, inc, div, out), cuda::avg_pool2d(x, planes, g, inc, div, out, d));
  }
}
template <class T>
void avg_pool2d_backward(const T* gy, std::int64_t planes, const Window2d& g, bool inc, std::int64_t div, T* gx,
                         Device d) {
  if constexpr (is_reduced_floating_v<T>) {
    detail::no_reduced_kernel<T>("avg_pool2d_backward");
  } else {
    CHORUS_DISPATCH(d, cpu::avg_pool2d_backward(gy, planes, g, inc, div, gx),
                    cuda::avg_pool2d_backward(gy, planes, g, inc, div, gx, d));
  }
}
template <class T>
void adaptive_avg_pool2d(const T* x, std::int64_t planes, const Window2d& g, T* out, Device d) {
  if constexpr (is_reduced_floating_v<T>) {
    detail::no_reduced_kernel<T>("adaptive_avg_pool2d");
  } else {
    CHORUS_DISPATCH(d, cpu::adaptive_avg_pool2d(x, planes, g, out), cuda::adaptive_avg_pool2d(x, planes, g, out, d));
  }
}
template <class T>
void adaptive_avg_pool2d_backward(const T* gy, std::int64_t planes, const Window2d& g, T* gx, Device d) {
  if constexpr (is_reduced_floating_v<T>) {
    detail::no_reduced_kernel<T>("adaptive_avg_pool2d_backward");
  } else {
    CHORUS_DISPATCH(d, cpu::adaptive_avg_pool2d_backward(gy, planes, g, gx),
                    cuda::adaptive_avg_pool2d_backward(gy, planes, g, gx, d));
  }
}
template <class T>
void channel_sums(const T* x, std::int64_t N, std::int64_t C, std::int64_t S, const T* mean, T* out, Device d) {
  if constexpr (is_reduced_floating_v<T>) {
    detail::no_reduced_kernel<T>("channel_sums");
  } else {
    CHORUS_DISPATCH(d, cpu::channel_sums(x, N, C, S, mean, out), cuda::channel_sums(x, N, C, S, mean, out, d));
  }
}
template <class T>
void bn_apply(const T* x, std::int64_t N, std::int64_t C, std::int64_t S, const T* mean, const T* invstd, const T* w,
              const T* b, T* y, Device d) {
  if constexpr (is_reduced_floating_v<T>) {
    detail::no_reduced_kernel<T>("bn_apply");
  } else {
    CHORUS_DISPATCH(d, cpu::bn_apply(x, N, C, S, mean, invstd, w, b, y),
                    cuda::bn_apply(x, N, C, S, mean, invstd, w, b, y, d));
  }
}
/// Per-channel mean and M2 = Σ (x - mean)² of x [N, C, S] in the accumulator A (either may be
/// null); with `fin`, also the finished statistics (Note [batch-norm statistics]).
template <class T, class A>
void bn_stats(const T* x, std::int64_t N, std::int64_t C, std::int64_t S, A* mean, A* m2, const BnFinish<T>* fin,
              Device d) {
  if constexpr (is_reduced_floating_v<T>) {
    detail::no_reduced_kernel<T>("bn_stats");
  } else {
    CHORUS_DISPATCH(d, cpu::bn_stats(x, N, C, S, mean, m2, fin), cuda::bn_stats(x, N, C, S, mean, m2, fin, d));
  }
}
/// Finishes per-channel statistics (mean, M2 over fin.count values) into `fin`.
template <class T, class A>
void bn_finish(const A* mean, const A* m2, std::int64_t C, const BnFinish<T>& fin, Device d) {
  if constexpr (is_reduced_floating_v<T>) {
    detail::no_reduced_kernel<T>("bn_finish");
  } else {
    CHORUS_DISPATCH(d, cpu::bn_finish(mean, m2, C, fin), cuda::bn_finish(mean, m2, C, fin, d));
  }
}
/// SyncBatchNorm between its reductions (see bn_sync_channel).
template <class A>
void bn_sync_stats(const A* local_mean, double local_n, double count, A* mean, A* m2, std::int64_t C, Device d) {
  CHORUS_DISPATCH(d, cpu::bn_sync_stats(local_mean, local_n, count, mean, m2, C),
                  cuda::bn_sync_stats(local_mean, local_n, count, mean, m2, C, d));
}
/// sums [2C] = (Σ dy, Σ dy·(x - mean)) per channel; gw = Σ dy·(x - mean)·invstd and gb = Σ dy
/// when not null.
template <class T, class A>
void bn_backward_reduce(const T* gy, const T* x, std::int64_t N, std::int64_t C, std::int64_t S, const T* mean,
                        const T* invstd, A* sums, T* gw, T* gb, Device d) {
  if constexpr (is_reduced_floating_v<T>) {
    detail::no_reduced_kernel<T>("bn_backward_reduce");
  } else {
    CHORUS_DISPATCH(d, cpu::bn_backward_reduce(gy, x, N, C, S, mean, invstd, sums, gw, gb),
                    cuda::bn_backward_reduce(gy, x, N, C, S, mean, invstd, sums, gw, gb, d));
  }
}
template <class T, class A>
void bn_backward_input(const T* gy, const T* x, std::int64_t N, std::int64_t C, std::int64_t S, const T* mean,
                       const T* invstd, const T* w, const A* sums, double inv_count, T* gx, Device d) {
  if constexpr (is_reduced_floating_v<T>) {
    detail::no_reduced_kernel<T>("bn_backward_input");
  } else {
    CHORUS_DISPATCH(d, cpu::bn_backward_input(gy, x, N, C, S, mean, invstd, w, sums, inv_count, gx),
                    cuda::bn_backward_input(gy, x, N, C, S, mean, invstd, w, sums, inv_count, gx, d));
  }
}

/// out = in · (kept ? scale : 0) over n contiguous elements, the keep decisions drawn from
/// Philox at `layout` (Note [dropout random numbers]): the same on every device.
template <class T>
void dropout_apply(const T* in, T* out, std::int64_t n, const PhiloxLayout& layout, std::uint64_t threshold, T scale,
                   Device d) {
  if constexpr (is_reduced_floating_v<T>) {
    detail::no_reduced_kernel<T>("dropout_apply");
  } else {
    CHORUS_DISPATCH(d, cpu::dropout_apply(in, out, n, layout, threshold, scale),
                    cuda::dropout_apply(in, out, n, layout, threshold, scale, d));
  }
}

}  // namespace backend
CHORUS_NAMESPACE_END

// The instances chorus::compiled holds (Note [compiled chorus] in compiled.hpp).
#define CHORUS_BACKEND_NN_INSTANCES(X, T)                                                                                              \
  X(void backend::im2col<T>(const T*, const Window2d&, T*, Device))                                                                    \
  X(void backend::col2im<T>(const T*, const Window2d&, T*, Device))                                                                    \
  X(void backend::max_pool2d<T>(const T*, std::int64_t, const Window2d&, T*, std::int64_t*, Device))                                   \
  X(void backend::max_pool2d_backward<T>(const T*, const std::int64_t*, std::int64_t, const Window2d&, T*, Device))                    \
  X(void backend::avg_pool2d<T>(const T*, std::int64_t, const Window2d&, bool, std::int64_t, T*, Device))                              \
  X(void backend::avg_pool2d_backward<T>(const T*, std::int64_t, const Window2d&, bool, std::int64_t, T*, Device))                     \
  X(void backend::adaptive_avg_pool2d<T>(const T*, std::int64_t, const Window2d&, T*, Device))                                         \
  X(void backend::adaptive_avg_pool2d_backward<T>(const T*, std::int64_t, const Window2d&, T*, Device))                                \
  X(void backend::channel_sums<T>(const T*, std::int64_t, std::int64_t, std::int64_t, const T*, T*, Device))                           \
  X(void backend::bn_apply<T>(const T*, std::int64_t, std::int64_t, std::int64_t, const T*, const T*, const T*, const T*, T*, Device)) \
  X(void backend::dropout_apply<T>(const T*, T*, std::int64_t, const PhiloxLayout&, std::uint64_t, T, Device))
CHORUS_EXTERN_INSTANCES(CHORUS_BACKEND_NN_INSTANCES, CHORUS_ALL_DTYPES)
