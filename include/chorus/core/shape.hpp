#pragma once
// Shape: the sizes of a tensor, printed as `[30, 5]`. A fixed-capacity array (no heap
// allocation per tensor); tensors have at most Shape::kMaxDims dimensions.
#include <algorithm>
#include <array>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <ostream>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "../error.hpp"

CHORUS_NAMESPACE_BEGIN

/// A small fixed-capacity vector of int64 used for sizes and strides.
class Dims {
 public:
  static constexpr int kMaxDims = 8;  ///< the capacity: the most dimensions a tensor has

  constexpr Dims() = default;
  /// The given values, in order; throws when there are more than kMaxDims.
  ///@{
  Dims(std::initializer_list<std::int64_t> il) { assign(il.begin(), il.end()); }
  explicit Dims(std::span<const std::int64_t> s) { assign(s.begin(), s.end()); }
  explicit Dims(const std::vector<std::int64_t>& v) { assign(v.begin(), v.end()); }
  ///@}

  /// `n` copies of `value`.
  static Dims filled(int n, std::int64_t value) {
    Dims d;
    d.resize(n);
    for (int i = 0; i < n; ++i) d.v_[i] = value;
    return d;
  }

  /// The number of values (a shape's number of dimensions).
  int size() const { return n_; }
  /// True when there are no values (a 0-dim shape).
  bool empty() const { return n_ == 0; }
  /// Value `i`, for `i` in [0, size()) (unchecked).
  ///@{
  std::int64_t operator[](int i) const { return v_[i]; }
  std::int64_t& operator[](int i) { return v_[i]; }
  ///@}
  /// Pointers to the first value and one past the last, for range-for and algorithms.
  ///@{
  const std::int64_t* begin() const { return v_.data(); }
  const std::int64_t* end() const { return v_.data() + n_; }
  std::int64_t* begin() { return v_.data(); }
  std::int64_t* end() { return v_.data() + n_; }
  ///@}
  /// Pointer to the first value.
  const std::int64_t* data() const { return v_.data(); }
  /// The last value (the container must not be empty).
  std::int64_t back() const { return v_[n_ - 1]; }

  /// Sets the number of values to `n`, new ones 0; throws when `n` is outside [0, kMaxDims].
  void resize(int n) {
    CHORUS_CHECK(n >= 0 && n <= kMaxDims, "tensors have at most ", kMaxDims, " dimensions, got ", n);
    for (int i = n_; i < n; ++i) v_[i] = 0;
    n_ = n;
  }
  /// Appends `x`; throws when full.
  void push_back(std::int64_t x) {
    resize(n_ + 1);
    v_[n_ - 1] = x;
  }
  /// Inserts `x` before position `pos` (unchecked, in [0, size()]); throws when full.
  void insert(int pos, std::int64_t x) {
    resize(n_ + 1);
    for (int i = n_ - 1; i > pos; --i) v_[i] = v_[i - 1];
    v_[pos] = x;
  }
  /// Removes the value at `pos`; throws when `pos` is out of range.
  void erase(int pos) {
    CHORUS_CHECK(pos >= 0 && pos < n_, "dimension ", pos, " is out of range for ", n_, " dimension(s)");
    for (int i = pos; i + 1 < n_; ++i) v_[i] = v_[i + 1];
    --n_;
  }
  /// The values as a std::vector.
  std::vector<std::int64_t> vec() const { return {begin(), end()}; }

  friend bool operator==(const Dims& a, const Dims& b) {
    return a.n_ == b.n_ && std::equal(a.begin(), a.end(), b.begin());
  }

  /// The values as `[30, 5]` (`[]` when empty).
  std::string str() const {
    std::string s = "[";
    for (int i = 0; i < n_; ++i) {
      if (i) s += ", ";
      s += std::to_string(v_[i]);
    }
    return s + "]";
  }
  friend std::ostream& operator<<(std::ostream& os, const Dims& d) { return os << d.str(); }

