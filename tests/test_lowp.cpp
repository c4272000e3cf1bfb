// The 16-bit floating-point types (Note [16-bit storage types]): conversions checked against
// a reference computed in double, exhaustively where the space allows.
#include <gtest/gtest.h>

#include <chorus/chorus.hpp>

#include "test_util.hpp"

#include <unistd.h>

#include <algorithm>
#include <filesystem>
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

// ---- Tensor<bfloat16> and Tensor<half> on the CPU ----

namespace {
using namespace chorus;
using chorus::testing::throws_with;

template <class T>
std::vector<T> lowp_vector(std::initializer_list<float> v) {
  std::vector<T> r;
  for (float x : v) r.push_back(T(x));
  return r;
}
template <class T>
std::vector<float> as_floats(const Tensor<T>& t) {
  std::vector<float> r;
  for (T x : t.to_vector()) r.push_back(static_cast<float>(x));
  return r;
}
/// Every element: the float result of `want` rounded once to T.
template <class T, class F>
void expect_rounded_once(const Tensor<T>& got, const std::vector<float>& in, F want) {
  const auto g = got.to_vector();
  ASSERT_EQ(g.size(), in.size());
  for (std::size_t i = 0; i < in.size(); ++i)
    EXPECT_EQ(g[i].bits(), T(want(in[i])).bits()) << i << ": " << in[i];
}

}  // namespace

TYPED_TEST(LowpTypes, TensorFactoriesAndPrinting) {
  using T = TypeParam;
  const DType dt = std::is_same_v<T, bfloat16> ? DType::BFloat16 : DType::Float16;
  EXPECT_EQ(Tensor<T>::dtype(), dt);
  EXPECT_EQ(dtype_size(dt), 2u);
  EXPECT_EQ(dtype_name(dt), (std::is_same_v<T, bfloat16> ? "bfloat16" : "float16"));
  auto z = zeros<T>({2, 3});
  EXPECT_EQ(as_floats(z), std::vector<float>(6, 0.0f));
  EXPECT_EQ(as_floats(ones<T>({4})), std::vector<float>(4, 1.0f));
  EXPECT_EQ(as_floats(full<T>({2}, T(0.1f))), std::vector<float>(2, static_cast<float>(T(0.1f))));
  EXPECT_EQ(as_floats(arange<T>(0, 5)), (std::vector<float>{0, 1, 2, 3, 4}));
  auto v = from_vector(lowp_vector<T>({1.5f, -2.0f, 0.25f, 3.0f}), {2, 2});
  EXPECT_EQ(v.numel(), 4);
  EXPECT_EQ(v[0][0].template item<float>(), 1.5f);
  std::ostringstream os;
  os << v;
  EXPECT_EQ(os.str(), std::string("tensor([[1.5, -2],\n        [0.25, 3]], shape=[2, 2], dtype=") +
                          std::string(dtype_name(dt)) + ", device=cpu:0)");
  // randn draws the float numbers of the same seed and rounds each once.
  manual_seed(5);
  auto rf = randn<float>({64});
  manual_seed(5);
  auto rl = randn<T>({64});
  expect_rounded_once(rl, rf.to_vector(), [](float x) { return x; });
  // Views and copies move bits, nothing is rounded.
  auto t = v.t().contiguous();
  EXPECT_EQ(as_floats(t), (std::vector<float>{1.5f, 0.25f, -2.0f, 3.0f}));
  EXPECT_EQ(as_floats(v.reshape({4}).narrow(0, 1, 2)), (std::vector<float>{-2.0f, 0.25f}));
  EXPECT_EQ(as_floats(v.clone()), as_floats(v));
}

TYPED_TEST(LowpTypes, ItemChecksTheRange) {
  using T = TypeParam;
  auto v = from_vector(lowp_vector<T>({3.0f}));
  EXPECT_EQ(v.template item<std::int64_t>(), 3);
  EXPECT_EQ(v.template item<double>(), 3.0);
  EXPECT_EQ(scalar_tensor<float>(0.1f).item<T>().bits(), T(0.1f).bits());
  EXPECT_THROW(scalar_tensor<float>(std::numeric_limits<float>::max()).item<T>(), Error);
  EXPECT_TRUE(std::isinf(static_cast<float>(scalar_tensor<float>(INFINITY).item<T>())));
  EXPECT_THROW(full<T>({1}, std::numeric_limits<T>::quiet_NaN()).template item<std::int64_t>(), Error);
}

