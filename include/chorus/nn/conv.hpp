#pragma once
// Conv2d and the pooling layers (NCHW). Each layer's holder has constructors mirroring its
// Impl's, so that braced options and sizes work (Note [layer options] in nn/module.hpp).
#include <cmath>
#include <optional>

#include "../ops/nn.hpp"
#include "init.hpp"
#include "module.hpp"

CHORUS_NAMESPACE_BEGIN
namespace nn {

/// Conv2d's options, braced in PyTorch's order (Note [layer options] in nn/module.hpp):
/// `nn::Conv2d(3, 8, 3, {.stride = 2, .padding = 1})`; a scalar means (k, k).
struct Conv2dOptions {
  Pair stride = 1;                ///< Step of the kernel over (H, W) (default 1).
  Pair padding = 0;               ///< Zeros added on each side of (H, W) (default 0).
  Pair dilation = 1;              ///< Spacing between kernel elements (default 1).
  std::int64_t groups = 1;        ///< Blocked connections: in and out channels split into this many groups (default 1).
  bool bias = true;               ///< Adds a learned bias per output channel (default true).
  Device device = Device::cpu();  ///< Where the parameters are created (default CPU).
};

/// 2-D convolution over NCHW input, initialised as torch.nn.Conv2d (weight: kaiming_uniform
/// with a = sqrt(5); bias: U(±1/sqrt(fan_in)), fan_in = in/groups·kh·kw). Parameters
/// `weight` [out, in/groups, kh, kw] and `bias` [out], as in PyTorch.
template <class T = float>
class Conv2dImpl : public Module {
 public:
  /// `in_channels` to `out_channels` with a `kernel_size` kernel (both channel counts divisible by
  /// groups), parameters initialised by reset_parameters().
  Conv2dImpl(std::int64_t in_channels, std::int64_t out_channels, Pair kernel_size, Conv2dOptions options = {})
      : in_channels(in_channels), out_channels(out_channels), kernel_size(kernel_size), options(options) {
    CHORUS_CHECK(in_channels > 0 && out_channels > 0, "Conv2d(", in_channels, ", ", out_channels,
                 "): channel counts must be positive");
    ops::detail::check_window("Conv2d", kernel_size, options.stride, options.padding, options.dilation);
    CHORUS_CHECK(options.groups > 0 && in_channels % options.groups == 0 && out_channels % options.groups == 0,
                 "Conv2d(", in_channels, ", ", out_channels, "): groups=", options.groups,
                 " must divide both channel counts");
    register_parameter(
        "weight", &Conv2dImpl::weight,
        Tensor<T>::empty(Shape{out_channels, in_channels / options.groups, kernel_size[0], kernel_size[1]},
                         options.device));
    if (options.bias)
      register_parameter("bias", &Conv2dImpl::bias, Tensor<T>::empty(Shape{out_channels}, options.device));
    reset_parameters();
  }

  /// Re-initialises weight and bias as torch.nn.Conv2d does (see above).
  void reset_parameters() {
    init::kaiming_uniform_(weight, std::sqrt(5.0));
    if (bias.defined()) {
      const auto fan_in = init::fans(weight).first;
      const double bound = fan_in > 0 ? 1.0 / std::sqrt(static_cast<double>(fan_in)) : 0.0;
      init::uniform_(bias, -bound, bound);
    }
  }

  /// x [N, in_channels, H, W] to [N, out_channels, OH, OW] (conv2d with these options).
  Tensor<T> forward(const Tensor<T>& x) const {
    return conv2d(x, weight, bias, options.stride, options.padding, options.dilation, options.groups);
  }
  std::string name() const override {
    return "Conv2d(" + std::to_string(in_channels) + ", " + std::to_string(out_channels) + ", kernel_size=(" +
           std::to_string(kernel_size[0]) + ", " + std::to_string(kernel_size[1]) + "))";
  }

