#pragma once
// Device dispatch: tensor-level kernels that run the CPU loops or the CUDA kernels depending
// on the tensors' device. ops/ calls these; they do no autograd and little validation
// (callers pass contiguous tensors where a function says so).
#include <cstdint>
#include <vector>

#include "../compiled.hpp"
#include "../core/generator.hpp"
#include "../core/tensor.hpp"
#include "cpu/blas.hpp"
#include "cpu/foreach.hpp"
#include "cpu/kernels.hpp"
#if CHORUS_CUDA
#include "cuda/foreach.cuh"
#include "cuda/kernels.cuh"
#endif

CHORUS_NAMESPACE_BEGIN
namespace backend {

#if CHORUS_CUDA
#define CHORUS_DISPATCH(dev, cpu_call, cuda_call) \
  do {                                            \
    if ((dev).is_cpu()) {                         \
      cpu_call;                                   \
    } else {                                      \
      cuda_call;                                  \
    }                                             \
  } while (0)
#else
#define CHORUS_DISPATCH(dev, cpu_call, cuda_call) \
  do {                                            \
    if ((dev).is_cpu()) {                         \
      cpu_call;                                   \
    } else {                                      \
      ::chorus::check_device(dev);                \
    }                                             \
  } while (0)
#endif

// Note [16-bit kernels]
// bfloat16 and half tensors run on kernels that compute in float and round once: on both
// backends the elementwise kernels (opmath loads of the functors), fills, copies, conversions,
// gathers and the sums (double accumulators); the matrix products (CPU: float blocks around
// sgemm; CUDA: cublasGemmEx with 16-bit operands and CUBLAS_COMPUTE_32F); the rest through a
// float copy (Note [16-bit through float]). A backend function without a 16-bit path still
// compiles for them (generic code visits every dtype of an AnyTensor: optimizers,
// DataParallel, checkpoints) but throws a chorus::Error naming the kernel and the dtype, and
// never instantiates the float kernel with a 16-bit T: nothing runs with silent extra
// roundings. CHORUS_DISPATCH(dev, cpu, cuda) is for kernels with 16-bit paths on both
// backends (or none needed); CHORUS_DISPATCH_T(T, name, dev, cpu, cuda) for those with a CPU
// 16-bit path only: for a 16-bit T it runs the CPU call and refuses a CUDA device.
//
// Note [16-bit through float]
// Kernels whose arithmetic is a whole-row affair (softmax, the losses, cumsum) take 16-bit
// tensors by widening their inputs into float scratch tensors, running the float kernel and
// rounding each result once on the way back: exactly "compute in float, round once", at the
// price of one float copy of the operands (allocated on the tensor's device, so memory_stats
// sees it). On CUDA the kernels that add with atomics (reduce_add_broadcast, index_add) do the
// same: there is no atomic add of chorus's 16-bit types. A kernel that is memory-bound in 16
// bits (the elementwise ones) has its own 16-bit loop instead.
namespace detail {
template <class T>
[[noreturn]] void no_reduced_kernel(const char* kernel, Device d = Device::cpu()) {
  CHORUS_FAIL(kernel, ": no ", dtype_name(dtype_of<T>()), " kernel", d.is_cuda() ? " for CUDA devices" : "",
              " yet; convert with .to<float>() first");
}

}  // namespace detail

#define CHORUS_DISPATCH_T(T, name, dev, cpu_call, cuda_call)                   \
  do {                                                                         \
    if constexpr (::chorus::is_reduced_floating_v<T>) {                        \
      if ((dev).is_cpu()) {                                                    \
        cpu_call;                                                              \
      } else {                                                                 \
        ::chorus::backend::detail::no_reduced_kernel<T>(name, (dev));          \
      }                                                                        \
    } else {                                                                   \
      CHORUS_DISPATCH(dev, cpu_call, cuda_call);                               \
    }                                                                          \
  } while (0)

template <class T>
void fill(const Tensor<T>& out, T value) {  // out contiguous
  CHORUS_DISPATCH(out.device(), cpu::fill(out.data(), out.numel(), value),
                  cuda::fill(out.data(), out.numel(), value, out.device()));
}

template <class T>
void arange(const Tensor<T>& out, double start, double step) {
  CHORUS_DISPATCH(out.device(), cpu::arange(out.data(), out.numel(), start, step),
                  cuda::arange(out.data(), out.numel(), start, step, out.device()));
}

/// dst = src elementwise for two tensors of one shape, any strides, any devices.
template <class T>
void copy(const Tensor<T>& dst, const Tensor<T>& src) {
  const Device dd = dst.device(), sd = src.device();
  if (dd == sd) {
    if (dst.is_contiguous() && src.is_contiguous()) {
      copy_bytes(dst.data(), dd, src.data(), sd, static_cast<std::size_t>(src.numel()) * sizeof(T));
      return;
    }
    CHORUS_DISPATCH(dd,
                    cpu::copy_strided(src.data(), src.strides(), dst.data(), dst.strides(), src.shape()),
                    cuda::copy_strided(src.data(), src.strides(), dst.data(), dst.strides(), src.shape(), dd));
    return;
  }
  // Across devices: make the source contiguous on its device, move the bytes, then scatter
  // into the destination's layout on its device.
  Tensor<T> s = src;
  if (!s.is_contiguous()) {
    s = Tensor<T>::empty(src.shape(), sd);
    copy(s, src);
  }
  if (dst.is_contiguous()) {
    copy_bytes(dst.data(), dd, s.data(), sd, static_cast<std::size_t>(s.numel()) * sizeof(T));
    return;
  }
  Tensor<T> d = Tensor<T>::empty(src.shape(), dd);
  copy_bytes(d.data(), dd, s.data(), sd, static_cast<std::size_t>(s.numel()) * sizeof(T));
  copy(dst, d);
}

/// dst = static_cast<U>(src), both contiguous on one device.
template <class U, class T>
void convert(const Tensor<U>& dst, const Tensor<T>& src) {
  CHORUS_DISPATCH(src.device(), cpu::convert(src.data(), dst.data(), src.numel()),
                cuda::convert(src.data(), dst.data(), src.numel(), src.device()));
}

namespace detail {
/// A float copy of a contiguous 16-bit tensor (`copy` false: uninitialised scratch of its
/// shape) on its device, for the float kernel (Note [16-bit through float]).
template <class T>
Tensor<float> widened(const char* kernel, const Tensor<T>& t, bool copy = true) {
  (void)kernel;
  auto f = Tensor<float>::empty(t.shape(), t.device());
  if (copy) convert(f, t);
  return f;
}
/// Writes the float kernel's result into the 16-bit tensor, each value rounded once.
template <class T>
void round_into(const Tensor<float>& f, const Tensor<T>& out) {
  convert(out, f);
}
}  // namespace detail

template <class T, class Op>
void unary(const Tensor<T>& in, const Tensor<T>& out, Op op) {  // contiguous
  CHORUS_DISPATCH(in.device(), cpu::unary(in.data(), out.data(), in.numel(), op),
                  cuda::unary(in.data(), out.data(), in.numel(), op, in.device()));
}

template <class T, class Op>
void binary_same(const Tensor<T>& a, const Tensor<T>& b, const Tensor<T>& out, Op op) {  // contiguous
  CHORUS_DISPATCH(a.device(), cpu::binary_same(a.data(), b.data(), out.data(), a.numel(), op),
                  cuda::binary_same(a.data(), b.data(), out.data(), a.numel(), op, a.device()));
}

/// out (contiguous) = op(a, b) with a, b read through strides expanded to out's shape.
template <class T, class Op>
void binary_broadcast(const Tensor<T>& a, const Strides& as, const Tensor<T>& b, const Strides& bs,
                      const Tensor<T>& out, Op op) {
  CHORUS_DISPATCH(a.device(),
                  cpu::binary_broadcast(a.data(), as, b.data(), bs, out.data(), out.shape(), op),
                  cuda::binary_broadcast(a.data(), as, b.data(), bs, out.data(), out.shape(), op, a.device()));
}

/// dst += src summed onto dst's broadcast strides (src contiguous).
template <class T>
void reduce_add_broadcast(const Tensor<T>& src, const Tensor<T>& dst, const Strides& dst_strides) {
  if constexpr (is_reduced_floating_v<T>) {
    if (src.device().is_cuda()) {  // atomics in float (Note [16-bit through float]); dst is contiguous
      CHORUS_CHECK(dst.is_contiguous(), "reduce_add_broadcast: a 16-bit CUDA destination must be contiguous");
      auto fd = detail::widened("reduce_add_broadcast", dst);
      reduce_add_broadcast(detail::widened("reduce_add_broadcast", src), fd, dst_strides);
      detail::round_into(fd, dst);
      return;
    }
  }
  CHORUS_DISPATCH_T(T, "reduce_add_broadcast", src.device(),
                    cpu::reduce_add_broadcast(src.data(), src.shape(), dst.data(), dst_strides),
                    cuda::reduce_add_broadcast(src.data(), src.shape(), dst.data(), dst_strides, src.device()));
}

/// out (one element) = scale * sum(in), in contiguous.
template <class T>
void sum_all(const Tensor<T>& in, const Tensor<T>& out, double scale) {
  CHORUS_DISPATCH(in.device(),
                  *out.data() = static_cast<T>(cpu::sum_all(in.data(), in.numel()) * scale),
                  cuda::sum_dim(in.data(), 1, in.numel(), 1, out.data(), scale, in.device()));
}

template <class T>
void sum_dim(const Tensor<T>& in, std::int64_t outer, std::int64_t n, std::int64_t inner, const Tensor<T>& out,
             double scale) {
  CHORUS_DISPATCH(in.device(), cpu::sum_dim(in.data(), outer, n, inner, out.data(), scale),
                  cuda::sum_dim(in.data(), outer, n, inner, out.data(), scale, in.device()));
}

template <class T>
void expand_dim(const Tensor<T>& in, std::int64_t outer, std::int64_t n, std::int64_t inner, const Tensor<T>& out,
                double scale) {
  CHORUS_DISPATCH(in.device(), cpu::expand_dim(in.data(), outer, n, inner, out.data(), scale),
                  cuda::expand_dim(in.data(), outer, n, inner, out.data(), scale, in.device()));
}

/// `zero_dead`: rows of -inf give zeros, not NaN (cpu::softmax).
template <class T>
void softmax(const Tensor<T>& in, std::int64_t outer, std::int64_t n, std::int64_t inner, const Tensor<T>& out,
             bool log_space, bool zero_dead = false) {
  if constexpr (is_reduced_floating_v<T>) {  // Note [16-bit through float]
    auto fo = detail::widened("softmax", out, false);
    softmax(detail::widened("softmax", in), outer, n, inner, fo, log_space, zero_dead);
    detail::round_into(fo, out);
  } else {
    CHORUS_DISPATCH(in.device(), cpu::softmax(in.data(), outer, n, inner, out.data(), log_space, zero_dead),
                    cuda::softmax(in.data(), outer, n, inner, out.data(), log_space, zero_dead, in.device()));
  }
}

template <class T>
void softmax_backward(const Tensor<T>& g, const Tensor<T>& y, std::int64_t outer, std::int64_t n,
                      std::int64_t inner, const Tensor<T>& gx, bool log_space) {
  if constexpr (is_reduced_floating_v<T>) {
    auto fgx = detail::widened("softmax_backward", gx, false);
    softmax_backward(detail::widened("softmax_backward", g), detail::widened("softmax_backward", y), outer, n, inner,
                     fgx, log_space);
    detail::round_into(fgx, gx);
  } else {
    CHORUS_DISPATCH(g.device(), cpu::softmax_backward(g.data(), y.data(), outer, n, inner, gx.data(), log_space),
                    cuda::softmax_backward(g.data(), y.data(), outer, n, inner, gx.data(), log_space, g.device()));
  }
}

/// CPU: the caller validated the indices. CUDA: the kernel does (Note [device-side validation];
/// `dim` names the dimension in its report).
template <class T>
void index_select(const Tensor<T>& in, std::int64_t outer, std::int64_t n, std::int64_t inner,
                  const Tensor<std::int64_t>& idx, const Tensor<T>& out, int dim = 0) {
  (void)dim;
  CHORUS_DISPATCH(in.device(),
                  cpu::index_select(in.data(), outer, n, inner, idx.data(), idx.numel(), out.data()),
                  cuda::index_select(in.data(), outer, n, inner, idx.data(), idx.numel(), out.data(), dim,
                                   in.device()));
}

template <class T>
void index_add(const Tensor<T>& in, std::int64_t outer, std::int64_t n, std::int64_t inner,
               const Tensor<std::int64_t>& idx, const Tensor<T>& out) {
  if constexpr (is_reduced_floating_v<T>) {
    if (in.device().is_cuda()) {  // atomics in float (Note [16-bit through float])
      auto fo = detail::widened("index_add", out);
      index_add(detail::widened("index_add", in), outer, n, inner, idx, fo);
      detail::round_into(fo, out);
      return;
    }
  }
  CHORUS_DISPATCH_T(T, "index_add", in.device(),
                    cpu::index_add(in.data(), outer, n, inner, idx.data(), idx.numel(), out.data()),
                    cuda::index_add(in.data(), outer, n, inner, idx.data(), idx.numel(), out.data(), in.device()));
}

/// Row-major C = alpha op(A) op(B) + beta C on one device.
template <class T>
void gemm(bool ta, bool tb, std::int64_t M, std::int64_t N, std::int64_t K, T alpha, const T* A, std::int64_t lda,
          const T* B, std::int64_t ldb, T beta, T* C, std::int64_t ldc, Device dev) {
  // CBLAS and cuBLAS take int sizes: a larger one would be truncated into a wrong,
  // out-of-bounds call (Note [checked sizes]).
  constexpr std::int64_t kMax = INT32_MAX;
  CHORUS_CHECK(M <= kMax && N <= kMax && K <= kMax && lda <= kMax && ldb <= kMax && ldc <= kMax, "gemm: sizes M=", M,
               " N=", N, " K=", K, " (lda ", lda, ", ldb ", ldb, ", ldc ", ldc,
               ") exceed the 32-bit BLAS interface (at most ", kMax, ")");
  CHORUS_DISPATCH(dev, cpu::gemm(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc),
                  cuda::gemm(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc, dev));
}

/// out[M,N] = x[M,K] @ w[N,K]^T (+ bias[N]) for contiguous row-major x and w. On CUDA a
/// float32 product with a bias is one cuBLASLt call with the bias fused into its epilogue.
template <class T>
void linear_forward(const Tensor<T>& x, const Tensor<T>& w, const Tensor<T>* bias, const Tensor<T>& out) {
  const auto M = x.size(0), K = x.size(1), N = w.size(0);
  const Device d = x.device();
#if CHORUS_CUDA
  if constexpr (std::is_same_v<T, float>) {
    if (d.is_cuda() && bias && M > 0 && N > 0 && K > 0 &&
        cuda::linear_bias_lt(x.data(), w.data(), bias->data(), out.data(), M, N, K, d))
      return;
  }
#endif
  T beta = T(0);
  if (bias && M > 0) {
    CHORUS_DISPATCH(d, cpu::broadcast_rows(bias->data(), M, N, out.data()),
                    cuda::broadcast_rows(bias->data(), M, N, out.data(), d));
    beta = T(1);
  }
  gemm(false, true, M, N, K, T(1), x.data(), std::max<std::int64_t>(K, 1), w.data(), std::max<std::int64_t>(K, 1),
       beta, out.data(), std::max<std::int64_t>(N, 1), d);
}

template <class T>
void broadcast_rows(const Tensor<T>& bias, std::int64_t rows, std::int64_t cols, const Tensor<T>& out) {
  CHORUS_DISPATCH(bias.device(), cpu::broadcast_rows(bias.data(), rows, cols, out.data()),
                  cuda::broadcast_rows(bias.data(), rows, cols, out.data(), bias.device()));
}

/// out (one element) = scale * sum((a - b)^2).
template <class T>
void squared_error_sum(const Tensor<T>& a, const Tensor<T>& b, const Tensor<T>& out, double scale) {
  if constexpr (is_reduced_floating_v<T>) {
    auto fo = detail::widened("mse_loss", out, false);
    squared_error_sum(detail::widened("mse_loss", a), detail::widened("mse_loss", b), fo, scale);
    detail::round_into(fo, out);
  } else {
    CHORUS_DISPATCH(a.device(),
                    *out.data() = static_cast<T>(cpu::squared_error_sum(a.data(), b.data(), a.numel()) * scale),
                    cuda::squared_error_sum(a.data(), b.data(), a.numel(), out.data(), scale, a.device()));
  }
}

/// ga = scale * g * (a - b), gb = -ga. `g` is a one-element tensor (broadcast) or has a's size.
template <class T>
void squared_error_backward(const Tensor<T>& a, const Tensor<T>& b, const Tensor<T>& g, double scale_d,
                            const Tensor<T>* ga, const Tensor<T>* gb) {
  if constexpr (is_reduced_floating_v<T>) {
    const char* k = "mse_loss backward";
    Tensor<float> fga, fgb;
    if (ga) fga = detail::widened(k, *ga, false);
    if (gb) fgb = detail::widened(k, *gb, false);
    squared_error_backward(detail::widened(k, a), detail::widened(k, b), detail::widened(k, g),
                           scale_d, ga ? &fga : nullptr, gb ? &fgb : nullptr);
    if (ga) detail::round_into(fga, *ga);
    if (gb) detail::round_into(fgb, *gb);
  } else {
    const T scale = static_cast<T>(scale_d);
    const bool per_elem = g.numel() == a.numel() && a.numel() != 1;
    T* pga = ga ? ga->data() : nullptr;
    T* pgb = gb ? gb->data() : nullptr;
    CHORUS_DISPATCH(
        a.device(),
        {
          if (per_elem) {
            cpu::squared_error_backward(a.data(), b.data(), a.numel(), scale, g.data(), pga, pgb);
          } else {
            cpu::squared_error_backward<T>(a.data(), b.data(), a.numel(), T(scale_d * *g.data()), nullptr, pga, pgb);
          }
        },
        cuda::squared_error_backward(a.data(), b.data(), a.numel(), scale, g.data(), per_elem, pga, pgb, a.device()));
  }
}

/// out (one element) = the number of targets that are not `ignore_index`.
template <class T>
void count_not_ignored(const Tensor<std::int64_t>& target, std::int64_t ignore_index, const Tensor<T>& out) {
  CHORUS_DISPATCH_T(T, "count_not_ignored", 
      target.device(),
      {
        std::int64_t c = 0;
        for (std::int64_t i = 0; i < target.numel(); ++i) c += target.data()[i] != ignore_index;
        *out.data() = static_cast<T>(c);
      },
      cuda::count_not_ignored(target.data(), target.numel(), ignore_index, out.data(), target.device()));
}

/// Per-row losses. CPU: the targets were validated by the caller. CUDA: the kernels validate
/// them (Note [device-side validation]).
template <class T>
void cross_entropy_forward(const Tensor<T>& logits, const Tensor<std::int64_t>& target, std::int64_t ignore_index,
                           const Tensor<T>& loss) {
  if constexpr (is_reduced_floating_v<T>) {
    auto fl = detail::widened("cross_entropy", loss, false);
    cross_entropy_forward(detail::widened("cross_entropy", logits), target, ignore_index, fl);
    detail::round_into(fl, loss);
  } else {
    const auto N = logits.size(0), C = logits.size(1);
    CHORUS_DISPATCH(logits.device(),
                    cpu::cross_entropy_forward(logits.data(), N, C, target.data(), ignore_index, loss.data()),
                    cuda::cross_entropy_forward(logits.data(), N, C, target.data(), ignore_index, loss.data(),
                                                logits.device()));
  }
}

template <class T>
void cross_entropy_backward(const Tensor<T>& logits, const Tensor<std::int64_t>& target, std::int64_t ignore_index,
                            const Tensor<T>& g, std::int64_t g_stride, const Tensor<T>& grad) {
  if constexpr (is_reduced_floating_v<T>) {
    const char* k = "cross_entropy backward";
    auto fg = detail::widened(k, grad, false);
    cross_entropy_backward(detail::widened(k, logits), target, ignore_index, detail::widened(k, g), g_stride, fg);
    detail::round_into(fg, grad);
  } else {
    const auto N = logits.size(0), C = logits.size(1);
    CHORUS_DISPATCH(
        logits.device(),
        cpu::cross_entropy_backward(logits.data(), N, C, target.data(), ignore_index, g.data(), g_stride, grad.data()),
        cuda::cross_entropy_backward(logits.data(), N, C, target.data(), ignore_index, g.data(), g_stride,
                                     grad.data(), logits.device()));
  }
}

template <class T>
void nll_forward(const Tensor<T>& logp, const Tensor<std::int64_t>& target, std::int64_t ignore_index,
                 const Tensor<T>& loss) {
  if constexpr (is_reduced_floating_v<T>) {
    auto fl = detail::widened("nll_loss", loss, false);
    nll_forward(detail::widened("nll_loss", logp), target, ignore_index, fl);
    detail::round_into(fl, loss);
  } else {
    const auto N = logp.size(0), C = logp.size(1);
    CHORUS_DISPATCH(logp.device(), cpu::nll_forward(logp.data(), N, C, target.data(), ignore_index, loss.data()),
                    cuda::nll_forward(logp.data(), N, C, target.data(), ignore_index, loss.data(), logp.device()));
  }
}

template <class T>
void nll_backward(const Tensor<std::int64_t>& target, std::int64_t C, std::int64_t ignore_index, const Tensor<T>& g,
                  std::int64_t g_stride, const Tensor<T>& grad) {
  if constexpr (is_reduced_floating_v<T>) {
    const char* k = "nll_loss backward";
    auto fg = detail::widened(k, grad, false);
    nll_backward(target, C, ignore_index, detail::widened(k, g), g_stride, fg);
    detail::round_into(fg, grad);
  } else {
    const auto N = target.numel();
    CHORUS_DISPATCH(grad.device(),
                    cpu::nll_backward(N, C, target.data(), ignore_index, g.data(), g_stride, grad.data()),
                    cuda::nll_backward(N, C, target.data(), ignore_index, g.data(), g_stride, grad.data(),
                                       grad.device()));
  }
}

/// Random fill: numbers come from the (host) generator whatever the device, so a seed gives
/// the same values on every device.
template <class T, class Fill>
void random_fill(const Tensor<T>& out, Fill&& fill_host) {
  if (out.device().is_cpu()) {
    fill_host(out.data(), out.numel());
    return;
  }
  std::vector<T> host(static_cast<std::size_t>(out.numel()));
  fill_host(host.data(), out.numel());
  copy_bytes(out.data(), out.device(), host.data(), Device::cpu(), host.size() * sizeof(T));
}

template <class T>
void sgd_step(const Tensor<T>& p, const Tensor<T>& g, const Tensor<T>* buf, double lr, double momentum,
              double dampening, double wd, bool nesterov, bool first, bool maximize) {
  if constexpr (is_reduced_floating_v<T>) {
    detail::no_reduced_kernel<T>("sgd_step");
  } else {
    T* b = buf ? buf->data() : nullptr;
    CHORUS_DISPATCH(p.device(),
                    cpu::sgd_step(p.data(), g.data(), b, p.numel(), lr, momentum, dampening, wd, nesterov, first,
                                  maximize),
                    cuda::sgd_step(p.data(), g.data(), b, p.numel(), lr, momentum, dampening, wd, nesterov, first,
                                   maximize, p.device()));
  }
}

template <class T>
void adam_step(const Tensor<T>& p, const Tensor<T>& g, const Tensor<T>& m, const Tensor<T>& v, const Tensor<T>* vmax,
               double lr, double b1, double b2, double eps, double wd, bool decoupled, std::int64_t step,
               bool maximize) {
  if constexpr (is_reduced_floating_v<T>) {
    detail::no_reduced_kernel<T>("adam_step");
  } else {
    T* vm = vmax ? vmax->data() : nullptr;
    CHORUS_DISPATCH(p.device(),
                    cpu::adam_step(p.data(), g.data(), m.data(), v.data(), vm, p.numel(), lr, b1, b2, eps, wd,
                                   decoupled, step, maximize),
                    cuda::adam_step(p.data(), g.data(), m.data(), v.data(), vm, p.numel(), lr, b1, b2, eps, wd,
                                    decoupled, step, maximize, p.device()));
  }
}

// ---- tensor lists (gradient clipping; Note [gradient clipping on the device], nn/utils.hpp) ----

/// raw[0] = the accumulated norm terms (see NormSpec) of contiguous tensors on device d (CPU:
/// raw is host memory; CUDA: device memory on d, written without waiting).
template <class T>
void foreach_norm(const std::vector<T*>& ptrs, const std::vector<std::int64_t>& numels, const NormSpec& s, double* raw,
                  Device d) {
  if constexpr (is_reduced_floating_v<T>) {
    detail::no_reduced_kernel<T>("foreach_norm");
  } else {
    CHORUS_DISPATCH(
        d,
        {
          double acc = 0;
          for (std::size_t i = 0; i < ptrs.size(); ++i)
            acc = norm_accumulate(s, acc, cpu::norm_partial(ptrs[i], numels[i], s));
          raw[0] = acc;
        },
        cuda::foreach_norm(ptrs, numels, s, raw, d));
  }
}

/// total[0] = the norm of `count` accumulated parts on d; coef[0] = min(1, max_norm / (total + 1e-6)).
inline void norm_finish(const double* parts, std::int64_t count, const NormSpec& s, double max_norm, double* total,
                        double* coef, Device d) {
  CHORUS_DISPATCH(
      d,
      {
        double acc = 0;
        for (std::int64_t i = 0; i < count; ++i) acc = norm_accumulate(s, acc, parts[i]);
        total[0] = norm_root(s, acc);
        coef[0] = clip_coefficient(total[0], max_norm);
      },
      cuda::norm_finish(parts, count, s, max_norm, total, coef, d));
}

/// Every tensor *= coef[0] (memory of d; nothing happens when it is 1).
template <class T>
void foreach_scale(const std::vector<T*>& ptrs, const std::vector<std::int64_t>& numels, const double* coef, Device d) {
  if constexpr (is_reduced_floating_v<T>) {
    detail::no_reduced_kernel<T>("foreach_scale");
  } else {
    CHORUS_DISPATCH(
        d,
        {
          if (coef[0] != 1.0)
            for (std::size_t i = 0; i < ptrs.size(); ++i) cpu::scale_inplace(ptrs[i], numels[i], coef[0]);
        },
        cuda::foreach_scale(ptrs, numels, coef, d));
  }
}

/// Every element clamped into [-hi, hi] (NaN stays NaN).
template <class T>
void foreach_clamp(const std::vector<T*>& ptrs, const std::vector<std::int64_t>& numels, T hi, Device d) {
  if constexpr (is_reduced_floating_v<T>) {
    detail::no_reduced_kernel<T>("foreach_clamp");
  } else {
    CHORUS_DISPATCH(
        d,
        {
          for (std::size_t i = 0; i < ptrs.size(); ++i) cpu::clamp_inplace(ptrs[i], numels[i], hi);
        },
        cuda::foreach_clamp(ptrs, numels, hi, d));
  }
}

}  // namespace backend
CHORUS_NAMESPACE_END