template <class From, class To>
void check_conversion() {
  const std::vector<float> in = {0.1f, -1.5f, 65504.0f, 70000.0f, 1e-6f, -0.0f, 3.0e38f, 1.0f / 3};
  std::vector<From> src;
  for (float x : in) src.push_back(From(x));
  auto out = from_vector(src).template to<To>();
  ASSERT_EQ(out.numel(), static_cast<std::int64_t>(in.size()));
  const auto got = out.to_vector();
  for (std::size_t i = 0; i < in.size(); ++i) {
    const To want = static_cast<To>(src[i]);  // the scalar conversion: RNE from the exact value
    if constexpr (is_reduced_floating_v<To>) {
      EXPECT_EQ(got[i].bits(), want.bits()) << i;
    } else {
      EXPECT_EQ(got[i], want) << i;
    }
  }
}

TEST(LowpTensor, ConversionsBetweenEveryFloatingPair) {
  check_conversion<float, bfloat16>();
  check_conversion<float, half>();
  check_conversion<double, bfloat16>();
  check_conversion<double, half>();
  check_conversion<bfloat16, float>();
  check_conversion<half, float>();
  check_conversion<bfloat16, double>();
  check_conversion<half, double>();
  check_conversion<bfloat16, half>();
  check_conversion<half, bfloat16>();
  // To int64: NaN and out-of-range saturate instead of being undefined.
  auto n = from_vector(std::vector<half>{std::numeric_limits<half>::quiet_NaN(), half(-7.0f), half(65504.0f)});
  EXPECT_EQ(n.to<std::int64_t>().to_vector(), (std::vector<std::int64_t>{0, -7, 65504}));
  // From int64: rounded once.
  auto i = from_vector(std::vector<std::int64_t>{257, 1 << 20, -3});
  EXPECT_EQ(as_floats(i.to<bfloat16>()), (std::vector<float>{256.0f, 1048576.0f, -3.0f}));
  // The double 1 + 2^-8 + 2^-40 is just above a bfloat16 tie: rounds up (a float detour would round to even).
  auto d = from_vector(std::vector<double>{1.0 + 0x1p-8 + 0x1p-40});
  EXPECT_EQ(d.to<bfloat16>().item().bits(), 0x3f81);
}

// The CUDA kernel converts each element with fn::convert_16bit; run on the host here, it must
// equal the CPU's conversion for every integer in [2^24, 2^26), where a route through float
// rounds twice (384 of them differ that way, e.g. 16842753: 16777216 instead of 16908288).
TEST(LowpTensor, IntegersConvertTo16BitsRoundingOnceOnBothBackends) {
  constexpr std::int64_t lo = std::int64_t{1} << 24, hi = std::int64_t{1} << 26;
  std::int64_t twice = 0;
  for (std::int64_t i = lo; i < hi; ++i) {
    const auto once = bfloat16(i).bits();  // what the CPU kernel's static_cast computes
    ASSERT_EQ(backend::fn::convert_16bit<bfloat16>(i).bits(), once) << i;
    twice += bfloat16(static_cast<float>(i)).bits() != once;
  }
  EXPECT_EQ(twice, 384);  // the route this guards against
  const std::vector<std::int64_t> ints = {16842753, -16842753, 33554431, 0, 1 << 20};
  const auto got = from_vector(ints).to<bfloat16>().to_vector();
  for (std::size_t k = 0; k < ints.size(); ++k)
    EXPECT_EQ(got[k].bits(), backend::fn::convert_16bit<bfloat16>(ints[k]).bits()) << ints[k];
  EXPECT_EQ(backend::fn::convert_16bit<bfloat16>(std::int64_t{16842753}).bits(), bfloat16(16908288.0f).bits());
  EXPECT_EQ(backend::fn::convert_16bit<std::int64_t>(bfloat16(16908288.0f)), 16908288);
  EXPECT_EQ(backend::fn::convert_16bit<half>(std::int64_t{2049}).bits(), half(2048.0f).bits());  // a tie: to even
}

TYPED_TEST(LowpTypes, ConversionIsDifferentiableAndRoundsTheGradientOnce) {
  // Note [one graph over every dtype]: y = sum((x.to<T>())^2).to<float>(): the gradient 2·x̃
  // is computed in T (x̃ = x rounded to T) and converted back to float exactly.
  using T = TypeParam;
  auto x = from_vector(std::vector<float>{0.1f, -1.7f, 3.3f}).requires_grad_();
  auto xt = x.template to<T>();
  ASSERT_TRUE(xt.requires_grad());
  EXPECT_EQ(xt.grad_fn()->name(), "ToCopyBackward");
  (xt * xt).template to<float>().sum().backward();
  const auto g = x.grad().to_vector();
  const auto xv = xt.to_vector();
  for (std::size_t i = 0; i < g.size(); ++i)
    EXPECT_EQ(g[i], static_cast<float>(T(2.0f * static_cast<float>(xv[i])))) << i;
  // A 16-bit leaf under a float loss: the gradient arrives in T.
  auto w = from_vector(lowp_vector<T>({0.5f, -2.0f})).requires_grad_();
  (w.template to<float>() * 3.0).sum().backward();
  EXPECT_EQ(w.grad().dtype(), Tensor<T>::dtype());
  EXPECT_EQ(as_floats(w.grad()), (std::vector<float>{3.0f, 3.0f}));
}

