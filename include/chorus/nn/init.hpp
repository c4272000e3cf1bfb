#pragma once
// Parameter initialisation (in place, not recorded), as torch.nn.init.
#include <cmath>

#include "../ops/ops.hpp"

CHORUS_NAMESPACE_BEGIN
namespace nn::init {

template <class T>
Tensor<T>& uniform_(Tensor<T>& t, double lo, double hi, Generator& gen = default_generator()) {
  NoGradGuard g;
  return t.copy_(rand<T>(t.shape(), t.device(), lo, hi, gen));
}

template <class T>
Tensor<T>& normal_(Tensor<T>& t, double mean = 0.0, double stddev = 1.0, Generator& gen = default_generator()) {
  NoGradGuard g;
  return t.copy_(randn<T>(t.shape(), t.device(), mean, stddev, gen));
}

template <class T>
Tensor<T>& constant_(Tensor<T>& t, T value) {
  NoGradGuard g;
  return t.fill_(value);
}

/// fan_in and fan_out of a weight [out, in, ...].
template <class T>
std::pair<std::int64_t, std::int64_t> fans(const Tensor<T>& t) {
  CHORUS_CHECK(t.dim() >= 2, "fan in/out needs a tensor with at least 2 dimensions, got shape ", t.shape());
  std::int64_t receptive = 1;
  for (int i = 2; i < t.dim(); ++i) receptive *= t.shape()[i];
  return {t.shape()[1] * receptive, t.shape()[0] * receptive};
}

/// He (Kaiming) uniform for leaky-ReLU slope `a` on fan_in, as torch.nn.init.kaiming_uniform_.
template <class T>
Tensor<T>& kaiming_uniform_(Tensor<T>& t, double a = 0.0, Generator& gen = default_generator()) {
  const auto fan_in = fans(t).first;
  const double gain = std::sqrt(2.0 / (1.0 + a * a));
  const double bound = fan_in > 0 ? gain * std::sqrt(3.0 / static_cast<double>(fan_in)) : 0.0;
  return uniform_(t, -bound, bound, gen);
}

/// Glorot (Xavier) uniform, as torch.nn.init.xavier_uniform_.
template <class T>
Tensor<T>& xavier_uniform_(Tensor<T>& t, double gain = 1.0, Generator& gen = default_generator()) {
  auto [fi, fo] = fans(t);
  const double bound = gain * std::sqrt(6.0 / static_cast<double>(std::max<std::int64_t>(fi + fo, 1)));
  return uniform_(t, -bound, bound, gen);
}

}  // namespace nn::init
CHORUS_NAMESPACE_END
