#pragma once
// CPU kernels: plain loops over raw pointers, written so the compiler vectorises the inner
// loops. Shapes/strides arrive already validated by ops/.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "../../core/dtype.hpp"
#include "../../core/shape.hpp"
#include "../functors.hpp"
#include "parallel.hpp"
#include "vmath.hpp"

CHORUS_NAMESPACE_BEGIN
namespace backend::cpu {

/// Accumulator type for long sums: double for float (and 16-bit) inputs keeps reductions accurate.
template <class T>
using acc_t = std::conditional_t<std::is_same_v<T, float> || is_reduced_floating_v<T>, double, T>;

/// An element loaded for a functor: as its arithmetic type (float for bfloat16 and half, the
/// type itself otherwise), so that a 16-bit kernel evaluates the whole functor in float and
/// rounds its result once (Note [16-bit storage types]).
template <class T>
CHORUS_HOST_DEVICE inline fn::opmath_t<T> load(T v) {
  return static_cast<fn::opmath_t<T>>(v);
}

/// Visits `shape` in row-major order with K operands of the given strides; calls
/// inner(offsets, n_last, last_strides) once per innermost row.
template <std::size_t K, class Inner>
void nd_apply(const Shape& shape, const std::array<Strides, K>& strides, Inner&& inner) {
  const int nd = shape.size();
  if (numel_of(shape) == 0) return;
  std::array<std::int64_t, K> off{};
  if (nd == 0) {
    std::array<std::int64_t, K> zero{};
    inner(off, std::int64_t{1}, zero);
    return;
  }
  const std::int64_t n_last = shape[nd - 1];
  std::array<std::int64_t, K> last{};
  for (std::size_t k = 0; k < K; ++k) last[k] = strides[k][nd - 1];
  const std::int64_t outer = numel_of(shape) / n_last;
  std::int64_t idx[Dims::kMaxDims] = {};
  for (std::int64_t o = 0; o < outer; ++o) {
    inner(off, n_last, last);
    for (int d = nd - 2; d >= 0; --d) {
      ++idx[d];
      for (std::size_t k = 0; k < K; ++k) off[k] += strides[k][d];
      if (idx[d] < shape[d]) break;
      for (std::size_t k = 0; k < K; ++k) off[k] -= strides[k][d] * shape[d];
      idx[d] = 0;
    }
  }
}

template <class T>
void fill(T* out, std::int64_t n, T value) {
  parallel_for(n, [&](std::int64_t begin, std::int64_t end) { std::fill(out + begin, out + end, value); });
}

template <class T>
void arange(T* out, std::int64_t n, double start, double step) {
  for (std::int64_t i = 0; i < n; ++i) out[i] = static_cast<T>(start + step * static_cast<double>(i));
}

/// dst (with dst_strides) = src (with src_strides), both of `shape`.
template <class T>
void copy_strided(const T* src, const Strides& src_strides, T* dst, const Strides& dst_strides,
                  const Shape& shape) {
  nd_apply<2>(shape, {src_strides, dst_strides}, [&](const auto& off, std::int64_t n, const auto& st) {
    const T* s = src + off[0];
    T* d = dst + off[1];
    if (st[0] == 1 && st[1] == 1) {
      std::memcpy(d, s, static_cast<std::size_t>(n) * sizeof(T));
    } else {
      for (std::int64_t i = 0; i < n; ++i) d[i * st[1]] = s[i * st[0]];
    }
  });
}

template <class U, class T>
void convert(const T* src, U* dst, std::int64_t n) {
  if constexpr ((std::is_floating_point_v<T> || is_reduced_floating_v<T>) && std::is_integral_v<U>) {
    // Casting NaN or an out-of-range value to an integer is undefined behaviour in C++:
    // saturate instead, as CUDA's conversion instructions do (NaN -> 0).
    using F = fn::opmath_t<T>;
    constexpr U lo = std::numeric_limits<U>::min(), hi = std::numeric_limits<U>::max();
    for (std::int64_t i = 0; i < n; ++i) {
      const F v = load(src[i]);
      dst[i] = v != v ? U(0) : v <= static_cast<F>(lo) ? lo : v >= static_cast<F>(hi) ? hi : static_cast<U>(v);
    }
  } else {
    parallel_for(n, [&](std::int64_t begin, std::int64_t end) {
      for (std::int64_t i = begin; i < end; ++i) dst[i] = static_cast<U>(src[i]);
    });
  }
}

template <class T, class Op>
void unary(const T* in, T* out, std::int64_t n, Op op) {
  parallel_for(n, [&](std::int64_t begin, std::int64_t end) {
    for (std::int64_t i = begin; i < end; ++i) out[i] = static_cast<T>(op(load(in[i])));
  });
}

/// out[i] = op(a[i], b[i]) for contiguous operands of equal size.
template <class T, class Op>
void binary_same(const T* a, const T* b, T* out, std::int64_t n, Op op) {
  parallel_for(n, [&](std::int64_t begin, std::int64_t end) {
    for (std::int64_t i = begin; i < end; ++i) out[i] = static_cast<T>(op(load(a[i]), load(b[i])));
  });
}

/// out (contiguous, `shape`) = op(a, b) with broadcast strides (0 on broadcast dimensions).
template <class T, class Op>
void binary_broadcast(const T* a, const Strides& as, const T* b, const Strides& bs, T* out,
                      const Shape& shape, Op op) {
  at_cpu_width([&] {
    nd_apply<3>(shape, {as, bs, contiguous_strides(shape)},
                [&](const auto& off, std::int64_t n, const auto& st) {
                  const T* pa = a + off[0];
                  const T* pb = b + off[1];
                  T* po = out + off[2];
                  if (st[0] == 1 && st[1] == 1) {
                    for (std::int64_t i = 0; i < n; ++i) po[i] = static_cast<T>(op(load(pa[i]), load(pb[i])));
                  } else if (st[0] == 1 && st[1] == 0) {
                    const auto vb = load(*pb);
                    for (std::int64_t i = 0; i < n; ++i) po[i] = static_cast<T>(op(load(pa[i]), vb));
                  } else if (st[0] == 0 && st[1] == 1) {
                    const auto va = load(*pa);
                    for (std::int64_t i = 0; i < n; ++i) po[i] = static_cast<T>(op(va, load(pb[i])));
                  } else {
                    for (std::int64_t i = 0; i < n; ++i)
                      po[i] = static_cast<T>(op(load(pa[i * st[0]]), load(pb[i * st[1]])));
                  }
                });
  });
}

/// dst += src reduced onto dst's (broadcast) strides; src is contiguous of `shape`.
template <class T>
void reduce_add_broadcast(const T* src, const Shape& shape, T* dst, const Strides& dst_strides) {
  at_cpu_width([&] {
    nd_apply<2>(shape, {contiguous_strides(shape), dst_strides},
                [&](const auto& off, std::int64_t n, const auto& st) {
                  const T* s = src + off[0];
                  T* d = dst + off[1];
                  if (st[1] == 0) {
                    acc_t<T> acc = 0;
                    for (std::int64_t i = 0; i < n; ++i) acc += s[i];
                    if constexpr (is_reduced_floating_v<T>) {
                      *d = static_cast<T>(acc + static_cast<acc_t<T>>(*d));  // one rounding
                    } else {
                      *d += static_cast<T>(acc);
                    }
                  } else {
                    for (std::int64_t i = 0; i < n; ++i) d[i * st[1]] += s[i];
                  }
                });
  });
}

template <class T>
acc_t<T> sum_all(const T* in, std::int64_t n) {
  // Four partial sums: vectorisable and more accurate than one running sum.
  acc_t<T> s[4] = {0, 0, 0, 0};
  std::int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    s[0] += in[i];
    s[1] += in[i + 1];
    s[2] += in[i + 2];
    s[3] += in[i + 3];
  }
  for (; i < n; ++i) s[0] += in[i];
  return (s[0] + s[1]) + (s[2] + s[3]);
}

