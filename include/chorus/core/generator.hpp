#pragma once
// Random numbers: a seedable generator (one process-wide default), producing the same
// sequence whatever device the numbers end up on.
#include <cmath>
#include <cstdint>
#include <mutex>
#include <random>

#include "../config.hpp"

CHORUS_NAMESPACE_BEGIN

class Generator {
 public:
  explicit Generator(std::uint64_t seed = 5489u) : eng_(seed) {}

  void manual_seed(std::uint64_t seed) {
    std::lock_guard<std::mutex> lk(m_);
    eng_.seed(seed);
  }

  /// Fills out[0..n) with uniform numbers in [lo, hi).
  template <class T>
  void uniform(T* out, std::int64_t n, double lo, double hi) {
    std::lock_guard<std::mutex> lk(m_);
    for (std::int64_t i = 0; i < n; ++i) out[i] = static_cast<T>(lo + (hi - lo) * next_unit());
  }

  /// Fills out[0..n) with normal numbers (Box–Muller on the generator's stream).
  template <class T>
  void normal(T* out, std::int64_t n, double mean, double stddev) {
    std::lock_guard<std::mutex> lk(m_);
    constexpr double kTwoPi = 6.283185307179586476925286766559;
    for (std::int64_t i = 0; i < n; i += 2) {
      double u1 = 1.0 - next_unit();  // (0, 1]
      double u2 = next_unit();
      double r = std::sqrt(-2.0 * std::log(u1));
      out[i] = static_cast<T>(mean + stddev * r * std::cos(kTwoPi * u2));
      if (i + 1 < n) out[i + 1] = static_cast<T>(mean + stddev * r * std::sin(kTwoPi * u2));
    }
  }

  /// Fills out[0..n) with 1 with probability p, else 0.
  template <class T>
  void bernoulli(T* out, std::int64_t n, double p) {
    std::lock_guard<std::mutex> lk(m_);
    for (std::int64_t i = 0; i < n; ++i) out[i] = next_unit() < p ? T(1) : T(0);
  }

  /// A uniformly random integer in [0, n).
  std::uint64_t below(std::uint64_t n) {
    std::lock_guard<std::mutex> lk(m_);
    return std::uniform_int_distribution<std::uint64_t>(0, n - 1)(eng_);
  }

  std::mt19937_64& engine() { return eng_; }

 private:
  double next_unit() { return static_cast<double>(eng_() >> 11) * 0x1.0p-53; }  // [0, 1)
  std::mutex m_;
  std::mt19937_64 eng_;
};

/// The process-wide default generator (used when none is passed).
inline Generator& default_generator() {
  static Generator g;
  return g;
}

/// Seeds the default generator.
inline void manual_seed(std::uint64_t seed) { default_generator().manual_seed(seed); }

CHORUS_NAMESPACE_END
