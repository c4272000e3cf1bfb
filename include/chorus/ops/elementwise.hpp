#pragma once
// Elementwise operations with NumPy broadcasting, and the activations.
#include <optional>

#include "../compiled.hpp"
#include "common.hpp"

CHORUS_NAMESPACE_BEGIN
namespace ops::detail {

template <class T, class Op>
Tensor<T> binary_forward(std::string_view name, const Tensor<T>& a, const Tensor<T>& b, Op op) {
  check_defined(name, a, "left operand");
  check_defined(name, b, "right operand");
  check_same_device(name, a, b);
  Shape out_shape = a.shape() == b.shape() ? a.shape() : broadcast_shapes(a.shape(), b.shape(), name.data());
  auto out = Tensor<T>::empty(out_shape, a.device());
  if (a.shape() == b.shape() && a.is_contiguous() && b.is_contiguous()) {
    backend::binary_same(a, b, out, op);
  } else {
    backend::binary_broadcast(a, broadcast_strides(a, out_shape), b, broadcast_strides(b, out_shape), out, op);
  }
  return out;
}

template <class T, class Op>
Tensor<T> unary_forward(const Tensor<T>& x, Op op) {
  auto xc = contiguous_data(x);
  auto out = Tensor<T>::empty(x.shape(), x.device());
  backend::unary(xc, out, op);
  return out;
}

/// grad_in = op(grad, saved) elementwise (saved: the forward input or output).
template <class T, class BwdOp>
class PointwiseBackward final : public autograd::Node<T> {
 public:
  PointwiseBackward(const char* name, Tensor<T> saved, BwdOp op) : name_(name), saved_(std::move(saved)), op_(op) {
    this->save_version(saved_);
  }
  std::string name() const override { return name_; }
  typename autograd::Node<T>::TensorList apply(typename autograd::Node<T>::TensorList&& g) override {
    auto out = Tensor<T>::empty(g[0].shape(), g[0].device());
    backend::binary_same(g[0], saved_, out, op_);
    return {out};
  }
  void release_saved() override { saved_ = Tensor<T>(); }

 private:
  const char* name_;
  Tensor<T> saved_;
  BwdOp op_;
};

/// grad_in = op(grad) elementwise (no saved tensor).
template <class T, class Op>
class ScaleBackward final : public autograd::Node<T> {
 public:
  ScaleBackward(const char* name, Op op) : name_(name), op_(op) {}
  std::string name() const override { return name_; }
  typename autograd::Node<T>::TensorList apply(typename autograd::Node<T>::TensorList&& g) override {
    auto out = Tensor<T>::empty(g[0].shape(), g[0].device());
    backend::unary(g[0], out, op_);
    return {out};
  }

 private:
  const char* name_;
  Op op_;
};

enum class BinaryKind { Add, Sub, Mul, Div };

template <class T>
class BinaryBackward final : public autograd::Node<T> {
 public:
  BinaryBackward(BinaryKind kind, const Tensor<T>& a, const Tensor<T>& b, bool save)
      : kind_(kind), a_shape_(a.shape()), b_shape_(b.shape()) {
    if (save) {
      a_ = this->save_version(a.detach());
      b_ = this->save_version(b.detach());
    }
  }
  std::string name() const override {
    switch (kind_) {
      case BinaryKind::Add: return "AddBackward";
      case BinaryKind::Sub: return "SubBackward";
      case BinaryKind::Mul: return "MulBackward";
      case BinaryKind::Div: return "DivBackward";
    }
    return "?";
  }
  typename autograd::Node<T>::TensorList apply(typename autograd::Node<T>::TensorList&& grads) override {
    const Tensor<T>& g = grads[0];
    const bool need_a = this->next_edges()[0].valid(), need_b = this->next_edges()[1].valid();
    Tensor<T> ga, gb;
    switch (kind_) {
      case BinaryKind::Add:
        if (need_a) ga = sum_to(g, a_shape_);
        if (need_b) gb = sum_to(g, b_shape_);
        break;
      case BinaryKind::Sub:
        if (need_a) ga = sum_to(g, a_shape_);
        if (need_b) gb = unary_forward(sum_to(g, b_shape_), backend::fn::Neg{});
        break;
      case BinaryKind::Mul:
        if (need_a) ga = sum_to(binary_forward("mul", g, b_, backend::fn::Mul{}), a_shape_);
        if (need_b) gb = sum_to(binary_forward("mul", g, a_, backend::fn::Mul{}), b_shape_);
        break;
      case BinaryKind::Div:
        if (need_a) ga = sum_to(binary_forward("div", g, b_, backend::fn::Div{}), a_shape_);
        if (need_b) {  // -g * a / b^2
          auto q = binary_forward("div", binary_forward("mul", g, a_, backend::fn::Mul{}),
                                  binary_forward("mul", b_, b_, backend::fn::Mul{}), backend::fn::Div{});
          gb = unary_forward(sum_to(q, b_shape_), backend::fn::Neg{});
        }
        break;
    }
    return {ga, gb};
  }
  void release_saved() override {
    a_ = Tensor<T>();
    b_ = Tensor<T>();
  }