// The instances chorus::compiled holds (Note [compiled chorus] in compiled.hpp).
#define CHORUS_BACKEND_BACKEND_INSTANCES(X, T)                                                                                                                                              \
  X(void backend::fill<T>(const Tensor<T>&, T))                                                                                                                                             \
  X(void backend::arange<T>(const Tensor<T>&, double, double))                                                                                                                              \
  X(void backend::copy<T>(const Tensor<T>&, const Tensor<T>&))                                                                                                                              \
  X(void backend::reduce_add_broadcast<T>(const Tensor<T>&, const Tensor<T>&, const Strides&))                                                                                              \
  X(void backend::sum_all<T>(const Tensor<T>&, const Tensor<T>&, double))                                                                                                                   \
  X(void backend::sum_dim<T>(const Tensor<T>&, std::int64_t, std::int64_t, std::int64_t, const Tensor<T>&, double))                                                                         \
  X(void backend::expand_dim<T>(const Tensor<T>&, std::int64_t, std::int64_t, std::int64_t, const Tensor<T>&, double))                                                                      \
  X(void backend::softmax<T>(const Tensor<T>&, std::int64_t, std::int64_t, std::int64_t, const Tensor<T>&, bool, bool))                                                                     \
  X(void backend::softmax_backward<T>(const Tensor<T>&, const Tensor<T>&, std::int64_t, std::int64_t, std::int64_t, const Tensor<T>&, bool))                                                \
  X(void backend::index_select<T>(const Tensor<T>&, std::int64_t, std::int64_t, std::int64_t, const Tensor<std::int64_t>&, const Tensor<T>&, int))                                          \
  X(void backend::index_add<T>(const Tensor<T>&, std::int64_t, std::int64_t, std::int64_t, const Tensor<std::int64_t>&, const Tensor<T>&))                                                  \
  X(void backend::broadcast_rows<T>(const Tensor<T>&, std::int64_t, std::int64_t, const Tensor<T>&))                                                                                        \
  X(void backend::squared_error_sum<T>(const Tensor<T>&, const Tensor<T>&, const Tensor<T>&, double))                                                                                       \
  X(void backend::squared_error_backward<T>(const Tensor<T>&, const Tensor<T>&, const Tensor<T>&, double, const Tensor<T>*, const Tensor<T>*))                                              \
  X(void backend::count_not_ignored<T>(const Tensor<std::int64_t>&, std::int64_t, const Tensor<T>&))                                                                                        \
  X(void backend::cross_entropy_forward<T>(const Tensor<T>&, const Tensor<std::int64_t>&, std::int64_t, const Tensor<T>&))                                                                  \
  X(void backend::cross_entropy_backward<T>(const Tensor<T>&, const Tensor<std::int64_t>&, std::int64_t, const Tensor<T>&, std::int64_t, const Tensor<T>&))                                 \
  X(void backend::nll_forward<T>(const Tensor<T>&, const Tensor<std::int64_t>&, std::int64_t, const Tensor<T>&))                                                                            \
  X(void backend::nll_backward<T>(const Tensor<std::int64_t>&, std::int64_t, std::int64_t, const Tensor<T>&, std::int64_t, const Tensor<T>&))                                               \
  X(void backend::sgd_step<T>(const Tensor<T>&, const Tensor<T>&, const Tensor<T>*, double, double, double, double, bool, bool, bool))                                                      \
  X(void backend::adam_step<T>(const Tensor<T>&, const Tensor<T>&, const Tensor<T>&, const Tensor<T>&, const Tensor<T>*, double, double, double, double, double, bool, std::int64_t, bool)) \
  X(void backend::foreach_norm<T>(const std::vector<T*>&, const std::vector<std::int64_t>&, const NormSpec&, double*, Device))                                                              \
  X(void backend::foreach_scale<T>(const std::vector<T*>&, const std::vector<std::int64_t>&, const double*, Device))                                                                        \
  X(void backend::foreach_clamp<T>(const std::vector<T*>&, const std::vector<std::int64_t>&, T, Device))