/// out[o, j] = scale * sum_i in[o, i, j] for contiguous in viewed as [outer, n, inner].
template <class T>
void sum_dim(const T* in, std::int64_t outer, std::int64_t n, std::int64_t inner, T* out, double scale) {
  at_cpu_width([&] {
    for (std::int64_t o = 0; o < outer; ++o) {
      const T* base = in + o * n * inner;
      T* dst = out + o * inner;
      if (inner == 1) {
        dst[0] = static_cast<T>(sum_all(base, n) * scale);
        continue;
      }
      if constexpr (is_reduced_floating_v<T>) {  // accumulate in double, round once
        std::vector<double> acc(static_cast<std::size_t>(inner), 0.0);
        for (std::int64_t i = 0; i < n; ++i) {
          const T* row = base + i * inner;
          for (std::int64_t j = 0; j < inner; ++j) acc[j] += row[j];
        }
        for (std::int64_t j = 0; j < inner; ++j) dst[j] = static_cast<T>(acc[j] * scale);
        continue;
      } else {
        std::fill(dst, dst + inner, T(0));
        for (std::int64_t i = 0; i < n; ++i) {
          const T* row = base + i * inner;
          for (std::int64_t j = 0; j < inner; ++j) dst[j] += row[j];
        }
        if (scale != 1.0)
          for (std::int64_t j = 0; j < inner; ++j) dst[j] = static_cast<T>(dst[j] * scale);
      }
    }
  });
}

