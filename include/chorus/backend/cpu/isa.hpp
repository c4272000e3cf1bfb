#pragma once
// chorus's own CPU loops at the vector width of the CPU that runs them.
//
// Note [CPU capability]
// chorus is compiled for the program's target, by default the baseline x86-64, whose vectors
// are SSE2's 16 bytes: the elementwise, normalisation, softmax, pooling and optimizer loops
// would use a quarter of an AVX-512 core. With GCC on x86-64, at_cpu_width(f) calls f inside
// one of three copies of a small function, compiled for the baseline, for AVX2 (with FMA, BMI2
// and F16C: Haswell's set) and for AVX-512 (F, CD, BW, DQ, VL: Skylake-SP's set), with
// everything f calls inlined into the copy (`flatten`), so the compiler vectorizes the loop at
// 16, 32 or 64 bytes. parallel_for (parallel.hpp) runs each range of a loop through it, and
// the kernels that loop by themselves (softmax, broadcasting, reductions over a dimension,
// losses) wrap their body. The copy follows the CPU's flags (once, from cpuid), capped by
// CHORUS_CPU_CAPABILITY=default|avx2|avx512 in the environment or set_cpu_capability
// (PyTorch's ATEN_CPU_CAPABILITY and torch.backends.cpu.get_cpu_capability()).
// The three copies are compiled with floating-point contraction off (no fused multiply-add the
// code does not write), and a loop's order of operations is its code's (sums keep their own
// partial sums, vmath::sum), so every capability gives the same bits: a test runs the operators
// under each capability this CPU has and compares them bitwise. With other compilers, other
// architectures and nvcc, and in header-only units unless asked for (below), at_cpu_width(f)
// is f(): the loops are compiled for the program's own target (-march).
#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <string_view>

#include "../../compiled.hpp"
#include "../../error.hpp"

// The copies cost compile time in every unit that instantiates a loop (a header-only unit
// compiles half again as long): on by default where the loops are compiled once, in
// chorus::compiled; -DCHORUS_CPU_DISPATCH=1 turns it on in a header-only program.
#ifndef CHORUS_CPU_DISPATCH
#define CHORUS_CPU_DISPATCH CHORUS_COMPILED
#endif
#if !(defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && !defined(__CUDACC__))
#undef CHORUS_CPU_DISPATCH
#define CHORUS_CPU_DISPATCH 0
#endif

CHORUS_NAMESPACE_BEGIN
namespace backend::cpu {

/// The instruction sets chorus's own loops are compiled for (Note [CPU capability]).
enum class CpuCapability { baseline = 0, avx2 = 1, avx512 = 2 };

namespace detail {
/// The best capability of this CPU (and build).
inline CpuCapability cpu_capability_supported() {
#if CHORUS_CPU_DISPATCH
  static const CpuCapability best = [] {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512cd") &&
        __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
        __builtin_cpu_supports("avx512vl"))
      return CpuCapability::avx512;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("bmi2") &&
        __builtin_cpu_supports("f16c"))
      return CpuCapability::avx2;
    return CpuCapability::baseline;
  }();
  return best;
#else
  return CpuCapability::baseline;
#endif
}

/// CHORUS_CPU_CAPABILITY's value as a capability.
inline CpuCapability parse_cpu_capability(std::string_view v) {
  CHORUS_CHECK(v == "default" || v == "avx2" || v == "avx512", "CHORUS_CPU_CAPABILITY=", v,
               ": expected default, avx2 or avx512");
  return v == "default" ? CpuCapability::baseline : v == "avx2" ? CpuCapability::avx2 : CpuCapability::avx512;
}

inline std::atomic<int>& cpu_capability_in_use() {
  static std::atomic<int> cap{[] {
    int c = static_cast<int>(cpu_capability_supported());
    if (const char* e = std::getenv("CHORUS_CPU_CAPABILITY")) c = std::min(c, static_cast<int>(parse_cpu_capability(e)));
    return c;
  }()};
  return cap;
}

#if CHORUS_CPU_DISPATCH
template <class F>
[[gnu::flatten, gnu::optimize("fp-contract=off")]] void run_baseline(const F& f) {
  f();
}
template <class F>
[[gnu::flatten, gnu::optimize("fp-contract=off"), gnu::target("avx2,fma,bmi,bmi2,f16c,lzcnt,popcnt")]] void run_avx2(
    const F& f) {
  f();
}
template <class F>
[[gnu::flatten, gnu::optimize("fp-contract=off"),
  gnu::target("avx512f,avx512cd,avx512bw,avx512dq,avx512vl,avx2,fma,bmi,bmi2,f16c,lzcnt,popcnt")]] void
run_avx512(const F& f) {
  f();
}
#endif
}  // namespace detail

/// Caps the capability chorus's loops use (process-wide); above the CPU's own it is an error.
inline void set_cpu_capability(CpuCapability c) {
  CHORUS_CHECK(static_cast<int>(c) <= static_cast<int>(detail::cpu_capability_supported()),
               "set_cpu_capability: this CPU (or build) has no ", c == CpuCapability::avx512 ? "AVX-512" : "AVX2");
  detail::cpu_capability_in_use().store(static_cast<int>(c));
}
/// The capability chorus's loops use now.
inline CpuCapability get_cpu_capability() {
  return static_cast<CpuCapability>(detail::cpu_capability_in_use().load(std::memory_order_relaxed));
}
/// Its name: "default", "avx2" or "avx512" (PyTorch's spelling, lower case).
inline const char* cpu_capability_name(CpuCapability c) {
  return c == CpuCapability::avx512 ? "avx512" : c == CpuCapability::avx2 ? "avx2" : "default";
}

/// Calls f() compiled for the capability in use (Note [CPU capability]).
template <class F>
inline void at_cpu_width(const F& f) {
#if CHORUS_CPU_DISPATCH
  switch (detail::cpu_capability_in_use().load(std::memory_order_relaxed)) {
    case 2:
      return detail::run_avx512(f);
    case 1:
      return detail::run_avx2(f);
    default:
      return detail::run_baseline(f);
  }
#else
  f();
#endif
}

}  // namespace backend::cpu
CHORUS_NAMESPACE_END