CHORUS_EXTERN_INSTANCES(CHORUS_BACKEND_BACKEND_INSTANCES, CHORUS_ALL_DTYPES)
#define CHORUS_BACKEND_BACKEND_FLOAT_INSTANCES(X, T)                                                                                                             \
  X(void backend::gemm<T>(bool, bool, std::int64_t, std::int64_t, std::int64_t, T, const T*, std::int64_t, const T*, std::int64_t, T, T*, std::int64_t, Device)) \
  X(void backend::linear_forward<T>(const Tensor<T>&, const Tensor<T>&, const Tensor<T>*, const Tensor<T>&))
CHORUS_EXTERN_INSTANCES(CHORUS_BACKEND_BACKEND_FLOAT_INSTANCES, CHORUS_FLOATING_DTYPES)
// The elementwise kernels with their functors (backend/functors.hpp), and the conversions:
// every floating dtype has every functor of its arity; int64 the few integer ones.
#define CHORUS_BACKEND_OP(X, f, T, F) X(decltype(backend::f<T, backend::fn::F>) backend::f<T, backend::fn::F>)
#define CHORUS_BACKEND_UNARY_OPS(X, T)                                                                        \
  CHORUS_BACKEND_OP(X, unary, T, Neg) CHORUS_BACKEND_OP(X, unary, T, Exp) CHORUS_BACKEND_OP(X, unary, T, Log)  \
  CHORUS_BACKEND_OP(X, unary, T, Sqrt) CHORUS_BACKEND_OP(X, unary, T, Relu) CHORUS_BACKEND_OP(X, unary, T, Gelu) \
  CHORUS_BACKEND_OP(X, unary, T, Tanh) CHORUS_BACKEND_OP(X, unary, T, Sigmoid)                                 \
  CHORUS_BACKEND_OP(X, unary, T, AddScalar) CHORUS_BACKEND_OP(X, unary, T, MulScalar)                          \
  CHORUS_BACKEND_OP(X, unary, T, PowScalar) CHORUS_BACKEND_OP(X, unary, T, Abs)                                \
  CHORUS_BACKEND_OP(X, unary, T, Sign) CHORUS_BACKEND_OP(X, unary, T, InfToZero)                               \
  CHORUS_BACKEND_OP(X, unary, T, Sin) CHORUS_BACKEND_OP(X, unary, T, Cos) CHORUS_BACKEND_OP(X, unary, T, Clamp) \
  CHORUS_BACKEND_OP(X, unary, T, NonZero) CHORUS_BACKEND_OP(X, unary, T, AbsPow) CHORUS_BACKEND_OP(X, unary, T, Scale) \
  CHORUS_BACKEND_OP(X, unary, T, DivScalar)