 private:
  template <class It>
  void assign(It b, It e) {
    resize(static_cast<int>(e - b));
    std::copy(b, e, v_.begin());
  }
  std::array<std::int64_t, kMaxDims> v_{};
  int n_ = 0;
};

/// A tensor's sizes, one per dimension (torch.Size).
using Shape = Dims;
/// A tensor's strides in elements, one per dimension.
using Strides = Dims;

/// Product of the sizes (1 for a 0-dim shape). Throws when a size is negative or the product
/// does not fit in int64 (see Note [checked sizes]).
///
/// Note [checked sizes]
/// Every element count, stride and byte count is computed with overflow checks: a wrapped
/// product (`{1<<32, 1<<32}` gives 0) would allocate too little and every kernel would then
/// read and write out of bounds. A shape holding a 0 has no elements however large the other
/// sizes are, as in PyTorch, but a tensor's shape must also keep the product of max(size, 1)
/// within int64 (contiguous_strides checks it): then every partial product of its sizes
/// (outer/inner extents, strides, row counts) fits, and kernels need no checks of their own.
inline std::int64_t numel_of(const Shape& s) {
  std::int64_t n = 1;
  bool overflow = false, zero = false;
  for (auto x : s) {
    CHORUS_CHECK(x >= 0, "negative size ", x, " in shape ", s);
    zero |= x == 0;
    overflow |= __builtin_mul_overflow(n, x, &n);
  }
  if (zero) return 0;
  if (overflow) [[unlikely]]
    CHORUS_FAIL("shape ", s, " has more elements than an int64 can count");
  return n;
}

/// Bytes of `numel` elements of `elem_size` bytes each; throws when they exceed what a
/// pointer difference can address (so `p + nbytes` and every element offset are defined).
inline std::size_t checked_nbytes(std::int64_t numel, std::size_t elem_size, const Shape& shape) {
  constexpr auto kMax = static_cast<std::uint64_t>(PTRDIFF_MAX);
  CHORUS_CHECK(numel >= 0 && static_cast<std::uint64_t>(numel) <= kMax / elem_size, "shape ", shape, " of ",
               numel, " elements of ", elem_size, " bytes needs more bytes than the address space holds");
  return static_cast<std::size_t>(numel) * elem_size;
}

/// Row-major (contiguous) strides of a shape (checked: Note [checked sizes]).
inline Strides contiguous_strides(const Shape& s) {
  Strides st = Strides::filled(s.size(), 1);
  std::int64_t acc = 1;
  for (int i = s.size() - 1; i >= 0; --i) {
    st[i] = acc;
    if (__builtin_mul_overflow(acc, std::max<std::int64_t>(s[i], 1), &acc)) [[unlikely]]
      CHORUS_FAIL("shape ", s, " has strides an int64 cannot hold");
  }
  return st;
}

/// A size per spatial dimension (kernel, stride, padding, dilation, output size), given as
/// one value for every dimension or as exactly N values: PyTorch's `int or tuple` arguments,
/// LibTorch's ExpandingArray. `Pair` (= ExpandingArray<2>) is what the 2-D layers take.
///
/// Note [expanding arrays]
/// This is a class with constructors, not std::array, on purpose. With
/// `using Pair = std::array<int64_t, 2>`, `Conv2dOptions{.padding = 1}` compiled without a
/// warning and meant padding (1, 0) (aggregate initialisation fills the rest with zeros), so a
/// 16x16 input came out 16x14. Here a scalar means (k, k) as in PyTorch, braces take exactly N
/// values, and nothing else compiles: no default (half-filled or zero) value, no other count,
/// no floating-point or bool value (constructors take integral types only, so 1.5 is not
/// truncated to 1). Values are validated where they are used (a kernel must be positive, …).
template <int N>
class ExpandingArray {
  static_assert(N >= 1, "ExpandingArray needs at least one dimension");
  template <class I>
  static constexpr bool is_size_v = std::is_integral_v<I> && !std::is_same_v<I, bool>;

