#pragma once
// CUDA kernels of the convolution, pooling and normalisation layers on NCHW data (compiled
// only by nvcc): im2col/col2im around cuBLAS for convolution, one thread per output for
// pooling, one block per channel for the batch-norm reductions. They mirror
// backend/cpu/nn_kernels.hpp function by function.
#include <cstdint>

#include "../cpu/nn_kernels.hpp"
#include "kernels.cuh"

CHORUS_NAMESPACE_BEGIN
namespace backend::cuda {
namespace k {

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

// One block per channel: Σ x (mean == nullptr) or Σ (x - mean)^2.
template <class T>
__global__ void channel_sums(const T* x, std::int64_t N, std::int64_t C, std::int64_t S, const T* mean, T* out) {
  for (std::int64_t c = blockIdx.x; c < C; c += gridDim.x) {
    acc_t<T> s = 0;
    const acc_t<T> m = mean ? mean[c] : 0;
    for (std::int64_t e = threadIdx.x; e < N * S; e += blockDim.x) {
      const acc_t<T> v = x[((e / S) * C + c) * S + e % S];
      s += mean ? (v - m) * (v - m) : v;
    }
    s = block_sum(s);
    if (threadIdx.x == 0) out[c] = static_cast<T>(s);
  }
}

template <class T>
__global__ void bn_apply(const T* x, std::int64_t N, std::int64_t C, std::int64_t S, const T* mean, const T* invstd,
                         const T* w, const T* b, T* y) {
  CHORUS_GRID_STRIDE(t, N * C * S) {
    const std::int64_t c = (t / S) % C;
    const T scale = invstd[c] * (w ? w[c] : T(1));
    y[t] = (x[t] - mean[c]) * scale + (b ? b[c] : T(0));
  }
}

template <class T>
__global__ void bn_backward_reduce(const T* gy, const T* x, std::int64_t N, std::int64_t C, std::int64_t S,
                                   const T* mean, T* sums) {
  for (std::int64_t c = blockIdx.x; c < C; c += gridDim.x) {
    acc_t<T> s = 0, sx = 0;
    const acc_t<T> m = mean[c];
    for (std::int64_t e = threadIdx.x; e < N * S; e += blockDim.x) {
      const std::int64_t o = ((e / S) * C + c) * S + e % S;
      s += gy[o];
      sx += acc_t<T>(gy[o]) * (x[o] - m);
    }
    s = block_sum(s);
    sx = block_sum(sx);
    if (threadIdx.x == 0) {
      sums[c] = static_cast<T>(s);
      sums[C + c] = static_cast<T>(sx);
    }
  }
}

template <class T>
__global__ void bn_backward_input(const T* gy, const T* x, std::int64_t N, std::int64_t C, std::int64_t S,
                                  const T* mean, const T* invstd, const T* w, const T* sums, double count, T* gx) {
  CHORUS_GRID_STRIDE(t, N * C * S) {
    const std::int64_t c = (t / S) % C;
    const T mdy = static_cast<T>(sums[c] / count);
    const T kk = static_cast<T>(sums[C + c] / count) * invstd[c] * invstd[c];
    gx[t] = (gy[t] - mdy - (x[t] - mean[c]) * kk) * invstd[c] * (w ? w[c] : T(1));
  }
}

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
inline unsigned channel_blocks(std::int64_t C) { return static_cast<unsigned>(std::clamp<std::int64_t>(C, 1, 65535)); }
template <class T>
void channel_sums(const T* x, std::int64_t N, std::int64_t C, std::int64_t S, const T* mean, T* out, Device d) {
  if (C == 0) return;
  Launch launch(d);
  k::channel_sums<T><<<channel_blocks(C), kThreads, 0, launch.stream>>>(x, N, C, S, mean, out);
  ::chorus::cuda::check_launch("channel_sums");
}
template <class T>
void bn_apply(const T* x, std::int64_t N, std::int64_t C, std::int64_t S, const T* mean, const T* invstd, const T* w,
              const T* b, T* y, Device d) {
  Launch launch(d);
  CHORUS_LAUNCH(k::bn_apply<T>, N * C * S, x, N, C, S, mean, invstd, w, b, y);
}
template <class T>
void bn_backward_reduce(const T* gy, const T* x, std::int64_t N, std::int64_t C, std::int64_t S, const T* mean,
                        T* sums, Device d) {
  if (C == 0) return;
  Launch launch(d);
  k::bn_backward_reduce<T><<<channel_blocks(C), kThreads, 0, launch.stream>>>(gy, x, N, C, S, mean, sums);
  ::chorus::cuda::check_launch("bn_backward_reduce");
}
template <class T>
void bn_backward_input(const T* gy, const T* x, std::int64_t N, std::int64_t C, std::int64_t S, const T* mean,
                       const T* invstd, const T* w, const T* sums, double count, T* gx, Device d) {
  Launch launch(d);
  CHORUS_LAUNCH(k::bn_backward_input<T>, N * C * S, gy, x, N, C, S, mean, invstd, w, sums, count, gx);
}

}  // namespace backend::cuda
CHORUS_NAMESPACE_END
