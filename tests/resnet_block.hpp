#pragma once
// The ResNet basic block (He et al. 2016; torchvision's BasicBlock) built from chorus's
// layers with torchvision's names (conv1, bn1, conv2, bn2, downsample.0/.1), and the
// deterministic values that the LibTorch cross-check and the Python safetensors test give
// each tensor by name.
#include <chorus/chorus.hpp>

#include <string>

namespace chorus::testing {

template <class T>
struct BasicBlock : nn::Module {
  nn::Conv2dT<T> conv1;
  nn::BatchNorm2dT<T> bn1;
  nn::Conv2dT<T> conv2;
  nn::BatchNorm2dT<T> bn2;
  nn::SequentialT<T> downsample{nullptr};

  BasicBlock(std::int64_t in, std::int64_t out, std::int64_t stride)
      : conv1(register_module(
            "conv1", nn::Conv2dT<T>(in, out, 3, {.stride = stride, .padding = 1, .bias = false}))),
        bn1(register_module("bn1", nn::BatchNorm2dT<T>(out))),
        conv2(register_module("conv2", nn::Conv2dT<T>(out, out, 3, {.padding = 1, .bias = false}))),
        bn2(register_module("bn2", nn::BatchNorm2dT<T>(out))) {
    if (stride != 1 || in != out)
      downsample = register_module(
          "downsample", nn::SequentialT<T>(nn::Conv2dT<T>(in, out, 1, {.stride = stride, .bias = false}),
                                           nn::BatchNorm2dT<T>(out)));
  }
  Tensor<T> forward(const Tensor<T>& x) {
    auto y = relu(bn1(conv1(x)));
    y = bn2(conv2(y));
    return relu(y + (downsample ? downsample(x) : x));
  }
};

/// A name's seed: the sum of its characters mod 97 (also computed by the Python and LibTorch sides).
inline int name_seed(const std::string& name) {
  int s = 0;
  for (unsigned char c : name) s += c;
  return s % 97;
}
/// Element j of the tensor called `name` (exact in binary floating point).
inline double pattern_value(const std::string& name, std::int64_t j) {
  const int s = name_seed(name);
  if (name.size() >= 11 && name.compare(name.size() - 11, 11, "running_var") == 0)
    return 0.5 + double((j * 5 + s) % 11) / 8.0;
  return double((j * 7 + s) % 17) / 16.0 - 0.5;
}
inline std::int64_t pattern_count(const std::string& name) { return 3 + name_seed(name) % 5; }

/// Gives every parameter and buffer of `m` its pattern values.
inline void fill_pattern(nn::Module& m) {
  NoGradGuard g;
  for (auto& t : m.named_tensors()) {
    t.tensor.visit([&](auto& x) {
      using T = typename std::decay_t<decltype(x)>::value_type;
      std::vector<T> v(static_cast<std::size_t>(x.numel()));
      for (std::size_t j = 0; j < v.size(); ++j) {
        if constexpr (std::is_same_v<T, std::int64_t>) v[j] = pattern_count(t.name);
        else v[j] = static_cast<T>(pattern_value(t.name, static_cast<std::int64_t>(j)));
      }
      x.detach().copy_(from_vector<T>(v, x.shape(), x.device()));
    });
  }
}

}  // namespace chorus::testing
