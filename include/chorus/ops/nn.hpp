#pragma once
// Differentiable operations of the convolutional and normalisation layers, on NCHW tensors:
// conv2d, max/avg/adaptive-avg pooling, embedding, silu; batch_norm (batch_norm.hpp),
// layer_norm (layer_norm.hpp), dropout and dropout2d (dropout.hpp).
//
// Note [16-bit CNN operators]
// conv2d, the poolings, batch_norm and dropout of bfloat16/float16 tensors run the float32
// kernels on float32 copies made by the differentiable conversion (x.to<float>()), and convert
// the result back: products and sums accumulate in float32 and each output value is rounded
// once, as PyTorch's CPU bf16 convolutions do; backward runs in float32 too and each gradient
// is rounded once when it flows back through the conversion. batch_norm's running statistics
// are updated in float32 and rounded once into the 16-bit buffers. This costs a float32 copy of
// the saved activations. conv2d on a GPU with cuDNN is the exception: cuDNN convolves 16-bit
// tensors as they are (tensor cores, float32 accumulation, Note [cuDNN convolutions]) and saves
// the 16-bit input and weight for backward; the bias is added to the rounded output in 16 bits
// and its gradient summed in float32, as PyTorch's cuDNN convolutions do. Without cuDNN (or for
// sizes cuDNN's int descriptors cannot take) a 16-bit convolution takes the float32 route.
#include <array>
#include <limits>
#include <memory>
#include <optional>

#include "../compiled.hpp"
#include "../backend/nn.hpp"
#include "batch_norm.hpp"
#include "dropout.hpp"
#include "elementwise.hpp"
#include "layer_norm.hpp"
#include "reduce.hpp"
#include "view.hpp"

CHORUS_NAMESPACE_BEGIN