 private:
  BinaryKind kind_;
  Shape a_shape_, b_shape_;
  Tensor<T> a_, b_;
};

template <class T, class Op>
Tensor<T> binary(BinaryKind kind, std::string_view name, const Tensor<T>& a, const Tensor<T>& b, Op op) {
  auto out = binary_forward(name, a, b, op);
  if (autograd::needs_grad(a, b)) {
    const bool save = kind == BinaryKind::Mul || kind == BinaryKind::Div;
    auto node = autograd::make_node<BinaryBackward<T>, T>({&a, &b}, kind, a, b, save);
    autograd::set_history(out, std::shared_ptr<autograd::Node<T>>(node));
  }
  return out;
}

/// Unary op whose backward is op_bwd(grad, saved), saved being the input or the output.
template <class T, class Op, class BwdOp>
Tensor<T> pointwise(const char* node_name, const Tensor<T>& x, Op op, BwdOp bwd, bool save_output) {
  check_defined(node_name, x);
  auto out = unary_forward(x, op);
  if (autograd::needs_grad(x)) {
    Tensor<T> saved = save_output ? out.detach() : contiguous_data(x).detach();
    auto node = autograd::make_node<PointwiseBackward<T, BwdOp>, T>({&x}, node_name, saved, bwd);
    autograd::set_history(out, std::shared_ptr<autograd::Node<T>>(node));
  }
  return out;
}

/// Unary op whose backward is scale(grad) (linear ops: neg, x*s, x+s).
template <class T, class Op, class BwdOp>
Tensor<T> linear_pointwise(const char* node_name, const Tensor<T>& x, Op op, BwdOp bwd) {
  check_defined(node_name, x);
  auto out = unary_forward(x, op);
  if (autograd::needs_grad(x)) {
    auto node = autograd::make_node<ScaleBackward<T, BwdOp>, T>({&x}, node_name, bwd);
    autograd::set_history(out, std::shared_ptr<autograd::Node<T>>(node));
  }
  return out;
}

}  // namespace ops::detail

// ---- binary, tensor ⊕ tensor (broadcasting) ----
/// a + b elementwise, broadcasting (torch.add).
template <class T>
Tensor<T> add(const Tensor<T>& a, const Tensor<T>& b) {
  return ops::detail::binary(ops::detail::BinaryKind::Add, "add", a, b, backend::fn::Add{});
}
/// a - b elementwise, broadcasting (torch.sub).
template <class T>
Tensor<T> sub(const Tensor<T>& a, const Tensor<T>& b) {
  return ops::detail::binary(ops::detail::BinaryKind::Sub, "sub", a, b, backend::fn::Sub{});
}
/// a * b elementwise, broadcasting (torch.mul).
template <class T>
Tensor<T> mul(const Tensor<T>& a, const Tensor<T>& b) {
  return ops::detail::binary(ops::detail::BinaryKind::Mul, "mul", a, b, backend::fn::Mul{});
}
/// a / b elementwise, broadcasting (torch.div; an int64 tensor divides as C++ does, truncating).
template <class T>
Tensor<T> div(const Tensor<T>& a, const Tensor<T>& b) {
  return ops::detail::binary(ops::detail::BinaryKind::Div, "div", a, b, backend::fn::Div{});
}