/// out[o, i, j] = in[o, j] * scale (the backward of sum_dim).
template <class T>
void expand_dim(const T* in, std::int64_t outer, std::int64_t n, std::int64_t inner, T* out, double scale) {
  at_cpu_width([&] {
    for (std::int64_t o = 0; o < outer; ++o)
      for (std::int64_t i = 0; i < n; ++i) {
        T* dst = out + (o * n + i) * inner;
        const T* src = in + o * inner;
        for (std::int64_t j = 0; j < inner; ++j) dst[j] = static_cast<T>(src[j] * scale);
      }
  });
}

/// Softmax (or log-softmax) over the middle axis of [outer, n, inner]. `zero_dead`: a row whose
/// every element is -inf gets zeros instead of NaN (the attention core's rows whose keys are all
/// masked, Note [fully masked rows]); its backward, y * (g - sum(g * y)), is then 0 as well.
template <class T>
void softmax(const T* in, std::int64_t outer, std::int64_t n, std::int64_t inner, T* out, bool log_space,
             bool zero_dead = false) {
  at_cpu_width([&] {
    constexpr T ninf = -std::numeric_limits<T>::infinity();
    if (inner == 1) {  // contiguous rows: exp into the output once (a loop that vectorizes), then scale
      for (std::int64_t o = 0; o < outer; ++o) {
        const T* x = in + o * n;
        T* y = out + o * n;
        const T mx = vmath::max(x, n);
        if (zero_dead && mx == ninf) {
          std::fill(y, y + n, T(0));
          continue;
        }
        for (std::int64_t i = 0; i < n; ++i) y[i] = vmath::exp(x[i] - mx);
        const acc_t<T> s = vmath::sum<acc_t<T>>(y, n);
        if (log_space) {
          const T lse = mx + static_cast<T>(std::log(s));
          for (std::int64_t i = 0; i < n; ++i) y[i] = x[i] - lse;
        } else {
          const T inv = static_cast<T>(1.0 / s);
          for (std::int64_t i = 0; i < n; ++i) y[i] *= inv;
        }
      }
      return;
    }
    for (std::int64_t o = 0; o < outer; ++o)
      for (std::int64_t j = 0; j < inner; ++j) {
        const T* x = in + o * n * inner + j;
        T* y = out + o * n * inner + j;
        T mx = ninf;
        for (std::int64_t i = 0; i < n; ++i) mx = std::max(mx, x[i * inner]);
        if (zero_dead && mx == ninf) {
          for (std::int64_t i = 0; i < n; ++i) y[i * inner] = T(0);
          continue;
        }
        acc_t<T> s = 0;
        for (std::int64_t i = 0; i < n; ++i) s += vmath::exp(x[i * inner] - mx);
        if (log_space) {
          T lse = mx + static_cast<T>(std::log(s));
          for (std::int64_t i = 0; i < n; ++i) y[i * inner] = x[i * inner] - lse;
        } else {
          T inv = static_cast<T>(1.0 / s);
          for (std::int64_t i = 0; i < n; ++i) y[i * inner] = vmath::exp(x[i * inner] - mx) * inv;
        }
      }
  });
}

/// Backward of softmax / log_softmax given the forward output y and the output gradient g.
template <class T>
void softmax_backward(const T* g, const T* y, std::int64_t outer, std::int64_t n, std::int64_t inner,
                      T* gx, bool log_space) {
  at_cpu_width([&] {
    for (std::int64_t o = 0; o < outer; ++o)
      for (std::int64_t j = 0; j < inner; ++j) {
        const std::int64_t base = o * n * inner + j;
        acc_t<T> s = 0;
        if (log_space) {
          for (std::int64_t i = 0; i < n; ++i) s += g[base + i * inner];
          for (std::int64_t i = 0; i < n; ++i)
            gx[base + i * inner] = g[base + i * inner] - std::exp(y[base + i * inner]) * static_cast<T>(s);
        } else {
          for (std::int64_t i = 0; i < n; ++i) s += g[base + i * inner] * y[base + i * inner];
          for (std::int64_t i = 0; i < n; ++i)
            gx[base + i * inner] = y[base + i * inner] * (g[base + i * inner] - static_cast<T>(s));
        }
      }
  });
}

