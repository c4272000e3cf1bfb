#pragma once
// The definitions of core/host_engine.hpp (Note [host engine]): compiled into chorus::compiled
// (src/core/runtime.cpp), included by host_engine.hpp itself in the header-only form.
#include <new>
#include <random>
#include <type_traits>

#include "host_engine.hpp"

CHORUS_NAMESPACE_BEGIN

namespace detail {
static_assert(sizeof(std::mt19937_64) == kHostEngineBytes && alignof(std::mt19937_64) <= alignof(std::uint64_t),
              "HostEngine's state block must be std::mt19937_64's size (detail::kHostEngineBytes)");
static_assert(std::is_trivially_copyable_v<std::mt19937_64>, "HostEngine copies the engine's bytes");
struct HostEngineAccess {
  static std::mt19937_64& of(HostEngine& e) { return *std::launder(reinterpret_cast<std::mt19937_64*>(e.state_)); }
  static const std::mt19937_64& of(const HostEngine& e) {
    return *std::launder(reinterpret_cast<const std::mt19937_64*>(e.state_));
  }
};
}  // namespace detail

CHORUS_INLINE HostEngine::HostEngine(std::uint64_t seed) { ::new (static_cast<void*>(state_)) std::mt19937_64(seed); }
CHORUS_INLINE void HostEngine::seed(std::uint64_t seed) { detail::HostEngineAccess::of(*this).seed(seed); }
CHORUS_INLINE HostEngine::result_type HostEngine::operator()() { return detail::HostEngineAccess::of(*this)(); }
CHORUS_INLINE std::uint64_t HostEngine::below(std::uint64_t n) {
  return std::uniform_int_distribution<std::uint64_t>(0, n - 1)(detail::HostEngineAccess::of(*this));
}
CHORUS_INLINE bool HostEngine::operator==(const HostEngine& other) const {
  return detail::HostEngineAccess::of(*this) == detail::HostEngineAccess::of(other);
}

CHORUS_NAMESPACE_END
