#pragma once
// The 16-bit floating-point storage types: chorus::bfloat16 and chorus::half.
//
// Note [16-bit storage types]
// bfloat16 (1 sign, 8 exponent, 7 mantissa bits: float's range, 3 significant digits) and
// half (IEEE binary16: 1, 5, 10 bits) are *storage* types: a struct holding the 16 bits, the
// same bits as CUDA's __nv_bfloat16 / __half and PyTorch's c10::BFloat16 / c10::Half, so a
// buffer of them can be handed to cuBLAS, NCCL or a safetensors file as it is.
//
// Arithmetic happens in float, the *arithmetic type* (backend::fn::opmath_t):
//  - A conversion from float or double rounds to nearest, ties to even, once; NaN stays NaN
//    (made quiet, sign kept), infinities stay infinite, finite values beyond the largest
//    finite one become infinite, half's subnormals are produced and read exactly. The
//    conversion to float is exact and implicit, so a 16-bit value goes wherever a float goes
//    (std::exp(x), `x < 0.5f`, printing).
//  - Construction from a number is explicit (`bfloat16(0.1f)`, `T(1)` in templates), so that
//    no rounding happens unseen: `bfloat16 y = x * 2.0f` does not compile, the rounding point
//    is written `bfloat16 y(x * 2.0f)`.
//  - Two operands of one 16-bit type give that type (`a + b` is bfloat16, computed in float
//    and rounded once, as c10::BFloat16 and __nv_bfloat16 do), so that generic code written
//    for T (`T s = a * b;`) instantiates for bfloat16 unchanged. With a wider operand the
//    usual arithmetic conversions apply through the conversion to float: `a + 1.0f` is a float
//    and `a + 1.0` a double, nothing is rounded to 16 bits behind the user's back.
//  - For +, -, *, / the float result rounded to 16 bits is the correctly rounded 16-bit result:
//    float's 24-bit significand is at least 2p + 2 bits for p = 8 (bfloat16) and p = 11 (half),
//    so the double rounding is innocuous (Figueroa, "When is double rounding innocuous?").
//  - Kernels do not chain 16-bit operations: they load each element as float, evaluate the
//    whole functor in float and round the result once (backend/cpu/kernels.hpp, the opmath
//    loads). Reductions accumulate in double on the CPU (backend::cpu::acc_t).
//  - A double is rounded to float with round-to-odd first and then to 16 bits, which is the
//    correctly rounded result (float keeps more than p + 1 bits), never a double rounding.
//    Integers convert through double: exact up to 2^53 in magnitude.
//  - Names: OpenBLAS declares a global `bfloat16` (renamed while backend/cpu/blas.hpp reads
//    <cblas.h>) and cuda_fp16.h a global `half` (= __half): in a translation unit compiled by
//    nvcc, `using namespace chorus;` makes a bare `half` ambiguous; write chorus::half there.
#include <bit>
#include <cstdint>
#include <limits>
#include <ostream>
#include <type_traits>

#include "../config.hpp"

CHORUS_NAMESPACE_BEGIN

namespace detail::lowp {

CHORUS_HOST_DEVICE inline std::uint32_t float_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  return std::bit_cast<std::uint32_t>(f);
#endif
}
CHORUS_HOST_DEVICE inline float bits_float(std::uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  return std::bit_cast<float>(u);
#endif
}

/// float -> bfloat16 bits, round to nearest even; NaN made quiet (sign and top payload kept).
CHORUS_HOST_DEVICE inline std::uint16_t float_to_bf16(float f) {
  std::uint32_t u = float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((u >> 16) | 0x0040u);
  u += 0x7fffu + ((u >> 16) & 1u);  // carries into the exponent (up to infinity) as it should
  return static_cast<std::uint16_t>(u >> 16);
}
CHORUS_HOST_DEVICE inline float bf16_to_float(std::uint16_t b) { return bits_float(std::uint32_t{b} << 16); }