/// out[o, k, j] = in[o, idx[k], j].
template <class T>
void index_select(const T* in, std::int64_t outer, std::int64_t n, std::int64_t inner,
                  const std::int64_t* idx, std::int64_t k, T* out) {
  for (std::int64_t o = 0; o < outer; ++o)
    for (std::int64_t r = 0; r < k; ++r)
      std::memcpy(out + (o * k + r) * inner, in + (o * n + idx[r]) * inner,
                  static_cast<std::size_t>(inner) * sizeof(T));
}

/// out[o, idx[k], j] += in[o, k, j] (the backward of index_select).
template <class T>
void index_add(const T* in, std::int64_t outer, std::int64_t n, std::int64_t inner,
               const std::int64_t* idx, std::int64_t k, T* out) {
  at_cpu_width([&] {
    for (std::int64_t o = 0; o < outer; ++o)
      for (std::int64_t r = 0; r < k; ++r) {
        T* d = out + (o * n + idx[r]) * inner;
        const T* s = in + (o * k + r) * inner;
        for (std::int64_t j = 0; j < inner; ++j) d[j] += s[j];
      }
  });
}

/// Writes bias into every row of out[rows, cols] (the start of a fused linear).
template <class T>
void broadcast_rows(const T* bias, std::int64_t rows, std::int64_t cols, T* out) {
  for (std::int64_t r = 0; r < rows; ++r) std::memcpy(out + r * cols, bias, static_cast<std::size_t>(cols) * sizeof(T));
}

/// sum((a - b)^2) over n elements.
template <class T>
acc_t<T> squared_error_sum(const T* a, const T* b, std::int64_t n) {
  acc_t<T> s[4] = {0, 0, 0, 0};
  std::int64_t i = 0;
  for (; i + 4 <= n; i += 4)
    for (int k = 0; k < 4; ++k) {
      T d = a[i + k] - b[i + k];
      s[k] += d * d;
    }
  for (; i < n; ++i) {
    T d = a[i] - b[i];
    s[0] += d * d;
  }
  return (s[0] + s[1]) + (s[2] + s[3]);
}

/// ga = scale * (a - b) (and gb = -ga when gb is not null); scale may be per element.
template <class T>
void squared_error_backward(const T* a, const T* b, std::int64_t n, T scale, const T* gscale, T* ga, T* gb) {
  // One plain loop per case (the usual one: a scalar scale and only ga), so each vectorises.
  if (!gscale && ga && !gb) {
    parallel_for(n, [&](std::int64_t begin, std::int64_t end) {
      for (std::int64_t i = begin; i < end; ++i) ga[i] = scale * (a[i] - b[i]);
    });
    return;
  }
  for (std::int64_t i = 0; i < n; ++i) {
    T s = gscale ? gscale[i] * scale : scale;
    T v = s * (a[i] - b[i]);
    if (ga) ga[i] = v;
    if (gb) gb[i] = -v;
  }
}

/// Max of a row of C logits and the sum of exp(x - max) over it.
template <class T>
void row_max_sumexp(const T* x, std::int64_t C, T& mx, acc_t<T>& s) {
  mx = *std::max_element(x, x + C);
  s = 0;
  for (std::int64_t c = 0; c < C; ++c) s += std::exp(x[c] - mx);
}

/// Per-row cross entropy of logits[N, C] against integer targets (validated by the caller;
/// an out-of-range one is skipped, never read); rows whose target is ignore_index get 0.
template <class T>
void cross_entropy_forward(const T* logits, std::int64_t N, std::int64_t C, const std::int64_t* target,
                           std::int64_t ignore_index, T* loss) {
  at_cpu_width([&] {
    for (std::int64_t r = 0; r < N; ++r) {
      const std::int64_t t = target[r];
      if (t == ignore_index || t < 0 || t >= C) {
        loss[r] = 0;
        continue;
      }
      const T* x = logits + r * C;
      T mx;
      acc_t<T> s;
      row_max_sumexp(x, C, mx, s);
      loss[r] = static_cast<T>(mx + std::log(s) - x[t]);
    }
  });
}

