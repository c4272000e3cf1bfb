#pragma once
// CUDA kernels of the sequence-model operators (the CPU loops are in cpu/index_kernels.hpp):
// where and comparisons, gather / scatter_add / one_hot (indices validated by the kernels:
// Note [device-side validation]), max/min with indices, topk, cumsum and tril/triu. Templates
// only, launched on the calling thread's current stream and checked, as in kernels.cuh.
//
// These kernels never call max/min/abs unqualified: chorus::max and friends (the tensor ops)
// would hide the CUDA math overloads from a template parsed after them.
#include <cstdint>

#include "../functors.hpp"
#include "kernels.cuh"
#include "launch.cuh"

CHORUS_NAMESPACE_BEGIN
namespace backend::cuda {
namespace kidx {

#if defined(__CUDACC__)  // device code (Note [precompiled CUDA kernels])

/// atomicAdd for every element type a tensor holds (int64 through its two's-complement twin).
template <class T>
__device__ inline void atomic_add(T* p, T v) {
  if constexpr (std::is_same_v<T, std::int64_t>) {
    atomicAdd(reinterpret_cast<unsigned long long*>(p), static_cast<unsigned long long>(v));
  } else {
    atomicAdd(p, v);
  }
}

template <class M, class T>
__global__ void where(const M* c, const T* a, const T* b, T* out, NdDesc d, std::int64_t n) {
  CHORUS_GRID_STRIDE(i, n) {
    std::int64_t off[3];
    nd_offsets(d, i, off);
    out[i] = c[off[0]] != M(0) ? a[off[1]] : b[off[2]];
  }
}

template <class M, class T, class Op>
__global__ void compare(const T* a, const T* b, M* out, NdDesc d, std::int64_t n, Op op) {
  CHORUS_GRID_STRIDE(i, n) {
    std::int64_t off[3];
    nd_offsets(d, i, off);
    out[i] = op(opload(a[off[0]]), opload(b[off[1]])) ? M(1) : M(0);
  }
}

/// out[i] = in[offset of position i, with dim read from idx[i]]; d: in's strides (dim zeroed).
template <class T>
__global__ void gather(const T* in, std::int64_t sd, std::int64_t size, const std::int64_t* idx, T* out, NdDesc d,
                       std::int64_t n, ::chorus::detail::DeviceAssertSink sink, int dim) {
  CHORUS_GRID_STRIDE(i, n) {
    const std::int64_t v = idx[i];
    if (v < 0 || v >= size) [[unlikely]] {
      k::device_assert(sink, ::chorus::detail::kAssertGather, v, i, size, dim);
      out[i] = T(0);
      continue;
    }
    std::int64_t off[3];
    nd_offsets(d, i, off);
    out[i] = in[off[0] + v * sd];
  }
}

/// d: src's strides (0) and out's strides with dim zeroed (1).
template <class T>
__global__ void scatter_add(const T* src, std::int64_t sd, std::int64_t size, const std::int64_t* idx, T* out,
                            NdDesc d, std::int64_t n, ::chorus::detail::DeviceAssertSink sink, int dim) {
  CHORUS_GRID_STRIDE(i, n) {
    const std::int64_t v = idx[i];
    if (v < 0 || v >= size) [[unlikely]] {
      k::device_assert(sink, ::chorus::detail::kAssertScatterAdd, v, i, size, dim);
      continue;
    }
    std::int64_t off[3];
    nd_offsets(d, i, off);
    atomic_add(out + off[1] + v * sd, src[off[0]]);
  }
}

template <class M>
__global__ void one_hot(const std::int64_t* idx, std::int64_t n, std::int64_t classes, M* out,
                        ::chorus::detail::DeviceAssertSink sink) {
  CHORUS_GRID_STRIDE(t, n * classes) {
    const std::int64_t i = t / classes, c = t % classes, v = idx[i];
    if (c == 0 && (v < 0 || v >= classes)) [[unlikely]]
      k::device_assert(sink, ::chorus::detail::kAssertOneHot, v, i, classes);
    out[t] = v == c ? M(1) : M(0);
  }
}

/// Block-wide choice of the first (value, index) in `order` among the threads' candidates (an
/// index < 0 is no candidate). Every thread gets the winner.
template <class T>
__device__ inline void block_first(T& v, std::int64_t& i, fn::RankOrder order) {
  __shared__ T sv[kThreads];
  __shared__ std::int64_t si[kThreads];
  const int tid = threadIdx.x;
  sv[tid] = v;
  si[tid] = i;
  __syncthreads();
  for (int s = blockDim.x / 2; s > 0; s >>= 1) {
    if (tid < s) {
      const std::int64_t oi = si[tid + s];
      if (oi >= 0 && (si[tid] < 0 || order.before(sv[tid + s], oi, sv[tid], si[tid]))) {
        sv[tid] = sv[tid + s];
        si[tid] = oi;
      }
    }
    __syncthreads();
  }
  v = sv[0];
  i = si[0];
  __syncthreads();
}

/// max/min along rows of [outer, n] (inner == 1): one block per row.
template <class T>
__global__ void extremum_rows(const T* in, std::int64_t outer, std::int64_t n, T* vals, std::int64_t* idx,
                              fn::RankOrder order) {
  for (std::int64_t o = blockIdx.x; o < outer; o += gridDim.x) {
    const T* x = in + o * n;
    T best = T(0);
    std::int64_t bi = -1;
    for (std::int64_t i = threadIdx.x; i < n; i += blockDim.x)
      if (bi < 0 || order.before(x[i], i, best, bi)) {
        best = x[i];
        bi = i;
      }
    block_first(best, bi, order);
    if (threadIdx.x == 0) {
      if (vals) vals[o] = best;
      if (idx) idx[o] = bi;
    }
  }
}

/// max/min along the middle axis of [outer, n, inner] for inner > 1: one thread per column,
/// coalesced over the columns.
template <class T>
__global__ void extremum_columns(const T* in, std::int64_t outer, std::int64_t n, std::int64_t inner, T* vals,
                                 std::int64_t* idx, fn::RankOrder order) {
  CHORUS_GRID_STRIDE(c, outer * inner) {
    const T* x = in + (c / inner) * n * inner + c % inner;
    T best = x[0];
    std::int64_t bi = 0;
    for (std::int64_t i = 1; i < n; ++i)
      if (order.before(x[i * inner], i, best, bi)) {
        best = x[i * inner];
        bi = i;
      }
    if (vals) vals[c] = best;
    if (idx) idx[c] = bi;
  }
}

// Note [topk on the GPU]
// One block per row picks the k winners in k passes: pass r takes the first element in the
// order (fn::RankOrder) among those ranking after the winner of pass r - 1. That is
// O(k * n / threads) per row: good for the small k of beam search and top-k sampling, and
// the same total order as the CPU's partial_sort, so both return the same indices even for
// ties. A radix select would serve large k better (later work, with a benchmark).
template <class T>
__global__ void topk(const T* in, std::int64_t outer, std::int64_t n, std::int64_t inner, std::int64_t kk, T* vals,
                     std::int64_t* idx, fn::RankOrder order) {
  for (std::int64_t row = blockIdx.x; row < outer * inner; row += gridDim.x) {
    const std::int64_t o = row / inner, j = row % inner;
    const T* x = in + o * n * inner + j;
    T prev = T(0);
    std::int64_t prev_i = -1;
    for (std::int64_t r = 0; r < kk; ++r) {
      T best = T(0);
      std::int64_t bi = -1;
      for (std::int64_t i = threadIdx.x; i < n; i += blockDim.x) {
        const T v = x[i * inner];
        if (prev_i >= 0 && !order.before(prev, prev_i, v, i)) continue;  // taken by an earlier pass
        if (bi < 0 || order.before(v, i, best, bi)) {
          best = v;
          bi = i;
        }
      }
      block_first(best, bi, order);  // every thread gets the winner: it is the next `prev`
      if (threadIdx.x == 0) {
        vals[(o * kk + r) * inner + j] = best;
        idx[(o * kk + r) * inner + j] = bi;
      }
      prev = best;
      prev_i = bi;
    }
  }
}

/// Inclusive scans along the middle axis of [outer, n, inner] for inner > 1: a thread per column.
template <class T>
__global__ void cumsum_columns(const T* in, std::int64_t outer, std::int64_t n, std::int64_t inner, T* out,
                               bool reverse) {
  CHORUS_GRID_STRIDE(c, outer * inner) {
    const std::int64_t base = (c / inner) * n * inner + c % inner;
    acc_t<T> s = 0;
    for (std::int64_t t = 0; t < n; ++t) {
      const std::int64_t p = base + (reverse ? n - 1 - t : t) * inner;
      s += static_cast<acc_t<T>>(in[p]);
      out[p] = static_cast<T>(s);
    }
  }
}

/// Inclusive scans of rows (inner == 1): one block per row, a block-wide scan per chunk of
/// blockDim elements plus the carry of the chunks before it.
template <class T>
__global__ void cumsum_rows(const T* in, std::int64_t outer, std::int64_t n, T* out, bool reverse) {
  __shared__ acc_t<T> buf[kThreads];
  const int tid = threadIdx.x;
  for (std::int64_t o = blockIdx.x; o < outer; o += gridDim.x) {
    acc_t<T> carry = 0;
    for (std::int64_t start = 0; start < n; start += blockDim.x) {
      const std::int64_t s = start + tid, i = reverse ? n - 1 - s : s;
      buf[tid] = s < n ? static_cast<acc_t<T>>(in[o * n + i]) : acc_t<T>(0);
      __syncthreads();
      for (int off = 1; off < static_cast<int>(blockDim.x); off <<= 1) {
        const acc_t<T> add = tid >= off ? buf[tid - off] : acc_t<T>(0);
        __syncthreads();
        buf[tid] += add;
        __syncthreads();
      }
      if (s < n) out[o * n + i] = static_cast<T>(carry + buf[tid]);
      carry += buf[blockDim.x - 1];
      __syncthreads();
    }
  }
}

template <class T>
__global__ void triangle(const T* in, T* out, std::int64_t total, std::int64_t rows, std::int64_t cols,
                         std::int64_t diagonal, bool lower) {
  CHORUS_GRID_STRIDE(t, total) {
    const std::int64_t j = t % cols, i = (t / cols) % rows, d = j - i;
    out[t] = (lower ? d <= diagonal : d >= diagonal) ? in[t] : T(0);
  }
}

#endif  // __CUDACC__
}  // namespace kidx

template <class M, class T>
void where(const M* cond, const Strides& cs, const T* a, const Strides& as, const T* b, const Strides& bs, T* out,
           const Shape& shape, Device d) {
  Launch launch(d);
  const auto n = numel_of(shape);
  CHORUS_LAUNCH((kidx::where<M, T>), n, cond, a, b, out, make_desc(shape, cs, as, bs), n);
}

template <class M, class T, class Op>
void compare(const T* a, const Strides& as, const T* b, const Strides& bs, M* out, const Shape& shape, Op op,
             Device d) {
  Launch launch(d);
  const auto n = numel_of(shape);
  CHORUS_LAUNCH((kidx::compare<M, T, Op>), n, a, b, out, make_desc(shape, as, bs), n, op);
}

template <class T>
void gather(const T* in, const Strides& in_strides, std::int64_t size, int dim, const std::int64_t* idx, T* out,
            const Shape& shape, Device d) {
  Launch launch(d);
  const auto n = numel_of(shape);
  if (n == 0) return;
  Strides s = in_strides;
  s[dim] = 0;
  const auto sink = ::chorus::cuda::device_assert_sink(d.index);
  CHORUS_LAUNCH(kidx::gather<T>, n, in, in_strides[dim], size, idx, out, make_desc(shape, s), n, sink, dim);
}

template <class T>
void scatter_add(const T* src, const Strides& src_strides, int dim, const std::int64_t* idx, T* out,
                 const Strides& out_strides, std::int64_t size, const Shape& shape, Device d) {
  Launch launch(d);
  const auto n = numel_of(shape);
  if (n == 0) return;
  Strides s = out_strides;
  s[dim] = 0;
  const auto sink = ::chorus::cuda::device_assert_sink(d.index);
  CHORUS_LAUNCH(kidx::scatter_add<T>, n, src, out_strides[dim], size, idx, out, make_desc(shape, src_strides, s), n,
                sink, dim);
}

template <class M>
void one_hot(const std::int64_t* idx, std::int64_t n, std::int64_t classes, M* out, Device d) {
  Launch launch(d);
  if (n * classes == 0) return;
  const auto sink = ::chorus::cuda::device_assert_sink(d.index);
  CHORUS_LAUNCH(kidx::one_hot<M>, n * classes, idx, n, classes, out, sink);
}

template <class T>
void select_extremum(const T* in, std::int64_t outer, std::int64_t n, std::int64_t inner, T* vals, std::int64_t* idx,
                     fn::RankOrder order, Device d) {
  Launch launch(d);
  if (outer * inner == 0 || n == 0) return;
  if (inner > 1) {
    CHORUS_LAUNCH(kidx::extremum_columns<T>, outer * inner, in, outer, n, inner, vals, idx, order);
    return;
  }
  CHORUS_LAUNCH_GRID((kidx::extremum_rows<T>), static_cast<unsigned>(std::min<std::int64_t>(outer, 65535)), kThreads,
                     launch.stream, in, outer, n, vals, idx, order);
}

template <class T>
void topk(const T* in, std::int64_t outer, std::int64_t n, std::int64_t inner, std::int64_t kk, T* vals,
          std::int64_t* idx, fn::RankOrder order, Device d) {
  Launch launch(d);
  const std::int64_t rows = outer * inner;
  if (rows == 0 || kk == 0) return;
  CHORUS_LAUNCH_GRID((kidx::topk<T>), static_cast<unsigned>(std::min<std::int64_t>(rows, 65535)), kThreads,
                     launch.stream, in, outer, n, inner, kk, vals, idx, order);
}

template <class T>
void cumsum(const T* in, std::int64_t outer, std::int64_t n, std::int64_t inner, T* out, bool reverse, Device d) {
  Launch launch(d);
  if (outer * inner == 0 || n == 0) return;
  if (inner > 1) {
    CHORUS_LAUNCH(kidx::cumsum_columns<T>, outer * inner, in, outer, n, inner, out, reverse);
    return;
  }
  CHORUS_LAUNCH_GRID((kidx::cumsum_rows<T>), static_cast<unsigned>(std::min<std::int64_t>(outer, 65535)), kThreads,
                     launch.stream, in, outer, n, out, reverse);
}

template <class T>
void triangle(const T* in, T* out, std::int64_t batch, std::int64_t rows, std::int64_t cols, std::int64_t diagonal,
              bool lower, Device d) {
  Launch launch(d);
  const std::int64_t total = batch * rows * cols;
  CHORUS_LAUNCH(kidx::triangle<T>, total, in, out, total, rows, cols, diagonal, lower);
}

#if CHORUS_CUDA_PRECOMPILED  // Note [precompiled CUDA kernels]
CHORUS_CUDA_INDEX_INSTANCES(CHORUS_CUDA_EXTERN_INSTANCE)
#endif

}  // namespace backend::cuda
CHORUS_NAMESPACE_END
