#pragma once
// Conv2d and the pooling layers (NCHW).
#include <cmath>
#include <optional>

#include "../ops/nn.hpp"
#include "init.hpp"
#include "module.hpp"

CHORUS_NAMESPACE_BEGIN
namespace nn {

struct Conv2dOptions {
  Pair stride{1, 1};
  Pair padding{0, 0};
  Pair dilation{1, 1};
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
    CHORUS_CHECK(kernel_size[0] > 0 && kernel_size[1] > 0, "Conv2d: kernel size must be positive, got [",
                 kernel_size[0], ", ", kernel_size[1], "]");
    CHORUS_CHECK(options.groups > 0 && in_channels % options.groups == 0 && out_channels % options.groups == 0,
                 "Conv2d(", in_channels, ", ", out_channels, "): groups=", options.groups,
                 " must divide both channel counts");
    weight = register_parameter(
        "weight", Tensor<T>::empty(Shape{out_channels, in_channels / options.groups, kernel_size[0], kernel_size[1]},
                                   options.device));
    if (options.bias) bias = register_parameter("bias", Tensor<T>::empty(Shape{out_channels}, options.device));
    reset_parameters();
  }
  Conv2dImpl(std::int64_t in_channels, std::int64_t out_channels, std::int64_t kernel_size, Conv2dOptions options = {})
      : Conv2dImpl(in_channels, out_channels, Pair{kernel_size, kernel_size}, options) {}

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
using Conv2dT = ModuleHolder<Conv2dImpl<T>>;
using Conv2d = Conv2dT<float>;

struct MaxPool2dOptions {
  std::optional<Pair> stride;  // default: the kernel size
  Pair padding{0, 0};
  Pair dilation{1, 1};
  bool ceil_mode = false;
};

/// Max pooling (no parameters; works for any floating type).
class MaxPool2dImpl : public Module {
 public:
  explicit MaxPool2dImpl(Pair kernel_size, MaxPool2dOptions options = {}) : kernel_size(kernel_size), options(options) {
    ops::detail::check_window("MaxPool2d", kernel_size, options.stride.value_or(kernel_size), options.padding,
                              options.dilation);
  }
  explicit MaxPool2dImpl(std::int64_t k, MaxPool2dOptions options = {}) : MaxPool2dImpl(Pair{k, k}, options) {}
  template <class T>
  Tensor<T> forward(const Tensor<T>& x) const {
    return max_pool2d(x, kernel_size, options.stride, options.padding, options.dilation, options.ceil_mode);
  }
  std::string name() const override { return "MaxPool2d"; }
  Pair kernel_size;
  MaxPool2dOptions options;
};
using MaxPool2d = ModuleHolder<MaxPool2dImpl>;

struct AvgPool2dOptions {
  std::optional<Pair> stride;  // default: the kernel size
  Pair padding{0, 0};
  bool ceil_mode = false;
  bool count_include_pad = true;
  std::int64_t divisor_override = 0;  // 0: none
};

class AvgPool2dImpl : public Module {
 public:
  explicit AvgPool2dImpl(Pair kernel_size, AvgPool2dOptions options = {}) : kernel_size(kernel_size), options(options) {
    ops::detail::check_window("AvgPool2d", kernel_size, options.stride.value_or(kernel_size), options.padding, {1, 1});
  }
  explicit AvgPool2dImpl(std::int64_t k, AvgPool2dOptions options = {}) : AvgPool2dImpl(Pair{k, k}, options) {}
  template <class T>
  Tensor<T> forward(const Tensor<T>& x) const {
    return avg_pool2d(x, kernel_size, options.stride, options.padding, options.ceil_mode, options.count_include_pad,
                      options.divisor_override);
  }
  std::string name() const override { return "AvgPool2d"; }
  Pair kernel_size;
  AvgPool2dOptions options;
};
using AvgPool2d = ModuleHolder<AvgPool2dImpl>;

class AdaptiveAvgPool2dImpl : public Module {
 public:
  explicit AdaptiveAvgPool2dImpl(Pair output_size) : output_size(output_size) {
    CHORUS_CHECK(output_size[0] > 0 && output_size[1] > 0, "AdaptiveAvgPool2d: output size must be positive, got [",
                 output_size[0], ", ", output_size[1], "]");
  }
  explicit AdaptiveAvgPool2dImpl(std::int64_t s) : AdaptiveAvgPool2dImpl(Pair{s, s}) {}
  template <class T>
  Tensor<T> forward(const Tensor<T>& x) const {
    return adaptive_avg_pool2d(x, output_size);
  }
  std::string name() const override { return "AdaptiveAvgPool2d"; }
  Pair output_size;
};
using AdaptiveAvgPool2d = ModuleHolder<AdaptiveAvgPool2dImpl>;

}  // namespace nn
CHORUS_NAMESPACE_END