TEST(LowpTensor, PathsOfTwoDtypesMeetingAgainWaitForEachOther) {
  // a feeds the output directly and through a float -> bfloat16 -> float round trip: a's node
  // must run once, after both gradients arrived (a nested backward per dtype would not).
  auto x = from_vector(std::vector<float>{1.0f, 2.0f}).requires_grad_();
  auto a = x * 2.0;
  auto b = a.to<bfloat16>().to<double>().to<float>();
  (a + b * 3.0).sum().backward();
  EXPECT_EQ(x.grad().to_vector(), (std::vector<float>{8.0f, 8.0f}));  // 2 · (1 + 3)
  // And double <-> float, through a shared interior node, against the analytic gradient.
  auto d = from_vector(std::vector<double>{0.25, -1.5, 2.0}).requires_grad_();
  auto f = d.to<float>();
  auto y = (f * f).to<double>() + d * f.to<double>();  // 2 d^2 in two dtypes
  y.sum().backward();
  const auto gd = d.grad().to_vector();
  const std::vector<double> dv{0.25, -1.5, 2.0};
  for (std::size_t i = 0; i < dv.size(); ++i) EXPECT_NEAR(gd[i], 4 * dv[i], 1e-6) << i;
}

TEST(LowpTensor, ConversionToIntegersAndUnderNoGradRecordsNothing) {
  auto x = ones<float>({2}).requires_grad_();
  EXPECT_FALSE(x.to<std::int64_t>().requires_grad());
  EXPECT_FALSE(x.detach().to<bfloat16>().requires_grad());
  NoGradGuard g;
  EXPECT_FALSE(x.to<half>().requires_grad());
}

TEST(LowpTensor, AFloatLossOverA16BitModelTrainsItsParameters) {
  // The shape of a mixed-precision step: a bfloat16 layer, logits converted to float, the loss
  // in float; the layer's gradients are those of the float loss, in bfloat16.
  manual_seed(5);
  nn::LinearT<bfloat16> lin(4, 3);
  auto x = randn<bfloat16>({6, 4});
  auto target = randn<float>({6, 3});
  auto loss = nn::functional::mse_loss(lin(x).to<float>(), target);
  loss.backward();
  ASSERT_TRUE(lin->weight.grad().defined());
  EXPECT_EQ(lin->weight.grad().dtype(), DType::BFloat16);
  // The same in float from the same (exactly representable) values.
  auto wf = lin->weight.detach().to<float>().requires_grad_();
  auto bf = lin->bias.detach().to<float>().requires_grad_();
  auto xf = x.to<float>();
  nn::functional::mse_loss(xf.matmul(wf.t()) + bf, target).backward();
  const auto g16 = lin->weight.grad().to_vector();
  const auto g32 = wf.grad().to_vector();
  for (std::size_t i = 0; i < g32.size(); ++i)
    EXPECT_NEAR(static_cast<float>(g16[i]), g32[i], 2e-2f * (std::abs(g32[i]) + 0.05f)) << i;
}

TYPED_TEST(LowpTypes, ElementwiseComputesInFloatAndRoundsOnce) {
  using T = TypeParam;
  const std::vector<float> a = {0.1f, -1.7f, 2.5f, 100.0f, -0.0f, 3.3f};
  const std::vector<float> b = {0.3f, 0.7f, -4.0f, 1e-3f, 2.0f, 3.3f};
  std::vector<T> la, lb;
  for (float x : a) la.push_back(T(x));
  for (float x : b) lb.push_back(T(x));
  std::vector<float> fa, fb;  // the exact values held
  for (T x : la) fa.push_back(x);
  for (T x : lb) fb.push_back(x);
  auto ta = from_vector(la), tb = from_vector(lb);
  auto at = [&](std::size_t i) { return fb[i]; };
  expect_rounded_once(ta + tb, fa, [&, i = 0](float x) mutable { return x + at(i++); });
  expect_rounded_once(ta * tb, fa, [&, i = 0](float x) mutable { return x * at(i++); });
  expect_rounded_once(ta / tb, fa, [&, i = 0](float x) mutable { return x / at(i++); });
  expect_rounded_once(ta - tb, fa, [&, i = 0](float x) mutable { return x - at(i++); });
  expect_rounded_once(relu(ta), fa, [](float x) { return x < 0 ? 0.0f : x; });
  expect_rounded_once(exp(ta * 0.01), fa, [](float x) { return std::exp(static_cast<float>(T(x * 0.01f))); });
  // A compound functor (GELU) is evaluated in float as a whole, then rounded once.
  expect_rounded_once(gelu(ta), fa, [](float x) { return 0.5f * x * (1.0f + std::erf(x * 0.70710678118654752440f)); });
  expect_rounded_once(sigmoid(ta), fa, [](float x) { return 1.0f / (1.0f + std::exp(-x)); });
  // Broadcasting: [2, 3] + [3].
  auto m = from_vector(la, {2, 3}) + from_vector(std::vector<T>(lb.begin(), lb.begin() + 3));
  expect_rounded_once(m, fa, [&, i = 0](float x) mutable { return x + fb[i++ % 3]; });
}