#define CHORUS_BACKEND_BINARY_OPS(X, T)                                                                           \
  CHORUS_BACKEND_OP(X, binary_same, T, Add) CHORUS_BACKEND_OP(X, binary_same, T, Sub)                             \
  CHORUS_BACKEND_OP(X, binary_same, T, Mul) CHORUS_BACKEND_OP(X, binary_same, T, Div)                             \
  CHORUS_BACKEND_OP(X, binary_same, T, Maximum) CHORUS_BACKEND_OP(X, binary_same, T, ReluBackward)                \
  CHORUS_BACKEND_OP(X, binary_same, T, GeluBackward) CHORUS_BACKEND_OP(X, binary_same, T, TanhBackward)           \
  CHORUS_BACKEND_OP(X, binary_same, T, SigmoidBackward) CHORUS_BACKEND_OP(X, binary_same, T, LogBackward)         \
  CHORUS_BACKEND_OP(X, binary_same, T, SqrtBackward) CHORUS_BACKEND_OP(X, binary_same, T, PowBackward)            \
  CHORUS_BACKEND_OP(X, binary_same, T, AbsBackward) CHORUS_BACKEND_OP(X, binary_same, T, SinBackward)             \
  CHORUS_BACKEND_OP(X, binary_same, T, CosBackward) CHORUS_BACKEND_OP(X, binary_same, T, ClampBackward)           \
  CHORUS_BACKEND_OP(X, binary_same, T, NormScale) CHORUS_BACKEND_OP(X, binary_same, T, AddThenScale)              \
  CHORUS_BACKEND_OP(X, binary_same, T, AddScaled) CHORUS_BACKEND_OP(X, binary_broadcast, T, Add)                  \
  CHORUS_BACKEND_OP(X, binary_broadcast, T, Sub) CHORUS_BACKEND_OP(X, binary_broadcast, T, Mul)                   \
  CHORUS_BACKEND_OP(X, binary_broadcast, T, Div) CHORUS_BACKEND_OP(X, binary_broadcast, T, NormGrad)              \
  CHORUS_BACKEND_OP(X, binary_broadcast, T, NormInfMask) CHORUS_BACKEND_OP(X, binary_broadcast, T, SameValue)     \
  CHORUS_BACKEND_OP(X, binary_broadcast, T, AddScaled)