namespace ops::detail {

/// Output size of a window op along one dimension (PyTorch's rule):
/// floor-or-ceil((in + 2p - d(k-1) - 1) / s) + 1, 0 when the dilated kernel does not fit.
///
/// Note [checked window geometry]
/// The geometry comes from user values (padding, dilation, kernel, stride) that no tensor
/// bounds, so it is computed with overflow checks (Note [checked sizes]): unchecked, padding
/// 2^62 overflowed (undefined behaviour) and dilation 2^62 with a 5-tap kernel wrapped to 0,
/// was accepted and returned 2·x. Beyond the output size it also checks that
/// in + 2p + d(k-1) + s fits in int64: every index the kernels form from the output position
/// (o·s - p + i·d) and oneDNN's right padding ((o-1)·s + d(k-1) + 1 - in - p) then fits too,
/// so the kernels need no checks of their own.
inline std::int64_t window_out(const char* op, const char* dim, std::int64_t in, std::int64_t k, std::int64_t s,
                               std::int64_t p, std::int64_t d, bool ceil_mode) {
  std::int64_t padded = 0, reach = 0, extent = 0;
  const bool overflow = __builtin_mul_overflow(p, 2, &padded) || __builtin_add_overflow(padded, in, &padded) ||
                        __builtin_mul_overflow(d, k - 1, &reach) || __builtin_add_overflow(padded, reach, &extent) ||
                        __builtin_add_overflow(extent, s, &extent);
  if (overflow) [[unlikely]]
    CHORUS_FAIL(op, ": the ", dim, " window geometry overflows int64 (input size ", in, ", kernel ", k, ", stride ", s,
                ", padding ", p, ", dilation ", d, ")");
  const std::int64_t span = padded - reach - 1;  // both non-negative: no overflow
  if (span < 0) return 0;
  std::int64_t out = (ceil_mode ? (span + s - 1) / s : span / s) + 1;
  if (ceil_mode && (out - 1) * s >= in + p) --out;  // the last window must start inside the input or left padding
  return out;
}

template <class T>
void check_4d(const char* op, const Tensor<T>& x) {
  check_defined(op, x);
  CHORUS_CHECK(x.dim() == 4, op, ": expected a 4-D input [N, C, H, W], got shape ", x.shape());
}

inline void check_window(const char* op, Pair k, Pair s, Pair p, Pair d) {
  for (int i = 0; i < 2; ++i) {
    CHORUS_CHECK(k[i] > 0, op, ": kernel size must be positive, got ", k);
    CHORUS_CHECK(s[i] > 0, op, ": stride must be positive, got ", s);
    CHORUS_CHECK(p[i] >= 0, op, ": padding must be non-negative, got ", p);
    CHORUS_CHECK(d[i] > 0, op, ": dilation must be positive, got ", d);
  }
}

/// The output size [OH, OW] of a window op on x [N, C, H, W] (checked: Note [checked window geometry]).
template <class T>
void set_window_out(const char* op, const Tensor<T>& x, backend::Window2d& g, bool ceil_mode) {
  g.C = x.shape()[1], g.H = x.shape()[2], g.W = x.shape()[3];
  g.OH = window_out(op, "height", g.H, g.kh, g.sh, g.ph, g.dh, ceil_mode);
  g.OW = window_out(op, "width", g.W, g.kw, g.sw, g.pw, g.dw, ceil_mode);
}

// ---- convolution ----

/// Note [convolution by im2col]
/// Each image is unfolded into columns [C*kh*kw, OH*OW] and multiplied per group by the
/// weight [O/g, C/g*kh*kw] (one GEMM per image and group; 1x1 convolutions with stride 1
/// and no padding use the image itself). The backward reuses the same unfolding: dW from
/// dY @ col^T, dX by folding W^T @ dY back (col2im).
struct ConvGeometry {
  backend::Window2d g;
  std::int64_t N, O, groups;
  bool direct;  // 1x1, stride 1, no padding: the image is its own column matrix
  bool onednn = false;  // float32 on the CPU through oneDNN (Note [oneDNN convolutions])
  bool cudnn = false;   // on a GPU through cuDNN (Note [cuDNN convolutions])
  backend::cpu::OnednnConv onednn_conv() const { return {g, N, O, groups, has_bias}; }
  bool has_bias = false;
  std::int64_t K = 0;  // C*kh*kw, the rows of the column matrix (checked when the geometry is made)
  std::int64_t cols() const { return K; }
  std::int64_t L() const { return g.OH * g.OW; }  // fits: the output [N, O, OH, OW] exists
  /// cuDNN's descriptors count in int (Note [cuDNN operands]): larger sizes go through im2col.
  bool fits_int() const {
    constexpr std::int64_t kMax = std::numeric_limits<int>::max();
    for (std::int64_t v : {N, O, groups, g.C, g.H, g.W, g.OH, g.OW, g.kh, g.kw, g.sh, g.sw, g.ph, g.pw, g.dh, g.dw})
      if (v > kMax) return false;
    // Each tensor's element count, and with it every stride (the batch stride is C*H*W).
    std::int64_t n = 0;
    for (auto dims : {std::array<std::int64_t, 4>{N, g.C, g.H, g.W}, std::array<std::int64_t, 4>{N, O, g.OH, g.OW},
                      std::array<std::int64_t, 4>{O, g.C / groups, g.kh, g.kw}})
      if (__builtin_mul_overflow(dims[0], dims[1], &n) || __builtin_mul_overflow(n, dims[2], &n) ||
          __builtin_mul_overflow(n, dims[3], &n) || n > kMax)
        return false;
    return true;
  }
};

/// Note [cuDNN operands]
/// cuDNN's descriptors count in int, so each tensor of a cuDNN convolution has fewer than 2^31
/// elements (ConvGeometry::fits_int, else im2col), and its tensor-core algorithms read 16-byte
/// vectors, chosen for a shape without seeing the pointers: every operand is handed over
/// contiguous and 16-byte aligned, so a view at another offset (a 16-bit tensor sliced at an odd
/// element) is copied first. Fresh tensors come from the allocator aligned.
template <class T>
Tensor<T> cudnn_operand(const Tensor<T>& t) {
  auto c = contiguous_data(t);
  if (!c.defined() || reinterpret_cast<std::uintptr_t>(c.data()) % 16 == 0) return c;
  auto aligned = Tensor<T>::empty(c.shape(), c.device());
  backend::copy(aligned, c);
  return aligned;
}

/// out[n, c] += bias[c] (bias read through strides [0, 1, 0]).
template <class T>
void conv2d_add_bias(const Tensor<T>& bias, const ConvGeometry& geo, const Tensor<T>& out) {
  if (out.numel() == 0) return;
  auto bc = contiguous_data(bias.detach());
  const Shape s3{geo.N, geo.O, geo.L()};
  backend::binary_broadcast(view_as_shape(out, s3), contiguous_strides(s3), bc, Strides{0, 1, 0},
                            view_as_shape(out, s3), backend::fn::Add{});
}

/// The im2col + GEMM forward (Note [convolution by im2col]); xc, wc contiguous.
template <class T>
void conv2d_im2col(const Tensor<T>& xc, const Tensor<T>& wc, const Tensor<T>& bias, const ConvGeometry& geo,
                   const Tensor<T>& out) {
  const auto& g = geo.g;
  const Device dev = xc.device();
  const std::int64_t O = geo.O;
  const std::int64_t L = geo.L(), K = geo.cols(), G = geo.groups, Og = O / G, Kg = K / G, img = g.C * g.H * g.W;
  Tensor<T> col = geo.direct ? Tensor<T>() : Tensor<T>::empty(Shape{K, L}, dev);
  for (std::int64_t n = 0; n < geo.N; ++n) {
    const T* cn = xc.data() + n * img;
    if (!geo.direct) {
      backend::im2col(cn, g, col.data(), dev);
      cn = col.data();
    }
    for (std::int64_t q = 0; q < G; ++q)  // Y_q [Og, L] = W_q [Og, Kg] @ col_q [Kg, L]
      backend::gemm(false, false, Og, L, Kg, T(1), wc.data() + q * Og * Kg, Kg, cn + q * Kg * L, L, T(0),
                    out.data() + (n * geo.O + q * Og) * L, L, dev);
  }
  if (bias.defined()) conv2d_add_bias(bias, geo, out);
}

template <class T>
class Conv2dBackward final : public autograd::Node<T> {
 public:
  Conv2dBackward(Tensor<T> x, Tensor<T> w, bool has_bias, ConvGeometry geo)
      : x_(std::move(x)), w_(std::move(w)), bias_(has_bias), geo_(geo) {}
  std::string name() const override { return "Conv2dBackward"; }
  typename autograd::Node<T>::TensorList apply(typename autograd::Node<T>::TensorList&& grads) override {
    const auto gy = geo_.cudnn ? cudnn_operand(grads[0]) : contiguous_data(grads[0]);
    const auto& e = this->next_edges();
    const Device dev = gy.device();
    const std::int64_t L = geo_.L();
    Tensor<T> gx, gw, gb;
    if (bias_ && e[2].valid()) {
      gb = Tensor<T>::empty(Shape{geo_.O}, dev);
      if constexpr (is_reduced_floating_v<T>) {  // summed in float32, rounded once
        auto gyf = backend::detail::widened("conv2d bias gradient", gy);
        auto gbf = Tensor<float>::empty(Shape{geo_.O}, dev);
        backend::channel_sums(gyf.data(), geo_.N, geo_.O, L, static_cast<const float*>(nullptr), gbf.data(), dev);
        backend::detail::round_into(gbf, gb);
      } else {
        backend::channel_sums(gy.data(), geo_.N, geo_.O, L, static_cast<const T*>(nullptr), gb.data(), dev);
      }
    }
    const bool want_x = e[0].valid(), want_w = e[1].valid();
#if CHORUS_CUDA && CHORUS_HAS_CUDNN
    if (geo_.cudnn) {
      const auto& g = geo_.g;
      const std::int64_t G = geo_.groups;
      if (want_x) {
        gx = Tensor<T>::empty(x_.shape(), dev);
        backend::cuda::cudnn::conv_backward_data(g, geo_.N, geo_.O, G, gy.data(), w_.data(), gx.data(), dev);
      }
      if (want_w) {
        gw = Tensor<T>::empty(w_.shape(), dev);
        backend::cuda::cudnn::conv_backward_filter(g, geo_.N, geo_.O, G, x_.data(), gy.data(), gw.data(), dev);
      }
      if (bias_) return {gx, gw, gb};
      return {gx, gw};
    }
#endif
#if CHORUS_ONEDNN_API
    if constexpr (std::is_same_v<T, float>) {
      if (geo_.onednn) {
        if (want_x) {
          gx = Tensor<T>::empty(x_.shape(), dev);
          backend::cpu::onednn::conv_backward_data(geo_.onednn_conv(), gy.data(), w_.data(), gx.data());
        }
        if (want_w) {
          gw = Tensor<T>::empty(w_.shape(), dev);
          backend::cpu::onednn::conv_backward_weights(geo_.onednn_conv(), x_.data(), gy.data(), gw.data(),
                                                      gb.defined() ? gb.data() : nullptr);
        }
        if (bias_) return {gx, gw, gb};
        return {gx, gw};
      }
    }
#endif
    if constexpr (is_reduced_floating_v<T>) {
      // conv2d records a 16-bit node only for cuDNN (Note [16-bit CNN operators]).
      CHORUS_FAIL("conv2d backward: a 16-bit convolution node without cuDNN");
    } else {
      im2col_backward(gy, want_x, want_w, gx, gw);
    }
    if (bias_) return {gx, gw, gb};
    return {gx, gw};
  }
  /// gx and gw by im2col + GEMM (Note [convolution by im2col]); gy contiguous.
  void im2col_backward(const Tensor<T>& gy, bool want_x, bool want_w, Tensor<T>& gx, Tensor<T>& gw) const {
    const Device dev = gy.device();
    const auto& g = geo_.g;
    const std::int64_t L = geo_.L(), K = geo_.cols(), G = geo_.groups, Og = geo_.O / G, Kg = K / G;
    if (want_x) gx = zeros<T>(x_.shape(), dev);
    if (want_w) gw = zeros<T>(w_.shape(), dev);
    Tensor<T> col = geo_.direct ? Tensor<T>() : Tensor<T>::empty(Shape{K, L}, dev);
    const std::int64_t img = g.C * g.H * g.W;
    for (std::int64_t n = 0; n < geo_.N; ++n) {
      const T* gyn = gy.data() + n * geo_.O * L;
      if (want_w) {
        const T* cn = x_.data() + n * img;
        if (!geo_.direct) {
          backend::im2col(cn, g, col.data(), dev);
          cn = col.data();
        }
        for (std::int64_t q = 0; q < G; ++q)  // gW_q += gY_q [Og, L] @ col_q^T [L, Kg]
          backend::gemm(false, true, Og, Kg, L, T(1), gyn + q * Og * L, L, cn + q * Kg * L, L, T(1),
                        gw.data() + q * Og * Kg, Kg, dev);
      }
      if (want_x) {
        T* dst = geo_.direct ? gx.data() + n * img : col.data();
        for (std::int64_t q = 0; q < G; ++q)  // dcol_q = W_q^T [Kg, Og] @ gY_q [Og, L]
          backend::gemm(true, false, Kg, L, Og, T(1), w_.data() + q * Og * Kg, Kg, gyn + q * Og * L, L, T(0),
                        dst + q * Kg * L, L, dev);
        if (!geo_.direct) backend::col2im(col.data(), g, gx.data() + n * img, dev);
      }
    }
  }
  void release_saved() override {
    x_ = Tensor<T>();
    w_ = Tensor<T>();
  }