TYPED_TEST(LowpTypes, ReductionsAccumulateWideAndMatmulGoesThroughFloat) {
  using T = TypeParam;
  // 4096 copies of 1 + 2^-7 (or 2^-10): a 16-bit running sum would stall at 256 (bfloat16);
  // accumulated in double and rounded once the sum is exact up to the final rounding.
  const float e = std::ldexp(1.0f, 1 - std::numeric_limits<T>::digits);
  auto x = full<T>({4096}, T(1.0f + e));
  EXPECT_EQ(x.sum().item().bits(), T(4096.0 * (1.0 + e)).bits());
  EXPECT_EQ(x.mean().item().bits(), T(1.0f + e).bits());
  auto x2 = full<T>({64, 3}, T(1.0f + e));
  EXPECT_EQ(as_floats(x2.sum(0)), std::vector<float>(3, static_cast<float>(T(64.0 * (1.0 + e)))));
  EXPECT_EQ(as_floats(x2.sum(1)), std::vector<float>(64, static_cast<float>(T(3.0 * (1.0 + e)))));
  // matmul: float products and sums, one rounding per output element.
  manual_seed(1);
  auto a = randn<T>({5, 7}), b = randn<T>({7, 3});
  auto fa = a.template to<float>(), fb = b.template to<float>();
  auto want = fa.matmul(fb).to_vector();
  auto got = a.matmul(b).to_vector();
  ASSERT_EQ(got.size(), want.size());
  for (std::size_t i = 0; i < got.size(); ++i) EXPECT_EQ(got[i].bits(), T(want[i]).bits()) << i;
  auto gt = a.t().contiguous().t().matmul(b).to_vector();  // a transposed operand
  for (std::size_t i = 0; i < got.size(); ++i) EXPECT_EQ(gt[i].bits(), got[i].bits()) << i;
}

TYPED_TEST(LowpTypes, BackwardWithinA16BitGraph) {
  using T = TypeParam;
  auto x = from_vector(lowp_vector<T>({1.0f, -2.0f, 0.5f})).requires_grad_();
  auto y = (x * x + x).sum();  // dy/dx = 2x + 1
  y.backward();
  EXPECT_EQ(as_floats(x.grad()), (std::vector<float>{3.0f, -3.0f, 2.0f}));
}