#define CHORUS_BACKEND_ELEMENTWISE_FLOAT_INSTANCES(X, T) CHORUS_BACKEND_UNARY_OPS(X, T) CHORUS_BACKEND_BINARY_OPS(X, T)
CHORUS_EXTERN_INSTANCES(CHORUS_BACKEND_ELEMENTWISE_FLOAT_INSTANCES, CHORUS_FLOATING_DTYPES)
#define CHORUS_BACKEND_ELEMENTWISE_INT_INSTANCES(X, T)                                                            \
  CHORUS_BACKEND_OP(X, unary, T, AddScalar) CHORUS_BACKEND_OP(X, unary, T, MulScalar)                             \
  CHORUS_BACKEND_OP(X, unary, T, Neg) CHORUS_BACKEND_OP(X, binary_same, T, Add) CHORUS_BACKEND_OP(X, binary_same, T, Sub) \
  CHORUS_BACKEND_OP(X, binary_same, T, Mul) CHORUS_BACKEND_OP(X, binary_broadcast, T, Add)                        \
  CHORUS_BACKEND_OP(X, binary_broadcast, T, Sub) CHORUS_BACKEND_OP(X, binary_broadcast, T, Mul)
CHORUS_EXTERN_INSTANCES(CHORUS_BACKEND_ELEMENTWISE_INT_INSTANCES, CHORUS_INT_DTYPES)
#define CHORUS_BACKEND_CONVERT_INSTANCES(X, T)                                                          \
  X(void backend::convert<float, T>(const Tensor<float>&, const Tensor<T>&))                            \
  X(void backend::convert<double, T>(const Tensor<double>&, const Tensor<T>&))                          \
  X(void backend::convert<bfloat16, T>(const Tensor<bfloat16>&, const Tensor<T>&))                      \
  X(void backend::convert<half, T>(const Tensor<half>&, const Tensor<T>&))                              \
  X(void backend::convert<std::int64_t, T>(const Tensor<std::int64_t>&, const Tensor<T>&))
CHORUS_EXTERN_INSTANCES(CHORUS_BACKEND_CONVERT_INSTANCES, CHORUS_ALL_DTYPES)
