#pragma once
// AnyTensor: a Tensor of any supported element type, for registries that hold tensors of
// several dtypes (module parameters and buffers, optimizers, checkpoints).
#include <variant>

#include "tensor.hpp"

CHORUS_NAMESPACE_BEGIN

/// A Tensor handle of any supported element type (float, double, int64, bfloat16, half).
class AnyTensor {
 public:
  /// The typed tensors an AnyTensor can hold.
  using Variant = std::variant<Tensor<float>, Tensor<double>, Tensor<std::int64_t>, Tensor<bfloat16>, Tensor<half>>;

  AnyTensor() = default;
  /// Wraps `t` (implicit, so a Tensor<T> passes where an AnyTensor is taken).
  template <class T>
  AnyTensor(Tensor<T> t) : v_(std::move(t)) {}  // NOLINT: implicit on purpose

  /// The element type of the held tensor.
  DType dtype() const;
  /// True when the held tensor is a Tensor<T>.
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
  /// The typed tensor, mutable; throws when the dtype differs.
  template <class T>
  Tensor<T>& as() {
    auto* p = std::get_if<Tensor<T>>(&v_);
    CHORUS_CHECK(p != nullptr, "tensor has dtype ", dtype_name(dtype()), ", not ",
                 dtype_name(dtype_of<T>()));
    return *p;
  }

  /// Calls `f` with the held typed tensor (std::visit) and returns what it returns.
  ///@{
  template <class F>
  decltype(auto) visit(F&& f) const {
    return std::visit(std::forward<F>(f), v_);
  }
  template <class F>
  decltype(auto) visit(F&& f) {
    return std::visit(std::forward<F>(f), v_);
  }
  ///@}

  /// True when the held tensor is defined (false for a default-constructed AnyTensor).
  bool defined() const;
  /// The held tensor's shape.
  Shape shape() const;
  /// The held tensor's number of elements.
  std::int64_t numel() const;
  /// The device of the held tensor's storage.
  Device device() const;
  /// Whether the held tensor requires gradients (torch.Tensor.requires_grad).
  bool requires_grad() const;

  // The dtype-independent half of Tensor's interface, so that a loop over parameters()
  // reads as it does in PyTorch (`for (auto& p : model.parameters()) p.grad()`).
  /// The number of dimensions (torch.Tensor.dim).
  int dim() const;
  /// The size of dimension `d` (torch.Tensor.size(d)).
  std::int64_t size(std::int64_t d) const;
  /// True when the tensor was not produced by a recorded operation (torch.Tensor.is_leaf).
  bool is_leaf() const;
  /// Sets requires_grad on a leaf (see Tensor::requires_grad_). Returns *this.
  AnyTensor& requires_grad_(bool on = true);
  /// The accumulated gradient, of the same dtype (undefined before the first backward).
  AnyTensor grad() const;
  /// Replaces (or clears, with an undefined AnyTensor) the accumulated gradient.
  void set_grad(const AnyTensor& g) const;
  /// The size of the elements in bytes: numel() times the dtype's size.
  std::size_t nbytes() const { return static_cast<std::size_t>(numel()) * dtype_size(dtype()); }
  /// The address of the held tensor's impl: equal for handles to the same tensor (an identity key).
  const void* impl_key() const;

 private:
  Variant v_;
};

/// An uninitialised contiguous tensor of a runtime dtype.
CHORUS_INLINE AnyTensor empty_any(DType dtype, const Shape& shape, Device device);

CHORUS_NAMESPACE_END

// The definitions: compiled into chorus::compiled, or here in the header-only form (Note
// [compiled chorus] in compiled.hpp).
#if !CHORUS_COMPILED
#include "any_tensor_impl.hpp"
#endif