// Note [16-bit through float]: softmax, the losses, cumsum and batched products compute in float
// from the 16-bit values and round once: bit for bit the float result of the same inputs,
// rounded. Backward too.
TYPED_TEST(LowpTypes, RowKernelsComputeInFloatAndRoundOnce) {
  using T = TypeParam;
  manual_seed(21);
  auto x = randn<T>({4, 5});
  const auto xf = x.template to<float>();
  auto same_bits = [](const Tensor<T>& got, const Tensor<float>& want, const char* what) {
    const auto g = got.to_vector();
    const auto w = want.to_vector();
    ASSERT_EQ(g.size(), w.size()) << what;
    for (std::size_t i = 0; i < g.size(); ++i) EXPECT_EQ(g[i].bits(), T(w[i]).bits()) << what << " " << i;
  };
  same_bits(softmax(x, 1), softmax(xf, 1), "softmax");
  same_bits(softmax(x, 0), softmax(xf, 0), "softmax dim 0");
  same_bits(log_softmax(x, 1), log_softmax(xf, 1), "log_softmax");
  same_bits(x.cumsum(1), xf.cumsum(1), "cumsum");
  auto target = from_vector<std::int64_t>({0, 4, 2, 1});
  namespace F = nn::functional;
  same_bits(F::cross_entropy(x, target), F::cross_entropy(xf, target), "cross_entropy");
  same_bits(F::nll_loss(log_softmax(x, 1), target), F::nll_loss(log_softmax(x, 1).template to<float>(), target),
            "nll_loss");
  auto z = randn<T>({4, 5});
  same_bits(F::mse_loss(x, z), F::mse_loss(xf, z.template to<float>()), "mse_loss");
  auto a = randn<T>({3, 4, 6}), b = randn<T>({3, 6, 2});
  same_bits(a.matmul(b), a.template to<float>().matmul(b.template to<float>()), "batched matmul");
  // Backward: the gradient of sum(softmax(x) * w) in T is y (g - sum(y g)) computed in float
  // from the saved 16-bit y and g = w, rounded once (within one rounding of T: the float
  // reference below sums in another order).
  auto w = randn<T>({4, 5});
  auto xl = x.detach().requires_grad_();
  (softmax(xl, 1) * w).sum().backward();
  const auto yr = softmax(x, 1).template to<float>(), gy = w.template to<float>();
  const auto want = (yr * (gy - (yr * gy).sum(1, true))).to_vector();
  const auto got = xl.grad().to_vector();
  const float eps = std::ldexp(1.0f, 1 - std::numeric_limits<T>::digits);
  for (std::size_t i = 0; i < got.size(); ++i)
    EXPECT_NEAR(static_cast<float>(got[i]), want[i], eps * std::abs(want[i]) + 1e-6f) << i;
}

// The layers a 16-bit Transformer runs (layer norm, GELU, attention, embedding lookups) against
// the float32 operators on the same values: within the type's tolerance (a few roundings of T:
// each 16-bit operator rounds its result once, the float chain does not).
TYPED_TEST(LowpTypes, TransformerOperatorsTrackFloat32) {
  using T = TypeParam;
  manual_seed(23);
  const float eps = std::ldexp(1.0f, 1 - std::numeric_limits<T>::digits);
  auto near = [&](const Tensor<T>& got, const Tensor<float>& want, float rounds, const char* what) {
    const auto g = got.to_vector();
    const auto w = want.to_vector();
    ASSERT_EQ(g.size(), w.size()) << what;
    float scale = 0;
    for (float v : w) scale = std::max(scale, std::abs(v));
    for (std::size_t i = 0; i < g.size(); ++i)
      ASSERT_NEAR(static_cast<float>(g[i]), w[i], rounds * eps * (std::abs(w[i]) + 0.1f * scale)) << what << " " << i;
  };
  auto x = randn<T>({2, 5, 16});
  auto w = randn<T>({16}), b = randn<T>({16});
  const auto xf = x.template to<float>(), wf = w.template to<float>(), bf = b.template to<float>();
  near(layer_norm(x, {16}, w, b), layer_norm(xf, {16}, wf, bf), 3, "layer_norm");
  near(gelu(x), gelu(xf), 1, "gelu");
  auto q = randn<T>({2, 4, 5, 8}), k = randn<T>({2, 4, 5, 8}), v = randn<T>({2, 4, 5, 8});
  near(scaled_dot_product_attention(q, k, v), scaled_dot_product_attention(q.template to<float>(), k.template to<float>(),
                                                                           v.template to<float>()),
       6, "scaled_dot_product_attention");
  auto table = randn<T>({10, 16});
  auto idx = from_vector<std::int64_t>({3, 0, 9, 3});
  near(table.index_select(0, idx), table.template to<float>().index_select(0, idx), 0, "index_select");
  near(x.permute({2, 0, 1}).contiguous(), xf.permute({2, 0, 1}).contiguous(), 0, "permute");
}

