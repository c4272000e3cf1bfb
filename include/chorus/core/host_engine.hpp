#pragma once
// HostEngine: std::mt19937_64's numbers, bit for bit, compiled into the library.
//
// Note [host engine]
// The host-side draws (the generator's normal and uniform fills, a DataLoader's shuffle, the
// image transforms) come from a 64-bit Mersenne Twister. std::mt19937_64 is a class template
// of <random>, whose parse every unit including it pays (a few percent of a small program's
// compile); HostEngine is that engine behind a small class: its state is an opaque block of
// the engine's size, and its members are compiled into chorus::compiled (host_engine_impl.hpp
// holds the std::mt19937_64 they work on). It is a UniformRandomBitGenerator, so std::shuffle
// and the standard distributions take it and give what they give with std::mt19937_64 seeded
// the same; it copies as the engine does (its state is trivially copyable).
#include <cstddef>
#include <cstdint>

#include "../compiled.hpp"

CHORUS_NAMESPACE_BEGIN

namespace detail {
struct HostEngineAccess;
/// sizeof(std::mt19937_64) (312 words and an index; checked where the engine is defined).
inline constexpr std::size_t kHostEngineBytes = 312 * sizeof(std::uint64_t) + sizeof(std::size_t);
}  // namespace detail

/// std::mt19937_64 behind a compiled interface (Note [host engine]); a UniformRandomBitGenerator.
class HostEngine {
 public:
  using result_type = std::uint64_t;  ///< the type of the numbers drawn
  /// The engine std::mt19937_64(`seed`) would be.
  CHORUS_INLINE explicit HostEngine(std::uint64_t seed = 5489u);
  /// Restarts the engine from `seed` (std::mt19937_64::seed).
  CHORUS_INLINE void seed(std::uint64_t seed);
  /// The smallest number drawn: 0.
  static constexpr result_type min() { return 0; }
  /// The largest number drawn: 2^64 - 1.
  static constexpr result_type max() { return ~result_type{0}; }
  /// The next 64-bit number of the sequence.
  CHORUS_INLINE result_type operator()();
  /// A uniformly random integer in [0, n) (std::uniform_int_distribution's).
  CHORUS_INLINE std::uint64_t below(std::uint64_t n);
  /// True when both engines are in the same state (will draw the same numbers).
  CHORUS_INLINE bool operator==(const HostEngine& other) const;

 private:
  friend struct detail::HostEngineAccess;
  alignas(std::uint64_t) unsigned char state_[detail::kHostEngineBytes];
};

CHORUS_NAMESPACE_END

#if !CHORUS_COMPILED
#include "host_engine_impl.hpp"
#endif
