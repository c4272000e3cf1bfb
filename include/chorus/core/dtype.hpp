#pragma once
// The element types a Tensor<T> may hold.
#include <cstdint>
#include <string_view>
#include <type_traits>

#include "../config.hpp"

CHORUS_NAMESPACE_BEGIN

enum class DType : std::uint8_t { Float32, Float64, Int64 };

template <class T>
inline constexpr bool is_supported_scalar_v =
    std::is_same_v<T, float> || std::is_same_v<T, double> || std::is_same_v<T, std::int64_t>;

template <class T>
inline constexpr bool is_floating_v = std::is_same_v<T, float> || std::is_same_v<T, double>;

template <class T>
constexpr DType dtype_of() {
  static_assert(is_supported_scalar_v<T>, "chorus tensors hold float, double or int64_t");
  if constexpr (std::is_same_v<T, float>) return DType::Float32;
  else if constexpr (std::is_same_v<T, double>) return DType::Float64;
  else return DType::Int64;
}

constexpr std::string_view dtype_name(DType d) {
  switch (d) {
    case DType::Float32: return "float32";
    case DType::Float64: return "float64";
    case DType::Int64: return "int64";
  }
  return "?";
}

constexpr std::size_t dtype_size(DType d) { return d == DType::Float32 ? 4 : 8; }

/// Calls f(T{}) with T the element type of `d` (to dispatch a runtime dtype to a template).
template <class F>
decltype(auto) visit_dtype(DType d, F&& f) {
  switch (d) {
    case DType::Float32: return f(float{});
    case DType::Float64: return f(double{});
    case DType::Int64: break;
  }
  return f(std::int64_t{});
}

CHORUS_NAMESPACE_END
