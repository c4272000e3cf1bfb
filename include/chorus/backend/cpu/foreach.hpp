#pragma once
// Kernels over lists of tensors (gradient clipping): the norm of many tensors as one vector,
// and in-place scaling and clamping. The per-element rules are host/device functions shared
// with backend/cuda/foreach.cuh; here the CPU loops.
#include <cmath>
#include <cstdint>

#include "../../config.hpp"

CHORUS_NAMESPACE_BEGIN
namespace backend {

/// Which norm: Σ|x| (p = 1), Σx² (p = 2), Σ|x|^p, or max |x| (p = ∞), before the root.
struct NormSpec {
  enum Kind { kL1, kL2, kLp, kMax } kind = kL2;
  double p = 2.0;
};

inline NormSpec norm_spec(double norm_type) {
  NormSpec s;
  s.p = norm_type;
  s.kind = std::isinf(norm_type) ? NormSpec::kMax
           : norm_type == 1.0    ? NormSpec::kL1
           : norm_type == 2.0    ? NormSpec::kL2
                                 : NormSpec::kLp;
  return s;
}

/// One element's term (|v|, v², |v|^p or |v|); NaN stays NaN.
CHORUS_HOST_DEVICE inline double norm_term(const NormSpec& s, double v) {
  const double a = v < 0 ? -v : v;
  switch (s.kind) {
    case NormSpec::kL2:
      return a * a;
    case NormSpec::kLp:
      return ::pow(a, s.p);
    default:
      return a;
  }
}

/// Adds a term (or a partial) to an accumulator: a sum, or a maximum that keeps a NaN.
CHORUS_HOST_DEVICE inline double norm_accumulate(const NormSpec& s, double acc, double term) {
  if (s.kind != NormSpec::kMax) return acc + term;
  return (term > acc || term != term) ? term : acc;  // a NaN acc stays: NaN > x and x > NaN are false
}

/// The norm from the accumulated terms.
CHORUS_HOST_DEVICE inline double norm_root(const NormSpec& s, double acc) {
  switch (s.kind) {
    case NormSpec::kL2:
      return ::sqrt(acc);
    case NormSpec::kLp:
      return ::pow(acc, 1.0 / s.p);
    default:
      return acc;
  }
}

/// clip_grad_norm_'s scale: min(1, max_norm / (total + 1e-6)), NaN when the norm is NaN (as
/// PyTorch's clamp(max=1) keeps it).
CHORUS_HOST_DEVICE inline double clip_coefficient(double total, double max_norm) {
  const double c = max_norm / (total + 1e-6);
  return (c < 1.0 || c != c) ? c : 1.0;
}

/// Clamps into [-hi, hi]; NaN stays NaN.
template <class T>
CHORUS_HOST_DEVICE inline T clamp_abs(T x, T hi) {
  return x > hi ? hi : (x < -hi ? -hi : x);
}

namespace cpu {

/// The accumulated norm terms of n contiguous values (a specialised loop per kind: these are
/// the only hot ones in clipping on the CPU).
template <class T>
double norm_partial(const T* x, std::int64_t n, const NormSpec& s) {
  double acc = 0;
  switch (s.kind) {
    case NormSpec::kL2:
      for (std::int64_t i = 0; i < n; ++i) acc += static_cast<double>(x[i]) * static_cast<double>(x[i]);
      return acc;
    case NormSpec::kL1:
      for (std::int64_t i = 0; i < n; ++i) acc += std::abs(static_cast<double>(x[i]));
      return acc;
    default:
      for (std::int64_t i = 0; i < n; ++i) acc = norm_accumulate(s, acc, norm_term(s, static_cast<double>(x[i])));
      return acc;
  }
}

template <class T>
void scale_inplace(T* x, std::int64_t n, double coef) {
  const T c = static_cast<T>(coef);
  for (std::int64_t i = 0; i < n; ++i) x[i] *= c;
}

template <class T>
void clamp_inplace(T* x, std::int64_t n, T hi) {
  for (std::int64_t i = 0; i < n; ++i) x[i] = clamp_abs(x[i], hi);
}

}  // namespace cpu
}  // namespace backend
CHORUS_NAMESPACE_END
