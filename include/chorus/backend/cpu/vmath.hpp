#pragma once
// exp, sigmoid and tanh, sums and maxima for the CPU loops, written so that they vectorize.
//
// Note [vectorizable math]
// A call to std::exp/std::tanh is opaque to the compiler: a loop over the gates of an LSTM
// (three sigmoids and two tanh per element) or over the rows of a softmax then runs one libm
// call per element, and that was a quarter of lstm-lm's training step on one core. These
// functions are branch-free arithmetic on float (both sides of a select are computed), so GCC
// and Clang vectorize the loops that call them at the target's width. exp: x = n·ln2 + r with
// |r| <= ln2/2 (Cody-Waite, two-part ln2), e^r by its Taylor polynomial to degree 7 (the next
// term is < 6e-9), times 2^n built in the exponent bits; +-inf and overflow as std::exp, NaN
// stays NaN, and results below 1.22e-38 (x < -87.3, next to the smallest normal float) are
// flushed to 0: no lane ever computes a denormal, which costs x86 a microcode assist each. tanh: an odd polynomial (fitted here to tanh on [0, 0.625], < 1.3 half-ulps) below
// 0.625, 1 - 2/(e^{2|x|} + 1) above it, where the subtraction loses at most two bits. Measured
// against the double-precision functions over 2^24 samples of [-20, 20] (tests/test_ops.cpp,
// VectorizableMath): exp and sigmoid within 2 ulp, tanh within 3 ulp. Double (and every other
// type) goes to the standard functions, so float64 results and gradchecks are unchanged.
// Sums (sum, shifted_sums, gradient_sums) keep eight partial sums in a fixed order: they
// vectorize at any width and give the same bits at every one (Note [CPU capability]).
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include "../../config.hpp"

CHORUS_NAMESPACE_BEGIN
namespace backend::cpu::vmath {

namespace detail {
/// c ? a : b as bit operations: a select the compiler keeps branch-free (a conditional between
/// two computed floats becomes a branch under -ftrapping-math, GCC's default, and the loop
/// around it stays scalar).
inline float select(bool c, float a, float b) {
  std::uint32_t ua, ub;
  std::memcpy(&ua, &a, sizeof ua);
  std::memcpy(&ub, &b, sizeof ub);
  const std::uint32_t m = 0u - static_cast<std::uint32_t>(c);
  const std::uint32_t r = (ua & m) | (ub & ~m);
  float out;
  std::memcpy(&out, &r, sizeof out);
  return out;
}

// Sums with eight partial sums of double, lane u adding elements u, u + 8, u + 16, ...: where the
// compiler has GCC's vector extensions they are one vector of eight doubles (GCC does not
// vectorize the array form when each element is widened from float first), elsewhere an array;
// both add the same numbers in the same order, so the bits are the same.
#if defined(__GNUC__) && !defined(__CUDACC__)
#define CHORUS_VECTOR_LANES 1
typedef double lanes8d __attribute__((vector_size(64)));
typedef float lanes8f __attribute__((vector_size(32)));
/// p[0, 8) widened to double (passed by reference: a vector argument would change the ABI).
template <class T>
inline void load_lanes(const T* p, lanes8d& out) {
  if constexpr (std::is_same_v<T, float>) {
    lanes8f v;
    std::memcpy(&v, p, sizeof v);
    out = __builtin_convertvector(v, lanes8d);
  } else {
    std::memcpy(&out, p, sizeof out);
  }
}
inline double fold_lanes(const lanes8d& a) { return ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7])); }
#else
#define CHORUS_VECTOR_LANES 0
#endif
/// Whether a sum of T in Acc takes the vector form.
template <class Acc, class T>
inline constexpr bool vector_lanes =
    CHORUS_VECTOR_LANES && std::is_same_v<Acc, double> && (std::is_same_v<T, float> || std::is_same_v<T, double>);
}  // namespace detail

inline float exp(float x) {
  constexpr float log2e = 1.44269504088896341f, ln2_hi = 0.693359375f, ln2_lo = -2.12194440e-4f;
  constexpr float round = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  // Clamped so that every lane computes a normal float (the lanes of masked scores, -inf, too:
  // a denormal intermediate costs a microcode assist, ~100 cycles, even when the select below
  // drops it).
  const float xc = detail::select(std::isless(x, -87.3f), -87.3f, detail::select(std::isgreater(x, 88.8f), 88.8f, x));
  const float n = (xc * log2e + round) - round;  // in [-126, 128]
  const float r = (xc - n * ln2_hi) - n * ln2_lo;
  float p = 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  // 2^n as 2^n1 * 2^n2, both normal floats: the product rounds once and overflows to inf above
  // ln(FLT_MAX).
  const std::int32_t ni = static_cast<std::int32_t>(n), n1 = ni >> 1, n2 = ni - n1;
  const std::int32_t b1 = (n1 + 127) << 23, b2 = (n2 + 127) << 23;
  float s1, s2;
  std::memcpy(&s1, &b1, sizeof s1);
  std::memcpy(&s2, &b2, sizeof s2);
  const float e = p * s1 * s2;
  // Below e^-87.3 = 1.22e-38 (just above the smallest normal float) the result is flushed to 0;
  // NaN compares false and stays NaN.
  return detail::select(std::isless(x, -87.3f), 0.0f, e);
}

inline float sigmoid(float x) { return 1.0f / (1.0f + vmath::exp(-x)); }

