#pragma once
// The definitions of core/any_tensor.hpp: compiled into chorus::compiled (src/core/core.cpp),
// included by any_tensor.hpp itself in the header-only form (Note [compiled chorus] in
// compiled.hpp).
#include "any_tensor.hpp"

CHORUS_NAMESPACE_BEGIN

CHORUS_INLINE DType AnyTensor::dtype() const {
  return std::visit([](const auto& t) { return std::decay_t<decltype(t)>::dtype(); }, v_);
}

CHORUS_INLINE bool AnyTensor::defined() const {
  return visit([](const auto& t) { return t.defined(); });
}

CHORUS_INLINE Shape AnyTensor::shape() const {
  return visit([](const auto& t) { return t.shape(); });
}

CHORUS_INLINE std::int64_t AnyTensor::numel() const {
  return visit([](const auto& t) { return t.numel(); });
}

CHORUS_INLINE Device AnyTensor::device() const {
  return visit([](const auto& t) { return t.device(); });
}

CHORUS_INLINE bool AnyTensor::requires_grad() const {
  return visit([](const auto& t) { return t.requires_grad(); });
}

CHORUS_INLINE int AnyTensor::dim() const {
  return visit([](const auto& t) { return t.dim(); });
}

CHORUS_INLINE bool AnyTensor::is_leaf() const {
  return visit([](const auto& t) { return t.is_leaf(); });
}

CHORUS_INLINE std::int64_t AnyTensor::size(std::int64_t d) const {
  return visit([&](const auto& t) { return t.size(d); });
}

CHORUS_INLINE AnyTensor& AnyTensor::requires_grad_(bool on) {
  visit([&](auto& t) { t.requires_grad_(on); });
  return *this;
}

CHORUS_INLINE AnyTensor AnyTensor::grad() const {
  return visit([](const auto& t) { return AnyTensor(t.grad()); });
}

CHORUS_INLINE const void* AnyTensor::impl_key() const {
  return visit([](const auto& t) -> const void* { return t.impl().get(); });
}

CHORUS_INLINE void AnyTensor::set_grad(const AnyTensor& g) const {
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

CHORUS_INLINE AnyTensor empty_any(DType dtype, const Shape& shape, Device device) {
  return visit_dtype(dtype, [&](auto tag) { return AnyTensor(Tensor<decltype(tag)>::empty(shape, device)); });
}

CHORUS_NAMESPACE_END