// ---- with a scalar ----
namespace ops::detail {
/// An integer tensor takes only whole scalars: PyTorch would promote `x * 0.5` to float (and
/// refuse `x *= 0.5`), which a Tensor<int64_t> cannot be, and truncating would be silently wrong.
template <class T>
void check_scalar_for(const char* op, double s) {
  if constexpr (!is_floating_v<T>)
    CHORUS_CHECK(std::isfinite(s) && s == std::trunc(s), op, ": an ", dtype_name(dtype_of<T>()),
                 " tensor and the scalar ", s, ", which is not a whole number (PyTorch would make the result "
                 "float): convert first, e.g. x.to<float>()");
}
}  // namespace ops::detail

/// a + s (torch.add); an int64 tensor takes only a whole `s`.
template <class T>
Tensor<T> add(const Tensor<T>& a, double s) {
  ops::detail::check_scalar_for<T>("add", s);
  return ops::detail::linear_pointwise("AddScalarBackward", a, backend::fn::AddScalar{s}, backend::fn::MulScalar{1.0});
}
/// a * s (torch.mul); an int64 tensor takes only a whole `s`.
template <class T>
Tensor<T> mul(const Tensor<T>& a, double s) {
  ops::detail::check_scalar_for<T>("mul", s);
  return ops::detail::linear_pointwise("MulScalarBackward", a, backend::fn::MulScalar{s}, backend::fn::MulScalar{s});
}
/// -a elementwise (torch.neg).
template <class T>
Tensor<T> neg(const Tensor<T>& a) {
  return ops::detail::linear_pointwise("NegBackward", a, backend::fn::Neg{}, backend::fn::Neg{});
}

// ---- unary ----
/// e^x elementwise (torch.exp).
template <class T>
Tensor<T> exp(const Tensor<T>& x) {
  return ops::detail::pointwise("ExpBackward", x, backend::fn::Exp{}, backend::fn::Mul{}, true);
}
/// Natural logarithm elementwise (torch.log).
template <class T>
Tensor<T> log(const Tensor<T>& x) {
  return ops::detail::pointwise("LogBackward", x, backend::fn::Log{}, backend::fn::LogBackward{}, false);
}
/// Square root elementwise (torch.sqrt).
template <class T>
Tensor<T> sqrt(const Tensor<T>& x) {
  return ops::detail::pointwise("SqrtBackward", x, backend::fn::Sqrt{}, backend::fn::SqrtBackward{}, true);
}
/// x^p elementwise for a scalar exponent `p` (torch.pow).
template <class T>
Tensor<T> pow(const Tensor<T>& x, double p) {
  return ops::detail::pointwise("PowBackward", x, backend::fn::PowScalar{p}, backend::fn::PowBackward{p}, false);
}
/// x^2 elementwise, as pow(x, 2) (torch.square).
template <class T>
Tensor<T> square(const Tensor<T>& x) {
  return pow(x, 2.0);
}
/// |x|; the gradient at 0 is 0 (sgn(0)), as in PyTorch.
template <class T>
Tensor<T> abs(const Tensor<T>& x) {
  return ops::detail::pointwise("AbsBackward", x, backend::fn::Abs{}, backend::fn::AbsBackward{}, false);
}
/// Sine elementwise (torch.sin).
template <class T>
Tensor<T> sin(const Tensor<T>& x) {
  return ops::detail::pointwise("SinBackward", x, backend::fn::Sin{}, backend::fn::SinBackward{}, false);
}
/// Cosine elementwise (torch.cos).
template <class T>
Tensor<T> cos(const Tensor<T>& x) {
  return ops::detail::pointwise("CosBackward", x, backend::fn::Cos{}, backend::fn::CosBackward{}, false);
}
/// min(max(x, min), max) with either bound optional (at least one given), as torch.clamp; the
/// gradient passes where min <= x <= max, the boundaries included.
template <class T>
Tensor<T> clamp(const Tensor<T>& x, std::optional<double> min, std::optional<double> max = std::nullopt) {
  CHORUS_CHECK(min || max, "clamp: at least one of 'min' or 'max' must be given");
  const backend::fn::Clamp f{min.value_or(0.0), max.value_or(0.0), min.has_value(), max.has_value()};
  const backend::fn::ClampBackward b{f.lo, f.hi, f.has_lo, f.has_hi};
  return ops::detail::pointwise("ClampBackward", x, f, b, false);
}
/// max(x, min) elementwise: clamp with only a lower bound (torch.clamp_min).
template <class T>
Tensor<T> clamp_min(const Tensor<T>& x, double min) {
  return clamp(x, min, std::nullopt);
}
/// min(x, max) elementwise: clamp with only an upper bound (torch.clamp_max).
template <class T>
Tensor<T> clamp_max(const Tensor<T>& x, double max) {
  return clamp(x, std::nullopt, max);
}
/// max(x, 0) elementwise (torch.relu).
template <class T>
Tensor<T> relu(const Tensor<T>& x) {
  return ops::detail::pointwise("ReluBackward", x, backend::fn::Relu{}, backend::fn::ReluBackward{}, true);
}
/// x · Φ(x) elementwise, the exact (erf) form (torch.nn.functional.gelu).
template <class T>
Tensor<T> gelu(const Tensor<T>& x) {
  return ops::detail::pointwise("GeluBackward", x, backend::fn::Gelu{}, backend::fn::GeluBackward{}, false);
}
/// Hyperbolic tangent elementwise (torch.tanh).
template <class T>
Tensor<T> tanh(const Tensor<T>& x) {
  return ops::detail::pointwise("TanhBackward", x, backend::fn::Tanh{}, backend::fn::TanhBackward{}, true);
}
/// 1 / (1 + e^-x) elementwise (torch.sigmoid).
template <class T>
Tensor<T> sigmoid(const Tensor<T>& x) {
  return ops::detail::pointwise("SigmoidBackward", x, backend::fn::Sigmoid{}, backend::fn::SigmoidBackward{}, true);
}

