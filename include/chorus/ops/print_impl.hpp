#pragma once
// The definitions of ops/print.hpp: compiled into chorus::compiled (src/ops/elementwise.cpp) for
// every dtype (all listed), included by print.hpp itself in the header-only form (Note
// [compiled chorus] in compiled.hpp).
#include <ostream>
#include <sstream>

#include "print.hpp"

CHORUS_NAMESPACE_BEGIN
namespace ops::detail {
template <class T>
void print_rec(std::ostream& os, const std::vector<T>& v, const Shape& s, int d, std::int64_t off, int indent) {
  if (s.size() == 0) {
    os << v[0];
    return;
  }
  os << '[';
  const std::int64_t n = s[d];
  std::int64_t inner = 1;
  for (int i = d + 1; i < s.size(); ++i) inner *= s[i];
  const bool summarise = n > 6 && numel_of(s) > 1000;
  for (std::int64_t i = 0; i < n; ++i) {
    if (summarise && i == 3) {
      os << (d + 1 == s.size() ? "..., " : "...,\n" + std::string(indent + 1, ' '));
      i = n - 3;
    }
    if (d + 1 == s.size()) {
      os << v[off + i];
    } else {
      print_rec(os, v, s, d + 1, off + i * inner, indent + 1);
    }
    if (i + 1 < n) os << (d + 1 == s.size() ? ", " : ",\n" + std::string(indent + 1, ' '));
  }
  os << ']';
}
}  // namespace ops::detail

// Declared and documented in print.hpp.
template <class T>
std::ostream& operator<<(std::ostream& os, const Tensor<T>& t) {
  if (!t.defined()) return os << "tensor(undefined)";
  std::ostringstream body;
  body.precision(4);
  if (t.numel() == 0) {
    body << "[]";  // not one "[]" per row: a [2^40, 0] tensor would take hours to print
  } else {
    ops::detail::print_rec(body, t.to_vector(), t.shape(), 0, 0, 7);
  }
  os << "tensor(" << body.str() << ", shape=" << t.shape() << ", dtype=" << dtype_name(t.dtype())
     << ", device=" << t.device();
  if (t.grad_fn()) os << ", grad_fn=" << t.grad_fn()->name();
  else if (t.requires_grad()) os << ", requires_grad=true";
  return os << ")";
}

CHORUS_NAMESPACE_END