 private:
  Tensor<T> x_, w_;
  bool bias_;
  ConvGeometry geo_;
};

// ---- pooling ----

template <class T>
class MaxPool2dBackward final : public autograd::Node<T> {
 public:
  MaxPool2dBackward(Tensor<std::int64_t> idx, Shape in, backend::Window2d g)
      : idx_(std::move(idx)), in_(std::move(in)), g_(g) {}
  std::string name() const override { return "MaxPool2dBackward"; }
  typename autograd::Node<T>::TensorList apply(typename autograd::Node<T>::TensorList&& grads) override {
    auto gy = contiguous_data(grads[0]);
    auto gx = zeros<T>(in_, gy.device());
    backend::max_pool2d_backward(gy.data(), idx_.data(), in_[0] * in_[1], g_, gx.data(), gy.device());
    return {gx};
  }
  void release_saved() override { idx_ = Tensor<std::int64_t>(); }

 private:
  Tensor<std::int64_t> idx_;
  Shape in_;
  backend::Window2d g_;
};

template <class T>
class AvgPool2dBackward final : public autograd::Node<T> {
 public:
  AvgPool2dBackward(Shape in, backend::Window2d g, bool adaptive, bool include_pad, std::int64_t div)
      : in_(std::move(in)), g_(g), adaptive_(adaptive), include_pad_(include_pad), div_(div) {}
  std::string name() const override { return adaptive_ ? "AdaptiveAvgPool2dBackward" : "AvgPool2dBackward"; }
  typename autograd::Node<T>::TensorList apply(typename autograd::Node<T>::TensorList&& grads) override {
    auto gy = contiguous_data(grads[0]);
    auto gx = zeros<T>(in_, gy.device());
    const std::int64_t planes = in_[0] * in_[1];
    if (adaptive_) {
      backend::adaptive_avg_pool2d_backward(gy.data(), planes, g_, gx.data(), gy.device());
    } else {
      backend::avg_pool2d_backward(gy.data(), planes, g_, include_pad_, div_, gx.data(), gy.device());
    }
    return {gx};
  }

