#pragma once
// CUDA kernels of the convolution, pooling and normalisation layers on NCHW data (compiled
// only by nvcc): im2col/col2im around cuBLAS for convolution, one thread per output for
// pooling, 2-D reductions for the batch-norm statistics (Note [batch-norm statistics]),
// Philox for dropout. They mirror backend/cpu/nn_kernels.hpp function by function.
#include <cstdint>

#include "../cpu/nn_kernels.hpp"
#include "kernels.cuh"

CHORUS_NAMESPACE_BEGIN
namespace backend::cuda {
namespace k {

#if defined(__CUDACC__)  // device code (Note [precompiled CUDA kernels])
template <class T>
__global__ void im2col(const T* x, Window2d g, T* col) {
  const std::int64_t L = g.OH * g.OW;
  CHORUS_GRID_STRIDE(t, g.C * g.kh * g.kw * L) {
    const std::int64_t ow = t % g.OW, oh = (t / g.OW) % g.OH, r = t / L;
    const std::int64_t j = r % g.kw, i = (r / g.kw) % g.kh, c = r / (g.kw * g.kh);
    const std::int64_t h = oh * g.sh - g.ph + i * g.dh, w = ow * g.sw - g.pw + j * g.dw;
    col[t] = (h >= 0 && h < g.H && w >= 0 && w < g.W) ? x[(c * g.H + h) * g.W + w] : T(0);
  }
}

// One thread per input element gathers what im2col copied from it (no atomics).
template <class T>
__global__ void col2im(const T* col, Window2d g, T* x) {
  const std::int64_t L = g.OH * g.OW;
  CHORUS_GRID_STRIDE(t, g.C * g.H * g.W) {
    const std::int64_t w = t % g.W, h = (t / g.W) % g.H, c = t / (g.W * g.H);
    T s = 0;
    for (std::int64_t i = 0; i < g.kh; ++i) {
      const std::int64_t hh = h + g.ph - i * g.dh;
      if (hh < 0 || hh % g.sh) continue;
      const std::int64_t oh = hh / g.sh;
      if (oh >= g.OH) continue;
      for (std::int64_t j = 0; j < g.kw; ++j) {
        const std::int64_t ww = w + g.pw - j * g.dw;
        if (ww < 0 || ww % g.sw) continue;
        const std::int64_t ow = ww / g.sw;
        if (ow >= g.OW) continue;
        s += col[((c * g.kh + i) * g.kw + j) * L + oh * g.OW + ow];
      }
    }
    x[t] += s;
  }
}

template <class T>
__global__ void max_pool2d(const T* x, std::int64_t planes, Window2d g, T* out, std::int64_t* idx) {
  CHORUS_GRID_STRIDE(t, planes * g.OH * g.OW) {
    const std::int64_t ow = t % g.OW, oh = (t / g.OW) % g.OH, p = t / (g.OW * g.OH);
    const T* xp = x + p * g.H * g.W;
    T best = T(0);
    std::int64_t arg = -1;
    for (std::int64_t i = 0; i < g.kh; ++i) {
      const std::int64_t h = oh * g.sh - g.ph + i * g.dh;
      if (h < 0 || h >= g.H) continue;
      for (std::int64_t j = 0; j < g.kw; ++j) {
        const std::int64_t w = ow * g.sw - g.pw + j * g.dw;
        if (w < 0 || w >= g.W) continue;
        const T v = xp[h * g.W + w];
        if (arg < 0 || v > best || isnan(v)) {
          best = v;
          arg = h * g.W + w;
          if (isnan(v)) i = g.kh;  // NaN propagates
          if (isnan(v)) break;
        }
      }
    }
    out[t] = best;
    idx[t] = arg;
  }
}

template <class T>
__global__ void max_pool2d_backward(const T* gy, const std::int64_t* idx, std::int64_t planes, Window2d g, T* gx) {
  CHORUS_GRID_STRIDE(t, planes * g.OH * g.OW) {
    const std::int64_t p = t / (g.OH * g.OW);
    if (idx[t] >= 0) atomicAdd(gx + p * g.H * g.W + idx[t], gy[t]);
  }
}

template <class T>
__global__ void avg_pool2d(const T* x, std::int64_t planes, Window2d g, bool include_pad, std::int64_t div_override,
                           T* out) {
  CHORUS_GRID_STRIDE(t, planes * g.OH * g.OW) {
    const std::int64_t ow = t % g.OW, oh = (t / g.OW) % g.OH, p = t / (g.OW * g.OH);
    const auto win = cpu::avg_window(g, oh, ow, include_pad, div_override);
    const T* xp = x + p * g.H * g.W;
    acc_t<T> s = 0;
    for (std::int64_t h = win.h0; h < win.h1; ++h)
      for (std::int64_t w = win.w0; w < win.w1; ++w) s += xp[h * g.W + w];
    out[t] = static_cast<T>(s / win.divisor);
  }
}

template <class T>
__global__ void avg_pool2d_backward(const T* gy, std::int64_t planes, Window2d g, bool include_pad,
                                    std::int64_t div_override, T* gx) {
  CHORUS_GRID_STRIDE(t, planes * g.OH * g.OW) {
    const std::int64_t ow = t % g.OW, oh = (t / g.OW) % g.OH, p = t / (g.OW * g.OH);
    const auto win = cpu::avg_window(g, oh, ow, include_pad, div_override);
    const T v = static_cast<T>(gy[t] / win.divisor);
    for (std::int64_t h = win.h0; h < win.h1; ++h)
      for (std::int64_t w = win.w0; w < win.w1; ++w) atomicAdd(gx + p * g.H * g.W + h * g.W + w, v);
  }
}

template <class T>
__global__ void adaptive_avg_pool2d(const T* x, std::int64_t planes, Window2d g, T* out) {
  CHORUS_GRID_STRIDE(t, planes * g.OH * g.OW) {
    const std::int64_t ow = t % g.OW, oh = (t / g.OW) % g.OH, p = t / (g.OW * g.OH);
    const std::int64_t h0 = (oh * g.H) / g.OH, h1 = ((oh + 1) * g.H + g.OH - 1) / g.OH;
    const std::int64_t w0 = (ow * g.W) / g.OW, w1 = ((ow + 1) * g.W + g.OW - 1) / g.OW;
    const T* xp = x + p * g.H * g.W;
    acc_t<T> s = 0;
    for (std::int64_t h = h0; h < h1; ++h)
      for (std::int64_t w = w0; w < w1; ++w) s += xp[h * g.W + w];
    out[t] = static_cast<T>(s / double((h1 - h0) * (w1 - w0)));
  }
}

template <class T>
__global__ void adaptive_avg_pool2d_backward(const T* gy, std::int64_t planes, Window2d g, T* gx) {
  CHORUS_GRID_STRIDE(t, planes * g.OH * g.OW) {
    const std::int64_t ow = t % g.OW, oh = (t / g.OW) % g.OH, p = t / (g.OW * g.OH);
    const std::int64_t h0 = (oh * g.H) / g.OH, h1 = ((oh + 1) * g.H + g.OH - 1) / g.OH;
    const std::int64_t w0 = (ow * g.W) / g.OW, w1 = ((ow + 1) * g.W + g.OW - 1) / g.OW;
    const T v = static_cast<T>(gy[t] / double((h1 - h0) * (w1 - w0)));
    for (std::int64_t h = h0; h < h1; ++h)
      for (std::int64_t w = w0; w < w1; ++w) atomicAdd(gx + p * g.H * g.W + h * g.W + w, v);
  }
}

#endif  // __CUDACC__

// ---- batch normalisation (Note [batch-norm statistics]) ----

/// The values the per-channel reductions combine: Welford statistics (forward) or two sums
/// (backward, channel sums); warp shuffles move them component by component.
template <class A>
struct Sum2 {
  A a = 0, b = 0;
};
#if defined(__CUDACC__)  // device code (Note [precompiled CUDA kernels])
template <class A>
__device__ inline Welford<A> shfl_down(const Welford<A>& w, int o) {
  Welford<A> r;
  r.n = __shfl_down_sync(0xffffffffu, w.n, o);
  r.mean = __shfl_down_sync(0xffffffffu, w.mean, o);
  r.m2 = __shfl_down_sync(0xffffffffu, w.m2, o);
  return r;
}
template <class A>
__device__ inline Sum2<A> shfl_down(const Sum2<A>& v, int o) {
  Sum2<A> r;
  r.a = __shfl_down_sync(0xffffffffu, v.a, o);
  r.b = __shfl_down_sync(0xffffffffu, v.b, o);
  return r;
}
template <class A>
__device__ inline Welford<A> combine(const Welford<A>& x, const Welford<A>& y) {
  return welford_combine(x, y);
}
template <class A>
__device__ inline Sum2<A> combine(const Sum2<A>& x, const Sum2<A>& y) {
  Sum2<A> r;
  r.a = x.a + y.a;
  r.b = x.b + y.b;
  return r;
}

/// `v` combined over the warp in a fixed tree order (valid in lane 0).
template <class V>
__device__ inline V warp_combine(V v) {
  for (int o = 16; o > 0; o >>= 1) v = combine(v, shfl_down(v, o));
  return v;
}

/// `v` combined over the block in a fixed order (valid in thread 0). (Raw shared storage: a
/// __shared__ array of a type with default member initializers is not allowed.)
template <class V>
__device__ inline V block_combine(V v) {
  __shared__ double raw[32 * ((sizeof(V) + 7) / 8)];
  V* buf = reinterpret_cast<V*>(raw);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
  v = warp_combine(v);
  __syncthreads();  // a previous call may still read buf
  if (lane == 0) buf[warp] = v;
  __syncthreads();
  if (warp == 0) v = warp_combine(lane < warps ? buf[lane] : V{});
  return v;
}

#endif  // __CUDACC__

/// Forward statistics of x: each thread sums its values around the first one it sees.
template <class T, class A>
struct StatsOp {
  const T* x;
  using V = Welford<A>;
  struct State {
    A pivot = 0, s1 = 0, s2 = 0;
    std::int64_t n = 0;
  };
  __device__ State start(std::int64_t) const { return {}; }
  __device__ void add(State& st, std::int64_t o) const {
    const A v = static_cast<A>(x[o]);
    if (st.n == 0) st.pivot = v;
    const A d = v - st.pivot;
    st.s1 += d;
    st.s2 += d * d;
    ++st.n;
  }
  __device__ V finish(const State& st) const {
    return welford_from_shifted<A>(static_cast<double>(st.n), st.pivot, st.s1, st.s2);
  }
};

/// Backward: Σ dy and Σ dy·(x - mean[c]).
template <class T, class A>
struct GradOp {
  const T* gy;
  const T* x;
  const T* mean;
  using V = Sum2<A>;
  struct State {
    A m = 0;
    V s;
  };
  __device__ State start(std::int64_t c) const {
    State st;
    st.m = static_cast<A>(mean[c]);
    return st;
  }
  __device__ void add(State& st, std::int64_t o) const {
    const A g = static_cast<A>(gy[o]);
    st.s.a += g;
    st.s.b += g * (static_cast<A>(x[o]) - st.m);
  }
  __device__ V finish(const State& st) const { return st.s; }
};

/// Channel sums: Σ x, or Σ (x - mean[c])² when mean is given.
template <class T, class A>
struct SumOp {
  const T* x;
  const T* mean;
  using V = Sum2<A>;
  struct State {
    A m = 0;
    V s;
  };
  __device__ State start(std::int64_t c) const {
    State st;
    if (mean) st.m = static_cast<A>(mean[c]);
    return st;
  }
  __device__ void add(State& st, std::int64_t o) const {
    const A v = static_cast<A>(x[o]);
    st.s.a += mean ? (v - st.m) * (v - st.m) : v;
  }
  __device__ V finish(const State& st) const { return st.s; }
};

#if defined(__CUDACC__)  // device code (Note [precompiled CUDA kernels])
/// Planar layout: block (x, y) reduces values [x*chunk, (x+1)*chunk) of channel y (and of
/// y + gridDim.y, … when C > 65535).
template <class Op>
__global__ void channel_partials_planar(Op op, BnReducePlan p, typename Op::V* partial) {
  for (std::int64_t c = blockIdx.y; c < p.C; c += gridDim.y) {
    auto st = op.start(c);
    planar_walk(p, c, blockIdx.x, threadIdx.x, blockDim.x, [&](std::int64_t o) { op.add(st, o); });
    const auto v = block_combine(op.finish(st));
    if (threadIdx.x == 0) partial[c * p.splits + blockIdx.x] = v;
  }
}

/// Column layout: x as [N, J = C*S]; block (x, y) reduces rows [y*chunk, (y+1)*chunk) of the
/// 32 columns of tile x (threads: 32 columns x 8 row lanes), one partial per column.
template <class Op>
__global__ void channel_partials_columns(Op op, BnReducePlan p, typename Op::V* partial) {
  using V = typename Op::V;
  constexpr int kPitch = kBnColTile + 1;
  __shared__ double raw[kBnColLanes * kPitch * ((sizeof(V) + 7) / 8)];
  V* buf = reinterpret_cast<V*>(raw);
  const std::int64_t J = p.C * p.S;
  for (std::int64_t tile = blockIdx.x; tile < p.tiles; tile += gridDim.x) {
    const std::int64_t j = tile * kBnColTile + threadIdx.x;
    auto st = op.start(j < J ? j / p.S : 0);
    column_walk(p, tile, blockIdx.y, threadIdx.x, threadIdx.y, [&](std::int64_t o) { op.add(st, o); });
    buf[threadIdx.y * kPitch + threadIdx.x] = op.finish(st);
    __syncthreads();
    if (threadIdx.y == 0 && j < J) {
      V v = buf[threadIdx.x];
      for (int y = 1; y < kBnColLanes; ++y) v = combine(v, buf[y * kPitch + threadIdx.x]);
      partial[blockIdx.y * J + j] = v;
    }
    __syncthreads();
  }
}

/// One warp per channel combines the channel's partials (lane l: entries l, l + 32, …, then a
/// fixed tree) and hands the result to the epilogue.
template <class V, class Epilogue>
__global__ void channel_combine(const V* partial, BnReducePlan p, Epilogue epi) {
  const int lane = threadIdx.x & 31;
  const std::int64_t warps = static_cast<std::int64_t>(gridDim.x) * (blockDim.x >> 5);
  const std::int64_t entries = p.entries();
  for (std::int64_t c = (blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x) >> 5; c < p.C;
       c += warps) {
    V v{};
    for (std::int64_t k = lane; k < entries; k += 32) v = combine(v, partial[p.entry(c, k)]);
    v = warp_combine(v);
    if (lane == 0) epi(c, v);
  }
}

#endif  // __CUDACC__

template <class T, class A>
struct StatsEpilogue {
  A* mean;
  A* m2;
  BnFinish<T> fin;  // fin.mean == nullptr: not finished here
  __device__ void operator()(std::int64_t c, const Welford<A>& w) const {
    if (mean) mean[c] = w.mean;
    if (m2) m2[c] = w.m2;
    if (fin.mean) bn_finish_channel(fin, c, w.mean, w.m2);
  }
};
template <class T, class A>
struct GradEpilogue {
  A* sums;
  std::int64_t C;
  const T* invstd;
  T* gw;
  T* gb;
  __device__ void operator()(std::int64_t c, const Sum2<A>& s) const {
    sums[c] = s.a;
    sums[C + c] = s.b;
    if (gw) gw[c] = static_cast<T>(s.b * static_cast<A>(invstd[c]));
    if (gb) gb[c] = static_cast<T>(s.a);
  }
};
template <class T, class A>
struct SumEpilogue {
  T* out;
  __device__ void operator()(std::int64_t c, const Sum2<A>& s) const { out[c] = static_cast<T>(s.a); }
};

#if defined(__CUDACC__)  // device code (Note [precompiled CUDA kernels])
template <class A>
__global__ void bn_sync_stats(const A* local_mean, double local_n, double count, A* mean, A* m2, std::int64_t C) {
  CHORUS_GRID_STRIDE(c, C) bn_sync_channel(local_mean[c], local_n, count, mean[c], m2[c]);
}

template <class T, class A>
__global__ void bn_finish(const A* mean, const A* m2, std::int64_t C, BnFinish<T> fin) {
  CHORUS_GRID_STRIDE(c, C) bn_finish_channel(fin, c, mean[c], m2[c]);
}

// The elementwise kernels index with I = unsigned when N*C*S < 2^31 (a 32-bit division per
// element instead of a 64-bit one, which is emulated and costs more than the memory traffic).
template <class T, class I>
__global__ void bn_apply(const T* x, I C, I S, I total, const T* mean, const T* invstd, const T* w, const T* b, T* y) {
  const I step = static_cast<I>(gridDim.x) * blockDim.x;
  for (I t = blockIdx.x * static_cast<I>(blockDim.x) + threadIdx.x; t < total; t += step) {
    const I c = (t / S) % C;
    const T scale = invstd[c] * (w ? w[c] : T(1));
    y[t] = (x[t] - mean[c]) * scale + (b ? b[c] : T(0));
  }
}

template <class T, class A, class I>
__global__ void bn_backward_input(const T* gy, const T* x, I C, I S, I total, const T* mean, const T* invstd,
                                  const T* w, const A* sums, double inv_count, T* gx) {
  const I step = static_cast<I>(gridDim.x) * blockDim.x;
  for (I t = blockIdx.x * static_cast<I>(blockDim.x) + threadIdx.x; t < total; t += step) {
    const I c = (t / S) % C;
    const T mdy = static_cast<T>(sums[c] * inv_count);
    const T kk = static_cast<T>(sums[C + c] * inv_count) * invstd[c] * invstd[c];
    gx[t] = (gy[t] - mdy - (x[t] - mean[c]) * kk) * invstd[c] * (w ? w[c] : T(1));
  }
}

// ---- dropout (Note [dropout random numbers], core/generator.hpp) ----

/// Thread t: cpu::dropout_thread (one block of four Philox numbers for up to four elements).
template <class T>
__global__ void dropout(const T* in, T* out, std::int64_t n, PhiloxLayout l, std::int64_t gpr, std::int64_t threads,
                        std::uint64_t threshold, T scale) {
  CHORUS_GRID_STRIDE(t, threads) cpu::dropout_thread(in, out, n, l, gpr, t, threshold, scale);
}

#endif  // __CUDACC__

}  // namespace k

template <class T>
void im2col(const T* x, const Window2d& g, T* col, Device d) {
  Launch launch(d);
  CHORUS_LAUNCH(k::im2col<T>, g.C * g.kh * g.kw * g.OH * g.OW, x, g, col);
}
template <class T>
void col2im(const T* col, const Window2d& g, T* x, Device d) {
  Launch launch(d);
  CHORUS_LAUNCH(k::col2im<T>, g.C * g.H * g.W, col, g, x);
}
template <class T>
void max_pool2d(const T* x, std::int64_t planes, const Window2d& g, T* out, std::int64_t* idx, Device d) {
  Launch launch(d);
  CHORUS_LAUNCH(k::max_pool2d<T>, planes * g.OH * g.OW, x, planes, g, out, idx);
}
template <class T>
void max_pool2d_backward(const T* gy, const std::int64_t* idx, std::int64_t planes, const Window2d& g, T* gx,
                         Device d) {
  Launch launch(d);
  CHORUS_LAUNCH(k::max_pool2d_backward<T>, planes * g.OH * g.OW, gy, idx, planes, g, gx);
}
template <class T>
void avg_pool2d(const T* x, std::int64_t planes, const Window2d& g, bool inc, std::int64_t div, T* out, Device d) {
  Launch launch(d);
  CHORUS_LAUNCH(k::avg_pool2d<T>, planes * g.OH * g.OW, x, planes, g, inc, div, out);
}
template <class T>
void avg_pool2d_backward(const T* gy, std::int64_t planes, const Window2d& g, bool inc, std::int64_t div, T* gx,
                         Device d) {
  Launch launch(d);
  CHORUS_LAUNCH(k::avg_pool2d_backward<T>, planes * g.OH * g.OW, gy, planes, g, inc, div, gx);
}
template <class T>
void adaptive_avg_pool2d(const T* x, std::int64_t planes, const Window2d& g, T* out, Device d) {
  Launch launch(d);
  CHORUS_LAUNCH(k::adaptive_avg_pool2d<T>, planes * g.OH * g.OW, x, planes, g, out);
}
template <class T>
void adaptive_avg_pool2d_backward(const T* gy, std::int64_t planes, const Window2d& g, T* gx, Device d) {
  Launch launch(d);
  CHORUS_LAUNCH(k::adaptive_avg_pool2d_backward<T>, planes * g.OH * g.OW, gy, planes, g, gx);
}
/// The partials of a reduction plan (doubles, read as V).
template <class V>
Tensor<double> partials_buffer(const BnReducePlan& p, Device d) {
  return Tensor<double>::empty(Shape{std::max<std::int64_t>(p.partials(), 1) * std::int64_t((sizeof(V) + 7) / 8)}, d);
}

template <class Op>
void channel_partials(const Op& op, const BnReducePlan& p, typename Op::V* partial, cudaStream_t s) {
  if (p.planar) {
    const dim3 grid(static_cast<unsigned>(p.splits), static_cast<unsigned>(std::min<std::int64_t>(p.C, 65535)));
    CHORUS_LAUNCH_GRID((k::channel_partials_planar<Op>), grid, kBnThreads, s, op, p, partial);
  } else {
    const dim3 grid(static_cast<unsigned>(std::min<std::int64_t>(p.tiles, std::int64_t{1} << 20)),
                    static_cast<unsigned>(p.splits));
    CHORUS_LAUNCH_GRID((k::channel_partials_columns<Op>), grid, dim3(kBnColTile, kBnColLanes), s, op, p, partial);
  }
}

template <class V, class Epilogue>
void channel_combine(const V* partial, const BnReducePlan& p, const Epilogue& epi, cudaStream_t s) {
  const unsigned blocks = static_cast<unsigned>(std::min<std::int64_t>((p.C + 7) / 8, 65535));  // a warp per channel
  CHORUS_LAUNCH_GRID((k::channel_combine<V, Epilogue>), blocks, kBnThreads, s, partial, p, epi);
}

/// Σ x (mean == nullptr) or Σ (x - mean)^2 per channel (the convolution's bias gradient).
template <class T>
void channel_sums(const T* x, std::int64_t N, std::int64_t C, std::int64_t S, const T* mean, T* out, Device d) {
  if (C == 0) return;
  using A = bn_acc_t<T>;
  Launch launch(d);
  const auto p = bn_reduce_plan(N, C, S);
  auto ws = partials_buffer<k::Sum2<A>>(p, d);
  auto* part = reinterpret_cast<k::Sum2<A>*>(ws.data());
  channel_partials(k::SumOp<T, A>{x, mean}, p, part, launch.stream);
  channel_combine(part, p, k::SumEpilogue<T, A>{out}, launch.stream);
}

/// Per-channel mean and M2 of x (either may be null), finished into `fin` when given: two
/// launches (Note [batch-norm statistics]).
template <class T, class A>
void bn_stats(const T* x, std::int64_t N, std::int64_t C, std::int64_t S, A* mean, A* m2, const BnFinish<T>* fin,
              Device d) {
  if (C == 0) return;
  Launch launch(d);
  const auto p = bn_reduce_plan(N, C, S);
  auto ws = partials_buffer<Welford<A>>(p, d);
  auto* part = reinterpret_cast<Welford<A>*>(ws.data());
  channel_partials(k::StatsOp<T, A>{x}, p, part, launch.stream);
  channel_combine(part, p, k::StatsEpilogue<T, A>{mean, m2, fin ? *fin : BnFinish<T>{}}, launch.stream);
}

template <class T, class A>
void bn_finish(const A* mean, const A* m2, std::int64_t C, const BnFinish<T>& fin, Device d) {
  Launch launch(d);
  CHORUS_LAUNCH((k::bn_finish<T, A>), C, mean, m2, C, fin);
}

template <class A>
void bn_sync_stats(const A* local_mean, double local_n, double count, A* mean, A* m2, std::int64_t C, Device d) {
  Launch launch(d);
  CHORUS_LAUNCH(k::bn_sync_stats<A>, C, local_mean, local_n, count, mean, m2, C);
}

template <class T>
void bn_apply(const T* x, std::int64_t N, std::int64_t C, std::int64_t S, const T* mean, const T* invstd, const T* w,
              const T* b, T* y, Device d) {
  Launch launch(d);
  const std::int64_t n = N * C * S;
  if (n < (std::int64_t{1} << 31)) {
    const auto u = [](std::int64_t v) { return static_cast<unsigned>(v); };
    CHORUS_LAUNCH((k::bn_apply<T, unsigned>), n, x, u(C), u(S), u(n), mean, invstd, w, b, y);
  } else {
    CHORUS_LAUNCH((k::bn_apply<T, std::int64_t>), n, x, C, S, n, mean, invstd, w, b, y);
  }
}

/// Σ dy and Σ dy·(x - mean) per channel into sums [2C], and the local weight and bias
/// gradients when gw / gb are given: two launches.
template <class T, class A>
void bn_backward_reduce(const T* gy, const T* x, std::int64_t N, std::int64_t C, std::int64_t S, const T* mean,
                        const T* invstd, A* sums, T* gw, T* gb, Device d) {
  if (C == 0) return;
  Launch launch(d);
  const auto p = bn_reduce_plan(N, C, S);
  auto ws = partials_buffer<k::Sum2<A>>(p, d);
  auto* part = reinterpret_cast<k::Sum2<A>*>(ws.data());
  channel_partials(k::GradOp<T, A>{gy, x, mean}, p, part, launch.stream);
  channel_combine(part, p, k::GradEpilogue<T, A>{sums, C, invstd, gw, gb}, launch.stream);
}

template <class T, class A>
void bn_backward_input(const T* gy, const T* x, std::int64_t N, std::int64_t C, std::int64_t S, const T* mean,
                       const T* invstd, const T* w, const A* sums, double inv_count, T* gx, Device d) {
  Launch launch(d);
  const std::int64_t n = N * C * S;
  if (n < (std::int64_t{1} << 31)) {
    const auto u = [](std::int64_t v) { return static_cast<unsigned>(v); };
    CHORUS_LAUNCH((k::bn_backward_input<T, A, unsigned>), n, gy, x, u(C), u(S), u(n), mean, invstd, w, sums,
                  inv_count, gx);
  } else {
    CHORUS_LAUNCH((k::bn_backward_input<T, A, std::int64_t>), n, gy, x, C, S, n, mean, invstd, w, sums, inv_count,
                  gx);
  }
}

/// The dropout multiplier over n contiguous elements (Note [dropout random numbers]).
template <class T>
void dropout_apply(const T* in, T* out, std::int64_t n, const PhiloxLayout& l, std::uint64_t threshold, T scale,
                   Device d) {
  if (n == 0) return;
  Launch launch(d);
  const auto grid = cpu::dropout_grid(n, l);
  CHORUS_LAUNCH(k::dropout<T>, grid.threads, in, out, n, l, grid.gpr, grid.threads, threshold, scale);
}

#if CHORUS_CUDA_PRECOMPILED  // Note [precompiled CUDA kernels]
CHORUS_CUDA_NN_INSTANCES(CHORUS_CUDA_EXTERN_INSTANCE)
#endif

}  // namespace backend::cuda
CHORUS_NAMESPACE_END
