// The 16-bit floating-point types (Note [16-bit storage types]): conversions checked against
// a reference computed in double, exhaustively where the space allows.
#include <gtest/gtest.h>

#include <chorus/core/half.hpp>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <sstream>
#include <vector>

using chorus::bfloat16;
using chorus::half;

namespace {

// The exact value of a bit pattern, computed from the format's definition in double.
double bf16_value(std::uint16_t b) { return static_cast<double>(std::bit_cast<float>(std::uint32_t{b} << 16)); }
double half_value(std::uint16_t b) {
  const int e = (b >> 10) & 0x1f, m = b & 0x3ff;
  const double s = (b & 0x8000) ? -1.0 : 1.0;
  if (e == 0x1f) return m ? std::numeric_limits<double>::quiet_NaN() : s * std::numeric_limits<double>::infinity();
  if (e == 0) return s * std::ldexp(m, -24);
  return s * std::ldexp(1024 + m, e - 25);
}

// The format's non-negative finite values in order, plus a virtual next value (2^128 for
// bfloat16, 2^16 for half) standing for infinity: IEEE rounds to infinity exactly when the
// value is at least max + ulp/2, the midpoint to that virtual neighbour.
struct Format {
  std::vector<double> values;  // index = bits
  std::uint16_t inf_bits;
  std::uint16_t quiet_bit;
};
const Format& bf16_format() {
  static const Format f = [] {
    Format r{{}, 0x7f80, 0x0040};
    for (std::uint32_t b = 0; b < 0x7f80; ++b) r.values.push_back(bf16_value(static_cast<std::uint16_t>(b)));
    r.values.push_back(std::ldexp(1.0, 128));
    return r;
  }();
  return f;
}
const Format& half_format() {
  static const Format f = [] {
    Format r{{}, 0x7c00, 0x0200};
    for (std::uint32_t b = 0; b < 0x7c00; ++b) r.values.push_back(half_value(static_cast<std::uint16_t>(b)));
    r.values.push_back(std::ldexp(1.0, 16));
    return r;
  }();
  return f;
}

/// Round to nearest even by search: exact, since 2v and lo + hi are exact in double.
std::uint16_t reference_round(double v, const Format& f) {
  const std::uint16_t sign = std::signbit(v) ? 0x8000 : 0;
  const double a = std::fabs(v);
  if (std::isinf(a)) return sign | f.inf_bits;
  auto it = std::upper_bound(f.values.begin(), f.values.end(), a);  // first value > a
  if (it == f.values.end()) return sign | f.inf_bits;
  const auto hi = static_cast<std::uint16_t>(it - f.values.begin());
  const auto lo = static_cast<std::uint16_t>(hi - 1);  // values[0] = 0 <= a
  const double mid = f.values[lo] + f.values[hi];
  const double twice = 2 * a;
  std::uint16_t r = twice < mid ? lo : twice > mid ? hi : ((lo & 1) ? hi : lo);
  return sign | r;
}

std::uint16_t bits_of(bfloat16 x) { return x.bits(); }
std::uint16_t bits_of(half x) { return x.bits(); }

template <class T>
const Format& format_of() {
  if constexpr (std::is_same_v<T, bfloat16>) return bf16_format();
  else return half_format();
}

template <class T>
class LowpTypes : public ::testing::Test {};
using Types = ::testing::Types<bfloat16, half>;
TYPED_TEST_SUITE(LowpTypes, Types);

}  // namespace

TYPED_TEST(LowpTypes, IsATwoByteTriviallyCopyableStruct) {
  using T = TypeParam;
  static_assert(sizeof(T) == 2 && std::is_trivially_copyable_v<T> && std::is_standard_layout_v<T>);
  static_assert(!std::is_convertible_v<float, T> && std::is_constructible_v<T, float>);  // explicit
  static_assert(std::is_convertible_v<T, float>);                                         // implicit, exact
  static_assert(std::is_same_v<decltype(T(1.0f) + T(2.0f)), T>);
  static_assert(std::is_same_v<decltype(T(1.0f) * 2.0f), float>);
  static_assert(std::is_same_v<decltype(T(1.0f) * 2.0), double>);
  static_assert(std::is_same_v<decltype(T(1.0f) < T(2.0f)), bool>);
  EXPECT_EQ(T::from_bits(0x1234).bits(), 0x1234);
}