 private:
  Shape in_;
  backend::Window2d g_;
  bool adaptive_, include_pad_;
  std::int64_t div_;
};

template <class T>
backend::Window2d pool_geometry(const char* op, const Tensor<T>& x, Pair k, Pair s, Pair p, Pair d, bool ceil_mode) {
  check_4d(op, x);
  check_window(op, k, s, p, d);
  for (int i = 0; i < 2; ++i)
    CHORUS_CHECK(p[i] <= k[i] / 2, op, ": padding should be at most half the kernel size, got padding ", p,
                 " for kernel ", k);
  std::int64_t window = 0;  // the average pool's divisor is at most kh*kw (Note [checked window geometry])
  CHORUS_CHECK(!__builtin_mul_overflow(k[0], k[1], &window), op, ": kernel ", k, " has more elements than an int64 can count");
  backend::Window2d g;
  g.kh = k[0], g.kw = k[1], g.sh = s[0], g.sw = s[1], g.ph = p[0], g.pw = p[1], g.dh = d[0], g.dw = d[1];
  set_window_out(op, x, g, ceil_mode);
  CHORUS_CHECK(g.OH > 0 && g.OW > 0, op, ": input of shape ", x.shape(), " is too small for kernel ", k,
               " (output would be ", g.OH, "x", g.OW, ")");
  return g;
}

// ---- batch normalisation ----

template <class T>
class EmbeddingBackward final : public autograd::Node<T> {
 public:
  /// padding_idx: a row in [0, num_embeddings), or -1 for none (embedding() normalises it).
  EmbeddingBackward(Shape weight, Tensor<std::int64_t> idx, std::int64_t padding_idx)
      : weight_(std::move(weight)), idx_(std::move(idx)), padding_idx_(padding_idx) {}
  std::string name() const override { return "EmbeddingBackward"; }
  typename autograd::Node<T>::TensorList apply(typename autograd::Node<T>::TensorList&& grads) override {
    auto gy = contiguous_data(grads[0]);
    auto gw = zeros<T>(weight_, gy.device());
    backend::index_add(gy, 1, weight_[0], weight_[1], idx_, gw);
    if (padding_idx_ >= 0) gw.narrow(0, padding_idx_, 1).zero_();  // the padding row never learns
    return {gw};
  }
  void release_saved() override { idx_ = Tensor<std::int64_t>(); }