  /// The input and output channel counts.
  ///@{
  std::int64_t in_channels, out_channels;
  ///@}
  Pair kernel_size;       ///< The kernel's (kh, kw).
  Conv2dOptions options;  ///< The options it was built with.
  /// The parameters: weight [out, in/groups, kh, kw] and bias [out] (undefined without bias).
  ///@{
  Tensor<T> weight, bias;
  ///@}
};

/// Holder of Conv2dImpl<T> (Note [layer options] in nn/module.hpp): `nn::Conv2d(3, 8, 3, {.padding = 1})`.
template <class T = float>
class Conv2dT : public ModuleHolder<Conv2dImpl<T>> {
 public:
  using ModuleHolder<Conv2dImpl<T>>::ModuleHolder;
  /// Constructs the implementation: Conv2dImpl(in_channels, out_channels, kernel_size, options).
  explicit Conv2dT(std::int64_t in_channels, std::int64_t out_channels, Pair kernel_size, Conv2dOptions options = {})
      : ModuleHolder<Conv2dImpl<T>>(std::make_shared<Conv2dImpl<T>>(in_channels, out_channels, kernel_size, options)) {}
};
using Conv2d = Conv2dT<float>;  ///< Conv2dT over float tensors.

/// MaxPool2d's options, braced in PyTorch's order (Note [layer options] in nn/module.hpp).
struct MaxPool2dOptions {
  std::optional<Pair> stride = std::nullopt;  ///< Step of the window (default: the kernel size).
  Pair padding = 0;                           ///< Implicit -infinity padding on each side of (H, W) (default 0).
  Pair dilation = 1;                          ///< Spacing between window elements (default 1).
  bool ceil_mode = false;                     ///< Rounds the output size up instead of down (default false).
};

/// Max pooling (no parameters; works for any floating type).
class MaxPool2dImpl : public Module {
 public:
  /// Max over `kernel_size` windows.
  explicit MaxPool2dImpl(Pair kernel_size, MaxPool2dOptions options = {}) : kernel_size(kernel_size), options(options) {
    ops::detail::check_window("MaxPool2d", kernel_size, options.stride.value_or(kernel_size), options.padding,
                              options.dilation);
  }
  /// x [N, C, H, W] to [N, C, OH, OW] (max_pool2d with these options).
  template <class T>
  Tensor<T> forward(const Tensor<T>& x) const {
    return max_pool2d(x, kernel_size, options.stride, options.padding, options.dilation, options.ceil_mode);
  }
  std::string name() const override { return "MaxPool2d"; }
  Pair kernel_size;          ///< The window's (kh, kw).
  MaxPool2dOptions options;  ///< The options it was built with.
};
/// Holder of MaxPool2dImpl: `nn::MaxPool2d(2)`, `nn::MaxPool2d(3, {.stride = 2, .padding = 1})`.
class MaxPool2d : public ModuleHolder<MaxPool2dImpl> {
 public:
  using ModuleHolder<MaxPool2dImpl>::ModuleHolder;
  /// Constructs the implementation: MaxPool2dImpl(kernel_size, options).
  explicit MaxPool2d(Pair kernel_size, MaxPool2dOptions options = {})
      : ModuleHolder(std::make_shared<MaxPool2dImpl>(kernel_size, options)) {}
};

/// AvgPool2d's options, braced in PyTorch's order (Note [layer options] in nn/module.hpp).
struct AvgPool2dOptions {
  std::optional<Pair> stride = std::nullopt;  ///< Step of the window (default: the kernel size).
  Pair padding = 0;                           ///< Implicit zero padding on each side of (H, W) (default 0).
  bool ceil_mode = false;                     ///< Rounds the output size up instead of down (default false).
  bool count_include_pad = true;              ///< Counts the padding zeros in the divisor (default true).
  std::int64_t divisor_override = 0;          ///< Divisor used instead of the window's size; 0 (default): none.
};

/// Average pooling (no parameters; works for any floating type).
class AvgPool2dImpl : public Module {
 public:
  /// Average over `kernel_size` windows.
  explicit AvgPool2dImpl(Pair kernel_size, AvgPool2dOptions options = {}) : kernel_size(kernel_size), options(options) {
    ops::detail::check_window("AvgPool2d", kernel_size, options.stride.value_or(kernel_size), options.padding, 1);
  }
  /// x [N, C, H, W] to [N, C, OH, OW] (avg_pool2d with these options).
  template <class T>
  Tensor<T> forward(const Tensor<T>& x) const {
    return avg_pool2d(x, kernel_size, options.stride, options.padding, options.ceil_mode, options.count_include_pad,
                      options.divisor_override);
  }
  std::string name() const override { return "AvgPool2d"; }
  Pair kernel_size;          ///< The window's (kh, kw).
  AvgPool2dOptions options;  ///< The options it was built with.
};
/// Holder of AvgPool2dImpl: `nn::AvgPool2d(2)`, `nn::AvgPool2d(3, {.stride = 1, .padding = 1})`.
class AvgPool2d : public ModuleHolder<AvgPool2dImpl> {
 public:
  using ModuleHolder<AvgPool2dImpl>::ModuleHolder;
  /// Constructs the implementation: AvgPool2dImpl(kernel_size, options).
  explicit AvgPool2d(Pair kernel_size, AvgPool2dOptions options = {})
      : ModuleHolder(std::make_shared<AvgPool2dImpl>(kernel_size, options)) {}
};

/// Adaptive average pooling to a fixed output size (no parameters; works for any floating type).
class AdaptiveAvgPool2dImpl : public Module {
 public:
  /// Pools to `output_size` (OH, OW), both positive.
  explicit AdaptiveAvgPool2dImpl(Pair output_size) : output_size(output_size) {
    CHORUS_CHECK(output_size[0] > 0 && output_size[1] > 0, "AdaptiveAvgPool2d: output size must be positive, got ",
                 output_size);
  }
  /// x [N, C, H, W] to [N, C, OH, OW] (adaptive_avg_pool2d).
  template <class T>
  Tensor<T> forward(const Tensor<T>& x) const {
    return adaptive_avg_pool2d(x, output_size);
  }
  std::string name() const override { return "AdaptiveAvgPool2d"; }
  Pair output_size;  ///< The output's (OH, OW).
};
/// Holder of AdaptiveAvgPool2dImpl: `nn::AdaptiveAvgPool2d(1)` pools each channel to 1x1.
class AdaptiveAvgPool2d : public ModuleHolder<AdaptiveAvgPool2dImpl> {
 public:
  using ModuleHolder<AdaptiveAvgPool2dImpl>::ModuleHolder;
  /// Constructs the implementation: AdaptiveAvgPool2dImpl(output_size).
  explicit AdaptiveAvgPool2d(Pair output_size) : ModuleHolder(std::make_shared<AdaptiveAvgPool2dImpl>(output_size)) {}
};

}  // namespace nn
CHORUS_NAMESPACE_END