// Note [16-bit CNN operators]: conv2d, the poolings, batch_norm and dropout run the float32
// kernel on the float32 values of the 16-bit inputs and round each result once, so each output,
// gradient and running statistic has exactly the bits of the float32 result rounded.
TYPED_TEST(LowpTypes, CnnOperatorsComputeInFloatAndRoundOnce) {
  using T = TypeParam;
  using namespace chorus;
  namespace F = nn::functional;
  manual_seed(31);
  auto same_bits = [](const Tensor<T>& got, const Tensor<float>& want, const char* what) {
    ASSERT_EQ(got.shape(), want.shape()) << what;
    const auto g = got.to_vector();
    const auto w = want.to_vector();
    for (std::size_t i = 0; i < g.size(); ++i) ASSERT_EQ(g[i].bits(), T(w[i]).bits()) << what << " " << i;
  };
  auto x = randn<T>({2, 4, 7, 7}), w = randn<T>({6, 2, 3, 3}), b = randn<T>({6});
  const auto xf = x.template to<float>(), wf = w.template to<float>(), bf = b.template to<float>();
  same_bits(F::conv2d(x, w, b, 2, 1, 1, 2), F::conv2d(xf, wf, bf, 2, 1, 1, 2), "conv2d");
  same_bits(F::max_pool2d(x, 3, 2, 1), F::max_pool2d(xf, 3, 2, 1), "max_pool2d");
  same_bits(F::avg_pool2d(x, 2, 2, 0, true), F::avg_pool2d(xf, 2, 2, 0, true), "avg_pool2d");
  same_bits(F::adaptive_avg_pool2d(x, {3, 2}), F::adaptive_avg_pool2d(xf, {3, 2}), "adaptive_avg_pool2d");
  Generator g1(5), g2(5);
  same_bits(F::dropout(x, 0.3, true, g1), F::dropout(xf, 0.3, true, g2), "dropout");

  // Gradients: each rounded once from the float32 backward of the same values.
  auto xl = x.detach().requires_grad_(), wl = w.detach().requires_grad_(), bl = b.detach().requires_grad_();
  auto xr = xf.detach().requires_grad_(), wr = wf.detach().requires_grad_(), br = bf.detach().requires_grad_();
  auto gy = randn<T>({2, 6, 4, 4});
  (F::conv2d(xl, wl, bl, 2, 1, 1, 2) * gy).sum().backward();
  (F::conv2d(xr, wr, br, 2, 1, 1, 2) * gy.template to<float>()).sum().backward();
  same_bits(xl.grad(), xr.grad(), "conv2d grad x");
  same_bits(wl.grad(), wr.grad(), "conv2d grad weight");
  same_bits(bl.grad(), br.grad(), "conv2d grad bias");
  auto xp = x.detach().requires_grad_(), xq = xf.detach().requires_grad_();
  F::max_pool2d(xp, 2).sum().backward();
  F::max_pool2d(xq, 2).sum().backward();
  same_bits(xp.grad(), xq.grad(), "max_pool2d grad");

  // batch_norm in training: the output, the input gradient and the running statistics (updated
  // in float32, rounded once into the 16-bit buffers).
  auto rm = zeros<T>({4}), rv = ones<T>({4});
  auto rmf = zeros<float>({4}), rvf = ones<float>({4});
  auto gamma = randn<T>({4}), beta = randn<T>({4});
  auto xb = x.detach().requires_grad_(), xc = xf.detach().requires_grad_();
  auto yb = F::batch_norm(xb, rm, rv, gamma, beta, true, 0.1, 1e-5);
  auto yc = F::batch_norm(xc, rmf, rvf, gamma.template to<float>(), beta.template to<float>(), true, 0.1, 1e-5);
  same_bits(yb, yc, "batch_norm");
  same_bits(rm, rmf, "batch_norm running_mean");
  same_bits(rv, rvf, "batch_norm running_var");
  (yb * x).sum().backward();
  (yc * xf).sum().backward();
  same_bits(xb.grad(), xc.grad(), "batch_norm grad");
  // Evaluation reads the (rounded) running statistics.
  same_bits(F::batch_norm(x, rm, rv, gamma, beta, false), F::batch_norm(xf, rm.template to<float>(),
                                                                       rv.template to<float>(),
                                                                       gamma.template to<float>(),
                                                                       beta.template to<float>(), false),
            "batch_norm eval");
}

