#pragma once
// Dimension arguments of the operators: one dim or a list of them, negative counted from the
// end, checked with an error that names the operator.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "../core/shape.hpp"

CHORUS_NAMESPACE_BEGIN
namespace ops::detail {

/// `dim` wrapped into [0, ndim) (a 0-dim tensor takes 0 and -1, as PyTorch's reductions do).
inline int wrap_op_dim(std::int64_t dim, int ndim, const char* op) {
  const std::int64_t n = std::max(ndim, 1);
  CHORUS_CHECK(dim >= -n && dim < n, op, ": dim ", dim, " is out of range for a tensor with ", ndim,
               " dimension(s) (expected to be in [", -n, ", ", n - 1, "])");
  return static_cast<int>(dim < 0 ? dim + n : dim);
}

/// A list of distinct dimensions, wrapped, in the order given.
inline std::vector<int> wrap_distinct_dims(const std::vector<std::int64_t>& dims, int ndim, const char* op) {
  std::vector<int> out;
  std::vector<bool> seen(static_cast<std::size_t>(std::max(ndim, 1)), false);
  for (auto d : dims) {
    const int w = wrap_op_dim(d, ndim, op);
    CHORUS_CHECK(!seen[static_cast<std::size_t>(w)], op, ": dim ", d, " appears multiple times in the list of dims");
    seen[static_cast<std::size_t>(w)] = true;
    out.push_back(w);
  }
  return out;
}

/// The dimensions a reduction over `dims` covers, sorted: all of them for an empty list (as
/// PyTorch's dim=None); none for a 0-dim tensor (whose dims 0 and -1 name its one element).
inline std::vector<int> reduction_dims(const std::vector<std::int64_t>& dims, int ndim, const char* op) {
  std::vector<int> out;
  if (dims.empty()) {
    for (int i = 0; i < ndim; ++i) out.push_back(i);
    return out;
  }
  out = wrap_distinct_dims(dims, ndim, op);
  if (ndim == 0) return {};
  std::sort(out.begin(), out.end());
  return out;
}

/// `shape` without the reduced dimensions (keepdim = false) or with them as 1 (keepdim).
inline Shape reduced_shape(const Shape& shape, const std::vector<int>& dims, bool keepdim) {
  Shape s;
  for (int i = 0; i < shape.size(); ++i) {
    const bool reduced = std::find(dims.begin(), dims.end(), i) != dims.end();
    if (!reduced) s.push_back(shape[i]);
    else if (keepdim) s.push_back(1);
  }
  return s;
}

}  // namespace ops::detail
CHORUS_NAMESPACE_END
