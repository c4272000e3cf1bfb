#pragma once
// CPU kernels of the convolution, pooling and normalisation layers, on NCHW data. Plain
// loops over raw pointers; shapes arrive validated by ops/nn.hpp. Convolution itself is
// im2col + GEMM (blas.hpp) unless oneDNN is used (backend/cpu/dnnl.hpp).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "../../core/generator.hpp"
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
  parallel_for(planes, grain_for(g.H * g.W + g.OH * g.OW), [&](std::int64_t p0, std::int64_t p1) {
    for (std::int64_t p = p0; p < p1; ++p) {
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
  });
}

/// gx (zeroed) += gy scattered to the argmax positions.
template <class T>
void max_pool2d_backward(const T* gy, const std::int64_t* idx, std::int64_t planes, const Window2d& g, T* gx) {
  const std::int64_t L = g.OH * g.OW;
  parallel_for(planes, grain_for(g.H * g.W + g.OH * g.OW), [&](std::int64_t p0, std::int64_t p1) {
    for (std::int64_t p = p0; p < p1; ++p)
      for (std::int64_t o = 0; o < L; ++o)
        if (idx[p * L + o] >= 0) gx[p * g.H * g.W + idx[p * L + o]] += gy[p * L + o];
  });
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
  parallel_for(planes, grain_for(g.H * g.W + g.OH * g.OW), [&](std::int64_t p0, std::int64_t p1) {
    for (std::int64_t p = p0; p < p1; ++p) {
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
  });
}

template <class T>
void avg_pool2d_backward(const T* gy, std::int64_t planes, const Window2d& g, bool count_include_pad,
                         std::int64_t divisor_override, T* gx) {
  parallel_for(planes, grain_for(g.H * g.W + g.OH * g.OW), [&](std::int64_t p0, std::int64_t p1) {
    for (std::int64_t p = p0; p < p1; ++p) {
      T* gp = gx + p * g.H * g.W;
      for (std::int64_t oh = 0; oh < g.OH; ++oh)
        for (std::int64_t ow = 0; ow < g.OW; ++ow) {
          const auto win = avg_window(g, oh, ow, count_include_pad, divisor_override);
          const T v = static_cast<T>(gy[(p * g.OH + oh) * g.OW + ow] / win.divisor);
          for (std::int64_t h = win.h0; h < win.h1; ++h)
            for (std::int64_t w = win.w0; w < win.w1; ++w) gp[h * g.W + w] += v;
        }
    }
  });
}

/// Adaptive pooling windows: [floor(i*H/OH), ceil((i+1)*H/OH)).
inline std::int64_t adaptive_start(std::int64_t i, std::int64_t in, std::int64_t out) { return (i * in) / out; }
inline std::int64_t adaptive_end(std::int64_t i, std::int64_t in, std::int64_t out) {
  return ((i + 1) * in + out - 1) / out;
}

template <class T>
void adaptive_avg_pool2d(const T* x, std::int64_t planes, const Window2d& g, T* out) {
  parallel_for(planes, grain_for(g.H * g.W + g.OH * g.OW), [&](std::int64_t p0, std::int64_t p1) {
    for (std::int64_t p = p0; p < p1; ++p) {
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
  });
}

template <class T>
void adaptive_avg_pool2d_backward(const T* gy, std::int64_t planes, const Window2d& g, T* gx) {
  parallel_for(planes, grain_for(g.H * g.W + g.OH * g.OW), [&](std::int64_t p0, std::int64_t p1) {
    for (std::int64_t p = p0; p < p1; ++p) {
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
  });
}

}  // namespace cpu

// ---- batch normalisation on x viewed as [N, C, S] (S = H*W, 1 for BatchNorm1d on [N, C]) ----
// What the CPU loops and the CUDA kernels share (host/device, tested on the CPU).
//
// Note [batch-norm statistics]
// A training batch norm used to take ~15 launches on a GPU (channel sums, then the squared
// deviations, each with one block per channel: 16-64 blocks on a 132-SM GPU, latency bound,
// and a row of [C]-sized elementwise ops for invstd and the running statistics). Now:
//  1. One 2-D reduction pass over x: each block reduces a share of one channel (planar
//     layout) or of 32 adjacent columns of [N, C*S] (small S, coalesced across channels;
//     BnReducePlan), aiming at ~kBnTargetBlocks blocks. A thread sums its values around the
//     first one it reads (a pivot: no cancellation, no division per element) and turns them
//     into Welford statistics (n, mean, M2); the block combines those (Chan's pairwise
//     update) in a fixed order and writes one partial.
//  2. A warp per channel combines the channel's partials in a fixed order (deterministic,
//     no atomics) and finishes in the same kernel: invstd = 1/sqrt(M2/n + eps), and the
//     running statistics (unbiased variance) with momentum, or with 1 / num_batches_tracked
//     read on the device for momentum=None (BnFinish: no item(), no host sync).
//  3. The elementwise normalisation.
// The backward's Σdy and Σdy·(x-μ) use the same two-kernel reduction, the weight and bias
// gradients written by the combining kernel. SyncBatchNorm reduces local Welford statistics:
// Σ count·mean gives the global mean, then each participant's M2 around the global mean
// (its own M2 + n·(mean_r - mean)², never negative) sums to the global M2 — two [C]
// all-reduces and no second pass over x. Sums accumulate in double for float and double
// (bn_acc_t; float for 16-bit types), as the CPU loops do.

/// Accumulator of the batch-norm statistics: double for float and double (as the CPU sums
/// always were), float for 16-bit types (as PyTorch's accscalar_t).
template <class T>
using bn_acc_t = std::conditional_t<(sizeof(T) >= 4), double, float>;

/// Count, mean and M2 = Σ (x - mean)² of a set of values, in the form that combines (Chan et al.).
template <class A>
struct Welford {
  double n = 0;
  A mean = 0;
  A m2 = 0;
};

/// The statistics of the union of two disjoint sets (Chan, Golub, LeVeque's pairwise update).
template <class A>
CHORUS_HOST_DEVICE inline Welford<A> welford_combine(const Welford<A>& a, const Welford<A>& b) {
  if (b.n == 0) return a;
  if (a.n == 0) return b;
  const double n = a.n + b.n;
  const A fb = static_cast<A>(b.n / n);
  const A delta = b.mean - a.mean;
  return {n, a.mean + delta * fb, a.m2 + b.m2 + delta * delta * static_cast<A>(a.n) * fb};
}

/// The statistics of n values from their sums around a pivot (one of the values, so the sums
/// stay small and M2 does not cancel): s1 = Σ (x - pivot), s2 = Σ (x - pivot)².
template <class A>
CHORUS_HOST_DEVICE inline Welford<A> welford_from_shifted(double n, A pivot, A s1, A s2) {
  if (n == 0) return {};
  const A d = s1 / static_cast<A>(n);
  const A m2 = s2 - s1 * d;
  return {n, pivot + d, m2 > A(0) ? m2 : A(0)};
}

/// What finishing the statistics of a training batch norm writes (per channel): the mean and
/// 1/sqrt(var + eps) it normalises with, and the running statistics when they are tracked:
/// r = (1 - momentum)·r + momentum·stat, with the unbiased variance, and momentum =
/// 1 / *num_batches when num_batches is given (momentum=None: a cumulative average read on
/// the device, Note [batch-norm statistics]).
template <class T>
struct BnFinish {
  double count = 0;  // values per channel, over every participant
  double eps = 1e-5;
  T* mean = nullptr;
  T* invstd = nullptr;
  T* running_mean = nullptr;  // null: not tracked
  T* running_var = nullptr;
  double momentum = 0.1;
  const std::int64_t* num_batches = nullptr;
};

template <class T, class A>
CHORUS_HOST_DEVICE inline void bn_finish_channel(const BnFinish<T>& f, std::int64_t c, A mean, A m2) {
  const double var = static_cast<double>(m2) / f.count;  // biased, for normalising
  f.mean[c] = static_cast<T>(mean);
  f.invstd[c] = static_cast<T>(1.0 / ::sqrt(var + f.eps));
  if (f.running_mean) {
    const double mom = f.num_batches ? 1.0 / static_cast<double>(*f.num_batches) : f.momentum;
    f.running_mean[c] =
        static_cast<T>((1.0 - mom) * static_cast<double>(f.running_mean[c]) + mom * static_cast<double>(mean));
    f.running_var[c] = static_cast<T>((1.0 - mom) * static_cast<double>(f.running_var[c]) +
                                      mom * static_cast<double>(m2) / (f.count - 1.0));
  }
}

/// SyncBatchNorm, between its two reductions: `mean` holds Σ over the participants of each
/// one's count · mean and becomes the global mean; `m2` (this participant's M2 around its own
/// mean `local_mean` of `local_n` values) becomes its M2 around the global mean, so that the
/// sum of the m2s over the participants is the global M2 (no cancellation: each term is >= 0).
template <class A>
CHORUS_HOST_DEVICE inline void bn_sync_channel(A local_mean, double local_n, double count, A& mean, A& m2) {
  mean = mean / static_cast<A>(count);
  const A d = local_mean - mean;
  m2 = m2 + static_cast<A>(local_n) * d * d;
}

/// Walks the elements of one channel c of x [N, C, S] in the order of its flattened index
/// e = n*S + s, from a start e in steps of `step`, without a division per element: `off` is the
/// element's offset in x.
struct PlanarCursor {
  std::int64_t off, s, S, r, jump, wrap;
};
CHORUS_HOST_DEVICE inline PlanarCursor planar_cursor(std::int64_t C, std::int64_t S, std::int64_t c, std::int64_t e,
                                                     std::int64_t step) {
  const std::int64_t n = e / S, s = e - n * S, q = step / S, r = step - q * S;
  return {(n * C + c) * S + s, s, S, r, q * C * S + r, C * S - S};
}
CHORUS_HOST_DEVICE inline void advance(PlanarCursor& p) {
  p.s += p.r;
  p.off += p.jump;
  if (p.s >= p.S) {
    p.s -= p.S;
    p.off += p.wrap;
  }
}

/// How the per-channel reductions of [N, C, S] spread over a GPU (Note [batch-norm statistics]).
/// Planar (S >= kBnPlanarMinS): block (x, y) reduces elements [x*chunk, (x+1)*chunk) of
/// channel y's flattened N*S values (coalesced within each plane). Columns (small S, e.g.
/// BatchNorm1d's S = 1): x as [N, J = C*S], block (x, y) reduces rows [y*chunk, (y+1)*chunk) of
/// 32 consecutive columns (coalesced across columns). Either way each block writes one partial
/// per channel (planar) or per column (columns), and a second kernel combines a channel's
/// `entries()` partials in a fixed order (deterministic).
inline constexpr std::int64_t kBnPlanarMinS = 32;
inline constexpr int kBnThreads = 256, kBnColTile = 32, kBnColLanes = 8;
/// Blocks a reduction aims for: a few per SM on the largest GPUs (132 SMs on an H100/H200).
inline constexpr std::int64_t kBnTargetBlocks = 1024;
/// A thread walks at least this many elements (fewer blocks when there is little to do).
inline constexpr std::int64_t kBnMinPerThread = 8;

struct BnReducePlan {
  bool planar = true;
  std::int64_t N = 0, C = 0, S = 0;
  std::int64_t splits = 1;  // planar: blocks per channel; columns: row chunks
  std::int64_t chunk = 0;   // planar: channel values per block; columns: rows per block
  std::int64_t tiles = 0;   // columns: tiles of kBnColTile columns
  CHORUS_HOST_DEVICE std::int64_t entries() const { return planar ? splits : splits * S; }
  CHORUS_HOST_DEVICE std::int64_t partials() const { return planar ? C * splits : splits * C * S; }
  /// The index in the partials of entry k (< entries()) of channel c.
  CHORUS_HOST_DEVICE std::int64_t entry(std::int64_t c, std::int64_t k) const {
    return planar ? c * splits + k : (k / S) * (C * S) + c * S + k % S;
  }
};

inline BnReducePlan bn_reduce_plan(std::int64_t N, std::int64_t C, std::int64_t S,
                                   std::int64_t target_blocks = kBnTargetBlocks) {
  BnReducePlan p;
  p.N = N, p.C = C, p.S = S;
  p.planar = S >= kBnPlanarMinS;
  auto ceil_div = [](std::int64_t a, std::int64_t b) { return a / b + (a % b != 0); };
  if (p.planar) {
    const std::int64_t M = N * S;
    const std::int64_t most = std::max<std::int64_t>(1, M / (kBnThreads * kBnMinPerThread));
    p.splits = std::clamp<std::int64_t>(ceil_div(target_blocks, std::max<std::int64_t>(C, 1)), 1,
                                        std::min<std::int64_t>(most, 65535));
    p.chunk = ceil_div(M, p.splits);
    p.splits = p.chunk > 0 ? ceil_div(M, p.chunk) : 1;
  } else {
    p.tiles = ceil_div(C * S, kBnColTile);
    const std::int64_t xblocks = std::min<std::int64_t>(p.tiles, std::int64_t{1} << 20);
    const std::int64_t most = std::max<std::int64_t>(1, N / (kBnColLanes * kBnMinPerThread));
    p.splits = std::clamp<std::int64_t>(ceil_div(target_blocks, std::max<std::int64_t>(xblocks, 1)), 1,
                                        std::min<std::int64_t>(most, 65535));
    p.chunk = ceil_div(N, p.splits);
    p.splits = p.chunk > 0 ? ceil_div(N, p.chunk) : 1;
  }
  return p;
}

/// Calls f(offset in x) for every value thread `tid` (of `step` threads) of planar block (bx, c)
/// reduces (the CUDA kernels' walk, tested on the CPU).
template <class F>
CHORUS_HOST_DEVICE inline void planar_walk(const BnReducePlan& p, std::int64_t c, std::int64_t bx, std::int64_t tid,
                                           std::int64_t step, F&& f) {
  const std::int64_t M = p.N * p.S, end = (bx + 1) * p.chunk;
  const std::int64_t e1 = end < M ? end : M;
  std::int64_t e = bx * p.chunk + tid;
  if (e >= e1) return;
  PlanarCursor cur = planar_cursor(p.C, p.S, c, e, step);
#if defined(__CUDA_ARCH__)
#pragma unroll 4
#endif
  for (; e < e1; e += step) {
    f(cur.off);
    advance(cur);
  }
}

/// Calls f(offset in x) for every value thread (tx, ty) of column block (tile, by) reduces: rows
/// by*chunk + ty, + kBnColLanes, … of column tile*kBnColTile + tx of [N, C*S].
template <class F>
CHORUS_HOST_DEVICE inline void column_walk(const BnReducePlan& p, std::int64_t tile, std::int64_t by, int tx, int ty,
                                           F&& f) {
  const std::int64_t J = p.C * p.S, j = tile * kBnColTile + tx;
  if (j >= J) return;
  const std::int64_t n0 = by * p.chunk, n1 = n0 + p.chunk < p.N ? n0 + p.chunk : p.N;
  for (std::int64_t n = n0 + ty; n < n1; n += kBnColLanes) f(n * J + j);
}

namespace cpu {

/// Per-channel statistics of x: mean[c] and m2[c] = Σ (x - mean[c])² over n and s; with `fin`,
/// also the finished statistics. One pass in row-major order over a range of channels per
/// intra-op thread (each channel's sums around its first value).
template <class T, class A>
void bn_stats(const T* x, std::int64_t N, std::int64_t C, std::int64_t S, A* mean, A* m2, const BnFinish<T>* fin) {
  parallel_for(C, grain_for(N * S), [&](std::int64_t c0, std::int64_t c1) {
    const auto k = static_cast<std::size_t>(c1 - c0);
    std::vector<A> pivot(k, A(0)), s1(pivot), s2(pivot);
    if (N * S > 0)
      for (std::int64_t c = c0; c < c1; ++c) pivot[c - c0] = static_cast<A>(x[c * S]);
    for (std::int64_t n = 0; n < N; ++n)
      for (std::int64_t c = c0; c < c1; ++c) {
        const T* p = x + (n * C + c) * S;
        const A piv = pivot[c - c0];
        A a, b;
        vmath::shifted_sums<A>(p, S, piv, a, b);
        s1[c - c0] += a;
        s2[c - c0] += b;
      }
    for (std::int64_t c = c0; c < c1; ++c) {
      const auto w = welford_from_shifted<A>(static_cast<double>(N * S), pivot[c - c0], s1[c - c0], s2[c - c0]);
      if (mean) mean[c] = w.mean;
      if (m2) m2[c] = w.m2;
      if (fin) bn_finish_channel(*fin, c, w.mean, w.m2);
    }
  });
}

template <class T, class A>
void bn_finish(const A* mean, const A* m2, std::int64_t C, const BnFinish<T>& fin) {
  for (std::int64_t c = 0; c < C; ++c) bn_finish_channel(fin, c, mean[c], m2[c]);
}

template <class A>
void bn_sync_stats(const A* local_mean, double local_n, double count, A* mean, A* m2, std::int64_t C) {
  for (std::int64_t c = 0; c < C; ++c) bn_sync_channel(local_mean[c], local_n, count, mean[c], m2[c]);
}

/// sum[c] = Σ x[n, c, s]; sq[c] = Σ (x[n, c, s] - mean[c])^2 when mean is given.
template <class T>
void channel_sums(const T* x, std::int64_t N, std::int64_t C, std::int64_t S, const T* mean, T* out) {
  parallel_for(C, grain_for(N * S), [&](std::int64_t c0, std::int64_t c1) {
    for (std::int64_t c = c0; c < c1; ++c) {
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
  });
}

/// y = (x - mean[c]) * invstd[c] * w[c] + b[c] (w, b may be null).
template <class T>
void bn_apply(const T* x, std::int64_t N, std::int64_t C, std::int64_t S, const T* mean, const T* invstd, const T* w,
              const T* b, T* y) {
  parallel_for(N * C, grain_for(S), [&](std::int64_t p0, std::int64_t p1) {  // planes (n, c)
    for (std::int64_t nc = p0; nc < p1; ++nc) {
      const std::int64_t c = nc % C;
      const T scale = invstd[c] * (w ? w[c] : T(1));
      const T shift = (b ? b[c] : T(0)) - mean[c] * scale;
      const T* p = x + nc * S;
      T* q = y + nc * S;
      for (std::int64_t i = 0; i < S; ++i) q[i] = p[i] * scale + shift;
    }
  });
}

/// sums[c] = Σ gy, sums[C + c] = Σ gy * (x - mean[c]) (accumulator A); gw[c] = sums[C + c] *
/// invstd[c] and gb[c] = sums[c] when asked for (the local weight and bias gradients).
template <class T, class A>
void bn_backward_reduce(const T* gy, const T* x, std::int64_t N, std::int64_t C, std::int64_t S, const T* mean,
                        const T* invstd, A* sums, T* gw, T* gb) {
  parallel_for(C, grain_for(N * S), [&](std::int64_t c0, std::int64_t c1) {  // a range of channels per thread
    for (std::int64_t c = c0; c < c1; ++c) sums[c] = sums[C + c] = 0;
    for (std::int64_t n = 0; n < N; ++n)
      for (std::int64_t c = c0; c < c1; ++c) {
        const T* g = gy + (n * C + c) * S;
        const T* p = x + (n * C + c) * S;
        const A m = static_cast<A>(mean[c]);
        A s, sx;
        vmath::gradient_sums<A>(g, p, S, m, s, sx);
        sums[c] += s;
        sums[C + c] += sx;
      }
    for (std::int64_t c = c0; c < c1; ++c) {
      if (gw) gw[c] = static_cast<T>(sums[C + c] * static_cast<A>(invstd[c]));
      if (gb) gb[c] = static_cast<T>(sums[c]);
    }
  });
}

/// gx = (gy - sums[c]/count - (x - mean) * invstd^2 * sums[C+c]/count) * invstd * w
/// (inv_count = 1 / count).
template <class T, class A>
void bn_backward_input(const T* gy, const T* x, std::int64_t N, std::int64_t C, std::int64_t S, const T* mean,
                       const T* invstd, const T* w, const A* sums, double inv_count, T* gx) {
  parallel_for(N * C, grain_for(S), [&](std::int64_t p0, std::int64_t p1) {  // planes (n, c)
    for (std::int64_t nc = p0; nc < p1; ++nc) {
      const std::int64_t c = nc % C;
      const T mdy = static_cast<T>(sums[c] * inv_count);
      const T k = static_cast<T>(sums[C + c] * inv_count) * invstd[c] * invstd[c];
      const T scale = invstd[c] * (w ? w[c] : T(1));
      const T* g = gy + nc * S;
      const T* p = x + nc * S;
      T* q = gx + nc * S;
      for (std::int64_t i = 0; i < S; ++i) q[i] = (g[i] - mdy - (p[i] - mean[c]) * k) * scale;
    }
  });
}

// ---- dropout (Note [dropout random numbers], core/generator.hpp) ----

/// out[i] = in[i] * (kept ? scale : 0) for the local elements [first, end) whose stream indices
/// s0 + (i - first) fall into Philox subsequence g: one block of four numbers, shared by the CPU
/// loop and the CUDA kernel.
template <class T>
CHORUS_HOST_DEVICE inline void dropout_group(const T* in, T* out, std::int64_t first, std::int64_t end,
                                             std::uint64_t s0, const PhiloxLayout& l, std::uint64_t g,
                                             std::uint64_t threshold, T scale) {
  std::uint32_t r[4];
  philox_block(l.seed, g, l.offset, r);
  const std::uint64_t len = static_cast<std::uint64_t>(end - first);
  for (int w = 0; w < 4; ++w) {
    const std::uint64_t s = 4 * g + static_cast<std::uint64_t>(w);
    if (s < s0 || s - s0 >= len) continue;
    const std::int64_t i = first + static_cast<std::int64_t>(s - s0);
    out[i] = in[i] * (r[w] < threshold ? scale : T(0));
  }
}

/// How the CUDA kernel spreads dropout over threads: thread t takes Philox subsequence
/// s0/4 + t % gpr of run t / gpr, gpr (groups per run) covering any alignment of the run.
struct DropoutGrid {
  std::int64_t gpr, threads;
};
inline DropoutGrid dropout_grid(std::int64_t n, const PhiloxLayout& l) {
  const std::int64_t runs = (n + l.run - 1) / l.run, gpr = (l.run + 3) / 4 + 1;
  return {gpr, runs * gpr};
}
/// Thread t of the CUDA kernel (tested on the CPU by running every t).
template <class T>
CHORUS_HOST_DEVICE inline void dropout_thread(const T* in, T* out, std::int64_t n, const PhiloxLayout& l,
                                              std::int64_t gpr, std::int64_t t, std::uint64_t threshold, T scale) {
  const std::int64_t run = t / gpr, j = t - run * gpr;
  const std::int64_t first = run * l.run, end = first + l.run < n ? first + l.run : n;
  const std::uint64_t s0 = l.base + static_cast<std::uint64_t>(run) * l.stride;
  const std::uint64_t g = s0 / 4 + static_cast<std::uint64_t>(j);
  if (4 * g >= s0 + static_cast<std::uint64_t>(end - first)) return;
  dropout_group(in, out, first, end, s0, l, g, threshold, scale);
}

/// The dropout multiplier applied to n contiguous elements (forward: in = x; backward: in = dy).
template <class T>
void dropout_apply(const T* in, T* out, std::int64_t n, const PhiloxLayout& l, std::uint64_t threshold, T scale) {
  for (std::int64_t first = 0, k = 0; first < n; first += l.run, ++k) {
    const std::int64_t end = std::min(n, first + l.run);
    const std::uint64_t s0 = l.base + static_cast<std::uint64_t>(k) * l.stride;
    const std::uint64_t g_end = (s0 + static_cast<std::uint64_t>(end - first) + 3) / 4;
    for (std::uint64_t g = s0 / 4; g < g_end; ++g) dropout_group(in, out, first, end, s0, l, g, threshold, scale);
  }
}

}  // namespace cpu
}  // namespace backend
CHORUS_NAMESPACE_END