TYPED_TEST(LowpTypes, EveryBitPatternRoundTripsThroughFloat) {
  using T = TypeParam;
  const Format& f = format_of<T>();
  for (std::uint32_t b = 0; b < 0x10000; ++b) {
    const auto bits = static_cast<std::uint16_t>(b);
    const T x = T::from_bits(bits);
    const float v = x;
    const double want = std::is_same_v<T, bfloat16> ? bf16_value(bits) : half_value(bits);
    const bool nan = (bits & 0x7fff) > f.inf_bits;
    if (nan) {
      ASSERT_TRUE(std::isnan(v)) << std::hex << b;
      ASSERT_EQ(std::signbit(v), (bits & 0x8000) != 0) << std::hex << b;
      ASSERT_EQ(bits_of(T(v)), bits | f.quiet_bit) << std::hex << b;  // NaN stays NaN, made quiet
    } else {
      ASSERT_EQ(static_cast<double>(v), want) << std::hex << b;
      ASSERT_EQ(std::signbit(v), (bits & 0x8000) != 0) << std::hex << b;  // -0 keeps its sign
      ASSERT_EQ(bits_of(T(v)), bits) << std::hex << b;
      ASSERT_EQ(bits_of(T(static_cast<double>(v))), bits) << std::hex << b;
    }
  }
}

TYPED_TEST(LowpTypes, FloatRoundsToNearestEvenIncludingTiesAndNeighbours) {
  using T = TypeParam;
  const Format& f = format_of<T>();
  std::int64_t checked = 0;
  auto check = [&](float v) {
    if (std::isnan(v)) return;
    ASSERT_EQ(bits_of(T(v)), reference_round(v, f)) << "float " << std::hexfloat << v;
    ASSERT_EQ(bits_of(T(static_cast<double>(v))), reference_round(v, f)) << "double " << std::hexfloat << v;
    ++checked;
  };
  // Every midpoint between neighbours (a tie, exact in float) and the floats beside it.
  for (std::size_t k = 0; k + 1 < f.values.size(); ++k) {
    const auto mid = static_cast<float>((f.values[k] + f.values[k + 1]) / 2);
    for (float v : {mid, std::nextafter(mid, 0.0f), std::nextafter(mid, 1e30f), static_cast<float>(f.values[k])}) {
      check(v);
      check(-v);
    }
  }
  // A stride through all 2^32 float bit patterns (subnormals, overflow, everything between).
  for (std::uint64_t u = 0; u < (1ull << 32); u += 1021) check(std::bit_cast<float>(static_cast<std::uint32_t>(u)));
  EXPECT_GT(checked, 4000000);
}

TYPED_TEST(LowpTypes, DoubleRoundsOnceNotTwice) {
  using T = TypeParam;
  const Format& f = format_of<T>();
  // Just above or below a tie by less than half a float ulp: double -> float -> T would land on
  // the tie and round to even; the correctly rounded result goes the other way.
  for (std::size_t k = 1; k + 1 < f.values.size(); k += 7) {
    const double mid = (f.values[k] + f.values[k + 1]) / 2;
    for (double v : {mid * (1 + 0x1p-40), mid * (1 - 0x1p-40), mid}) {
      ASSERT_EQ(bits_of(T(v)), reference_round(v, f)) << std::hexfloat << v;
      ASSERT_EQ(bits_of(T(-v)), reference_round(-v, f)) << std::hexfloat << v;
    }
  }
  std::mt19937_64 rng(7);
  std::uniform_real_distribution<double> e(-140, 140);
  for (int i = 0; i < 200000; ++i) {
    const double v = std::ldexp(1.0 + std::uniform_real_distribution<double>(0, 1)(rng), static_cast<int>(e(rng)));
    ASSERT_EQ(bits_of(T(v)), reference_round(v, f)) << std::hexfloat << v;
  }
  EXPECT_EQ(bits_of(T(1e300)), f.inf_bits);
  EXPECT_EQ(bits_of(T(-1e300)), 0x8000 | f.inf_bits);
  EXPECT_EQ(bits_of(T(1e-300)), 0);
  EXPECT_EQ(bits_of(T(-1e-300)), 0x8000);
  EXPECT_EQ(bits_of(T(std::numeric_limits<double>::infinity())), f.inf_bits);
  EXPECT_TRUE(std::isnan(static_cast<float>(T(std::numeric_limits<double>::quiet_NaN()))));
}

