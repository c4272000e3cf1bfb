#pragma once
// The element types a Tensor<T> may hold.
#include <cstdint>
#include <string_view>
#include <type_traits>

#include "../config.hpp"
#include "half.hpp"

CHORUS_NAMESPACE_BEGIN

// New dtypes go at the end: the numbers are part of keys (cuBLASLt's plan cache).
/// The runtime element type of a tensor (torch.dtype): float32, float64, int64, bfloat16, float16.
enum class DType : std::uint8_t { Float32, Float64, Int64, BFloat16, Float16 };

/// True for the element types a Tensor<T> may hold: float, double, int64_t, bfloat16 and half.
template <class T>
inline constexpr bool is_supported_scalar_v = std::is_same_v<T, float> || std::is_same_v<T, double> ||
                                              std::is_same_v<T, std::int64_t> || is_reduced_floating_v<T>;

/// The floating-point element types (those that can require gradients): float, double and the
/// 16-bit bfloat16 and half (is_reduced_floating_v, Note [16-bit storage types]).
template <class T>
inline constexpr bool is_floating_v = std::is_same_v<T, float> || std::is_same_v<T, double> || is_reduced_floating_v<T>;

/// The DType of element type `T` (a compile error for an unsupported type).
template <class T>
constexpr DType dtype_of() {
  static_assert(is_supported_scalar_v<T>, "chorus tensors hold float, double, int64_t, bfloat16 or half");
  if constexpr (std::is_same_v<T, float>) return DType::Float32;
  else if constexpr (std::is_same_v<T, double>) return DType::Float64;
  else if constexpr (std::is_same_v<T, bfloat16>) return DType::BFloat16;
  else if constexpr (std::is_same_v<T, half>) return DType::Float16;
  else return DType::Int64;
}

/// PyTorch's names (torch.bfloat16, torch.float16).
constexpr std::string_view dtype_name(DType d) {
  switch (d) {
    case DType::Float32: return "float32";
    case DType::Float64: return "float64";
    case DType::Int64: return "int64";
    case DType::BFloat16: return "bfloat16";
    case DType::Float16: return "float16";
  }
  return "?";
}

/// Bytes per element of `d` (torch.dtype.itemsize).
constexpr std::size_t dtype_size(DType d) {
  switch (d) {
    case DType::Float32: return 4;
    case DType::Float64:
    case DType::Int64: return 8;
    case DType::BFloat16:
    case DType::Float16: return 2;
  }
  return 0;
}

/// True for the floating-point dtypes (all but Int64; torch.dtype.is_floating_point).
constexpr bool is_floating_dtype(DType d) { return d != DType::Int64; }
/// True for the 16-bit floating-point dtypes, BFloat16 and Float16.
constexpr bool is_reduced_floating_dtype(DType d) { return d == DType::BFloat16 || d == DType::Float16; }

/// Calls f(T{}) with T the element type of `d` (to dispatch a runtime dtype to a template).
template <class F>
decltype(auto) visit_dtype(DType d, F&& f) {
  switch (d) {
    case DType::Float32: return f(float{});
    case DType::Float64: return f(double{});
    case DType::BFloat16: return f(bfloat16{});
    case DType::Float16: return f(half{});
    case DType::Int64: break;
  }
  return f(std::int64_t{});
}

CHORUS_NAMESPACE_END
