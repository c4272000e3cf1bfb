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

// Note [GPU paths not yet tuned]
// Correct, but slower than they could be, and not yet measured on a GPU (the benchmarks name
// the workloads that matter first):
//  - conv2d's bias gradient and the 16-bit index_add and broadcast-reduce backward widen the
//    whole gradient into a float copy before summing (one extra pass over memory each);
//  - max/min/argmax, cumsum and softmax along a wide inner axis run one thread per column,
//    where a block per row with a tree reduction would use the device;
//  - topk makes k passes over its row (a radix select would make one);
//  - randn/rand/randint of a GPU tensor draw on the host (the generator's engine) and copy
//    from pageable memory: their numbers equal the CPU's, a Philox kernel would not.

/// Sums of float and of the 16-bit types accumulate in double (as on the CPU: a 16-bit sum is
/// then rounded once, and equals the CPU's bit for bit where the order does not matter).
template <class T>
using acc_t = std::conditional_t<std::is_same_v<T, float> || is_reduced_floating_v<T>, double, T>;

namespace k {
/// The column sums' block shape (sum_dim's launcher sizes its grid with them).
inline constexpr int kColTile = 32, kColLanes = 8;
}  // namespace k

/// Whether a contiguous elementwise kernel over these element types moves pairs (Note
/// [vectorised 16-bit loads]): when one of them is a 16-bit type.
template <class... P>
inline constexpr bool kPaired = (is_reduced_floating_v<P> || ...);

#if defined(__CUDACC__)  // device code (Note [precompiled CUDA kernels])
/// An element in the functors' arithmetic type (float for the 16-bit types, as the CPU kernels'
/// loads: Note [16-bit kernels]); the result is rounded once when stored.
template <class T>
__device__ inline fn::opmath_t<T> opload(T v) {
  return static_cast<fn::opmath_t<T>>(v);
}

// Note [vectorised 16-bit loads]
// A warp reading consecutive bfloat16/half values one per thread issues 2-byte loads and
// stores: every memory instruction moves half of what a 32-bit one would, and the contiguous
// elementwise kernels of the 16-bit types (bandwidth-bound) pay for it. unary, binary_same and
// the conversions to and from 16 bits therefore let each thread move two neighbouring values as
// one 32-bit word (and two floats as one 64-bit word), as PyTorch's vectorised elementwise loop
// does, when every pointer is aligned to its pair (a view starting at an odd element runs the
// scalar loop); the first thread does an odd last element. Each value is computed as in the
// scalar loop and rounded once, so the results are the same bits; the launchers size the grid
// by pairs.

/// Two neighbouring values, loaded and stored as one word.
template <class T>
struct alignas(2 * sizeof(T)) Two {
  T v[2];
};
/// Every pointer aligned to a pair of its type (the same answer in every thread).
template <class... P>
__device__ inline bool pair_aligned(const P*... p) {
  return ((reinterpret_cast<std::uintptr_t>(p) % alignof(Two<P>) == 0) && ...);
}
__device__ inline bool first_thread() { return blockIdx.x == 0 && threadIdx.x == 0; }

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
  if constexpr (is_reduced_floating_v<T> || is_reduced_floating_v<U>) {
    // Through double or float so that each value rounds once (fn::convert_16bit).
    auto one = [](T v) { return fn::convert_16bit<U>(v); };
    if (pair_aligned(src, dst)) {  // Note [vectorised 16-bit loads]
      CHORUS_GRID_STRIDE(i, n / 2) {
        const Two<T> x = reinterpret_cast<const Two<T>*>(src)[i];
        reinterpret_cast<Two<U>*>(dst)[i] = Two<U>{{one(x.v[0]), one(x.v[1])}};
      }
      if ((n & 1) && first_thread()) dst[n - 1] = one(src[n - 1]);
    } else {
      CHORUS_GRID_STRIDE(i, n) dst[i] = one(src[i]);
    }
  } else {
    CHORUS_GRID_STRIDE(i, n) dst[i] = static_cast<U>(src[i]);
  }
}

