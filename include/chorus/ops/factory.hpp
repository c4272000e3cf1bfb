#pragma once
// Tensor factories. Random factories draw from a Generator (the default one unless given),
// so a seed gives the same numbers on every device.
#include <cmath>
#include <cstdint>
#include <vector>

#include "../compiled.hpp"
#include "../backend/backend.hpp"

CHORUS_NAMESPACE_BEGIN

/// An uninitialised contiguous tensor.
template <class T = float>
Tensor<T> empty(const Shape& shape, Device device = Device::cpu()) {
  return Tensor<T>::empty(shape, device);
}

/// A tensor of `shape` filled with `value`.
template <class T = float>
Tensor<T> full(const Shape& shape, T value, Device device = Device::cpu()) {
  auto t = Tensor<T>::empty(shape, device);
  backend::fill(t, value);
  return t;
}

/// A tensor of `shape` filled with zeros (torch.zeros).
template <class T = float>
Tensor<T> zeros(const Shape& shape, Device device = Device::cpu()) {
  return full<T>(shape, T(0), device);
}

/// A tensor of `shape` filled with ones (torch.ones).
template <class T = float>
Tensor<T> ones(const Shape& shape, Device device = Device::cpu()) {
  return full<T>(shape, T(1), device);
}

/// An uninitialised contiguous tensor with `t`'s shape and device (torch.empty_like).
template <class T>
Tensor<T> empty_like(const Tensor<T>& t) {
  return Tensor<T>::empty(t.shape(), t.device());
}
/// Zeros with `t`'s shape and device (torch.zeros_like).
template <class T>
Tensor<T> zeros_like(const Tensor<T>& t) {
  return zeros<T>(t.shape(), t.device());
}
/// Ones with `t`'s shape and device (torch.ones_like).
template <class T>
Tensor<T> ones_like(const Tensor<T>& t) {
  return ones<T>(t.shape(), t.device());
}

/// A 0-dim tensor holding `value`.
template <class T = float>
Tensor<T> scalar_tensor(T value, Device device = Device::cpu()) {
  return full<T>(Shape{}, value, device);
}

/// [start, end) in steps of `step`, as torch.arange.
template <class T = float>
Tensor<T> arange(double start, double end, double step = 1.0, Device device = Device::cpu()) {
  CHORUS_CHECK(std::isfinite(start) && std::isfinite(end) && std::isfinite(step), "arange: unsupported range [",
               start, ", ", end, ") with step ", step, " (bounds and step must be finite)");
  CHORUS_CHECK(step != 0.0, "arange: step must be nonzero");
  CHORUS_CHECK((end - start) / step >= 0 || end == start, "arange: range [", start, ", ", end,
               ") is empty in the direction of step ", step);
  // Converting a double beyond int64's range is undefined: check the size before casting.
  const double size = std::ceil((end - start) / step);
  CHORUS_CHECK(size >= 0 && size < 9.2e18, "arange: range [", start, ", ", end, ") with step ", step, " has ", size,
               " elements, more than a tensor can hold");
  auto n = static_cast<std::int64_t>(size);
  if constexpr (!is_floating_v<T>) {  // each value is cast to int64: it must be in range
    const double last = n > 0 ? start + step * static_cast<double>(n - 1) : start;
    CHORUS_CHECK(std::abs(start) < 9.2e18 && std::abs(last) < 9.2e18, "arange: range [", start, ", ", end,
                 ") holds values outside int64's range");
  }
  auto t = Tensor<T>::empty(Shape{n}, device);
  backend::arange(t, start, step);
  return t;
}
/// [0, end) in steps of 1, as torch.arange(end).
template <class T = float>
Tensor<T> arange(double end, Device device = Device::cpu()) {
  return arange<T>(0.0, end, 1.0, device);
}

/// A tensor of `shape` holding a copy of `values` (row-major).
template <class T>
Tensor<T> from_vector(const std::vector<T>& values, const Shape& shape, Device device = Device::cpu()) {
  CHORUS_CHECK(numel_of(shape) == static_cast<std::int64_t>(values.size()), "from_vector: ", values.size(),
               " values do not fill shape ", shape, " (", numel_of(shape), " elements)");
  auto t = Tensor<T>::empty(shape, device);
  copy_bytes(t.data(), device, values.data(), Device::cpu(), values.size() * sizeof(T));
  return t;
}

/// A 1-D tensor holding a copy of `values`.
template <class T>
Tensor<T> from_vector(const std::vector<T>& values, Device device = Device::cpu()) {
  return from_vector(values, Shape{static_cast<std::int64_t>(values.size())}, device);
}