 private:
  Shape weight_;
  Tensor<std::int64_t> idx_;
  std::int64_t padding_idx_;
};

}  // namespace ops::detail

/// 2-D convolution (cross-correlation, as torch.nn.functional.conv2d): x [N, C, H, W],
/// weight [O, C/groups, kh, kw], bias [O] or undefined; NCHW output [N, O, OH, OW].
template <class T>
Tensor<T> conv2d(const Tensor<T>& x, const Tensor<T>& weight, const Tensor<T>& bias = Tensor<T>(), Pair stride = 1,
                 Pair padding = 0, Pair dilation = 1, std::int64_t groups = 1) {
  static_assert(is_floating_v<T>, "conv2d: floating-point tensors only");
  using namespace ops::detail;
  check_4d("conv2d", x);
  check_defined("conv2d", weight, "weight");
  check_same_device("conv2d", x, weight);
  CHORUS_CHECK(weight.dim() == 4, "conv2d: weight must be 4-D [out, in/groups, kh, kw], got shape ", weight.shape());
  check_window("conv2d", {weight.shape()[2], weight.shape()[3]}, stride, padding, dilation);
  CHORUS_CHECK(groups > 0, "conv2d: groups must be positive, got ", groups);
  const std::int64_t N = x.shape()[0], C = x.shape()[1], O = weight.shape()[0];
  std::int64_t expected = 0;  // checked: a huge groups must not wrap to C (Note [checked sizes])
  const bool wraps = __builtin_mul_overflow(weight.shape()[1], groups, &expected);
  CHORUS_CHECK(!wraps && expected == C, "conv2d: input of shape ", x.shape(), " has ", C,
               " channels, but weight of shape ", weight.shape(), " with groups=", groups, " expects ",
               wraps ? std::string("more than int64 holds") : std::to_string(expected));
  CHORUS_CHECK(O % groups == 0, "conv2d: ", C, " input and ", O, " output channels must both be divisible by groups=",
               groups);
  if (bias.defined()) {
    check_same_device("conv2d", x, bias);
    CHORUS_CHECK(bias.dim() == 1 && bias.shape()[0] == O, "conv2d: bias of shape ", bias.shape(),
                 " does not match ", O, " output channels");
  }
  ConvGeometry geo;
  auto& g = geo.g;
  g.kh = weight.shape()[2], g.kw = weight.shape()[3];
  g.sh = stride[0], g.sw = stride[1], g.ph = padding[0], g.pw = padding[1], g.dh = dilation[0], g.dw = dilation[1];
  set_window_out("conv2d", x, g, false);
  CHORUS_CHECK(g.OH > 0 && g.OW > 0, "conv2d: input of shape ", x.shape(), " (padding ", padding,
               ") is smaller than the dilated kernel of weight ", weight.shape());
  // The column matrix has C*kh*kw rows; the weight bounds kh*kw and C/groups*kh*kw, not C*kh*kw.
  CHORUS_CHECK(!__builtin_mul_overflow(C, g.kh * g.kw, &geo.K), "conv2d: ", C, " channels times kernel ",
               Pair{g.kh, g.kw}, " have more elements than an int64 can count");
  geo.N = N, geo.O = O, geo.groups = groups;
  geo.direct = g.kh == 1 && g.kw == 1 && g.sh == 1 && g.sw == 1 && g.ph == 0 && g.pw == 0;
  geo.has_bias = bias.defined();
  const Device dev = x.device();
#if CHORUS_CUDA && CHORUS_HAS_CUDNN
  geo.cudnn = dev.is_cuda() && N > 0 && backend::cuda::cudnn::enabled() && geo.fits_int();
#endif
  if constexpr (is_reduced_floating_v<T>) {  // Note [16-bit CNN operators]
    if (!geo.cudnn)
      return conv2d(float_copy(x), float_copy(weight), float_copy(bias), stride, padding, dilation, groups)
          .template to<T>();
  }
  auto xc = geo.cudnn ? cudnn_operand(x.detach()) : contiguous_data(x.detach());
  auto wc = geo.cudnn ? cudnn_operand(weight.detach()) : contiguous_data(weight.detach());
  auto out = Tensor<T>::empty(Shape{N, O, g.OH, g.OW}, dev);
#if CHORUS_ONEDNN_API
  if constexpr (std::is_same_v<T, float>) {
    geo.onednn = dev.is_cpu() && backend::cpu::onednn_enabled() && geo.onednn_conv().supported();
    if (geo.onednn) {
      auto bc = bias.defined() ? contiguous_data(bias.detach()) : Tensor<T>();
      backend::cpu::onednn::conv_forward(geo.onednn_conv(), xc.data(), wc.data(), bc.defined() ? bc.data() : nullptr,
                                         out.data());
    }
  }
#endif
#if CHORUS_CUDA && CHORUS_HAS_CUDNN
  if (geo.cudnn) {
    backend::cuda::cudnn::conv_forward(g, N, O, groups, xc.data(), wc.data(), out.data(), dev);
    if (bias.defined()) conv2d_add_bias(bias, geo, out);
  }
#endif
  if constexpr (!is_reduced_floating_v<T>) {
    if (!geo.onednn && !geo.cudnn) conv2d_im2col(xc, wc, bias, geo, out);
  }
  if (autograd::needs_grad(x, weight, bias)) {
    auto node = autograd::make_node<Conv2dBackward<T>, T>({&x, &weight, bias.defined() ? &bias : nullptr}, xc, wc,
                                                          bias.defined(), geo);
    if (!bias.defined()) node->mutable_next_edges().pop_back();
    autograd::set_history(out, std::shared_ptr<autograd::Node<T>>(node));
  }
  return out;
}