template <class T, class Op>
__global__ void unary(const T* in, T* out, std::int64_t n, Op op) {
  if constexpr (kPaired<T>) {
    if (pair_aligned(in, out)) {  // Note [vectorised 16-bit loads]
      CHORUS_GRID_STRIDE(i, n / 2) {
        const Two<T> x = reinterpret_cast<const Two<T>*>(in)[i];
        reinterpret_cast<Two<T>*>(out)[i] =
            Two<T>{{static_cast<T>(op(opload(x.v[0]))), static_cast<T>(op(opload(x.v[1])))}};
      }
      if ((n & 1) && first_thread()) out[n - 1] = static_cast<T>(op(opload(in[n - 1])));
      return;
    }
  }
  CHORUS_GRID_STRIDE(i, n) out[i] = static_cast<T>(op(opload(in[i])));
}

template <class T, class Op>
__global__ void binary_same(const T* a, const T* b, T* out, std::int64_t n, Op op) {
  if constexpr (kPaired<T>) {
    if (pair_aligned(a, b, out)) {  // Note [vectorised 16-bit loads]
      CHORUS_GRID_STRIDE(i, n / 2) {
        const Two<T> x = reinterpret_cast<const Two<T>*>(a)[i], y = reinterpret_cast<const Two<T>*>(b)[i];
        reinterpret_cast<Two<T>*>(out)[i] = Two<T>{{static_cast<T>(op(opload(x.v[0]), opload(y.v[0]))),
                                                    static_cast<T>(op(opload(x.v[1]), opload(y.v[1])))}};
      }
      if ((n & 1) && first_thread()) out[n - 1] = static_cast<T>(op(opload(a[n - 1]), opload(b[n - 1])));
      return;
    }
  }
  CHORUS_GRID_STRIDE(i, n) out[i] = static_cast<T>(op(opload(a[i]), opload(b[i])));
}