TYPED_TEST(LowpTypes, SpecialValues) {
  using T = TypeParam;
  using L = std::numeric_limits<T>;
  const Format& f = format_of<T>();
  EXPECT_EQ(bits_of(T(0.0f)), 0);
  EXPECT_EQ(bits_of(T(-0.0f)), 0x8000);
  EXPECT_EQ(bits_of(T(std::numeric_limits<float>::infinity())), f.inf_bits);
  EXPECT_EQ(bits_of(T(-std::numeric_limits<float>::infinity())), 0x8000 | f.inf_bits);
  // A signalling float NaN (payload only in the low bits) must not become an infinity.
  for (std::uint32_t nan : {0x7f800001u, 0xff800001u, 0x7fc00000u, 0x7fffffffu}) {
    const T x(std::bit_cast<float>(nan));
    EXPECT_TRUE(std::isnan(static_cast<float>(x))) << std::hex << nan;
    EXPECT_EQ((bits_of(x) & 0x8000) != 0, (nan >> 31) != 0);
  }
  EXPECT_TRUE(std::isinf(static_cast<float>(L::infinity())));
  EXPECT_TRUE(std::isnan(static_cast<float>(L::quiet_NaN())));
  EXPECT_TRUE(std::isnan(static_cast<float>(L::signaling_NaN())));
  EXPECT_EQ(static_cast<float>(L::max()), f.values[f.inf_bits - 1]);
  EXPECT_EQ(static_cast<float>(L::lowest()), -f.values[f.inf_bits - 1]);
  EXPECT_EQ(static_cast<float>(L::denorm_min()), f.values[1]);
  EXPECT_EQ(static_cast<float>(L::epsilon()), std::ldexp(1.0f, 1 - L::digits));
  EXPECT_EQ(static_cast<float>(L::min()), std::ldexp(1.0f, L::min_exponent - 1));
  EXPECT_EQ(static_cast<float>(L::round_error()), 0.5f);
  // The first value past max by half an ulp overflows; just below it does not.
  const double max = f.values[f.inf_bits - 1], half_ulp = (f.values[f.inf_bits] - max) / 2;
  EXPECT_EQ(bits_of(T(max + half_ulp)), f.inf_bits);
  EXPECT_EQ(bits_of(T(max + half_ulp * 0.999)), f.inf_bits - 1);
}

TEST(Half, SubnormalsAndOverflow) {
  EXPECT_EQ(half(65504.0f).bits(), 0x7bff);
  EXPECT_EQ(half(65519.0f).bits(), 0x7bff);
  EXPECT_EQ(half(65520.0f).bits(), 0x7c00);  // the tie rounds to "even": infinity
  EXPECT_EQ(half(std::ldexp(1.0f, -24)).bits(), 0x0001);
  EXPECT_EQ(half(std::ldexp(1.0f, -25)).bits(), 0x0000);                // a tie: to even (0)
  EXPECT_EQ(half(std::ldexp(1.5f, -25)).bits(), 0x0001);                // above the tie
  EXPECT_EQ(half(std::ldexp(3.0f, -25)).bits(), 0x0002);                // 1.5 units: to even (2)
  EXPECT_EQ(half(std::ldexp(1.0f, -14)).bits(), 0x0400);                // the smallest normal
  EXPECT_EQ(half(std::ldexp(1023.5f, -24)).bits(), 0x0400);             // rounds up into the normals
  EXPECT_EQ(half(-std::ldexp(1.0f, -24)).bits(), 0x8001);
  EXPECT_EQ(static_cast<float>(half::from_bits(0x3555)), 0x1.554p-2f);  // about 1/3
}