/// float -> IEEE binary16 bits, round to nearest even, with subnormals.
CHORUS_HOST_DEVICE inline std::uint16_t float_to_half(float f) {
  std::uint32_t u = float_bits(f);
  const std::uint32_t sign = (u >> 16) & 0x8000u;
  u &= 0x7fffffffu;
  if (u > 0x7f800000u) return static_cast<std::uint16_t>(sign | 0x7e00u | ((u >> 13) & 0x3ffu));  // NaN
  if (u >= 0x477ff000u) return static_cast<std::uint16_t>(sign | 0x7c00u);  // >= 65520 (tie to even): inf
  if (u < 0x38800000u) {                                                    // below 2^-14: subnormal or 0
    const std::uint32_t e = u >> 23;
    if (e < 102) return static_cast<std::uint16_t>(sign);  // below 2^-25 (2^-25 itself ties to 0)
    const std::uint32_t m = (u & 0x7fffffu) | 0x800000u;    // value = m * 2^(e - 150)
    const std::uint32_t shift = 126 - e;                    // in units of 2^-24: m >> shift, 14..24
    std::uint32_t r = m >> shift;
    const std::uint32_t rem = m & ((1u << shift) - 1u), halfway = 1u << (shift - 1);
    if (rem > halfway || (rem == halfway && (r & 1u))) ++r;  // 0x400 (the smallest normal) is right too
    return static_cast<std::uint16_t>(sign | r);
  }
  std::uint32_t r = (u - 0x38000000u) >> 13;  // rebias the exponent (127 - 15), drop 13 bits
  const std::uint32_t rem = u & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (r & 1u))) ++r;
  return static_cast<std::uint16_t>(sign | r);
}
CHORUS_HOST_DEVICE inline float half_to_float(std::uint16_t h) {
  const std::uint32_t sign = std::uint32_t{h & 0x8000u} << 16;
  std::uint32_t e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
  if (e == 0x1f) return bits_float(sign | 0x7f800000u | (m << 13));  // inf, NaN (payload kept)
  if (e == 0) {
    if (m == 0) return bits_float(sign);
    e = 113;  // a subnormal m * 2^-24: normalise
    while (!(m & 0x400u)) {
      m <<= 1;
      --e;
    }
    return bits_float(sign | (e << 23) | ((m & 0x3ffu) << 13));
  }
  return bits_float(sign | ((e + 112) << 23) | (m << 13));
}

/// double -> float rounded to odd (truncate, then set the last bit when inexact): rounding
/// that float once more to 16 bits gives the correctly rounded result (Note [16-bit storage types]).
CHORUS_HOST_DEVICE inline float double_to_float_odd(double d) {
  if (d != d) return static_cast<float>(d);
  // Beyond float's range a conversion is undefined: the largest float (odd already) or an
  // infinity stand for such values, and both round to the 16-bit infinity.
  constexpr double kMax = 3.4028234663852886e38;  // FLT_MAX
  if (d > kMax || d < -kMax) {
    const bool inf = d - d != d - d;  // inf - inf is NaN
    return bits_float((d < 0 ? 0x80000000u : 0u) | (inf ? 0x7f800000u : 0x7f7fffffu));
  }
  const float f = static_cast<float>(d);
  const double back = static_cast<double>(f);
  if (back == d) return f;
  std::uint32_t u = float_bits(f);
  if ((back < 0 ? -back : back) > (d < 0 ? -d : d)) --u;  // rounded away from zero: step back
  return bits_float(u | 1u);
}

/// The arithmetic and comparisons shared by both types, as hidden friends (found by ADL only,
/// so they never compete with the built-in operators for other types).
template <class D>
struct ReducedFloatOps {
  CHORUS_HOST_DEVICE friend D operator+(D a, D b) { return D(float(a) + float(b)); }
  CHORUS_HOST_DEVICE friend D operator-(D a, D b) { return D(float(a) - float(b)); }
  CHORUS_HOST_DEVICE friend D operator*(D a, D b) { return D(float(a) * float(b)); }
  CHORUS_HOST_DEVICE friend D operator/(D a, D b) { return D(float(a) / float(b)); }
  CHORUS_HOST_DEVICE friend D operator-(D a) { return D::from_bits(static_cast<std::uint16_t>(a.x ^ 0x8000u)); }
  CHORUS_HOST_DEVICE friend D operator+(D a) { return a; }
  CHORUS_HOST_DEVICE friend D& operator+=(D& a, D b) { return a = a + b; }
  CHORUS_HOST_DEVICE friend D& operator-=(D& a, D b) { return a = a - b; }
  CHORUS_HOST_DEVICE friend D& operator*=(D& a, D b) { return a = a * b; }
  CHORUS_HOST_DEVICE friend D& operator/=(D& a, D b) { return a = a / b; }
  CHORUS_HOST_DEVICE friend bool operator==(D a, D b) { return float(a) == float(b); }
  CHORUS_HOST_DEVICE friend bool operator!=(D a, D b) { return float(a) != float(b); }
  CHORUS_HOST_DEVICE friend bool operator<(D a, D b) { return float(a) < float(b); }
  CHORUS_HOST_DEVICE friend bool operator<=(D a, D b) { return float(a) <= float(b); }
  CHORUS_HOST_DEVICE friend bool operator>(D a, D b) { return float(a) > float(b); }
  CHORUS_HOST_DEVICE friend bool operator>=(D a, D b) { return float(a) >= float(b); }
  friend std::ostream& operator<<(std::ostream& os, D a) { return os << float(a); }
};

}  // namespace detail::lowp