/// grad[r, :] = g[r] * (softmax(logits[r]) - onehot(target[r])); zero for ignored rows.
template <class T>
void cross_entropy_backward(const T* logits, std::int64_t N, std::int64_t C, const std::int64_t* target,
                            std::int64_t ignore_index, const T* g, std::int64_t g_stride, T* grad) {
  at_cpu_width([&] {
    for (std::int64_t r = 0; r < N; ++r) {
      T* gr = grad + r * C;
      const std::int64_t t = target[r];
      if (t == ignore_index) {
        std::fill(gr, gr + C, T(0));
        continue;
      }
      const T* x = logits + r * C;
      const T gv = g[r * g_stride];
      T mx;
      acc_t<T> s;
      row_max_sumexp(x, C, mx, s);
      const T inv = static_cast<T>(1.0 / s);
      for (std::int64_t c = 0; c < C; ++c) gr[c] = gv * std::exp(x[c] - mx) * inv;
      gr[t] -= gv;
    }
  });
}

/// loss[r] = -logp[r, target[r]] (targets validated by the caller, as above).
template <class T>
void nll_forward(const T* logp, std::int64_t N, std::int64_t C, const std::int64_t* target, std::int64_t ignore_index,
                 T* loss) {
  for (std::int64_t r = 0; r < N; ++r) {
    const std::int64_t t = target[r];
    loss[r] = (t == ignore_index || t < 0 || t >= C) ? T(0) : -logp[r * C + t];
  }
}

template <class T>
void nll_backward(std::int64_t N, std::int64_t C, const std::int64_t* target, std::int64_t ignore_index,
                  const T* g, std::int64_t g_stride, T* grad) {
  std::fill(grad, grad + N * C, T(0));
  for (std::int64_t r = 0; r < N; ++r)
    if (target[r] != ignore_index) grad[r * C + target[r]] = -g[r * g_stride];
}

/// One SGD step on a flat parameter (PyTorch's torch.optim.SGD rule).
template <class T>
void sgd_step(T* p, const T* g, T* buf, std::int64_t n, double lr, double momentum, double dampening,
              double weight_decay, bool nesterov, bool first_step, bool maximize) {
  const T lr_ = T(lr), mom = T(momentum), damp = T(1.0 - dampening), wd = T(weight_decay);
  parallel_for(n, [&](std::int64_t begin, std::int64_t end) {
    if (momentum == 0 && weight_decay == 0 && !maximize) {  // plain SGD: one vectorised loop
      for (std::int64_t i = begin; i < end; ++i) p[i] -= lr_ * g[i];
      return;
    }
    for (std::int64_t i = begin; i < end; ++i) {
      T d = maximize ? -g[i] : g[i];
      if (weight_decay != 0) d += wd * p[i];
      if (momentum != 0) {
        T b = first_step ? d : mom * buf[i] + damp * d;
        buf[i] = b;
        d = nesterov ? d + mom * b : b;
      }
      p[i] -= lr_ * d;
    }
  });
}

/// One Adam / AdamW step on a flat parameter (torch.optim.Adam / AdamW rules).
template <class T>
void adam_step(T* p, const T* g, T* m, T* v, T* vmax, std::int64_t n, double lr, double beta1, double beta2,
               double eps, double weight_decay, bool decoupled, std::int64_t step, bool maximize) {
  const double bc1 = 1.0 - std::pow(beta1, static_cast<double>(step));
  const double bc2 = 1.0 - std::pow(beta2, static_cast<double>(step));
  const T step_size = static_cast<T>(lr / bc1);
  const T bc2_sqrt = static_cast<T>(std::sqrt(bc2));
  const T b1 = T(beta1), b2 = T(beta2), e = T(eps);
  const T decay = static_cast<T>(1.0 - lr * weight_decay), wd = T(weight_decay);
  parallel_for(n, [&](std::int64_t begin, std::int64_t end) {
  for (std::int64_t i = begin; i < end; ++i) {
    T gi = maximize ? -g[i] : g[i];
    if (decoupled) {
      p[i] *= decay;
    } else if (weight_decay != 0) {
      gi += wd * p[i];
    }
    m[i] = b1 * m[i] + (T(1) - b1) * gi;
    v[i] = b2 * v[i] + (T(1) - b2) * gi * gi;
    T vhat = v[i];
    if (vmax) {
      vmax[i] = fn::Maximum{}(vmax[i], v[i]);  // NaN propagates, as torch.maximum
      vhat = vmax[i];
    }
    T denom = std::sqrt(vhat) / bc2_sqrt + e;
    p[i] -= step_size * m[i] / denom;
  }
  });
}

}  // namespace backend::cpu
CHORUS_NAMESPACE_END