TEST(BFloat16, KnownValues) {
  EXPECT_EQ(bfloat16(1.0f).bits(), 0x3f80);
  EXPECT_EQ(bfloat16(3.140625f).bits(), 0x4049);
  EXPECT_EQ(bfloat16(std::numeric_limits<float>::max()).bits(), 0x7f80);  // rounds past the largest
  EXPECT_EQ(bfloat16(std::bit_cast<float>(0x3f808000u)).bits(), 0x3f80);   // tie, even below
  EXPECT_EQ(bfloat16(std::bit_cast<float>(0x3f818000u)).bits(), 0x3f82);   // tie, even above
  EXPECT_EQ(bfloat16(std::numeric_limits<float>::denorm_min()).bits(), 0x0000);
  EXPECT_EQ(bfloat16(std::bit_cast<float>(0x00008000u)).bits(), 0x0000);  // tie to 0
  EXPECT_EQ(bfloat16(std::bit_cast<float>(0x00018000u)).bits(), 0x0002);
}

TYPED_TEST(LowpTypes, ArithmeticIsCorrectlyRoundedFromFloat) {
  using T = TypeParam;
  const Format& f = format_of<T>();
  std::mt19937 rng(3);
  std::uniform_int_distribution<std::uint32_t> bits(0, 0xffff);
  int done = 0;
  while (done < 300000) {
    const T a = T::from_bits(static_cast<std::uint16_t>(bits(rng))), b = T::from_bits(static_cast<std::uint16_t>(bits(rng)));
    const double x = static_cast<float>(a), y = static_cast<float>(b);
    if (std::isnan(x) || std::isnan(y) || std::isinf(x) || std::isinf(y)) continue;
    // Sums and products of two 16-bit values are exact in double; a quotient is rounded to 53
    // bits, innocuous before the rounding to <= 11 bits (53 >= 2 * 11 + 2).
    const double sum = x + y, prod = x * y;
    ASSERT_EQ(bits_of(a + b), reference_round(sum, f)) << x << " + " << y;
    ASSERT_EQ(bits_of(a - b), reference_round(x - y, f)) << x << " - " << y;
    if (!std::isinf(prod) && !std::isnan(prod)) {
      ASSERT_EQ(bits_of(a * b), reference_round(prod, f)) << x << " * " << y;
    }
    if (y != 0) {
      ASSERT_EQ(bits_of(a / b), reference_round(x / y, f)) << x << " / " << y;
    }
    ++done;
  }
  T acc(1.0f);
  acc += T(2.0f);
  acc *= T(3.0f);
  acc -= T(1.0f);
  acc /= T(4.0f);
  EXPECT_EQ(static_cast<float>(acc), 2.0f);
  EXPECT_EQ(bits_of(-T(0.0f)), 0x8000);
  EXPECT_TRUE(T(1.0f) < T(2.0f) && T(2.0f) >= T(2.0f) && T(-0.0f) == T(0.0f));
  EXPECT_FALSE(std::numeric_limits<T>::quiet_NaN() == std::numeric_limits<T>::quiet_NaN());
  EXPECT_TRUE(std::numeric_limits<T>::quiet_NaN() != std::numeric_limits<T>::quiet_NaN());
  EXPECT_EQ(static_cast<float>(T(3)), 3.0f);                     // from an integer
  EXPECT_EQ(static_cast<std::int64_t>(T(7.0f)), 7);              // to an integer, through float
  EXPECT_EQ(half(bfloat16(1.5f)).bits(), half(1.5f).bits());     // between the two types
}

TYPED_TEST(LowpTypes, PrintsAsItsFloatValue) {
  using T = TypeParam;
  std::ostringstream os;
  os << T(1.5f) << " " << T(-0.25f) << " " << std::numeric_limits<T>::infinity();
  EXPECT_EQ(os.str(), "1.5 -0.25 inf");
}
