#pragma once
// CPU kernels of the convolution, pooling and normalisation layers, on NCHW data. Plain
// loops over raw pointers; shapes arrive validated by ops/nn.hpp. Convolution itself is
// im2col + GEMM (blas.hpp) unless oneDNN is used (backend/cpu/dnnl.hpp).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "kernels.hpp"

CHORUS_NAMESPACE_BEGIN
namespace backend {

/// The geometry of a 2-D window op (convolution or pooling) on one [C, H, W] image.
struct Window2d {
  std::int64_t C = 0, H = 0, W = 0;      // input channels and size
  std::int64_t OH = 0, OW = 0;           // output size
  std::int64_t kh = 1, kw = 1;           // kernel
  std::int64_t sh = 1, sw = 1;           // stride
  std::int64_t ph = 0, pw = 0;           // padding
  std::int64_t dh = 1, dw = 1;           // dilation
};

namespace cpu {

/// col[(c*kh + i)*kw + j, oh*OW + ow] = x[c, oh*sh - ph + i*dh, ow*sw - pw + j*dw] (0 outside).
template <class T>
void im2col(const T* x, const Window2d& g, T* col) {
  const std::int64_t L = g.OH * g.OW;
  for (std::int64_t c = 0; c < g.C; ++c)
    for (std::int64_t i = 0; i < g.kh; ++i)
      for (std::int64_t j = 0; j < g.kw; ++j) {
        T* row = col + ((c * g.kh + i) * g.kw + j) * L;
        for (std::int64_t oh = 0; oh < g.OH; ++oh) {
          const std::int64_t h = oh * g.sh - g.ph + i * g.dh;
          T* r = row + oh * g.OW;
          if (h < 0 || h >= g.H) {
            std::fill(r, r + g.OW, T(0));
            continue;
          }
          const T* xr = x + (c * g.H + h) * g.W;
          for (std::int64_t ow = 0; ow < g.OW; ++ow) {
            const std::int64_t w = ow * g.sw - g.pw + j * g.dw;
            r[ow] = (w >= 0 && w < g.W) ? xr[w] : T(0);
          }
        }
      }
}

/// The adjoint of im2col: x[c, h, w] += every col entry that im2col read from it.
template <class T>
void col2im(const T* col, const Window2d& g, T* x) {
  const std::int64_t L = g.OH * g.OW;
  for (std::int64_t c = 0; c < g.C; ++c)
    for (std::int64_t i = 0; i < g.kh; ++i)
      for (std::int64_t j = 0; j < g.kw; ++j) {
        const T* row = col + ((c * g.kh + i) * g.kw + j) * L;
        for (std::int64_t oh = 0; oh < g.OH; ++oh) {
          const std::int64_t h = oh * g.sh - g.ph + i * g.dh;
          if (h < 0 || h >= g.H) continue;
          T* xr = x + (c * g.H + h) * g.W;
          const T* r = row + oh * g.OW;
          for (std::int64_t ow = 0; ow < g.OW; ++ow) {
            const std::int64_t w = ow * g.sw - g.pw + j * g.dw;
            if (w >= 0 && w < g.W) xr[w] += r[ow];
          }
        }
      }
}

/// Max pooling over `planes` planes of [H, W]: out and the argmax (flat index in its plane).
template <class T>
void max_pool2d(const T* x, std::int64_t planes, const Window2d& g, T* out, std::int64_t* idx) {
  for (std::int64_t p = 0; p < planes; ++p) {
    const T* xp = x + p * g.H * g.W;
    for (std::int64_t oh = 0; oh < g.OH; ++oh)
      for (std::int64_t ow = 0; ow < g.OW; ++ow) {
        T best = -std::numeric_limits<T>::infinity();
        std::int64_t arg = -1;
        for (std::int64_t i = 0; i < g.kh; ++i) {
          const std::int64_t h = oh * g.sh - g.ph + i * g.dh;
          if (h < 0 || h >= g.H) continue;
          for (std::int64_t j = 0; j < g.kw; ++j) {
            const std::int64_t w = ow * g.sw - g.pw + j * g.dw;
            if (w < 0 || w >= g.W) continue;
            const T v = xp[h * g.W + w];
            if (arg < 0 || v > best || std::isnan(v)) {  // NaN propagates, as in PyTorch
              best = v;
              arg = h * g.W + w;
              if (std::isnan(v)) break;
            }
          }
        }
        const std::int64_t o = (p * g.OH + oh) * g.OW + ow;
        out[o] = best;
        idx[o] = arg;
      }
  }
}

/// gx (zeroed) += gy scattered to the argmax positions.
template <class T>
void max_pool2d_backward(const T* gy, const std::int64_t* idx, std::int64_t planes, const Window2d& g, T* gx) {
  const std::int64_t L = g.OH * g.OW;
  for (std::int64_t p = 0; p < planes; ++p)
    for (std::int64_t o = 0; o < L; ++o)
      if (idx[p * L + o] >= 0) gx[p * g.H * g.W + idx[p * L + o]] += gy[p * L + o];
}

/// The window of output (oh, ow) of an average pool, clipped to the image, and its divisor
/// (PyTorch's rule: the window clipped to the padded image when count_include_pad).
struct AvgWindow {
  std::int64_t h0, h1, w0, w1;
  double divisor;
};
CHORUS_HOST_DEVICE inline AvgWindow avg_window(const Window2d& g, std::int64_t oh, std::int64_t ow, bool count_include_pad,
                            std::int64_t divisor_override) {
  std::int64_t h0 = oh * g.sh - g.ph, w0 = ow * g.sw - g.pw;
  // (no std::min/max: this runs in CUDA kernels too)
  std::int64_t h1 = h0 + g.kh < g.H + g.ph ? h0 + g.kh : g.H + g.ph;
  std::int64_t w1 = w0 + g.kw < g.W + g.pw ? w0 + g.kw : g.W + g.pw;
  const std::int64_t padded = (h1 - h0) * (w1 - w0);
  if (h0 < 0) h0 = 0;
  if (w0 < 0) w0 = 0;
  if (h1 > g.H) h1 = g.H;
  if (w1 > g.W) w1 = g.W;
  double div = divisor_override > 0 ? double(divisor_override)
                                    : double(count_include_pad ? padded : (h1 - h0) * (w1 - w0));
  return {h0, h1, w0, w1, div};
}

template <class T>
void avg_pool2d(const T* x, std::int64_t planes, const Window2d& g, bool count_include_pad,
                std::int64_t divisor_override, T* out) {
  for (std::int64_t p = 0; p < planes; ++p) {
    const T* xp = x + p * g.H * g.W;
    for (std::int64_t oh = 0; oh < g.OH; ++oh)
      for (std::int64_t ow = 0; ow < g.OW; ++ow) {
        const auto win = avg_window(g, oh, ow, count_include_pad, divisor_override);
        acc_t<T> s = 0;
        for (std::int64_t h = win.h0; h < win.h1; ++h)
          for (std::int64_t w = win.w0; w < win.w1; ++w) s += xp[h * g.W + w];
        out[(p * g.OH + oh) * g.OW + ow] = static_cast<T>(s / win.divisor);
      }
  }
}

template <class T>
void avg_pool2d_backward(const T* gy, std::int64_t planes, const Window2d& g, bool count_include_pad,
                         std::int64_t divisor_override, T* gx) {
  for (std::int64_t p = 0; p < planes; ++p) {
    T* gp = gx + p * g.H * g.W;
    for (std::int64_t oh = 0; oh < g.OH; ++oh)
      for (std::int64_t ow = 0; ow < g.OW; ++ow) {
        const auto win = avg_window(g, oh, ow, count_include_pad, divisor_override);
        const T v = static_cast<T>(gy[(p * g.OH + oh) * g.OW + ow] / win.divisor);
        for (std::int64_t h = win.h0; h < win.h1; ++h)
          for (std::int64_t w = win.w0; w < win.w1; ++w) gp[h * g.W + w] += v;
      }
  }
}

/// Adaptive pooling windows: [floor(i*H/OH), ceil((i+1)*H/OH)).
inline std::int64_t adaptive_start(std::int64_t i, std::int64_t in, std::int64_t out) { return (i * in) / out; }
inline std::int64_t adaptive_end(std::int64_t i, std::int64_t in, std::int64_t out) {
  return ((i + 1) * in + out - 1) / out;
}

template <class T>
void adaptive_avg_pool2d(const T* x, std::int64_t planes, const Window2d& g, T* out) {
  for (std::int64_t p = 0; p < planes; ++p) {
    const T* xp = x + p * g.H * g.W;
    for (std::int64_t oh = 0; oh < g.OH; ++oh) {
      const auto h0 = adaptive_start(oh, g.H, g.OH), h1 = adaptive_end(oh, g.H, g.OH);
      for (std::int64_t ow = 0; ow < g.OW; ++ow) {
        const auto w0 = adaptive_start(ow, g.W, g.OW), w1 = adaptive_end(ow, g.W, g.OW);
        acc_t<T> s = 0;
        for (std::int64_t h = h0; h < h1; ++h)
          for (std::int64_t w = w0; w < w1; ++w) s += xp[h * g.W + w];
        out[(p * g.OH + oh) * g.OW + ow] = static_cast<T>(s / double((h1 - h0) * (w1 - w0)));
      }
    }
  }
}

template <class T>
void adaptive_avg_pool2d_backward(const T* gy, std::int64_t planes, const Window2d& g, T* gx) {
  for (std::int64_t p = 0; p < planes; ++p) {
    T* gp = gx + p * g.H * g.W;
    for (std::int64_t oh = 0; oh < g.OH; ++oh) {
      const auto h0 = adaptive_start(oh, g.H, g.OH), h1 = adaptive_end(oh, g.H, g.OH);
      for (std::int64_t ow = 0; ow < g.OW; ++ow) {
        const auto w0 = adaptive_start(ow, g.W, g.OW), w1 = adaptive_end(ow, g.W, g.OW);
        const T v = static_cast<T>(gy[(p * g.OH + oh) * g.OW + ow] / double((h1 - h0) * (w1 - w0)));
        for (std::int64_t h = h0; h < h1; ++h)
          for (std::int64_t w = w0; w < w1; ++w) gp[h * g.W + w] += v;
      }
    }
  }
}

// ---- batch normalisation on x viewed as [N, C, S] (S = H*W, 1 for BatchNorm1d on [N, C]) ----

/// sum[c] = Σ x[n, c, s]; sq[c] = Σ (x[n, c, s] - mean[c])^2 when mean is given.
template <class T>
void channel_sums(const T* x, std::int64_t N, std::int64_t C, std::int64_t S, const T* mean, T* out) {
  for (std::int64_t c = 0; c < C; ++c) {
    acc_t<T> s = 0;
    const acc_t<T> m = mean ? mean[c] : 0;
    for (std::int64_t n = 0; n < N; ++n) {
      const T* p = x + (n * C + c) * S;
      if (mean) {
        for (std::int64_t i = 0; i < S; ++i) s += (p[i] - m) * (p[i] - m);
      } else {
        for (std::int64_t i = 0; i < S; ++i) s += p[i];
      }
    }
    out[c] = static_cast<T>(s);
  }
}

/// y = (x - mean[c]) * invstd[c] * w[c] + b[c] (w, b may be null).
template <class T>
void bn_apply(const T* x, std::int64_t N, std::int64_t C, std::int64_t S, const T* mean, const T* invstd, const T* w,
              const T* b, T* y) {
  for (std::int64_t n = 0; n < N; ++n)
    for (std::int64_t c = 0; c < C; ++c) {
      const T scale = invstd[c] * (w ? w[c] : T(1));
      const T shift = (b ? b[c] : T(0)) - mean[c] * scale;
      const T* p = x + (n * C + c) * S;
      T* q = y + (n * C + c) * S;
      for (std::int64_t i = 0; i < S; ++i) q[i] = p[i] * scale + shift;
    }
}

/// sums[c] = Σ gy, sums[C + c] = Σ gy * (x - mean[c]).
template <class T>
void bn_backward_reduce(const T* gy, const T* x, std::int64_t N, std::int64_t C, std::int64_t S, const T* mean,
                        T* sums) {
  for (std::int64_t c = 0; c < C; ++c) {
    acc_t<T> s = 0, sx = 0;
    const acc_t<T> m = mean[c];
    for (std::int64_t n = 0; n < N; ++n) {
      const T* g = gy + (n * C + c) * S;
      const T* p = x + (n * C + c) * S;
      for (std::int64_t i = 0; i < S; ++i) {
        s += g[i];
        sx += g[i] * (p[i] - m);
      }
    }
    sums[c] = static_cast<T>(s);
    sums[C + c] = static_cast<T>(sx);
  }
}

/// gx = (gy - sums[c]/count - (x - mean) * invstd^2 * sums[C+c]/count) * invstd * w.
template <class T>
void bn_backward_input(const T* gy, const T* x, std::int64_t N, std::int64_t C, std::int64_t S, const T* mean,
                       const T* invstd, const T* w, const T* sums, double count, T* gx) {
  for (std::int64_t n = 0; n < N; ++n)
    for (std::int64_t c = 0; c < C; ++c) {
      const T mdy = static_cast<T>(sums[c] / count);
      const T k = static_cast<T>(sums[C + c] / count) * invstd[c] * invstd[c];
      const T scale = invstd[c] * (w ? w[c] : T(1));
      const T* g = gy + (n * C + c) * S;
      const T* p = x + (n * C + c) * S;
      T* q = gx + (n * C + c) * S;
      for (std::int64_t i = 0; i < S; ++i) q[i] = (g[i] - mdy - (p[i] - mean[c]) * k) * scale;
    }
}

}  // namespace cpu
}  // namespace backend
CHORUS_NAMESPACE_END
