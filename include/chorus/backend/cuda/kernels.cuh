#pragma once
// CUDA kernels (compiled only by nvcc). Every kernel is a template (no external-linkage
// __global__ functions in headers), launched on the calling thread's current stream of the
// device and checked (Note [CHORUS_DEBUG_SYNC] in core/cuda_runtime.hpp).
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "../../core/tensor.hpp"
#include "../functors.hpp"
#include "blas.cuh"
#include "launch.cuh"

CHORUS_NAMESPACE_BEGIN
namespace backend::cuda {

template <class T>
using acc_t = std::conditional_t<std::is_same_v<T, float>, double, T>;

namespace k {  // the kernels

template <class T>
__global__ void fill(T* p, std::int64_t n, T v) {
  CHORUS_GRID_STRIDE(i, n) p[i] = v;
}

template <class T>
__global__ void arange(T* p, std::int64_t n, double start, double step) {
  CHORUS_GRID_STRIDE(i, n) p[i] = static_cast<T>(start + step * static_cast<double>(i));
}

template <class T>
__global__ void copy_strided(const T* src, T* dst, NdDesc d, std::int64_t n) {
  CHORUS_GRID_STRIDE(i, n) {
    std::int64_t off[3];
    nd_offsets(d, i, off);
    dst[off[1]] = src[off[0]];
  }
}

template <class U, class T>
__global__ void convert(const T* src, U* dst, std::int64_t n) {
  CHORUS_GRID_STRIDE(i, n) dst[i] = static_cast<U>(src[i]);
}

template <class T, class Op>
__global__ void unary(const T* in, T* out, std::int64_t n, Op op) {
  CHORUS_GRID_STRIDE(i, n) out[i] = op(in[i]);
}

template <class T, class Op>
__global__ void binary_same(const T* a, const T* b, T* out, std::int64_t n, Op op) {
  CHORUS_GRID_STRIDE(i, n) out[i] = op(a[i], b[i]);
}

template <class T, class Op>
__global__ void binary_broadcast(const T* a, const T* b, T* out, NdDesc d, std::int64_t n, Op op) {
  CHORUS_GRID_STRIDE(i, n) {
    std::int64_t off[3];
    nd_offsets(d, i, off);
    out[i] = op(a[off[0]], b[off[1]]);
  }
}

template <class T>
__global__ void reduce_add_broadcast(const T* src, T* dst, NdDesc d, std::int64_t n) {
  CHORUS_GRID_STRIDE(i, n) {
    std::int64_t off[3];
    nd_offsets(d, i, off);
    atomicAdd(dst + off[1], src[i]);
  }
}

/// Stage 1 of a full reduction: each block sums f(i) over its grid-stride share.
template <class T, class F>
__global__ void partial_sums(F f, std::int64_t n, acc_t<T>* partial) {
  acc_t<T> s = 0;
  CHORUS_GRID_STRIDE(i, n) s += static_cast<acc_t<T>>(f(i));
  s = block_sum(s);
  if (threadIdx.x == 0) partial[blockIdx.x] = s;
}

/// Stage 2: one block sums the partials into out[0] (scaled).
template <class T>
__global__ void finish_sum(const acc_t<T>* partial, int count, T* out, double scale) {
  acc_t<T> s = 0;
  for (int i = threadIdx.x; i < count; i += blockDim.x) s += partial[i];
  s = block_sum(s);
  if (threadIdx.x == 0) out[0] = static_cast<T>(s * scale);
}

/// out[o] = scale * sum_i in[o, i] (rows, inner == 1): one block per row.
template <class T>
__global__ void row_sums(const T* in, std::int64_t outer, std::int64_t n, T* out, double scale) {
  for (std::int64_t o = blockIdx.x; o < outer; o += gridDim.x) {
    acc_t<T> s = 0;
    for (std::int64_t i = threadIdx.x; i < n; i += blockDim.x) s += in[o * n + i];
    s = block_sum(s);
    if (threadIdx.x == 0) out[o] = static_cast<T>(s * scale);
  }
}

/// out[o, j] = scale * sum_i in[o, i, j] (inner > 1): one thread per output, coalesced over j.
template <class T>
__global__ void strided_sums(const T* in, std::int64_t outer, std::int64_t n, std::int64_t inner, T* out,
                             double scale) {
  CHORUS_GRID_STRIDE(t, outer * inner) {
    const std::int64_t o = t / inner, j = t % inner;
    acc_t<T> s = 0;
    for (std::int64_t i = 0; i < n; ++i) s += in[(o * n + i) * inner + j];
    out[t] = static_cast<T>(s * scale);
  }
}

template <class T>
__global__ void expand_dim(const T* in, std::int64_t outer, std::int64_t n, std::int64_t inner, T* out,
                           double scale) {
  CHORUS_GRID_STRIDE(t, outer * n * inner) {
    const std::int64_t j = t % inner, o = t / (n * inner);
    out[t] = static_cast<T>(in[o * inner + j] * scale);
  }
}

/// Max and sum of exp(x - max) over a row of n elements `stride` apart (block-wide).
template <class T>
__device__ inline void row_max_sumexp(const T* x, std::int64_t n, std::int64_t stride, T& mx, acc_t<T>& s) {
  mx = -INFINITY;
  for (std::int64_t i = threadIdx.x; i < n; i += blockDim.x) mx = max(mx, x[i * stride]);
  mx = block_max(mx);
  s = 0;
  for (std::int64_t i = threadIdx.x; i < n; i += blockDim.x) s += exp(x[i * stride] - mx);
  s = block_sum(s);
}

/// Softmax / log-softmax along the middle axis of [outer, n, inner]: one block per row.
template <class T>
__global__ void softmax(const T* in, std::int64_t outer, std::int64_t n, std::int64_t inner, T* out, bool log_space) {
  for (std::int64_t r = blockIdx.x; r < outer * inner; r += gridDim.x) {
    const std::int64_t base = (r / inner) * n * inner + r % inner;
    T mx;
    acc_t<T> s;
    row_max_sumexp(in + base, n, inner, mx, s);
    const T lse = mx + static_cast<T>(log(s));
    for (std::int64_t i = threadIdx.x; i < n; i += blockDim.x) {
      const T x = in[base + i * inner];
      out[base + i * inner] = log_space ? x - lse : static_cast<T>(exp(x - mx) / s);
    }
  }
}

template <class T>
__global__ void softmax_backward(const T* g, const T* y, std::int64_t outer, std::int64_t n, std::int64_t inner, T* gx,
                                 bool log_space) {
  for (std::int64_t r = blockIdx.x; r < outer * inner; r += gridDim.x) {
    const std::int64_t base = (r / inner) * n * inner + r % inner;
    acc_t<T> s = 0;
    for (std::int64_t i = threadIdx.x; i < n; i += blockDim.x)
      s += log_space ? g[base + i * inner] : g[base + i * inner] * y[base + i * inner];
    s = block_sum(s);
    for (std::int64_t i = threadIdx.x; i < n; i += blockDim.x) {
      const std::int64_t p = base + i * inner;
      gx[p] = log_space ? g[p] - exp(y[p]) * static_cast<T>(s) : y[p] * (g[p] - static_cast<T>(s));
    }
  }
}

template <class T>
__global__ void index_select(const T* in, std::int64_t outer, std::int64_t n, std::int64_t inner,
                             const std::int64_t* idx, std::int64_t k, T* out) {
  CHORUS_GRID_STRIDE(t, outer * k * inner) {
    const std::int64_t j = t % inner, r = (t / inner) % k, o = t / (inner * k);
    out[t] = in[(o * n + idx[r]) * inner + j];
  }
}

template <class T>
__global__ void index_add(const T* in, std::int64_t outer, std::int64_t n, std::int64_t inner,
                          const std::int64_t* idx, std::int64_t k, T* out) {
  CHORUS_GRID_STRIDE(t, outer * k * inner) {
    const std::int64_t j = t % inner, r = (t / inner) % k, o = t / (inner * k);
    atomicAdd(out + (o * n + idx[r]) * inner + j, in[t]);
  }
}

template <class T>
__global__ void broadcast_rows(const T* bias, std::int64_t rows, std::int64_t cols, T* out) {
  CHORUS_GRID_STRIDE(t, rows * cols) out[t] = bias[t % cols];
}

template <class T>
__global__ void squared_error_backward(const T* a, const T* b, std::int64_t n, T scale, const T* g, bool per_elem,
                                       T* ga, T* gb) {
  CHORUS_GRID_STRIDE(i, n) {
    const T s = scale * (per_elem ? g[i] : g[0]);
    const T v = s * (a[i] - b[i]);
    if (ga) ga[i] = v;
    if (gb) gb[i] = -v;
  }
}

/// Per-row cross entropy (targets already validated on the host): one block per row.
template <class T>
__global__ void cross_entropy_forward(const T* logits, std::int64_t N, std::int64_t C, const std::int64_t* target,
                                      std::int64_t ignore, T* loss) {
  for (std::int64_t r = blockIdx.x; r < N; r += gridDim.x) {
    const std::int64_t t = target[r];
    if (t == ignore) {
      if (threadIdx.x == 0) loss[r] = 0;
      continue;
    }
    const T* x = logits + r * C;
    T mx;
    acc_t<T> s;
    row_max_sumexp(x, C, 1, mx, s);
    if (threadIdx.x == 0) loss[r] = static_cast<T>(mx + log(s) - x[t]);
  }
}

template <class T>
__global__ void cross_entropy_backward(const T* logits, std::int64_t N, std::int64_t C, const std::int64_t* target,
                                       std::int64_t ignore, const T* g, std::int64_t g_stride, T* grad) {
  for (std::int64_t r = blockIdx.x; r < N; r += gridDim.x) {
    const std::int64_t t = target[r];
    T* gr = grad + r * C;
    if (t == ignore) {
      for (std::int64_t c = threadIdx.x; c < C; c += blockDim.x) gr[c] = 0;
      continue;
    }
    const T* x = logits + r * C;
    T mx;
    acc_t<T> s;
    row_max_sumexp(x, C, 1, mx, s);
    const T gv = g[r * g_stride];
    for (std::int64_t c = threadIdx.x; c < C; c += blockDim.x)
      gr[c] = gv * (static_cast<T>(exp(x[c] - mx) / s) - (c == t ? T(1) : T(0)));
  }
}

template <class T>
__global__ void nll_forward(const T* logp, std::int64_t N, std::int64_t C, const std::int64_t* target,
                            std::int64_t ignore, T* loss) {
  CHORUS_GRID_STRIDE(r, N) loss[r] = target[r] == ignore ? T(0) : -logp[r * C + target[r]];
}

template <class T>
__global__ void nll_backward(std::int64_t N, std::int64_t C, const std::int64_t* target, std::int64_t ignore,
                             const T* g, std::int64_t g_stride, T* grad) {
  CHORUS_GRID_STRIDE(t, N * C) {
    const std::int64_t r = t / C, c = t % C;
    grad[t] = (target[r] != ignore && target[r] == c) ? -g[r * g_stride] : T(0);
  }
}

template <class T>
__global__ void sgd_step(T* p, const T* g, T* buf, std::int64_t n, T lr, T mom, T damp, T wd, bool nesterov, bool first,
                         bool maximize) {
  CHORUS_GRID_STRIDE(i, n) {
    T d = maximize ? -g[i] : g[i];
    if (wd != T(0)) d += wd * p[i];
    if (buf) {
      const T b = first ? d : mom * buf[i] + damp * d;
      buf[i] = b;
      d = nesterov ? d + mom * b : b;
    }
    p[i] -= lr * d;
  }
}

template <class T>
__global__ void adam_step(T* p, const T* g, T* m, T* v, T* vmax, std::int64_t n, T step_size, T bc2_sqrt, T b1, T b2,
                          T eps, T wd, T decay, bool decoupled, bool maximize) {
  CHORUS_GRID_STRIDE(i, n) {
    T gi = maximize ? -g[i] : g[i];
    if (decoupled) {
      p[i] *= decay;
    } else if (wd != T(0)) {
      gi += wd * p[i];
    }
    m[i] = b1 * m[i] + (T(1) - b1) * gi;
    v[i] = b2 * v[i] + (T(1) - b2) * gi * gi;
    T vhat = v[i];
    if (vmax) {
      vmax[i] = max(vmax[i], v[i]);
      vhat = vmax[i];
    }
    p[i] -= step_size * m[i] / (sqrt(vhat) / bc2_sqrt + eps);
  }
}

template <class T>
struct SquaredDiff {
  const T* a;
  const T* b;
  __device__ T operator()(std::int64_t i) const {
    const T d = a[i] - b[i];
    return d * d;
  }
};
template <class T>
struct Identity {
  const T* a;
  __device__ T operator()(std::int64_t i) const { return a[i]; }
};

}  // namespace k

// Launches `kernel` (parenthesised when it has template arguments) over n elements.
#define CHORUS_LAUNCH(kernel, n, ...)                                         \
  do {                                                                        \
    if ((n) > 0) {                                                            \
      auto* chorus_kernel_ = kernel;                                          \
      chorus_kernel_<<<blocks_for(n), kThreads, 0, launch.stream>>>(__VA_ARGS__); \
      ::chorus::cuda::check_launch(#kernel);                                  \
    }                                                                         \
  } while (0)

template <class T>
void fill(T* p, std::int64_t n, T v, Device d) {
  Launch launch(d);
  CHORUS_LAUNCH(k::fill<T>, n, p, n, v);
}

template <class T>
void arange(T* p, std::int64_t n, double start, double step, Device d) {
  Launch launch(d);
  CHORUS_LAUNCH(k::arange<T>, n, p, n, start, step);
}

template <class T>
void copy_strided(const T* src, const Strides& ss, T* dst, const Strides& ds, const Shape& shape, Device d) {
  Launch launch(d);
  const auto n = numel_of(shape);
  CHORUS_LAUNCH(k::copy_strided<T>, n, src, dst, make_desc(shape, ss, ds), n);
}

template <class T, class U>
void convert(const T* src, U* dst, std::int64_t n, Device d) {
  Launch launch(d);
  CHORUS_LAUNCH((k::convert<U, T>), n, src, dst, n);
}

template <class T, class Op>
void unary(const T* in, T* out, std::int64_t n, Op op, Device d) {
  Launch launch(d);
  CHORUS_LAUNCH((k::unary<T, Op>), n, in, out, n, op);
}

template <class T, class Op>
void binary_same(const T* a, const T* b, T* out, std::int64_t n, Op op, Device d) {
  Launch launch(d);
  CHORUS_LAUNCH((k::binary_same<T, Op>), n, a, b, out, n, op);
}

template <class T, class Op>
void binary_broadcast(const T* a, const Strides& as, const T* b, const Strides& bs, T* out, const Shape& shape, Op op,
                      Device d) {
  Launch launch(d);
  const auto n = numel_of(shape);
  CHORUS_LAUNCH((k::binary_broadcast<T, Op>), n, a, b, out, make_desc(shape, as, bs), n, op);
}

template <class T>
void reduce_add_broadcast(const T* src, const Shape& shape, T* dst, const Strides& dst_strides, Device d) {
  Launch launch(d);
  const auto n = numel_of(shape);
  CHORUS_LAUNCH(k::reduce_add_broadcast<T>, n, src, dst, make_desc(shape, contiguous_strides(shape), dst_strides), n);
}

/// out[0] = scale * sum over i < n of f(i), in two stages.
template <class T, class F>
void reduce_all(F f, std::int64_t n, T* out, double scale, Device d) {
  Launch launch(d);
  const int blocks = static_cast<int>(std::min<std::int64_t>((n + kThreads - 1) / kThreads, 1024));
  auto partial = Tensor<acc_t<T>>::empty(Shape{std::max(blocks, 1)}, d);
  if (n > 0) {
    k::partial_sums<T><<<blocks, kThreads, 0, launch.stream>>>(f, n, partial.data());
    ::chorus::cuda::check_launch("partial_sums");
  }
  k::finish_sum<T><<<1, kThreads, 0, launch.stream>>>(partial.data(), n > 0 ? blocks : 0, out, scale);
  ::chorus::cuda::check_launch("finish_sum");
}

template <class T>
void sum_dim(const T* in, std::int64_t outer, std::int64_t n, std::int64_t inner, T* out, double scale, Device d) {
  if (outer == 1 && inner == 1) return reduce_all<T>(k::Identity<T>{in}, n, out, scale, d);
  Launch launch(d);
  if (inner == 1) {
    const unsigned blocks = static_cast<unsigned>(std::min<std::int64_t>(outer, 65535));
    k::row_sums<T><<<blocks, kThreads, 0, launch.stream>>>(in, outer, n, out, scale);
    ::chorus::cuda::check_launch("row_sums");
  } else {
    CHORUS_LAUNCH(k::strided_sums<T>, outer * inner, in, outer, n, inner, out, scale);
  }
}

template <class T>
void expand_dim(const T* in, std::int64_t outer, std::int64_t n, std::int64_t inner, T* out, double scale, Device d) {
  Launch launch(d);
  CHORUS_LAUNCH(k::expand_dim<T>, outer * n * inner, in, outer, n, inner, out, scale);
}

template <class T>
void softmax(const T* in, std::int64_t outer, std::int64_t n, std::int64_t inner, T* out, bool log_space, Device d) {
  Launch launch(d);
  const std::int64_t rows = outer * inner;
  if (rows == 0 || n == 0) return;
  k::softmax<T><<<static_cast<unsigned>(std::min<std::int64_t>(rows, 65535)), kThreads, 0, launch.stream>>>(
      in, outer, n, inner, out, log_space);
  ::chorus::cuda::check_launch("softmax");
}

template <class T>
void softmax_backward(const T* g, const T* y, std::int64_t outer, std::int64_t n, std::int64_t inner, T* gx,
                      bool log_space, Device d) {
  Launch launch(d);
  const std::int64_t rows = outer * inner;
  if (rows == 0 || n == 0) return;
  k::softmax_backward<T><<<static_cast<unsigned>(std::min<std::int64_t>(rows, 65535)), kThreads, 0, launch.stream>>>(
      g, y, outer, n, inner, gx, log_space);
  ::chorus::cuda::check_launch("softmax_backward");
}

template <class T>
void index_select(const T* in, std::int64_t outer, std::int64_t n, std::int64_t inner, const std::int64_t* idx,
                  std::int64_t kk, T* out, Device d) {
  Launch launch(d);
  CHORUS_LAUNCH(k::index_select<T>, outer * kk * inner, in, outer, n, inner, idx, kk, out);
}

template <class T>
void index_add(const T* in, std::int64_t outer, std::int64_t n, std::int64_t inner, const std::int64_t* idx,
               std::int64_t kk, T* out, Device d) {
  Launch launch(d);
  CHORUS_LAUNCH(k::index_add<T>, outer * kk * inner, in, outer, n, inner, idx, kk, out);
}

template <class T>
void broadcast_rows(const T* bias, std::int64_t rows, std::int64_t cols, T* out, Device d) {
  Launch launch(d);
  CHORUS_LAUNCH(k::broadcast_rows<T>, rows * cols, bias, rows, cols, out);
}

template <class T>
void squared_error_sum(const T* a, const T* b, std::int64_t n, T* out, double scale, Device d) {
  reduce_all<T>(k::SquaredDiff<T>{a, b}, n, out, scale, d);
}

template <class T>
void squared_error_backward(const T* a, const T* b, std::int64_t n, T scale, const T* g, bool per_elem, T* ga, T* gb,
                            Device d) {
  Launch launch(d);
  CHORUS_LAUNCH(k::squared_error_backward<T>, n, a, b, n, scale, g, per_elem, ga, gb);
}

/// Per-row cross entropy; the targets were validated on the host by the caller.
template <class T>
void cross_entropy_forward(const T* logits, std::int64_t N, std::int64_t C, const std::int64_t* target,
                           std::int64_t ignore, T* loss, Device d) {
  Launch launch(d);
  if (N == 0) return;
  k::cross_entropy_forward<T><<<static_cast<unsigned>(std::min<std::int64_t>(N, 65535)), kThreads, 0, launch.stream>>>(
      logits, N, C, target, ignore, loss);
  ::chorus::cuda::check_launch("cross_entropy_forward");
}

template <class T>
void cross_entropy_backward(const T* logits, std::int64_t N, std::int64_t C, const std::int64_t* target,
                            std::int64_t ignore, const T* g, std::int64_t g_stride, T* grad, Device d) {
  Launch launch(d);
  if (N == 0) return;
  k::cross_entropy_backward<T><<<static_cast<unsigned>(std::min<std::int64_t>(N, 65535)), kThreads, 0,
                                 launch.stream>>>(logits, N, C, target, ignore, g, g_stride, grad);
  ::chorus::cuda::check_launch("cross_entropy_backward");
}

template <class T>
void nll_forward(const T* logp, std::int64_t N, std::int64_t C, const std::int64_t* target, std::int64_t ignore,
                 T* loss, Device d) {
  Launch launch(d);
  CHORUS_LAUNCH(k::nll_forward<T>, N, logp, N, C, target, ignore, loss);
}

template <class T>
void nll_backward(std::int64_t N, std::int64_t C, const std::int64_t* target, std::int64_t ignore, const T* g,
                  std::int64_t g_stride, T* grad, Device d) {
  Launch launch(d);
  CHORUS_LAUNCH(k::nll_backward<T>, N * C, N, C, target, ignore, g, g_stride, grad);
}

template <class T>
void sgd_step(T* p, const T* g, T* buf, std::int64_t n, double lr, double momentum, double dampening, double wd,
              bool nesterov, bool first, bool maximize, Device d) {
  Launch launch(d);
  CHORUS_LAUNCH(k::sgd_step<T>, n, p, g, momentum != 0 ? buf : nullptr, n, T(lr), T(momentum), T(1.0 - dampening),
                T(wd), nesterov, first, maximize);
}

template <class T>
void adam_step(T* p, const T* g, T* m, T* v, T* vmax, std::int64_t n, double lr, double b1, double b2, double eps,
               double wd, bool decoupled, std::int64_t step, bool maximize, Device d) {
  const double bc1 = 1.0 - std::pow(b1, static_cast<double>(step));
  const double bc2 = 1.0 - std::pow(b2, static_cast<double>(step));
  Launch launch(d);
  CHORUS_LAUNCH(k::adam_step<T>, n, p, g, m, v, vmax, n, T(lr / bc1), T(std::sqrt(bc2)), T(b1), T(b2), T(eps), T(wd),
                T(1.0 - lr * wd), decoupled, maximize);
}

#undef CHORUS_LAUNCH

}  // namespace backend::cuda
CHORUS_NAMESPACE_END