// The optimizers step float32 master weights (Note [the form of mixed precision]): one given
// 16-bit parameters says so, naming the type.
TYPED_TEST(LowpTypes, OptimizersOver16BitParametersSayWhy) {
  using T = TypeParam;
  auto message = [](auto&& f) {
    try {
      f();
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  const std::string name(dtype_name(Tensor<T>::dtype()));
  auto p = ones<T>({3}).requires_grad_();
  p.set_grad(ones<T>({3}));
  optim::SGD opt({p}, {.lr = 0.1});
  const auto sgd = message([&] { opt.step(); });
  EXPECT_NE(sgd.find(name), std::string::npos) << sgd;
}

TEST(LowpTensor, AnyTensorHoldsBothTypes) {
  AnyTensor a = zeros<bfloat16>({3}), h = ones<half>({2, 2});
  EXPECT_EQ(a.dtype(), DType::BFloat16);
  EXPECT_EQ(h.dtype(), DType::Float16);
  EXPECT_EQ(a.nbytes(), 6u);
  EXPECT_EQ(h.nbytes(), 8u);
  EXPECT_TRUE(h.is<half>());
  EXPECT_THROW(h.as<bfloat16>(), Error);
  auto e = empty_any(DType::BFloat16, {4}, Device::cpu());
  EXPECT_EQ(e.dtype(), DType::BFloat16);
  EXPECT_EQ(e.numel(), 4);
  EXPECT_EQ((visit_dtype(DType::Float16, [](auto tag) { return sizeof(tag); })), 2u);
}

TEST(LowpTensor, ALinearLayerIn16BitsFromAFloatCheckpoint) {
  // The 16-bit model of a float one: layers are templates over the scalar type, and a float
  // checkpoint loads into them with convert_dtype (each value rounded once).
  const std::string path = (std::filesystem::temp_directory_path() /
                            ("chorus_lowp_" + std::to_string(::getpid()) + ".safetensors")).string();
  manual_seed(3);
  nn::Linear f(4, 3);
  save(f, path);
  nn::LinearT<bfloat16> b(4, 3);
  load(b, path, io::LoadOptions{.convert_dtype = true});
  std::filesystem::remove(path);
  const auto fw = f->weight.to_vector();
  const auto bw = b->weight.to_vector();
  for (std::size_t i = 0; i < fw.size(); ++i) EXPECT_EQ(bw[i].bits(), bfloat16(fw[i]).bits());
  auto x = randn<bfloat16>({2, 4});
  auto y = b(x);
  EXPECT_EQ(y.shape(), (Shape{2, 3}));
  // Each output: the float dot product of the 16-bit values plus the bias, rounded once.
  const auto xv = x.to_vector(), yv = y.to_vector(), bias = b->bias.to_vector();
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 3; ++j) {
      float acc = 0;
      for (int k = 0; k < 4; ++k) acc += static_cast<float>(xv[i * 4 + k]) * static_cast<float>(bw[j * 4 + k]);
      EXPECT_NEAR(static_cast<float>(yv[i * 3 + j]), acc + static_cast<float>(bias[j]),
                  std::abs(acc + static_cast<float>(bias[j])) * 0x1p-8 + 1e-6);
    }
  y.sum().backward();
  ASSERT_TRUE(b->weight.grad().defined());
  const auto gw = b->weight.grad().to_vector();
  for (int j = 0; j < 3; ++j)
    for (int k = 0; k < 4; ++k)  // d(sum y)/dw[j, k] = x[0, k] + x[1, k], rounded once
      EXPECT_EQ(gw[j * 4 + k].bits(),
                bfloat16(static_cast<float>(xv[k]) + static_cast<float>(xv[4 + k])).bits());
  EXPECT_EQ(as_floats(b->bias.grad()), std::vector<float>(3, 2.0f));
}

// A model's dtype changes by loading its state into the same architecture built for the other
// type (Note [changing a model's dtype] in io/state.hpp).
template <class T>
struct TinyImpl : nn::Module {
  nn::LinearT<T> fc{nullptr};
  nn::BatchNorm1dT<T> bn{nullptr};
  TinyImpl() {
    fc = register_module("fc", nn::LinearT<T>(4, 3));
    bn = register_module("bn", nn::BatchNorm1dT<T>(3));
  }
  Tensor<T> forward(const Tensor<T>& x) { return bn(fc(x)); }
};

template <class T>
std::vector<std::vector<double>> state_values(const nn::Module& m) {
  std::vector<std::vector<double>> out;
  for (const auto& t : m.named_tensors())
    t.tensor.visit([&](const auto& x) {
      std::vector<double> v;
      for (auto e : x.to_vector()) v.push_back(static_cast<double>(e));
      out.push_back(std::move(v));
    });
  return out;
}

TEST(LowpTensor, AModelChangesDtypeByLoadingAnotherModelsState) {
  manual_seed(11);
  auto f = std::make_shared<TinyImpl<float>>();
  f->forward(randn<float>({5, 4}));  // training mode: the running statistics move off 0 and 1
  auto b = std::make_shared<TinyImpl<bfloat16>>();
  const auto before = state_values<bfloat16>(*b);
  // A dtype change has to be asked for; the refusal writes nothing.
  EXPECT_TRUE(throws_with([&] { load(b, f); }, {"'fc.weight' is float32 in the source module but",
                                                "but bfloat16 in the module", "convert_dtype = true"}));
  EXPECT_EQ(state_values<bfloat16>(*b), before);

  load(b, f, io::LoadOptions{.convert_dtype = true});
  const auto fs = f->named_tensors(), bs = b->named_tensors();
  ASSERT_EQ(fs.size(), bs.size());
  for (std::size_t i = 0; i < fs.size(); ++i) {
    ASSERT_EQ(fs[i].name, bs[i].name);
    if (fs[i].tensor.dtype() == DType::Int64) {  // num_batches_tracked: never converted
      EXPECT_EQ(bs[i].tensor.dtype(), DType::Int64);
      EXPECT_EQ(bs[i].tensor.as<std::int64_t>().to_vector(), fs[i].tensor.as<std::int64_t>().to_vector());
      EXPECT_EQ(bs[i].tensor.as<std::int64_t>().to_vector(), std::vector<std::int64_t>{1});
      continue;
    }
    const auto fv = fs[i].tensor.as<float>().to_vector();
    const auto bv = bs[i].tensor.as<bfloat16>().to_vector();
    ASSERT_EQ(fv.size(), bv.size()) << fs[i].name;
    for (std::size_t k = 0; k < fv.size(); ++k) EXPECT_EQ(bv[k].bits(), bfloat16(fv[k]).bits()) << fs[i].name;
  }
  // The 16-bit model computes with what it got; its parameters are still trained leaves.
  auto y = b->forward(randn<bfloat16>({5, 4}));
  y.sum().backward();
  EXPECT_TRUE(b->fc->weight.grad().defined());

  // And back: float32 holds every bfloat16 value exactly.
  auto g = std::make_shared<TinyImpl<float>>();
  load(g, b, {.convert_dtype = true});  // the README's spelling
  EXPECT_EQ(state_values<float>(*g), state_values<bfloat16>(*b));

  // Same dtype: a plain copy, no option needed; loading a module from itself changes nothing.
  auto h = std::make_shared<TinyImpl<float>>();
  load(h, f);
  EXPECT_EQ(state_values<float>(*h), state_values<float>(*f));
  // A graph that saved f's weights stays valid when f loads itself (nothing is written), and
  // one that saved h's is refused after h loads (its weights changed under it).
  auto fout = f->forward(randn<float>({5, 4}));  // moves f's running statistics again
  load(f, f);
  EXPECT_NO_THROW(fout.sum().backward());
  auto hout = h->forward(randn<float>({5, 4}));
  load(h, f);
  EXPECT_EQ(state_values<float>(*h), state_values<float>(*f));
  EXPECT_TRUE(throws_with([&] { hout.sum().backward(); }, {"modified by an inplace operation"}));
  // The copy is a copy: training h leaves f alone.
  h->fc->weight.data()[0] += 1.0f;
  EXPECT_NE(state_values<float>(*h), state_values<float>(*f));

  // Mismatches are checked as a checkpoint's are: shapes, and names on both sides.
  nn::Linear wide(5, 3), lin(4, 3);
  EXPECT_TRUE(throws_with([&] { load(lin, wide); }, {"'weight' has shape [3, 5] in the source module", "[3, 4]"}));
  EXPECT_TRUE(throws_with([&] { load(lin, f); }, {"the source module lacks 2 tensor(s) of the module: 'weight', 'bias'",
                                                  "the source module has 7 tensor(s) the module lacks: 'bn.bias'"}));
  // A submodule loads from the matching submodule of another model.
  load(lin, f->fc);
  EXPECT_EQ(lin->weight.to_vector(), f->fc->weight.to_vector());
}

TEST(CudnnOperands, ViewsAtAnOddElementAreCopiedAlignedAndLargeTensorsGoThroughIm2col) {
  // Note [cuDNN operands], on the CPU: the checks cuDNN's convolutions rely on.
  auto base = chorus::arange<half>(0, 33);
  auto odd = base.narrow(0, 1, 32);  // 2 bytes past an aligned start
  ASSERT_NE(reinterpret_cast<std::uintptr_t>(odd.data()) % 16, 0u);
  auto op = chorus::ops::detail::cudnn_operand(odd);
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(op.data()) % 16, 0u);
  EXPECT_EQ(op.to_vector(), odd.to_vector());
  auto even = base.narrow(0, 0, 32);
  EXPECT_EQ(chorus::ops::detail::cudnn_operand(even).data(), even.data());  // aligned already: no copy

  chorus::ops::detail::ConvGeometry geo{};
  geo.g.C = 3, geo.g.H = geo.g.W = geo.g.OH = geo.g.OW = 8, geo.g.kh = geo.g.kw = 1;
  geo.g.sh = geo.g.sw = geo.g.dh = geo.g.dw = 1;
  geo.N = 4, geo.O = 5, geo.groups = 1;
  EXPECT_TRUE(geo.fits_int());
  geo.N = std::int64_t{1} << 26;  // every size fits an int; the input's 2^32 elements do not
  EXPECT_FALSE(geo.fits_int());
  geo.N = 4, geo.g.C = 1 << 16, geo.O = 1 << 16;  // the weight's 2^32 elements
  geo.g.H = geo.g.W = geo.g.OH = geo.g.OW = 1;
  EXPECT_FALSE(geo.fits_int());
}