/// Max pooling (as torch.nn.functional.max_pool2d); stride defaults to the kernel size.
template <class T>
Tensor<T> max_pool2d(const Tensor<T>& x, Pair kernel, std::optional<Pair> stride = std::nullopt, Pair padding = 0,
                     Pair dilation = 1, bool ceil_mode = false) {
  static_assert(is_floating_v<T>, "max_pool2d: floating-point tensors only");
  if constexpr (is_reduced_floating_v<T>) {  // Note [16-bit CNN operators]
    return max_pool2d(ops::detail::float_copy(x), kernel, stride, padding, dilation, ceil_mode).template to<T>();
  } else {
    auto g = ops::detail::pool_geometry("max_pool2d", x, kernel, stride.value_or(kernel), padding, dilation, ceil_mode);
    auto xc = ops::detail::contiguous_data(x.detach());
    const std::int64_t N = x.shape()[0];
    auto out = Tensor<T>::empty(Shape{N, g.C, g.OH, g.OW}, x.device());
    auto idx = Tensor<std::int64_t>::empty(out.shape(), x.device());
    backend::max_pool2d(xc.data(), N * g.C, g, out.data(), idx.data(), x.device());
    if (autograd::needs_grad(x)) {
      auto node = autograd::make_node<ops::detail::MaxPool2dBackward<T>, T>({&x}, idx, x.shape(), g);
      autograd::set_history(out, std::shared_ptr<autograd::Node<T>>(node));
    }
    return out;
  }
}

