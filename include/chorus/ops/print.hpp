#pragma once
// Printing tensors: values (summarised when large), shape and device.
#include <iosfwd>

#include "../compiled.hpp"
#include "view.hpp"

CHORUS_NAMESPACE_BEGIN
/// Prints like `tensor([[1, 2], [3, 4]], shape=[2, 2], device=cpu:0)`.
template <class T>
std::ostream& operator<<(std::ostream& os, const Tensor<T>& t);
CHORUS_NAMESPACE_END

// The instances chorus::compiled holds (Note [compiled chorus] in compiled.hpp).
#define CHORUS_OPS_PRINT_INSTANCES(X, T)                           \
  X(std::ostream& operator<< <T>(std::ostream&, const Tensor<T>&))
CHORUS_EXTERN_INSTANCES(CHORUS_OPS_PRINT_INSTANCES, CHORUS_ALL_DTYPES)

#if !CHORUS_COMPILED
#include "print_impl.hpp"
#endif