/// Uniform numbers in [lo, hi).
template <class T = float>
Tensor<T> rand(const Shape& shape, Device device = Device::cpu(), double lo = 0.0, double hi = 1.0,
               Generator& gen = default_generator()) {
  static_assert(is_floating_v<T>, "rand: floating-point tensors only");
  auto t = Tensor<T>::empty(shape, device);
  // 16-bit: the float numbers of the same seed, each rounded once (a value just below hi may
  // round to hi itself).
  if constexpr (is_reduced_floating_v<T>) {
    backend::random_fill(t, [&](T* p, std::int64_t n) {
      std::vector<float> f(static_cast<std::size_t>(n));
      gen.uniform(f.data(), n, lo, hi);
      for (std::int64_t i = 0; i < n; ++i) p[i] = T(f[i]);
    });
  } else {
    backend::random_fill(t, [&](T* p, std::int64_t n) { gen.uniform(p, n, lo, hi); });
  }
  return t;
}

/// Normal numbers with the given mean and standard deviation.
template <class T = float>
Tensor<T> randn(const Shape& shape, Device device = Device::cpu(), double mean = 0.0, double stddev = 1.0,
                Generator& gen = default_generator()) {
  static_assert(is_floating_v<T>, "randn: floating-point tensors only");
  auto t = Tensor<T>::empty(shape, device);
  if constexpr (is_reduced_floating_v<T>) {  // the float numbers of the same seed, each rounded once
    backend::random_fill(t, [&](T* p, std::int64_t n) {
      std::vector<float> f(static_cast<std::size_t>(n));
      gen.normal(f.data(), n, mean, stddev);
      for (std::int64_t i = 0; i < n; ++i) p[i] = T(f[i]);
    });
  } else {
    backend::random_fill(t, [&](T* p, std::int64_t n) { gen.normal(p, n, mean, stddev); });
  }
  return t;
}

/// Integers uniform in [low, high), as torch.randint.
template <class T = std::int64_t>
Tensor<T> randint(std::int64_t low, std::int64_t high, const Shape& shape, Device device = Device::cpu(),
                  Generator& gen = default_generator()) {
  CHORUS_CHECK(high > low, "randint: empty range [", low, ", ", high, ")");
  auto t = Tensor<T>::empty(shape, device);
  // In uint64 arithmetic: high - low overflows int64 for a range wider than INT64_MAX.
  const auto range = static_cast<std::uint64_t>(high) - static_cast<std::uint64_t>(low);
  backend::random_fill(t, [&](T* p, std::int64_t n) {
    for (std::int64_t i = 0; i < n; ++i)
      p[i] = static_cast<T>(static_cast<std::int64_t>(static_cast<std::uint64_t>(low) + gen.below(range)));
  });
  return t;
}

CHORUS_NAMESPACE_END

// The instances chorus::compiled holds (Note [compiled chorus] in compiled.hpp).
#define CHORUS_OPS_FACTORY_INSTANCES(X, T)                                              \
  X(Tensor<T> empty<T>(const Shape&, Device))                                           \
  X(Tensor<T> full<T>(const Shape&, T, Device))                                         \
  X(Tensor<T> zeros<T>(const Shape&, Device))                                           \
  X(Tensor<T> ones<T>(const Shape&, Device))                                            \
  X(Tensor<T> empty_like<T>(const Tensor<T>&))                                          \
  X(Tensor<T> zeros_like<T>(const Tensor<T>&))                                          \
  X(Tensor<T> ones_like<T>(const Tensor<T>&))                                           \
  X(Tensor<T> scalar_tensor<T>(T, Device))                                              \
  X(Tensor<T> arange<T>(double, double, double, Device))                                \
  X(Tensor<T> arange<T>(double, Device))                                                \
  X(Tensor<T> from_vector<T>(const std::vector<T>&, const Shape&, Device))              \
  X(Tensor<T> from_vector<T>(const std::vector<T>&, Device))                            \
  X(Tensor<T> randint<T>(std::int64_t, std::int64_t, const Shape&, Device, Generator&))
CHORUS_EXTERN_INSTANCES(CHORUS_OPS_FACTORY_INSTANCES, CHORUS_ALL_DTYPES)
#define CHORUS_OPS_FACTORY_FLOAT_INSTANCES(X, T)                          \
  X(Tensor<T> rand<T>(const Shape&, Device, double, double, Generator&))  \
  X(Tensor<T> randn<T>(const Shape&, Device, double, double, Generator&))
CHORUS_EXTERN_INSTANCES(CHORUS_OPS_FACTORY_FLOAT_INSTANCES, CHORUS_FLOATING_DTYPES)