/// Average pooling (as torch.nn.functional.avg_pool2d); divisor_override 0 = none.
template <class T>
Tensor<T> avg_pool2d(const Tensor<T>& x, Pair kernel, std::optional<Pair> stride = std::nullopt, Pair padding = 0,
                     bool ceil_mode = false, bool count_include_pad = true, std::int64_t divisor_override = 0) {
  static_assert(is_floating_v<T>, "avg_pool2d: floating-point tensors only");
  CHORUS_CHECK(divisor_override >= 0, "avg_pool2d: divisor_override must be positive (or 0 for none), got ",
               divisor_override);
  if constexpr (is_reduced_floating_v<T>) {  // Note [16-bit CNN operators]
    return avg_pool2d(ops::detail::float_copy(x), kernel, stride, padding, ceil_mode, count_include_pad,
                      divisor_override)
        .template to<T>();
  } else {
    auto g = ops::detail::pool_geometry("avg_pool2d", x, kernel, stride.value_or(kernel), padding, 1, ceil_mode);
    auto xc = ops::detail::contiguous_data(x.detach());
    const std::int64_t N = x.shape()[0];
    auto out = Tensor<T>::empty(Shape{N, g.C, g.OH, g.OW}, x.device());
    backend::avg_pool2d(xc.data(), N * g.C, g, count_include_pad, divisor_override, out.data(), x.device());
    if (autograd::needs_grad(x)) {
      auto node = autograd::make_node<ops::detail::AvgPool2dBackward<T>, T>({&x}, x.shape(), g, false,
                                                                            count_include_pad, divisor_override);
      autograd::set_history(out, std::shared_ptr<autograd::Node<T>>(node));
    }
    return out;
  }
}

/// Adaptive average pooling to `output_size` (as torch.nn.functional.adaptive_avg_pool2d).
template <class T>
Tensor<T> adaptive_avg_pool2d(const Tensor<T>& x, Pair output_size) {
  static_assert(is_floating_v<T>, "adaptive_avg_pool2d: floating-point tensors only");
  if constexpr (is_reduced_floating_v<T>) {  // Note [16-bit CNN operators]
    return adaptive_avg_pool2d(ops::detail::float_copy(x), output_size).template to<T>();
  } else {
    ops::detail::check_4d("adaptive_avg_pool2d", x);
    CHORUS_CHECK(output_size[0] > 0 && output_size[1] > 0, "adaptive_avg_pool2d: output size must be positive, got ",
                 output_size);
    CHORUS_CHECK(x.shape()[2] > 0 && x.shape()[3] > 0, "adaptive_avg_pool2d: empty spatial size in input of shape ",
                 x.shape());
    // The kernels' window bounds compute (o+1)·in + out - 1 <= out·in + out (Note [checked window geometry]).
    for (int i = 0; i < 2 && x.shape()[0] * x.shape()[1] > 0; ++i) {
      std::int64_t bound = 0;
      CHORUS_CHECK(!__builtin_mul_overflow(output_size[i], x.shape()[2 + i], &bound) &&
                       !__builtin_add_overflow(bound, output_size[i], &bound),
                   "adaptive_avg_pool2d: output size ", output_size, " for input of shape ", x.shape(),
                   " overflows int64 in the window bounds");
    }
    backend::Window2d g;
    g.C = x.shape()[1], g.H = x.shape()[2], g.W = x.shape()[3], g.OH = output_size[0], g.OW = output_size[1];
    auto xc = ops::detail::contiguous_data(x.detach());
    const std::int64_t N = x.shape()[0];
    auto out = Tensor<T>::empty(Shape{N, g.C, g.OH, g.OW}, x.device());
    backend::adaptive_avg_pool2d(xc.data(), N * g.C, g, out.data(), x.device());
    if (autograd::needs_grad(x)) {
      auto node = autograd::make_node<ops::detail::AvgPool2dBackward<T>, T>({&x}, x.shape(), g, true, true, 0);
      autograd::set_history(out, std::shared_ptr<autograd::Node<T>>(node));
    }
    return out;
  }
}