/// Brain floating point: float's exponent, 8 significant bits. See Note [16-bit storage types].
struct bfloat16 : detail::lowp::ReducedFloatOps<bfloat16> {
  std::uint16_t x;  ///< the bits (uninitialised by default, as a float is)

  bfloat16() = default;
  /// `f` rounded to nearest, ties to even (NaN stays NaN, overflow gives infinity).
  CHORUS_HOST_DEVICE explicit bfloat16(float f) : x(detail::lowp::float_to_bf16(f)) {}
  /// `d` correctly rounded, ties to even (through float rounded to odd).
  CHORUS_HOST_DEVICE explicit bfloat16(double d) : bfloat16(detail::lowp::double_to_float_odd(d)) {}
  /// `i` converted through double (exact up to 2^53 in magnitude), then rounded once.
  template <class I>
    requires std::is_integral_v<I>
  CHORUS_HOST_DEVICE explicit bfloat16(I i) : bfloat16(static_cast<double>(i)) {}

  /// The value whose 16-bit pattern is `bits`.
  CHORUS_HOST_DEVICE static constexpr bfloat16 from_bits(std::uint16_t bits) {
    bfloat16 r{};
    r.x = bits;
    return r;
  }
  /// The 16-bit pattern.
  CHORUS_HOST_DEVICE constexpr std::uint16_t bits() const { return x; }
  /// The value as a float (exact, so implicit).
  CHORUS_HOST_DEVICE operator float() const { return detail::lowp::bf16_to_float(x); }  // NOLINT: exact
};

/// IEEE 754 binary16: 5 exponent bits (max 65504), 11 significant bits, subnormals from 2^-24.
struct half : detail::lowp::ReducedFloatOps<half> {
  std::uint16_t x;  ///< the bits (uninitialised by default, as a float is)

  half() = default;
  /// `f` rounded to nearest, ties to even (NaN stays NaN, overflow gives infinity).
  CHORUS_HOST_DEVICE explicit half(float f) : x(detail::lowp::float_to_half(f)) {}
  /// `d` correctly rounded, ties to even (through float rounded to odd).
  CHORUS_HOST_DEVICE explicit half(double d) : half(detail::lowp::double_to_float_odd(d)) {}
  /// `i` converted through double (exact up to 2^53 in magnitude), then rounded once.
  template <class I>
    requires std::is_integral_v<I>
  CHORUS_HOST_DEVICE explicit half(I i) : half(static_cast<double>(i)) {}

  /// The value whose 16-bit pattern is `bits`.
  CHORUS_HOST_DEVICE static constexpr half from_bits(std::uint16_t bits) {
    half r{};
    r.x = bits;
    return r;
  }
  /// The 16-bit pattern.
  CHORUS_HOST_DEVICE constexpr std::uint16_t bits() const { return x; }
  /// The value as a float (exact, so implicit).
  CHORUS_HOST_DEVICE operator float() const { return detail::lowp::half_to_float(x); }  // NOLINT: exact
};

static_assert(sizeof(bfloat16) == 2 && alignof(bfloat16) == 2 && std::is_trivially_copyable_v<bfloat16> &&
              std::is_standard_layout_v<bfloat16>);
static_assert(sizeof(half) == 2 && alignof(half) == 2 && std::is_trivially_copyable_v<half> &&
              std::is_standard_layout_v<half>);

/// True for the 16-bit floating-point types (Note [16-bit storage types]).
template <class T>
inline constexpr bool is_reduced_floating_v = std::is_same_v<T, bfloat16> || std::is_same_v<T, half>;

