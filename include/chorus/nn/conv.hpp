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
  Pair stride = 1;
  Pair padding = 0;
  Pair dilation = 1;
  std::int64_t groups = 1;
  bool bias = true;
  Device device = Device::cpu();
};

/// 2-D convolution over NCHW input, initialised as torch.nn.Conv2d (weight: kaiming_uniform
/// with a = sqrt(5); bias: U(±1/sqrt(fan_in)), fan_in = in/groups·kh·kw). Parameters
/// `weight` [out, in/groups, kh, kw] and `bias` [out], as in PyTorch.
template <class T = float>
class Conv2dImpl : public Module {
 public:
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

  void reset_parameters() {
    init::kaiming_uniform_(weight, std::sqrt(5.0));
    if (bias.defined()) {
      const auto fan_in = init::fans(weight).first;
      const double bound = fan_in > 0 ? 1.0 / std::sqrt(static_cast<double>(fan_in)) : 0.0;
      init::uniform_(bias, -bound, bound);
    }
  }

  Tensor<T> forward(const Tensor<T>& x) const {
    return conv2d(x, weight, bias, options.stride, options.padding, options.dilation, options.groups);
  }
  std::string name() const override {
    return "Conv2d(" + std::to_string(in_channels) + ", " + std::to_string(out_channels) + ", kernel_size=(" +
           std::to_string(kernel_size[0]) + ", " + std::to_string(kernel_size[1]) + "))";
  }

  std::int64_t in_channels, out_channels;
  Pair kernel_size;
  Conv2dOptions options;
  Tensor<T> weight, bias;
};

template <class T = float>
class Conv2dT : public ModuleHolder<Conv2dImpl<T>> {
 public:
  using ModuleHolder<Conv2dImpl<T>>::ModuleHolder;
  explicit Conv2dT(std::int64_t in_channels, std::int64_t out_channels, Pair kernel_size, Conv2dOptions options = {})
      : ModuleHolder<Conv2dImpl<T>>(std::make_shared<Conv2dImpl<T>>(in_channels, out_channels, kernel_size, options)) {}
};
using Conv2d = Conv2dT<float>;

struct MaxPool2dOptions {
  std::optional<Pair> stride = std::nullopt;  // default: the kernel size
  Pair padding = 0;
  Pair dilation = 1;
  bool ceil_mode = false;
};

/// Max pooling (no parameters; works for any floating type).
class MaxPool2dImpl : public Module {
 public:
  explicit MaxPool2dImpl(Pair kernel_size, MaxPool2dOptions options = {}) : kernel_size(kernel_size), options(options) {
    ops::detail::check_window("MaxPool2d", kernel_size, options.stride.value_or(kernel_size), options.padding,
                              options.dilation);
  }
  template <class T>
  Tensor<T> forward(const Tensor<T>& x) const {
    return max_pool2d(x, kernel_size, options.stride, options.padding, options.dilation, options.ceil_mode);
  }
  std::string name() const override { return "MaxPool2d"; }
  Pair kernel_size;
  MaxPool2dOptions options;
};
class MaxPool2d : public ModuleHolder<MaxPool2dImpl> {
 public:
  using ModuleHolder<MaxPool2dImpl>::ModuleHolder;
  explicit MaxPool2d(Pair kernel_size, MaxPool2dOptions options = {})
      : ModuleHolder(std::make_shared<MaxPool2dImpl>(kernel_size, options)) {}
};

struct AvgPool2dOptions {
  std::optional<Pair> stride = std::nullopt;  // default: the kernel size
  Pair padding = 0;
  bool ceil_mode = false;
  bool count_include_pad = true;
  std::int64_t divisor_override = 0;  // 0: none
};

class AvgPool2dImpl : public Module {
 public:
  explicit AvgPool2dImpl(Pair kernel_size, AvgPool2dOptions options = {}) : kernel_size(kernel_size), options(options) {
    ops::detail::check_window("AvgPool2d", kernel_size, options.stride.value_or(kernel_size), options.padding, 1);
  }
  template <class T>
  Tensor<T> forward(const Tensor<T>& x) const {
    return avg_pool2d(x, kernel_size, options.stride, options.padding, options.ceil_mode, options.count_include_pad,
                      options.divisor_override);
  }
  std::string name() const override { return "AvgPool2d"; }
  Pair kernel_size;
  AvgPool2dOptions options;
};
class AvgPool2d : public ModuleHolder<AvgPool2dImpl> {
 public:
  using ModuleHolder<AvgPool2dImpl>::ModuleHolder;
  explicit AvgPool2d(Pair kernel_size, AvgPool2dOptions options = {})
      : ModuleHolder(std::make_shared<AvgPool2dImpl>(kernel_size, options)) {}
};

class AdaptiveAvgPool2dImpl : public Module {
 public:
  explicit AdaptiveAvgPool2dImpl(Pair output_size) : output_size(output_size) {
    CHORUS_CHECK(output_size[0] > 0 && output_size[1] > 0, "AdaptiveAvgPool2d: output size must be positive, got ",
                 output_size);
  }
  template <class T>
  Tensor<T> forward(const Tensor<T>& x) const {
    return adaptive_avg_pool2d(x, output_size);
  }
  std::string name() const override { return "AdaptiveAvgPool2d"; }
  Pair output_size;
};
class AdaptiveAvgPool2d : public ModuleHolder<AdaptiveAvgPool2dImpl> {
 public:
  using ModuleHolder<AdaptiveAvgPool2dImpl>::ModuleHolder;
  explicit AdaptiveAvgPool2d(Pair output_size) : ModuleHolder(std::make_shared<AdaptiveAvgPool2dImpl>(output_size)) {}
};

}  // namespace nn
CHORUS_NAMESPACE_END