// The method forms (core/tensor.hpp), qualified: inside Tensor's scope the members hide the
// free functions.
template <class T>
Tensor<T> Tensor<T>::neg() const { return ::chorus::neg(*this); }
template <class T>
Tensor<T> Tensor<T>::abs() const { return ::chorus::abs(*this); }
template <class T>
Tensor<T> Tensor<T>::exp() const { return ::chorus::exp(*this); }
template <class T>
Tensor<T> Tensor<T>::log() const { return ::chorus::log(*this); }
template <class T>
Tensor<T> Tensor<T>::sqrt() const { return ::chorus::sqrt(*this); }
template <class T>
Tensor<T> Tensor<T>::square() const { return ::chorus::square(*this); }
template <class T>
Tensor<T> Tensor<T>::pow(double exponent) const { return ::chorus::pow(*this, exponent); }
template <class T>
Tensor<T> Tensor<T>::sin() const { return ::chorus::sin(*this); }
template <class T>
Tensor<T> Tensor<T>::cos() const { return ::chorus::cos(*this); }
template <class T>
Tensor<T> Tensor<T>::tanh() const { return ::chorus::tanh(*this); }
template <class T>
Tensor<T> Tensor<T>::sigmoid() const { return ::chorus::sigmoid(*this); }
template <class T>
Tensor<T> Tensor<T>::relu() const { return ::chorus::relu(*this); }
template <class T>
Tensor<T> Tensor<T>::gelu() const { return ::chorus::gelu(*this); }
template <class T>
Tensor<T> Tensor<T>::clamp(std::optional<double> min, std::optional<double> max) const {
  return ::chorus::clamp(*this, min, max);
}
template <class T>
Tensor<T> Tensor<T>::clamp_min(double min) const { return ::chorus::clamp_min(*this, min); }
template <class T>
Tensor<T> Tensor<T>::clamp_max(double max) const { return ::chorus::clamp_max(*this, max); }

// dropout lives in ops/dropout.hpp (Note [dropout random numbers]).

// ---- operators ----
/// `a + b`, `a - b`, `a * b`, `a / b` (add, sub, mul, div, broadcasting) and `-a` (neg).
///@{
template <class T>
Tensor<T> operator+(const Tensor<T>& a, const Tensor<T>& b) { return add(a, b); }
template <class T>
Tensor<T> operator-(const Tensor<T>& a, const Tensor<T>& b) { return sub(a, b); }
template <class T>
Tensor<T> operator*(const Tensor<T>& a, const Tensor<T>& b) { return mul(a, b); }
template <class T>
Tensor<T> operator/(const Tensor<T>& a, const Tensor<T>& b) { return div(a, b); }
template <class T>
Tensor<T> operator-(const Tensor<T>& a) { return neg(a); }
///@}
/// Arithmetic with a scalar on either side, through add, mul, neg and pow (`a / s` is `a * (1 / s)`).
///@{
template <class T>
Tensor<T> operator+(const Tensor<T>& a, double s) { return add(a, s); }
template <class T>
Tensor<T> operator+(double s, const Tensor<T>& a) { return add(a, s); }
template <class T>
Tensor<T> operator-(const Tensor<T>& a, double s) { return add(a, -s); }
template <class T>
Tensor<T> operator-(double s, const Tensor<T>& a) { return add(neg(a), s); }
template <class T>
Tensor<T> operator*(const Tensor<T>& a, double s) { return mul(a, s); }
template <class T>
Tensor<T> operator*(double s, const Tensor<T>& a) { return mul(a, s); }
template <class T>
Tensor<T> operator/(const Tensor<T>& a, double s) { return mul(a, 1.0 / s); }
template <class T>
Tensor<T> operator/(double s, const Tensor<T>& a) { return mul(pow(a, -1.0), s); }
///@}