CHORUS_NAMESPACE_END

namespace std {
// Following c10: bfloat16 is not IEC 559 (no such interchange format), half is.
// Specialises the standard's std::numeric_limits for chorus::bfloat16.
/// \cond
template <>
class numeric_limits<chorus::bfloat16> {
  using T = chorus::bfloat16;

 public:
  static constexpr bool is_specialized = true, is_signed = true, is_integer = false, is_exact = false;
  static constexpr bool has_infinity = true, has_quiet_NaN = true, has_signaling_NaN = true;
  static constexpr float_denorm_style has_denorm = denorm_present;
  static constexpr bool has_denorm_loss = false, is_iec559 = false, is_bounded = true, is_modulo = false;
  static constexpr bool traps = false, tinyness_before = false;
  static constexpr float_round_style round_style = round_to_nearest;
  static constexpr int digits = 8, digits10 = 2, max_digits10 = 4, radix = 2;
  static constexpr int min_exponent = -125, min_exponent10 = -37, max_exponent = 128, max_exponent10 = 38;
  CHORUS_HOST_DEVICE static constexpr T min() noexcept { return T::from_bits(0x0080); }
  CHORUS_HOST_DEVICE static constexpr T lowest() noexcept { return T::from_bits(0xff7f); }
  CHORUS_HOST_DEVICE static constexpr T max() noexcept { return T::from_bits(0x7f7f); }
  CHORUS_HOST_DEVICE static constexpr T epsilon() noexcept { return T::from_bits(0x3c00); }  // 2^-7
  CHORUS_HOST_DEVICE static constexpr T round_error() noexcept { return T::from_bits(0x3f00); }  // 0.5
  CHORUS_HOST_DEVICE static constexpr T infinity() noexcept { return T::from_bits(0x7f80); }
  CHORUS_HOST_DEVICE static constexpr T quiet_NaN() noexcept { return T::from_bits(0x7fc0); }
  CHORUS_HOST_DEVICE static constexpr T signaling_NaN() noexcept { return T::from_bits(0x7fa0); }
  CHORUS_HOST_DEVICE static constexpr T denorm_min() noexcept { return T::from_bits(0x0001); }
};
/// \endcond

// Specialises the standard's std::numeric_limits for chorus::half.
/// \cond
template <>
class numeric_limits<chorus::half> {
  using T = chorus::half;

 public:
  static constexpr bool is_specialized = true, is_signed = true, is_integer = false, is_exact = false;
  static constexpr bool has_infinity = true, has_quiet_NaN = true, has_signaling_NaN = true;
  static constexpr float_denorm_style has_denorm = denorm_present;
  static constexpr bool has_denorm_loss = false, is_iec559 = true, is_bounded = true, is_modulo = false;
  static constexpr bool traps = false, tinyness_before = false;
  static constexpr float_round_style round_style = round_to_nearest;
  static constexpr int digits = 11, digits10 = 3, max_digits10 = 5, radix = 2;
  static constexpr int min_exponent = -13, min_exponent10 = -4, max_exponent = 16, max_exponent10 = 4;
  CHORUS_HOST_DEVICE static constexpr T min() noexcept { return T::from_bits(0x0400); }  // 2^-14
  CHORUS_HOST_DEVICE static constexpr T lowest() noexcept { return T::from_bits(0xfbff); }
  CHORUS_HOST_DEVICE static constexpr T max() noexcept { return T::from_bits(0x7bff); }  // 65504
  CHORUS_HOST_DEVICE static constexpr T epsilon() noexcept { return T::from_bits(0x1400); }  // 2^-10
  CHORUS_HOST_DEVICE static constexpr T round_error() noexcept { return T::from_bits(0x3800); }  // 0.5
  CHORUS_HOST_DEVICE static constexpr T infinity() noexcept { return T::from_bits(0x7c00); }
  CHORUS_HOST_DEVICE static constexpr T quiet_NaN() noexcept { return T::from_bits(0x7e00); }
  CHORUS_HOST_DEVICE static constexpr T signaling_NaN() noexcept { return T::from_bits(0x7d00); }
  CHORUS_HOST_DEVICE static constexpr T denorm_min() noexcept { return T::from_bits(0x0001); }  // 2^-24
};
/// \endcond
}  // namespace std