/// Rows of `weight` [num, dim] picked by `indices` (any shape): output indices.shape + [dim].
/// The row `padding_idx` gets no gradient, as in torch.nn.functional.embedding: nullopt (the
/// default) for none; a negative index counts from the end (-1 is the last row), as in PyTorch
/// and nn::Embedding (so "none" is nullopt, never -1, which is the last row PyTorch freezes).
template <class T>
Tensor<T> embedding(const Tensor<std::int64_t>& indices, const Tensor<T>& weight,
                    std::optional<std::int64_t> padding_idx = std::nullopt) {
  ops::detail::check_defined("embedding", indices, "indices");
  ops::detail::check_defined("embedding", weight, "weight");
  ops::detail::check_same_device("embedding", weight, indices);
  CHORUS_CHECK(weight.dim() == 2, "embedding: weight must be 2-D [num_embeddings, dim], got shape ", weight.shape());
  const std::int64_t num = weight.shape()[0];
  if (padding_idx) {
    CHORUS_CHECK(*padding_idx >= -num && *padding_idx < num, "embedding: padding_idx ", *padding_idx,
                 " must be within num_embeddings (", num, " rows: expected -", num, " <= padding_idx < ", num, ")");
    if (*padding_idx < 0) *padding_idx += num;
  }
  auto flat = ops::detail::contiguous_data(indices).reshape(Shape{indices.numel()});
  auto rows = weight.detach().index_select(0, flat);  // validates the indices
  Shape s = indices.shape();
  s.push_back(weight.shape()[1]);
  auto out = ops::detail::view_as_shape(rows, s);
  if (autograd::needs_grad(weight)) {
    auto node = autograd::make_node<ops::detail::EmbeddingBackward<T>, T>({&weight}, weight.shape(), flat,
                                                                          padding_idx.value_or(-1));
    autograd::set_history(out, std::shared_ptr<autograd::Node<T>>(node));
  }
  return out;
}

/// x·sigmoid(x).
template <class T>
Tensor<T> silu(const Tensor<T>& x) {
  return mul(x, sigmoid(x));
}

CHORUS_NAMESPACE_END

// The instances chorus::compiled holds (Note [compiled chorus] in compiled.hpp).
#define CHORUS_OPS_NN_INSTANCES(X, T)                                                                   \
  X(Tensor<T> embedding<T>(const Tensor<std::int64_t>&, const Tensor<T>&, std::optional<std::int64_t>)) \
  X(Tensor<T> silu<T>(const Tensor<T>&))
CHORUS_EXTERN_INSTANCES(CHORUS_OPS_NN_INSTANCES, CHORUS_ALL_DTYPES)
#define CHORUS_OPS_NN_FLOAT_INSTANCES(X, T)                                                                    \
  X(Tensor<T> conv2d<T>(const Tensor<T>&, const Tensor<T>&, const Tensor<T>&, Pair, Pair, Pair, std::int64_t)) \
  X(Tensor<T> max_pool2d<T>(const Tensor<T>&, Pair, std::optional<Pair>, Pair, Pair, bool))                    \
  X(Tensor<T> avg_pool2d<T>(const Tensor<T>&, Pair, std::optional<Pair>, Pair, bool, bool, std::int64_t))      \
  X(Tensor<T> adaptive_avg_pool2d<T>(const Tensor<T>&, Pair))
CHORUS_EXTERN_INSTANCES(CHORUS_OPS_NN_FLOAT_INSTANCES, CHORUS_FLOATING_DTYPES)