template <class T, class Op>
__global__ void binary_broadcast(const T* a, const T* b, T* out, NdDesc d, std::int64_t n, Op op) {
  CHORUS_GRID_STRIDE(i, n) {
    std::int64_t off[3];
    nd_offsets(d, i, off);
    out[i] = static_cast<T>(op(opload(a[off[0]]), opload(b[off[1]])));
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

/// out[o] = scale * sum_i in[o, i] (rows, inner == 1): one block per row. `In` is T, or the
/// accumulator type when summing the partial sums of row_partial_sums.
template <class T, class In = T>
__global__ void row_sums(const In* in, std::int64_t outer, std::int64_t n, T* out, double scale) {
  for (std::int64_t o = blockIdx.x; o < outer; o += gridDim.x) {
    acc_t<T> s = 0;
    for (std::int64_t i = threadIdx.x; i < n; i += blockDim.x) s += in[o * n + i];
    s = block_sum(s);
    if (threadIdx.x == 0) out[o] = static_cast<T>(s * scale);
  }
}

/// Few long rows: block (x = s, y = o) sums chunk s of row o into partial[o * splits + s], so
/// that many blocks share a row instead of one block walking it alone (Note [2-D reductions]).
template <class T>
__global__ void row_partial_sums(const T* in, std::int64_t n, std::int64_t chunk, acc_t<T>* partial) {
  const std::int64_t o = blockIdx.y, i0 = blockIdx.x * chunk, i1 = min(n, i0 + chunk);
  acc_t<T> s = 0;
  for (std::int64_t i = i0 + threadIdx.x; i < i1; i += blockDim.x) s += in[o * n + i];
  s = block_sum(s);
  if (threadIdx.x == 0) partial[o * gridDim.x + blockIdx.x] = s;
}

// Note [2-D reductions]
// Column sums of [outer, n, inner] (the bias gradient is the column sums of [rows, features])
// used to run one thread per column walking all n rows: [8192, 4096] gave 16 blocks on a
// 132-SM GPU. Now a block is 32 columns x 8 row lanes (coalesced over columns), and the rows
// are split over gridDim.y blocks whose partial sums a second kernel adds in a fixed order
// (deterministic, unlike atomics): kColTile x kColLanes threads.

/// Block (x: a tile of 32 columns of one o, y: a chunk of rows) sums its share; writes
/// partial[y][o * inner + j], or the scaled result into out when there is one chunk.
template <class T>
__global__ void column_sums(const T* in, std::int64_t outer, std::int64_t n, std::int64_t inner, std::int64_t tiles,
                            std::int64_t chunk, acc_t<T>* partial, T* out, double scale) {
  __shared__ acc_t<T> buf[kColLanes][kColTile + 1];
  const std::int64_t i0 = blockIdx.y * chunk, i1 = min(n, i0 + chunk);
  for (std::int64_t tb = blockIdx.x; tb < outer * tiles; tb += gridDim.x) {
    const std::int64_t o = tb / tiles, j = (tb % tiles) * kColTile + threadIdx.x;
    acc_t<T> s = 0;
    if (j < inner)
      for (std::int64_t i = i0 + threadIdx.y; i < i1; i += kColLanes) s += in[(o * n + i) * inner + j];
    buf[threadIdx.y][threadIdx.x] = s;
    __syncthreads();
    if (threadIdx.y == 0 && j < inner) {
      acc_t<T> t = 0;
      for (int y = 0; y < kColLanes; ++y) t += buf[y][threadIdx.x];
      if (partial) {
        partial[blockIdx.y * outer * inner + o * inner + j] = t;
      } else {
        out[o * inner + j] = static_cast<T>(t * scale);
      }
    }
    __syncthreads();
  }
}

template <class T>
__global__ void finish_column_sums(const acc_t<T>* partial, std::int64_t chunks, std::int64_t m, T* out,
                                   double scale) {
  CHORUS_GRID_STRIDE(t, m) {
    acc_t<T> s = 0;
    for (std::int64_t c = 0; c < chunks; ++c) s += partial[c * m + t];
    out[t] = static_cast<T>(s * scale);
  }
}

template <class T>
__global__ void expand_dim(const T* in, std::int64_t outer, std::int64_t n, std::int64_t inner, T* out,
                           double scale) {
  CHORUS_GRID_STRIDE(t, outer * n * inner) {
    const std::int64_t j = t % inner, o = t / (n * inner);
    out[t] = static_cast<T>(static_cast<acc_t<T>>(in[o * inner + j]) * scale);
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
/// `zero_dead`: a row of -inf gives zeros (cpu::softmax).
template <class T>
__global__ void softmax(const T* in, std::int64_t outer, std::int64_t n, std::int64_t inner, T* out, bool log_space,
                        bool zero_dead) {
  for (std::int64_t r = blockIdx.x; r < outer * inner; r += gridDim.x) {
    const std::int64_t base = (r / inner) * n * inner + r % inner;
    T mx;
    acc_t<T> s;
    row_max_sumexp(in + base, n, inner, mx, s);
    const bool dead = zero_dead && mx == -INFINITY;  // the same for every thread of the block
    const T lse = mx + static_cast<T>(log(s));
    for (std::int64_t i = threadIdx.x; i < n; i += blockDim.x) {
      const T x = in[base + i * inner];
      out[base + i * inner] = dead ? T(0) : log_space ? x - lse : static_cast<T>(exp(x - mx) / s);
    }
  }
}

/// Softmax along the middle axis when inner is wide: one thread per (o, j) column, coalesced
/// over j (a block per row would read elements `inner` apart).
template <class T>
__global__ void softmax_columns(const T* in, std::int64_t outer, std::int64_t n, std::int64_t inner, T* out,
                                bool log_space, bool zero_dead) {
  CHORUS_GRID_STRIDE(c, outer * inner) {
    const std::int64_t base = (c / inner) * n * inner + c % inner;
    T mx = -INFINITY;
    for (std::int64_t i = 0; i < n; ++i) mx = max(mx, in[base + i * inner]);
    if (zero_dead && mx == -INFINITY) {
      for (std::int64_t i = 0; i < n; ++i) out[base + i * inner] = T(0);
      continue;
    }
    acc_t<T> s = 0;
    for (std::int64_t i = 0; i < n; ++i) s += exp(in[base + i * inner] - mx);
    const T lse = mx + static_cast<T>(log(s));
    for (std::int64_t i = 0; i < n; ++i) {
      const T x = in[base + i * inner];
      out[base + i * inner] = log_space ? x - lse : static_cast<T>(exp(x - mx) / s);
    }
  }
}

template <class T>
__global__ void softmax_backward_columns(const T* g, const T* y, std::int64_t outer, std::int64_t n,
                                         std::int64_t inner, T* gx, bool log_space) {
  CHORUS_GRID_STRIDE(c, outer * inner) {
    const std::int64_t base = (c / inner) * n * inner + c % inner;
    acc_t<T> s = 0;
    for (std::int64_t i = 0; i < n; ++i) {
      const std::int64_t p = base + i * inner;
      s += log_space ? g[p] : g[p] * y[p];
    }
    for (std::int64_t i = 0; i < n; ++i) {
      const std::int64_t p = base + i * inner;
      gx[p] = log_space ? g[p] - exp(y[p]) * static_cast<T>(s) : y[p] * (g[p] - static_cast<T>(s));
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

/// Reports bad input found by a kernel (Note [device-side validation] in core/device_assert.hpp):
/// the first claimant of the guard fills the record; others only skip their access.
__device__ inline void device_assert(::chorus::detail::DeviceAssertSink sink, int code, std::int64_t value,
                                     std::int64_t index, std::int64_t bound, int extra = 0) {
  if (atomicCAS(sink.guard, 0, 1) != 0) return;
  volatile ::chorus::detail::DeviceAssert* r = sink.record;
  r->extra = extra;
  r->value = value;
  r->index = index;
  r->bound = bound;
  __threadfence_system();
  r->code = code;
}

template <class T>
__global__ void index_select(const T* in, std::int64_t outer, std::int64_t n, std::int64_t inner,
                             const std::int64_t* idx, std::int64_t k, T* out, ::chorus::detail::DeviceAssertSink sink,
                             int dim) {
  CHORUS_GRID_STRIDE(t, outer * k * inner) {
    const std::int64_t j = t % inner, r = (t / inner) % k, o = t / (inner * k);
    const std::int64_t v = idx[r];
    if (v < 0 || v >= n) [[unlikely]] {
      device_assert(sink, ::chorus::detail::kAssertIndexSelect, v, r, n, dim);
      out[t] = T(0);
      continue;
    }
    out[t] = in[(o * n + v) * inner + j];
  }
}

/// The backward of index_select; a bad index was reported by the forward, here it is skipped.
template <class T>
__global__ void index_add(const T* in, std::int64_t outer, std::int64_t n, std::int64_t inner,
                          const std::int64_t* idx, std::int64_t k, T* out) {
  CHORUS_GRID_STRIDE(t, outer * k * inner) {
    const std::int64_t j = t % inner, r = (t / inner) % k, o = t / (inner * k);
    const std::int64_t v = idx[r];
    if (v < 0 || v >= n) [[unlikely]] continue;
    atomicAdd(out + (o * n + v) * inner + j, in[t]);
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

/// Per-row cross entropy, one block per row; a target out of range is reported (Note
/// [device-side validation]) and its row's loss is NaN.
template <class T>
__global__ void cross_entropy_forward(const T* logits, std::int64_t N, std::int64_t C, const std::int64_t* target,
                                      std::int64_t ignore, T* loss, ::chorus::detail::DeviceAssertSink sink) {
  for (std::int64_t r = blockIdx.x; r < N; r += gridDim.x) {
    const std::int64_t t = target[r];
    if (t == ignore) {
      if (threadIdx.x == 0) loss[r] = 0;
      continue;
    }
    if (t < 0 || t >= C) [[unlikely]] {
      if (threadIdx.x == 0) {
        device_assert(sink, ::chorus::detail::kAssertCrossEntropyTarget, t, r, C);
        loss[r] = NAN;
      }
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
    if (t == ignore || t < 0 || t >= C) {  // out of range: reported by the forward
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
                            std::int64_t ignore, T* loss, ::chorus::detail::DeviceAssertSink sink) {
  CHORUS_GRID_STRIDE(r, N) {
    const std::int64_t t = target[r];
    if (t == ignore) {
      loss[r] = T(0);
    } else if (t < 0 || t >= C) [[unlikely]] {
      device_assert(sink, ::chorus::detail::kAssertNllTarget, t, r, C);
      loss[r] = NAN;
    } else {
      loss[r] = -logp[r * C + t];
    }
  }
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
      vmax[i] = fn::Maximum{}(vmax[i], v[i]);  // keeps a NaN, as PyTorch (and the CPU path) do
      vhat = vmax[i];
    }
    p[i] -= step_size * m[i] / (sqrt(vhat) / bc2_sqrt + eps);
  }
}

}  // namespace k
#endif  // __CUDACC__

namespace k {
// The functors of the reductions (reduce_all), named by the launchers: outside the device
// code above, which a C++ translation unit does not see.
/// Counts the targets that take part (not ignore_index), as T, for the mean reduction.
struct NotIgnored {
  const std::int64_t* target;
  std::int64_t ignore;
  __device__ double operator()(std::int64_t i) const { return target[i] != ignore ? 1.0 : 0.0; }
};

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
  CHORUS_LAUNCH((k::convert<U, T>), (kPaired<T, U> ? (n + 1) / 2 : n), src, dst, n);  // Note [vectorised 16-bit loads]
}

template <class T, class Op>
void unary(const T* in, T* out, std::int64_t n, Op op, Device d) {
  Launch launch(d);
  CHORUS_LAUNCH((k::unary<T, Op>), (kPaired<T> ? (n + 1) / 2 : n), in, out, n, op);
}

template <class T, class Op>
void binary_same(const T* a, const T* b, T* out, std::int64_t n, Op op, Device d) {
  Launch launch(d);
  CHORUS_LAUNCH((k::binary_same<T, Op>), (kPaired<T> ? (n + 1) / 2 : n), a, b, out, n, op);
}

template <class T, class Op>
void binary_broadcast(const T* a, const Strides& as, const T* b, const Strides& bs, T* out, const Shape& shape, Op op,
                      Device d) {
  Launch launch(d);
  const auto n = numel_of(shape);
  CHORUS_LAUNCH((k::binary_broadcast<T, Op>), n, a, b, out, make_desc(shape, as, bs), n, op);
}

template <class T>
void sum_dim(const T* in, std::int64_t outer, std::int64_t n, std::int64_t inner, T* out, double scale, Device d);

/// dst (broadcast over some dimensions of `shape`) += src. When the broadcast dimensions are one
/// run [a, b) and dst is contiguous in the others (a bias gradient: [rows, features] onto
/// [features]), this is a sum over the middle axis of [outer, n, inner]: the 2-D reduction of
/// Note [2-D reductions] instead of one atomicAdd per element onto a few addresses.
template <class T>
void reduce_add_broadcast(const T* src, const Shape& shape, T* dst, const Strides& dst_strides, Device d) {
  const auto total = numel_of(shape);
  const int nd = shape.size();
  int a = 0;
  while (a < nd && !(dst_strides[a] == 0 && shape[a] != 1)) ++a;
  int b = a;
  while (b < nd && (dst_strides[b] == 0 || shape[b] == 1)) ++b;
  bool run = a < nd && total > 0;
  std::int64_t expect = 1, outer = 1, n = 1, inner = 1;
  for (int i = nd - 1; run && i >= 0; --i) {  // outside [a, b): dst's contiguous strides
    if (i >= a && i < b) {
      n *= shape[i];
      continue;
    }
    if (shape[i] != 1 && dst_strides[i] != expect) run = false;
    expect *= shape[i];
    (i < a ? outer : inner) *= shape[i];
  }
  if (run) {
    auto tmp = Tensor<T>::empty(Shape{outer * inner}, d);
    sum_dim<T>(src, outer, n, inner, tmp.data(), 1.0, d);
    Launch launch(d);
    CHORUS_LAUNCH((k::binary_same<T, fn::Add>), outer * inner, dst, tmp.data(), dst, outer * inner, fn::Add{});
    return;
  }
  Launch launch(d);
  CHORUS_LAUNCH(k::reduce_add_broadcast<T>, total, src, dst, make_desc(shape, contiguous_strides(shape), dst_strides),
                total);
}

/// out[0] = scale * sum over i < n of f(i), in two stages.
template <class T, class F>
void reduce_all(F f, std::int64_t n, T* out, double scale, Device d) {
  Launch launch(d);
  const int blocks = static_cast<int>(std::min<std::int64_t>((n + kThreads - 1) / kThreads, 1024));
  auto partial = Tensor<acc_t<T>>::empty(Shape{std::max(blocks, 1)}, d);
  if (n > 0) {
    CHORUS_LAUNCH_GRID((k::partial_sums<T, F>), blocks, kThreads, launch.stream, f, n, partial.data());
  }
  CHORUS_LAUNCH_GRID((k::finish_sum<T>), 1, kThreads, launch.stream, partial.data(), n > 0 ? blocks : 0, out, scale);
}

/// Blocks a reduction aims for: a few per SM on the largest GPUs (132 SMs on an H100/H200).
inline constexpr std::int64_t kReduceTargetBlocks = 1024;

template <class T>
void sum_dim(const T* in, std::int64_t outer, std::int64_t n, std::int64_t inner, T* out, double scale, Device d) {
  if (outer == 1 && inner == 1) return reduce_all<T>(k::Identity<T>{in}, n, out, scale, d);
  Launch launch(d);
  if (outer == 0 || inner == 0) return;
  if (n == 0) return fill<T>(out, outer * inner, T(0), d);
  if (inner == 1) {
    // Few long rows (Note [2-D reductions]): split each row over several blocks, then sum the
    // partials with one block per row.
    const std::int64_t splits = outer < kReduceTargetBlocks / 4 && n >= 8 * kThreads
                                    ? std::min<std::int64_t>({(kReduceTargetBlocks + outer - 1) / outer,
                                                              n / (4 * kThreads), 65535})
                                    : 1;
    if (splits > 1) {
      const std::int64_t chunk = (n + splits - 1) / splits;
      const std::int64_t used = (n + chunk - 1) / chunk;
      auto partial = Tensor<acc_t<T>>::empty(Shape{outer * used}, d);
      CHORUS_LAUNCH_GRID((k::row_partial_sums<T>), dim3(static_cast<unsigned>(used), static_cast<unsigned>(outer)),
                         kThreads, launch.stream, in, n, chunk, partial.data());
      CHORUS_LAUNCH_GRID((k::row_sums<T, acc_t<T>>), static_cast<unsigned>(outer), kThreads, launch.stream,
                         partial.data(), outer, used, out, scale);
      return;
    }
    const unsigned blocks = static_cast<unsigned>(std::min<std::int64_t>(outer, 65535));
    CHORUS_LAUNCH_GRID((k::row_sums<T>), blocks, kThreads, launch.stream, in, outer, n, out, scale);
    return;
  }
  // Columns (Note [2-D reductions]).
  const std::int64_t tiles = (inner + k::kColTile - 1) / k::kColTile;
  const std::int64_t xblocks = std::min<std::int64_t>(outer * tiles, std::int64_t{1} << 20);
  std::int64_t chunks = std::min<std::int64_t>({(kReduceTargetBlocks + xblocks - 1) / xblocks,
                                                std::max<std::int64_t>(1, n / 64), 65535});
  const std::int64_t chunk = (n + chunks - 1) / chunks;
  chunks = (n + chunk - 1) / chunk;
  const dim3 block(k::kColTile, k::kColLanes);
  const dim3 grid(static_cast<unsigned>(xblocks), static_cast<unsigned>(chunks));
  if (chunks == 1) {
    CHORUS_LAUNCH_GRID((k::column_sums<T>), grid, block, launch.stream, in, outer, n, inner, tiles, chunk, nullptr, out,
                       scale);
    return;
  }
  auto partial = Tensor<acc_t<T>>::empty(Shape{chunks * outer * inner}, d);
  CHORUS_LAUNCH_GRID((k::column_sums<T>), grid, block, launch.stream, in, outer, n, inner, tiles, chunk, partial.data(),
                     out, scale);
  CHORUS_LAUNCH(k::finish_column_sums<T>, outer * inner, partial.data(), chunks, outer * inner, out, scale);
}

template <class T>
void expand_dim(const T* in, std::int64_t outer, std::int64_t n, std::int64_t inner, T* out, double scale, Device d) {
  Launch launch(d);
  CHORUS_LAUNCH(k::expand_dim<T>, outer * n * inner, in, outer, n, inner, out, scale);
}

template <class T>
void softmax(const T* in, std::int64_t outer, std::int64_t n, std::int64_t inner, T* out, bool log_space,
             bool zero_dead, Device d) {
  Launch launch(d);
  const std::int64_t rows = outer * inner;
  if (rows == 0 || n == 0) return;
  if (inner >= k::kColTile) {  // wide inner axis: coalesced column kernel
    CHORUS_LAUNCH(k::softmax_columns<T>, rows, in, outer, n, inner, out, log_space, zero_dead);
    return;
  }
  CHORUS_LAUNCH_GRID((k::softmax<T>), static_cast<unsigned>(std::min<std::int64_t>(rows, 65535)), kThreads,
                     launch.stream, in, outer, n, inner, out, log_space, zero_dead);
}

template <class T>
void softmax_backward(const T* g, const T* y, std::int64_t outer, std::int64_t n, std::int64_t inner, T* gx,
                      bool log_space, Device d) {
  Launch launch(d);
  const std::int64_t rows = outer * inner;
  if (rows == 0 || n == 0) return;
  if (inner >= k::kColTile) {
    CHORUS_LAUNCH(k::softmax_backward_columns<T>, rows, g, y, outer, n, inner, gx, log_space);
    return;
  }
  CHORUS_LAUNCH_GRID((k::softmax_backward<T>), static_cast<unsigned>(std::min<std::int64_t>(rows, 65535)), kThreads,
                     launch.stream, g, y, outer, n, inner, gx, log_space);
}

/// Indices are validated by the kernel (Note [device-side validation]); `dim` names the
/// dimension in the report.
template <class T>
void index_select(const T* in, std::int64_t outer, std::int64_t n, std::int64_t inner, const std::int64_t* idx,
                  std::int64_t kk, T* out, int dim, Device d) {
  Launch launch(d);
  const auto sink = ::chorus::cuda::device_assert_sink(d.index);
  CHORUS_LAUNCH(k::index_select<T>, outer * kk * inner, in, outer, n, inner, idx, kk, out, sink, dim);
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

/// Per-row cross entropy; the kernel validates the targets (Note [device-side validation]).
template <class T>
void cross_entropy_forward(const T* logits, std::int64_t N, std::int64_t C, const std::int64_t* target,
                           std::int64_t ignore, T* loss, Device d) {
  Launch launch(d);
  if (N == 0) return;
  const auto sink = ::chorus::cuda::device_assert_sink(d.index);
  CHORUS_LAUNCH_GRID((k::cross_entropy_forward<T>), static_cast<unsigned>(std::min<std::int64_t>(N, 65535)), kThreads,
                     launch.stream, logits, N, C, target, ignore, loss, sink);
}

template <class T>
void cross_entropy_backward(const T* logits, std::int64_t N, std::int64_t C, const std::int64_t* target,
                            std::int64_t ignore, const T* g, std::int64_t g_stride, T* grad, Device d) {
  Launch launch(d);
  if (N == 0) return;
  CHORUS_LAUNCH_GRID((k::cross_entropy_backward<T>), static_cast<unsigned>(std::min<std::int64_t>(N, 65535)), kThreads,
                     launch.stream, logits, N, C, target, ignore, g, g_stride, grad);
}

template <class T>
void nll_forward(const T* logp, std::int64_t N, std::int64_t C, const std::int64_t* target, std::int64_t ignore,
                 T* loss, Device d) {
  Launch launch(d);
  const auto sink = ::chorus::cuda::device_assert_sink(d.index);
  CHORUS_LAUNCH(k::nll_forward<T>, N, logp, N, C, target, ignore, loss, sink);
}

/// out (one element) = the number of targets that are not ignore_index, on the device.
template <class T>
void count_not_ignored(const std::int64_t* target, std::int64_t N, std::int64_t ignore, T* out, Device d) {
  reduce_all<T>(k::NotIgnored{target, ignore}, N, out, 1.0, d);
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

#if CHORUS_CUDA_PRECOMPILED  // Note [precompiled CUDA kernels]
CHORUS_CUDA_KERNELS_INSTANCES(CHORUS_CUDA_EXTERN_INSTANCE)
#endif

}  // namespace backend::cuda
CHORUS_NAMESPACE_END
