#pragma once
// A capsule network (Sabour, Frosst and Hinton 2017, "Dynamic Routing Between Capsules") written
// from chorus's operators, as a test model nothing in the library was made for: a primary-capsule
// convolution, squash, and a digit-capsule layer whose couplings are found by routing-by-agreement.
#include <cstdint>

#include <chorus/chorus.hpp>

namespace chorus::testing {

/// squash(s) = |s|^2 / (1 + |s|^2) * s / |s| along the last dimension (eq. 1 of the paper).
template <class T>
Tensor<T> squash(const Tensor<T>& s) {
  auto n2 = sum(s * s, -1, /*keepdim=*/true);
  return s * n2 / ((n2 + 1.0) * sqrt(n2 + 1e-12));
}

/// Primary capsules: a convolution whose `caps * dim` output channels are `caps` capsule types of
/// `dim` components at every position; each capsule squashed.
template <class T>
struct PrimaryCapsules : nn::Module {
  nn::Conv2dT<T> conv;
  std::int64_t caps, dim;
  PrimaryCapsules(std::int64_t in_channels, std::int64_t caps, std::int64_t dim, std::int64_t kernel, std::int64_t stride)
      : conv(register_module("conv", nn::Conv2dT<T>(in_channels, caps * dim, kernel, nn::Conv2dOptions{.stride = stride}))),
        caps(caps),
        dim(dim) {}
  /// [B, C, H, W] -> [B, caps * H' * W', dim]
  Tensor<T> forward(const Tensor<T>& x) {
    auto p = conv(x);  // [B, caps * dim, H', W']
    const auto b = p.shape()[0], h = p.shape()[2], w = p.shape()[3];
    auto u = p.reshape({b, caps, dim, h, w}).permute({0, 1, 3, 4, 2}).reshape({b, caps * h * w, dim});
    return squash(u);
  }
};

/// Digit capsules: u_hat_{j|i} = W_ij u_i for every input capsule i and output capsule j, then
/// `iterations` rounds of routing (procedure 1 of the paper): c_i = softmax_j(b_i),
/// s_j = sum_i c_ij u_hat_{j|i}, v_j = squash(s_j), b_ij += u_hat_{j|i} . v_j.
template <class T>
struct DigitCapsules : nn::Module {
  Tensor<T> weight;  // [in_caps, out_caps, out_dim, in_dim]
  std::int64_t in_caps, out_caps, out_dim, in_dim;
  int iterations;
  DigitCapsules(std::int64_t in_caps, std::int64_t in_dim, std::int64_t out_caps, std::int64_t out_dim, int iterations)
      : in_caps(in_caps), out_caps(out_caps), out_dim(out_dim), in_dim(in_dim), iterations(iterations) {
    weight = register_parameter("weight", randn<T>({in_caps, out_caps, out_dim, in_dim}, Device::cpu(), 0.0, 0.3));
  }
  /// [B, in_caps, in_dim] -> [B, out_caps, out_dim]
  Tensor<T> forward(const Tensor<T>& u) {
    const auto b = u.shape()[0];
    auto u_hat = matmul(weight, u.reshape({b, in_caps, 1, in_dim, 1})).reshape({b, in_caps, out_caps, out_dim});
    auto logits = zeros<T>({b, in_caps, out_caps}, u.device());
    Tensor<T> v;
    for (int it = 0; it < iterations; ++it) {
      auto c = softmax(logits, 2);                                      // [B, in, out]
      v = squash(sum(c.unsqueeze(-1) * u_hat, 1));                      // [B, out, out_dim]
      if (it + 1 < iterations) logits = logits + sum(u_hat * v.unsqueeze(1), -1);  // agreement
    }
    return v;
  }
};

/// Primary capsules on a small image, routed to `classes` digit capsules; returns the digit
/// capsules [B, classes, out_dim] (their lengths are the class scores).
template <class T>
struct CapsuleNet : nn::Module {
  nn::ModuleHolder<PrimaryCapsules<T>> primary;  // holders: a copy (a replica) remaps them
  nn::ModuleHolder<DigitCapsules<T>> digits;
  static constexpr std::int64_t kCaps = 4, kDim = 6, kKernel = 3, kStride = 2;
  CapsuleNet(std::int64_t channels, std::int64_t image, std::int64_t classes, int iterations = 3)
      : primary(register_module("primary", nn::ModuleHolder<PrimaryCapsules<T>>(std::make_shared<PrimaryCapsules<T>>(
                                               channels, kCaps, kDim, kKernel, kStride)))),
        digits(register_module("digits", nn::ModuleHolder<DigitCapsules<T>>(std::make_shared<DigitCapsules<T>>(
                                             kCaps * side(image) * side(image), kDim, classes, 8, iterations)))) {}
  static std::int64_t side(std::int64_t image) { return (image - kKernel) / kStride + 1; }
  Tensor<T> forward(const Tensor<T>& x) { return digits->forward(primary->forward(x)); }
};

}  // namespace chorus::testing
