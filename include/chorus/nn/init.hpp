#pragma once
// Parameter initialisation (in place, not recorded), as torch.nn.init.
#include <cmath>
#include <string>

#include "../compiled.hpp"
#include "../ops/ops.hpp"

CHORUS_NAMESPACE_BEGIN
namespace nn::init {

/// Fills `t` with draws from U(lo, hi), as torch.nn.init.uniform_.
template <class T>
Tensor<T>& uniform_(Tensor<T>& t, double lo, double hi, Generator& gen = default_generator()) {
  NoGradGuard g;
  return t.copy_(rand<T>(t.shape(), t.device(), lo, hi, gen));
}

/// Fills `t` with draws from N(mean, stddev²), as torch.nn.init.normal_.
template <class T>
Tensor<T>& normal_(Tensor<T>& t, double mean = 0.0, double stddev = 1.0, Generator& gen = default_generator()) {
  NoGradGuard g;
  return t.copy_(randn<T>(t.shape(), t.device(), mean, stddev, gen));
}

/// Fills `t` with `value`, as torch.nn.init.constant_.
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

/// Recommended gain for a nonlinearity, as torch.nn.init.calculate_gain ("linear", "conv2d",
/// "sigmoid", "tanh", "relu", "leaky_relu" with `param` the negative slope, "selu").
inline double calculate_gain(const std::string& nonlinearity, double param = 0.01) {
  if (nonlinearity == "linear" || nonlinearity == "conv1d" || nonlinearity == "conv2d" ||
      nonlinearity == "conv3d" || nonlinearity == "sigmoid")
    return 1.0;
  if (nonlinearity == "tanh") return 5.0 / 3.0;
  if (nonlinearity == "relu") return std::sqrt(2.0);
  if (nonlinearity == "leaky_relu") return std::sqrt(2.0 / (1.0 + param * param));
  if (nonlinearity == "selu") return 0.75;
  CHORUS_FAIL("calculate_gain: unsupported nonlinearity '", nonlinearity, "'");
}

/// The fan the Kaiming initialisers scale by (PyTorch's mode="fan_in" / "fan_out").
enum class FanMode { FanIn, FanOut };

namespace detail {
template <class T>
double kaiming_std(const Tensor<T>& t, double a, FanMode mode, const std::string& nonlinearity) {
  auto [fi, fo] = fans(t);
  const auto fan = mode == FanMode::FanIn ? fi : fo;
  const double gain = calculate_gain(nonlinearity, a);
  return fan > 0 ? gain / std::sqrt(static_cast<double>(fan)) : 0.0;
}
}  // namespace detail

/// He (Kaiming) uniform with an explicit fan mode and nonlinearity (as PyTorch's full signature).
template <class T>
Tensor<T>& kaiming_uniform_(Tensor<T>& t, double a, FanMode mode, const std::string& nonlinearity = "leaky_relu",
                            Generator& gen = default_generator()) {
  const double bound = std::sqrt(3.0) * detail::kaiming_std(t, a, mode, nonlinearity);
  return uniform_(t, -bound, bound, gen);
}

/// He (Kaiming) normal: N(0, gain²/fan), as torch.nn.init.kaiming_normal_.
template <class T>
Tensor<T>& kaiming_normal_(Tensor<T>& t, double a = 0.0, FanMode mode = FanMode::FanIn,
                           const std::string& nonlinearity = "leaky_relu", Generator& gen = default_generator()) {
  return normal_(t, 0.0, detail::kaiming_std(t, a, mode, nonlinearity), gen);
}

/// Glorot (Xavier) normal: N(0, gain²·2/(fan_in + fan_out)), as torch.nn.init.xavier_normal_.
template <class T>
Tensor<T>& xavier_normal_(Tensor<T>& t, double gain = 1.0, Generator& gen = default_generator()) {
  auto [fi, fo] = fans(t);
  const double stddev = gain * std::sqrt(2.0 / static_cast<double>(std::max<std::int64_t>(fi + fo, 1)));
  return normal_(t, 0.0, stddev, gen);
}

/// Fills `t` with zeros, as torch.nn.init.zeros_.
template <class T>
Tensor<T>& zeros_(Tensor<T>& t) {
  return constant_(t, T(0));
}
/// Fills `t` with ones, as torch.nn.init.ones_.
template <class T>
Tensor<T>& ones_(Tensor<T>& t) {
  return constant_(t, T(1));
}

}  // namespace nn::init
CHORUS_NAMESPACE_END

// The instances chorus::compiled holds (Note [compiled chorus] in compiled.hpp).
#define CHORUS_NN_INIT_INSTANCES(X, T)                                         \
  X(Tensor<T>& nn::init::constant_<T>(Tensor<T>&, T))                          \
  X(std::pair<std::int64_t, std::int64_t> nn::init::fans<T>(const Tensor<T>&)) \
  X(Tensor<T>& nn::init::zeros_<T>(Tensor<T>&))                                \
  X(Tensor<T>& nn::init::ones_<T>(Tensor<T>&))
CHORUS_EXTERN_INSTANCES(CHORUS_NN_INIT_INSTANCES, CHORUS_ALL_DTYPES)
#define CHORUS_NN_INIT_FLOAT_INSTANCES(X, T)                                                               \
  X(Tensor<T>& nn::init::uniform_<T>(Tensor<T>&, double, double, Generator&))                              \
  X(Tensor<T>& nn::init::normal_<T>(Tensor<T>&, double, double, Generator&))                               \
  X(Tensor<T>& nn::init::kaiming_uniform_<T>(Tensor<T>&, double, Generator&))                              \
  X(Tensor<T>& nn::init::xavier_uniform_<T>(Tensor<T>&, double, Generator&))                               \
  X(Tensor<T>& nn::init::kaiming_uniform_<T>(Tensor<T>&, double, FanMode, const std::string&, Generator&)) \
  X(Tensor<T>& nn::init::kaiming_normal_<T>(Tensor<T>&, double, FanMode, const std::string&, Generator&))  \
  X(Tensor<T>& nn::init::xavier_normal_<T>(Tensor<T>&, double, Generator&))
CHORUS_EXTERN_INSTANCES(CHORUS_NN_INIT_FLOAT_INSTANCES, CHORUS_FLOATING_DTYPES)
