#pragma once
// Element functors shared by the CPU loops and the CUDA kernels (host/device callable).
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "../config.hpp"
#include "../core/half.hpp"

CHORUS_NAMESPACE_BEGIN
namespace backend::fn {

// Unqualified calls resolve to the float overloads on the host (std::) and the CUDA math
// library's overloads on the device.
using std::cos;
using std::erf;
using std::exp;
using std::log;
using std::pow;
using std::sin;
using std::sqrt;
using std::tanh;

/// The type a functor computes in: T itself for float, double and int64. A 16-bit type
/// (bfloat16, half) specialises it to float, so that its functors compute in float and round
/// once, as PyTorch's opmath_type does.
template <class T>
struct opmath {
  using type = T;
};
template <>
struct opmath<bfloat16> {
  using type = float;
};
template <>
struct opmath<half> {
  using type = float;
};
template <class T>
using opmath_t = typename opmath<T>::type;

/// sgn(x): -1, 0 or 1 (NaN stays NaN), as torch.sgn / torch.sign on real numbers.
template <class T>
CHORUS_HOST_DEVICE T sgn(T x) {
  return x > T(0) ? T(1) : x < T(0) ? T(-1) : x == T(0) ? T(0) : x;
}

// ---- unary ----
struct Neg {
  template <class T>
  CHORUS_HOST_DEVICE T operator()(T x) const { return -x; }
};
struct Exp {
  template <class T>
  CHORUS_HOST_DEVICE T operator()(T x) const { return exp(x); }
};
struct Log {
  template <class T>
  CHORUS_HOST_DEVICE T operator()(T x) const { return log(x); }
};
struct Sqrt {
  template <class T>
  CHORUS_HOST_DEVICE T operator()(T x) const { return sqrt(x); }
};
// NaN propagates, as in PyTorch: relu(NaN) is NaN (and relu(-0.0) is -0.0).
struct Relu {
  template <class T>
  CHORUS_HOST_DEVICE T operator()(T x) const { return x < T(0) ? T(0) : x; }
};
// Exact GELU (PyTorch's default): x * Phi(x).
struct Gelu {
  template <class T>
  CHORUS_HOST_DEVICE T operator()(T x) const {
    return T(0.5) * x * (T(1) + erf(x * T(0.70710678118654752440)));
  }
};
struct Tanh {
  template <class T>
  CHORUS_HOST_DEVICE T operator()(T x) const { return tanh(x); }
};
struct Sigmoid {
  template <class T>
  CHORUS_HOST_DEVICE T operator()(T x) const { return T(1) / (T(1) + exp(-x)); }
};
struct AddScalar {
  double s;
  template <class T>
  CHORUS_HOST_DEVICE T operator()(T x) const { return x + T(s); }
};
struct MulScalar {
  double s;
  template <class T>
  CHORUS_HOST_DEVICE T operator()(T x) const { return x * T(s); }
};
struct DivScalar {
  double s;
  template <class T>
  CHORUS_HOST_DEVICE T operator()(T x) const { return x / T(s); }
};
struct PowScalar {
  double p;
  template <class T>
  CHORUS_HOST_DEVICE T operator()(T x) const {
    return p == 2.0 ? x * x : pow(x, T(p));
  }
};

// |x| with |-0| = +0 and |NaN| = NaN, for any arithmetic T (no std::abs overload set needed).
struct Abs {
  template <class T>
  CHORUS_HOST_DEVICE T operator()(T x) const { return x < T(0) ? T(-x) : x == T(0) ? T(0) : x; }
};
struct Sign {
  template <class T>
  CHORUS_HOST_DEVICE T operator()(T x) const { return sgn(x); }
};
/// ±inf -> 0, everything else (NaN included) unchanged: the shift of a stable logsumexp.
struct InfToZero {
  template <class T>
  CHORUS_HOST_DEVICE T operator()(T x) const { return (x - x != x - x && x == x) ? T(0) : x; }
};
struct Sin {
  template <class T>
  CHORUS_HOST_DEVICE T operator()(T x) const { return static_cast<T>(sin(static_cast<opmath_t<T>>(x))); }
};
struct Cos {
  template <class T>
  CHORUS_HOST_DEVICE T operator()(T x) const { return static_cast<T>(cos(static_cast<opmath_t<T>>(x))); }
};
/// min(max(x, lo), hi) with either bound optional, as torch.clamp: NaN in x stays NaN, a NaN
/// bound gives NaN, and lo > hi gives hi everywhere.
struct Clamp {
  double lo, hi;
  bool has_lo, has_hi;
  template <class T>
  CHORUS_HOST_DEVICE T operator()(T x) const {
    using A = opmath_t<T>;
    A r = static_cast<A>(x);
    if (has_lo && (r < A(lo) || lo != lo)) r = A(lo);
    if (has_hi && (r > A(hi) || hi != hi)) r = A(hi);
    return static_cast<T>(r);
  }
};

// ---- binary ----
/// max(a, b) that propagates NaN from either side (torch.maximum); std::max and fmax drop it.
struct Maximum {
  template <class T>
  CHORUS_HOST_DEVICE T operator()(T a, T b) const { return (a != a || a > b) ? a : b; }
};
struct Add {
  template <class T>
  CHORUS_HOST_DEVICE T operator()(T a, T b) const { return a + b; }
};
struct Sub {
  template <class T>
  CHORUS_HOST_DEVICE T operator()(T a, T b) const { return a - b; }
};
struct Mul {
  template <class T>
  CHORUS_HOST_DEVICE T operator()(T a, T b) const { return a * b; }
};
struct Div {
  template <class T>
  CHORUS_HOST_DEVICE T operator()(T a, T b) const { return a / b; }
};

/// x * s and (a + b) * s computed in T's opmath and rounded once (a 16-bit T's s is not first
/// rounded to 16 bits): DistributedDataParallel dividing by the world size while it copies or
/// adds a gradient into its bucket (Note [DDP pre-division] in distributed/reducer.hpp).
struct Scale {
  double s;
  template <class T>
  CHORUS_HOST_DEVICE T operator()(T x) const {
    using O = opmath_t<T>;
    return T(O(x) * O(s));
  }
};
struct AddThenScale {
  double s;
  template <class T>
  CHORUS_HOST_DEVICE T operator()(T a, T b) const {
    using O = opmath_t<T>;
    return T((O(a) + O(b)) * O(s));
  }
};
/// a + alpha * b computed in T's opmath and rounded to T once (Tensor::add_(other, alpha)).
struct AddScaled {
  double alpha;
  template <class T>
  CHORUS_HOST_DEVICE T operator()(T a, T b) const {
    using O = opmath_t<T>;
    return T(O(a) + O(alpha) * O(b));
  }
};

// ---- backward: (grad, saved) -> grad_input ----
struct ReluBackward {  // saved: the output; PyTorch's threshold_backward passes g where y is NaN
  template <class T>
  CHORUS_HOST_DEVICE T operator()(T g, T y) const { return y <= T(0) ? T(0) : g; }
};
struct GeluBackward {  // saved: the input
  template <class T>
  CHORUS_HOST_DEVICE T operator()(T g, T x) const {
    T cdf = T(0.5) * (T(1) + erf(x * T(0.70710678118654752440)));
    T pdf = exp(T(-0.5) * x * x) * T(0.39894228040143267794);
    return g * (cdf + x * pdf);
  }
};
struct TanhBackward {  // saved: the output
  template <class T>
  CHORUS_HOST_DEVICE T operator()(T g, T y) const { return g * (T(1) - y * y); }
};
struct SigmoidBackward {  // saved: the output
  template <class T>
  CHORUS_HOST_DEVICE T operator()(T g, T y) const { return g * y * (T(1) - y); }
};
struct LogBackward {  // saved: the input
  template <class T>
  CHORUS_HOST_DEVICE T operator()(T g, T x) const { return g / x; }
};
struct SqrtBackward {  // saved: the output
  template <class T>
  CHORUS_HOST_DEVICE T operator()(T g, T y) const { return g / (T(2) * y); }
};
struct PowBackward {  // saved: the input
  double p;
  template <class T>
  CHORUS_HOST_DEVICE T operator()(T g, T x) const {
    return p == 2.0 ? g * T(2) * x : g * T(p) * pow(x, T(p - 1.0));
  }
};

struct AbsBackward {  // saved: the input; sgn(0) = 0, as PyTorch
  template <class T>
  CHORUS_HOST_DEVICE T operator()(T g, T x) const { return g * sgn(x); }
};
struct SinBackward {  // saved: the input
  template <class T>
  CHORUS_HOST_DEVICE T operator()(T g, T x) const { return g * Cos{}(x); }
};
struct CosBackward {  // saved: the input
  template <class T>
  CHORUS_HOST_DEVICE T operator()(T g, T x) const { return -(g * Sin{}(x)); }
};
/// The gradient passes where lo <= x <= hi (boundaries included, as PyTorch's clamp_backward).
struct ClampBackward {  // saved: the input
  double lo, hi;
  bool has_lo, has_hi;
  template <class T>
  CHORUS_HOST_DEVICE T operator()(T g, T x) const {
    using A = opmath_t<T>;
    const A v = static_cast<A>(x);
    const bool in = (!has_lo || v >= A(lo)) && (!has_hi || v <= A(hi));
    return in ? g : T(0);
  }
};

// ---- norm backward (PyTorch's norm_backward, FunctionsManual.cpp) ----
/// The per-output factor: g / norm^(p-1), 0 where the norm is 0 (p >= 1); g * norm^(1-p) for p < 1.
struct NormScale {
  double p;
  template <class T>
  CHORUS_HOST_DEVICE T operator()(T g, T n) const {
    using A = opmath_t<T>;
    const A gg = static_cast<A>(g), nn = static_cast<A>(n);
    if (p < 1.0) return static_cast<T>(gg * pow(nn, A(1.0 - p)));
    if (nn == A(0)) return T(0);
    return static_cast<T>(p == 2.0 ? gg / nn : p == 1.0 ? gg : gg / pow(nn, A(p - 1.0)));
  }
};
/// The per-element gradient from the factor s: sgn(x) |x|^(p-1) s, 0 where x is 0 (so that
/// p < 2 gives no 0 * inf, and the norm at 0 has gradient 0, as in PyTorch).
struct NormGrad {
  double p;
  template <class T>
  CHORUS_HOST_DEVICE T operator()(T x, T s) const {
    using A = opmath_t<T>;
    const A v = static_cast<A>(x), ss = static_cast<A>(s);
    if (v == A(0)) return T(0);
    if (p == 2.0) return static_cast<T>(v * ss);
    if (p == 1.0) return static_cast<T>(sgn(v) * ss);
    return static_cast<T>(sgn(v) * pow(Abs{}(v), A(p - 1.0)) * ss);
  }
};
/// 1 where |x| equals the (infinity or minus infinity) norm or is NaN, else 0: the elements
/// that share the gradient of amax/amin(|x|).
struct NormInfMask {
  template <class T>
  CHORUS_HOST_DEVICE T operator()(T x, T n) const {
    const T a = Abs{}(x);
    return (a == n || a != a) ? T(1) : T(0);
  }
};
/// x != 0 as 1 or 0 (the 0-"norm" counts nonzeros).
struct NonZero {
  template <class T>
  CHORUS_HOST_DEVICE T operator()(T x) const { return x != T(0) ? T(1) : T(0); }
};
/// |x|^p for the p-norm (p a positive real, not 1 or 2 which have their own paths).
struct AbsPow {
  double p;
  template <class T>
  CHORUS_HOST_DEVICE T operator()(T x) const {
    using A = opmath_t<T>;
    return static_cast<T>(pow(Abs{}(static_cast<A>(x)), A(p)));
  }
};

/// 1 where x equals the selected value v (both NaN counts as equal), else 0: the elements that
/// share the gradient of max()/min()/amax() (PyTorch's evenly_distribute_backward).
struct SameValue {
  template <class T>
  CHORUS_HOST_DEVICE T operator()(T x, T v) const { return (x == v || (x != x && v != v)) ? T(1) : T(0); }
};

/// A strict total order on (value, index) pairs, shared by the CPU and CUDA selection kernels
/// so that both pick the same elements: larger (or smaller) values first, NaN first or last,
/// ties broken by the smaller index (so max/argmax return the first extremum, as PyTorch).
struct RankOrder {
  bool largest;    // larger values rank first
  bool nan_first;  // NaN ranks before every number (max/min propagate NaN; topk treats it as largest)
  template <class T>
  CHORUS_HOST_DEVICE bool before(T a, std::int64_t ia, T b, std::int64_t ib) const {
    const bool na = a != a, nb = b != b;
    if (na || nb) return na && nb ? ia < ib : na == nan_first;
    if (a != b) return largest ? a > b : a < b;
    return ia < ib;
  }
};

// ---- comparisons (the result is a 0/1 mask) ----
struct Eq {
  template <class T>
  CHORUS_HOST_DEVICE bool operator()(T a, T b) const { return a == b; }
};
struct Ne {
  template <class T>
  CHORUS_HOST_DEVICE bool operator()(T a, T b) const { return a != b; }
};
struct Lt {
  template <class T>
  CHORUS_HOST_DEVICE bool operator()(T a, T b) const { return a < b; }
};
struct Le {
  template <class T>
  CHORUS_HOST_DEVICE bool operator()(T a, T b) const { return a <= b; }
};
struct Gt {
  template <class T>
  CHORUS_HOST_DEVICE bool operator()(T a, T b) const { return a > b; }
};
struct Ge {
  template <class T>
  CHORUS_HOST_DEVICE bool operator()(T a, T b) const { return a >= b; }
};

// ---- dtype conversion ----
/// One element of a conversion to a 16-bit type or from one, as the CUDA kernel computes it
/// (the CPU's bfloat16/half constructors take the same route): through double where the other
/// side is double or an integer, else through float, so that each value rounds once. (Through
/// float, an int64 past 2^24 would round twice: 16842753 to 16777216 instead of 16908288.)
template <class U, class T>
CHORUS_HOST_DEVICE U convert_16bit(T v) {
  static_assert(is_reduced_floating_v<T> || is_reduced_floating_v<U>, "convert_16bit: one side is 16-bit");
  constexpr bool wide = std::is_same_v<T, double> || std::is_same_v<U, double> || std::is_integral_v<T> ||
                        std::is_integral_v<U>;
  using W = std::conditional_t<wide, double, float>;
  return static_cast<U>(static_cast<W>(v));
}

}  // namespace backend::fn
CHORUS_NAMESPACE_END
