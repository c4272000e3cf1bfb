#pragma once
// Element functors shared by the CPU loops and the CUDA kernels (host/device callable).
#include <cmath>

#include "../config.hpp"

CHORUS_NAMESPACE_BEGIN
namespace backend::fn {

// Unqualified calls resolve to the float overloads on the host (std::) and the CUDA math
// library's overloads on the device.
using std::erf;
using std::exp;
using std::log;
using std::pow;
using std::sqrt;
using std::tanh;

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
struct PowScalar {
  double p;
  template <class T>
  CHORUS_HOST_DEVICE T operator()(T x) const {
    return p == 2.0 ? x * x : pow(x, T(p));
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

}  // namespace backend::fn
CHORUS_NAMESPACE_END