 public:
  /// k in every dimension.
  template <class I>
    requires is_size_v<I>
  constexpr ExpandingArray(I k) {  // NOLINT: implicit, so that `.padding = 1` means (1, 1)
    v_.fill(static_cast<std::int64_t>(k));
  }
  /// Exactly N values, one per dimension.
  template <class... Is>
    requires(N > 1 && sizeof...(Is) == N && (is_size_v<Is> && ...))
  constexpr ExpandingArray(Is... values) : v_{static_cast<std::int64_t>(values)...} {}
  /// The N values of an array (implicit).
  constexpr ExpandingArray(const std::array<std::int64_t, N>& values) : v_(values) {}  // NOLINT

  /// N, the number of dimensions.
  static constexpr int size() { return N; }
  /// The value for dimension `i` (unchecked).
  constexpr std::int64_t operator[](int i) const { return v_[i]; }
  /// All N values.
  constexpr const std::array<std::int64_t, N>& values() const { return v_; }
  friend constexpr bool operator==(const ExpandingArray&, const ExpandingArray&) = default;

  /// `[a, b]`, as shapes print.
  std::string str() const {
    std::string s = "[";
    for (int i = 0; i < N; ++i) s += (i ? ", " : "") + std::to_string(v_[i]);
    return s + "]";
  }
  friend std::ostream& operator<<(std::ostream& os, const ExpandingArray& a) { return os << a.str(); }

 private:
  std::array<std::int64_t, N> v_;
};

/// A size for each of two spatial dimensions (height, width), as the 2-D layers take.
using Pair = ExpandingArray<2>;

/// Wraps a possibly negative dimension index into [0, ndim); throws when out of range. A 0-dim
/// tensor accepts dim 0 and -1 (as PyTorch's reductions and squeeze do), so callers that go on
/// to index the shape must use wrap_dim_of_shape (or check ndim > 0) instead.
inline int wrap_dim(std::int64_t dim, int ndim, const char* what = "dim") {
  std::int64_t n = std::max(ndim, 1);
  CHORUS_CHECK(dim >= -n && dim < n, what, " ", dim, " is out of range for a tensor with ", ndim,
               " dimension(s)");
  return static_cast<int>(dim < 0 ? dim + n : dim);
}

/// Wraps a dimension index that will index the shape: a 0-dim tensor has no dimension to
/// index, so any dim is refused for it (as PyTorch's size(0) on a scalar is).
inline int wrap_dim_of_shape(std::int64_t dim, int ndim, const char* op) {
  CHORUS_CHECK(ndim > 0, op, ": dimension ", dim, " specified, but the tensor is 0-dim (has no dimensions)");
  CHORUS_CHECK(dim >= -ndim && dim < ndim, op, ": dimension ", dim, " is out of range for a tensor with ", ndim,
               " dimension(s) (expected to be in [", -ndim, ", ", ndim - 1, "])");
  return static_cast<int>(dim < 0 ? dim + ndim : dim);
}

/// NumPy broadcasting of two shapes; the error names both shapes.
inline Shape broadcast_shapes(const Shape& a, const Shape& b, const char* op = "broadcast") {
  int n = std::max(a.size(), b.size());
  Shape out = Shape::filled(n, 1);
  for (int i = 0; i < n; ++i) {
    int ia = a.size() - n + i, ib = b.size() - n + i;
    std::int64_t da = ia >= 0 ? a[ia] : 1, db = ib >= 0 ? b[ib] : 1;
    CHORUS_CHECK(da == db || da == 1 || db == 1, op, ": shapes ", a, " and ", b,
                 " cannot be broadcast together (dimension ", i, ": ", da, " vs ", db, ")");
    out[i] = da == 1 ? db : da;
  }
  return out;
}

CHORUS_NAMESPACE_END