CHORUS_NAMESPACE_END

// The instances chorus::compiled holds (Note [compiled chorus] in compiled.hpp).
#define CHORUS_OPS_ELEMENTWISE_INSTANCES(X, T)                                          \
  X(Tensor<T> add<T>(const Tensor<T>&, const Tensor<T>&))                               \
  X(Tensor<T> sub<T>(const Tensor<T>&, const Tensor<T>&))                               \
  X(Tensor<T> mul<T>(const Tensor<T>&, const Tensor<T>&))                               \
  X(Tensor<T> div<T>(const Tensor<T>&, const Tensor<T>&))                               \
  X(Tensor<T> add<T>(const Tensor<T>&, double))                                         \
  X(Tensor<T> mul<T>(const Tensor<T>&, double))                                         \
  X(Tensor<T> neg<T>(const Tensor<T>&))                                                 \
  X(Tensor<T> exp<T>(const Tensor<T>&))                                                 \
  X(Tensor<T> log<T>(const Tensor<T>&))                                                 \
  X(Tensor<T> sqrt<T>(const Tensor<T>&))                                                \
  X(Tensor<T> pow<T>(const Tensor<T>&, double))                                         \
  X(Tensor<T> square<T>(const Tensor<T>&))                                              \
  X(Tensor<T> abs<T>(const Tensor<T>&))                                                 \
  X(Tensor<T> sin<T>(const Tensor<T>&))                                                 \
  X(Tensor<T> cos<T>(const Tensor<T>&))                                                 \
  X(Tensor<T> clamp<T>(const Tensor<T>&, std::optional<double>, std::optional<double>)) \
  X(Tensor<T> clamp_min<T>(const Tensor<T>&, double))                                   \
  X(Tensor<T> clamp_max<T>(const Tensor<T>&, double))                                   \
  X(Tensor<T> relu<T>(const Tensor<T>&))                                                \
  X(Tensor<T> gelu<T>(const Tensor<T>&))                                                \
  X(Tensor<T> tanh<T>(const Tensor<T>&))                                                \
  X(Tensor<T> sigmoid<T>(const Tensor<T>&))                                             \
  X(Tensor<T> operator+<T>(const Tensor<T>&, const Tensor<T>&))                         \
  X(Tensor<T> operator-<T>(const Tensor<T>&, const Tensor<T>&))                         \
  X(Tensor<T> operator*<T>(const Tensor<T>&, const Tensor<T>&))                         \
  X(Tensor<T> operator/<T>(const Tensor<T>&, const Tensor<T>&))                         \
  X(Tensor<T> operator-<T>(const Tensor<T>&))                                           \
  X(Tensor<T> operator+<T>(const Tensor<T>&, double))                                   \
  X(Tensor<T> operator+<T>(double, const Tensor<T>&))                                   \
  X(Tensor<T> operator-<T>(const Tensor<T>&, double))                                   \
  X(Tensor<T> operator-<T>(double, const Tensor<T>&))                                   \
  X(Tensor<T> operator*<T>(const Tensor<T>&, double))                                   \
  X(Tensor<T> operator*<T>(double, const Tensor<T>&))                                   \
  X(Tensor<T> operator/<T>(const Tensor<T>&, double))                                   \
  X(Tensor<T> operator/<T>(double, const Tensor<T>&))
CHORUS_EXTERN_INSTANCES(CHORUS_OPS_ELEMENTWISE_INSTANCES, CHORUS_ALL_DTYPES)