inline float tanh(float x) {
  const float a = std::fabs(x);
  const float t = x * x;
  float p = -0.005731194745749235f;
  p = p * t + 0.020664723590016365f;
  p = p * t - 0.053748443722724915f;
  p = p * t + 0.13331560790538788f;
  p = p * t - 0.3333328664302826f;
  const float small = x * (1.0f + t * p);  // x * (...) keeps tanh(-0) = -0
  const float big = 1.0f - 2.0f / (vmath::exp(2.0f * a) + 1.0f);
  const float signed_big = std::copysign(big, x);
  return detail::select(std::isless(a, 0.625f), small, signed_big);  // NaN: isless is false, big is NaN
}

/// Σ x[0, n) in Acc, with eight partial sums: a loop the compiler vectorizes (it may not
/// reorder one running sum's additions itself).
template <class Acc, class T>
inline Acc sum(const T* x, std::int64_t n) {
  std::int64_t j = 0;
  Acc r;
#if CHORUS_VECTOR_LANES
  if constexpr (detail::vector_lanes<Acc, T>) {
    detail::lanes8d s = {}, v;
    for (; j + 8 <= n; j += 8) {
      detail::load_lanes(x + j, v);
      s += v;
    }
    r = detail::fold_lanes(s);
  } else
#endif
  {
    Acc s[8] = {};
    for (; j + 8 <= n; j += 8)
      for (int u = 0; u < 8; ++u) s[u] += Acc(x[j + u]);
    r = ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
  }
  for (; j < n; ++j) r += Acc(x[j]);
  return r;
}

namespace detail {
/// Two sums over [0, n) in Acc with eight partial sums each: term(g[i], x[i] - shift, a, b) adds
/// element i's parts to a and b, called with eight lanes at once or with one Acc (the same
/// operations either way).
template <class Acc, class T, class Term>
inline void paired_sums(const T* g, const T* x, std::int64_t n, Acc shift, Acc& s1, Acc& s2, const Term& term) {
  std::int64_t j = 0;
  Acc r1, r2;
#if CHORUS_VECTOR_LANES
  if constexpr (vector_lanes<Acc, T>) {
    const lanes8d sh = lanes8d{} + shift;
    lanes8d a = {}, b = {}, gv, d;
    for (; j + 8 <= n; j += 8) {
      load_lanes(g + j, gv);
      load_lanes(x + j, d);
      d -= sh;
      term(gv, d, a, b);
    }
    r1 = fold_lanes(a);
    r2 = fold_lanes(b);
  } else
#endif
  {
    Acc a[8] = {}, b[8] = {};
    for (; j + 8 <= n; j += 8)
      for (int u = 0; u < 8; ++u) term(Acc(g[j + u]), Acc(x[j + u]) - shift, a[u], b[u]);
    r1 = ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
    r2 = ((b[0] + b[1]) + (b[2] + b[3])) + ((b[4] + b[5]) + (b[6] + b[7]));
  }
  for (; j < n; ++j) term(Acc(g[j]), Acc(x[j]) - shift, r1, r2);
  s1 = r1;
  s2 = r2;
}
}  // namespace detail

/// s1 = Σ (x[i] - shift) and s2 = Σ (x[i] - shift)² over x[0, n) in Acc, with eight partial
/// sums each (batch norm's statistics around a pivot).
template <class Acc, class T>
inline void shifted_sums(const T* x, std::int64_t n, Acc shift, Acc& s1, Acc& s2) {
  detail::paired_sums<Acc>(x, x, n, shift, s1, s2, [](const auto&, const auto& d, auto& a, auto& b) {
    a += d;
    b += d * d;
  });
}

/// sg = Σ g[i] and sgx = Σ g[i]·(x[i] - shift) over [0, n) in Acc, with eight partial sums each
/// (batch norm's backward).
template <class Acc, class T>
inline void gradient_sums(const T* g, const T* x, std::int64_t n, Acc shift, Acc& sg, Acc& sgx) {
  detail::paired_sums<Acc>(g, x, n, shift, sg, sgx, [](const auto& gv, const auto& d, auto& a, auto& b) {
    a += gv;
    b += gv * d;
  });
}

/// max x[0, n) (-inf for n = 0; NaN elements are skipped, as std::max skips them), with eight
/// partial maxima.
template <class T>
inline T max(const T* x, std::int64_t n) {
  const T lowest = -std::numeric_limits<T>::infinity();
  T m[8] = {lowest, lowest, lowest, lowest, lowest, lowest, lowest, lowest};
  std::int64_t j = 0;
  for (; j + 8 <= n; j += 8)
    for (int u = 0; u < 8; ++u) m[u] = m[u] < x[j + u] ? x[j + u] : m[u];
  T r = lowest;
  for (int u = 0; u < 8; ++u) r = r < m[u] ? m[u] : r;
  for (; j < n; ++j) r = r < x[j] ? x[j] : r;
  return r;
}

// Every other type: the standard functions.
template <class A>
  requires(!std::is_same_v<A, float>)
A exp(A x) {
  return std::exp(x);
}
template <class A>
  requires(!std::is_same_v<A, float>)
A sigmoid(A x) {
  return A(1) / (A(1) + std::exp(-x));
}
template <class A>
  requires(!std::is_same_v<A, float>)
A tanh(A x) {
  return std::tanh(x);
}

}  // namespace backend::cpu::vmath
CHORUS_NAMESPACE_END
