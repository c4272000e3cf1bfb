#pragma once
// AnyTensor: a Tensor of any supported element type, for registries that hold tensors of
// several dtypes (module parameters and buffers, optimizers, checkpoints).
#include <variant>

#include "tensor.hpp"

CHORUS_NAMESPACE_BEGIN

class AnyTensor {
 public:
  using Variant = std::variant<Tensor<float>, Tensor<double>, Tensor<std::int64_t>, Tensor<bfloat16>, Tensor<half>>;

  AnyTensor() = default;
  template <class T>
  AnyTensor(Tensor<T> t) : v_(std::move(t)) {}  // NOLINT: implicit on purpose

  DType dtype() const {
    return std::visit([](const auto& t) { return std::decay_t<decltype(t)>::dtype(); }, v_);
  }
  template <class T>
  bool is() const {
    return std::holds_alternative<Tensor<T>>(v_);
  }
  /// The typed tensor; throws when the dtype differs.
  template <class T>
  const Tensor<T>& as() const {
    const auto* p = std::get_if<Tensor<T>>(&v_);
    CHORUS_CHECK(p != nullptr, "tensor has dtype ", dtype_name(dtype()), ", not ",
                 dtype_name(dtype_of<T>()));
    return *p;
  }
  template <class T>
  Tensor<T>& as() {
    auto* p = std::get_if<Tensor<T>>(&v_);
    CHORUS_CHECK(p != nullptr, "tensor has dtype ", dtype_name(dtype()), ", not ",
                 dtype_name(dtype_of<T>()));
    return *p;
  }

  template <class F>
  decltype(auto) visit(F&& f) const {
    return std::visit(std::forward<F>(f), v_);
  }
  template <class F>
  decltype(auto) visit(F&& f) {
    return std::visit(std::forward<F>(f), v_);
  }

  bool defined() const {
    return visit([](const auto& t) { return t.defined(); });
  }
  Shape shape() const {
    return visit([](const auto& t) { return t.shape(); });
  }
  std::int64_t numel() const {
    return visit([](const auto& t) { return t.numel(); });
  }
  Device device() const {
    return visit([](const auto& t) { return t.device(); });
  }
  bool requires_grad() const {
    return visit([](const auto& t) { return t.requires_grad(); });
  }

  // The dtype-independent half of Tensor's interface, so that a loop over parameters()
  // reads as it does in PyTorch (`for (auto& p : model.parameters()) p.grad()`).
  int dim() const {
    return visit([](const auto& t) { return t.dim(); });
  }
  std::int64_t size(std::int64_t d) const {
    return visit([&](const auto& t) { return t.size(d); });
  }
  bool is_leaf() const {
    return visit([](const auto& t) { return t.is_leaf(); });
  }
  /// Sets requires_grad on a leaf (see Tensor::requires_grad_). Returns *this.
  AnyTensor& requires_grad_(bool on = true) {
    visit([&](auto& t) { t.requires_grad_(on); });
    return *this;
  }
  /// The accumulated gradient, of the same dtype (undefined before the first backward).
  AnyTensor grad() const {
    return visit([](const auto& t) { return AnyTensor(t.grad()); });
  }
  /// Replaces (or clears, with an undefined AnyTensor) the accumulated gradient.
  void set_grad(const AnyTensor& g) const {
    visit([&](const auto& t) {
      using T = typename std::decay_t<decltype(t)>::value_type;
      if (!g.defined()) {
        t.set_grad(Tensor<T>());
        return;
      }
      CHORUS_CHECK(g.dtype() == dtype(), "set_grad: gradient has dtype ", dtype_name(g.dtype()),
                   ", the tensor has ", dtype_name(dtype()));
      t.set_grad(g.as<T>());
    });
  }
  std::size_t nbytes() const { return static_cast<std::size_t>(numel()) * dtype_size(dtype()); }
  const void* impl_key() const {
    return visit([](const auto& t) -> const void* { return t.impl().get(); });
  }

 private:
  Variant v_;
};

/// An uninitialised contiguous tensor of a runtime dtype.
inline AnyTensor empty_any(DType dtype, const Shape& shape, Device device) {
  return visit_dtype(dtype, [&](auto tag) { return AnyTensor(Tensor<decltype(tag)>::empty(shape, device)); });
}

CHORUS_NAMESPACE_END
