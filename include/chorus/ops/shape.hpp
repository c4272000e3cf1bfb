#pragma once
// Reordering and broadcasting views (permute, movedim, transpose, expand) and the triangular
// parts of matrices (tril, triu). Views share the input's data, as in PyTorch.
#include <vector>

#include "../compiled.hpp"
#include "../backend/index.hpp"
#include "dims.hpp"
#include "view.hpp"

CHORUS_NAMESPACE_BEGIN
namespace ops::detail {

/// Backward of permute: the gradient viewed through the inverse permutation.
template <class T>
class PermuteBackward final : public autograd::Node<T> {
 public:
  explicit PermuteBackward(std::vector<int> perm) : perm_(std::move(perm)) {}
  std::string name() const override { return "PermuteBackward"; }
  typename autograd::Node<T>::TensorList apply(typename autograd::Node<T>::TensorList&& g) override {
    const auto& gs = g[0].shape();
    const auto& gst = g[0].strides();
    Shape s = gs;
    Strides st = gst;
    for (std::size_t i = 0; i < perm_.size(); ++i) {  // output dim i is input dim perm_[i]
      s[perm_[i]] = gs[static_cast<int>(i)];
      st[perm_[i]] = gst[static_cast<int>(i)];
    }
    return {make_view(g[0], s, st, g[0].storage_offset())};
  }

 private:
  std::vector<int> perm_;
};

/// Backward of expand: the gradient summed over the broadcast dimensions.
template <class T>
class ExpandBackward final : public autograd::Node<T> {
 public:
  explicit ExpandBackward(Shape in_shape) : in_(in_shape) {}
  std::string name() const override { return "ExpandBackward"; }
  typename autograd::Node<T>::TensorList apply(typename autograd::Node<T>::TensorList&& g) override {
    return {sum_to(g[0], in_)};
  }

 private:
  Shape in_;
};

/// Backward of tril/triu: the same triangle of the gradient.
template <class T>
class TriangleBackward final : public autograd::Node<T> {
 public:
  TriangleBackward(std::int64_t diagonal, bool lower) : diagonal_(diagonal), lower_(lower) {}
  std::string name() const override { return lower_ ? "TrilBackward" : "TriuBackward"; }
  typename autograd::Node<T>::TensorList apply(typename autograd::Node<T>::TensorList&& g) override;

 private:
  std::int64_t diagonal_;
  bool lower_;
};

/// The triangle kernel on contiguous x (not recorded).
template <class T>
Tensor<T> triangle_forward(const Tensor<T>& x, std::int64_t diagonal, bool lower) {
  auto xc = contiguous_data(x);
  auto out = Tensor<T>::empty(x.shape(), x.device());
  const int d = x.dim();
  const std::int64_t rows = x.shape()[d - 2], cols = x.shape()[d - 1];
  const std::int64_t batch = rows * cols == 0 ? 0 : x.numel() / (rows * cols);
  backend::triangle(xc, out, batch, rows, cols, diagonal, lower);
  return out;
}

template <class T>
typename autograd::Node<T>::TensorList TriangleBackward<T>::apply(typename autograd::Node<T>::TensorList&& g) {
  return {triangle_forward(g[0], diagonal_, lower_)};
}

template <class T>
Tensor<T> triangle(const char* op, const Tensor<T>& x, std::int64_t diagonal, bool lower) {
  check_defined(op, x);
  CHORUS_CHECK(x.dim() >= 2, op, ": input tensor must have at least 2 dimensions, got shape ", x.shape());
  auto out = triangle_forward(x, diagonal, lower);
  if constexpr (is_floating_v<T>) {
    if (autograd::needs_grad(x)) {
      auto node = autograd::make_node<TriangleBackward<T>, T>({&x}, diagonal, lower);
      autograd::set_history(out, std::shared_ptr<autograd::Node<T>>(node));
    }
  }
  return out;
}

}  // namespace ops::detail

/// The dimensions reordered: output dimension i is input dimension dims[i] (a view).
template <class T>
Tensor<T> permute(const Tensor<T>& x, const std::vector<std::int64_t>& dims) {
  ops::detail::check_defined("permute", x);
  CHORUS_CHECK(static_cast<int>(dims.size()) == x.dim(), "permute: number of dims in the permutation (",
               dims.size(), ") does not match the number of dimensions of the tensor (", x.dim(), ", shape ",
               x.shape(), ")");
  auto perm = ops::detail::wrap_distinct_dims(dims, x.dim(), "permute");
  Shape s = x.shape();
  Strides st = x.strides();
  for (std::size_t i = 0; i < perm.size(); ++i) {
    s[static_cast<int>(i)] = x.shape()[perm[i]];
    st[static_cast<int>(i)] = x.strides()[perm[i]];
  }
  auto out = ops::detail::make_view(x, s, st, x.storage_offset());
  if constexpr (is_floating_v<T>) {
    if (autograd::needs_grad(x)) {
      auto node = autograd::make_node<ops::detail::PermuteBackward<T>, T>({&x}, perm);
      autograd::set_history(out, std::shared_ptr<autograd::Node<T>>(node));
    }
  }
  return out;
}

/// Moves dimensions `source` to positions `destination`, the others keeping their order (a view).
template <class T>
Tensor<T> movedim(const Tensor<T>& x, const std::vector<std::int64_t>& source,
                  const std::vector<std::int64_t>& destination) {
  ops::detail::check_defined("movedim", x);
  CHORUS_CHECK(source.size() == destination.size(), "movedim: invalid source or destination dims: source (",
               source.size(), " dims) should contain the same number of dims as destination (", destination.size(),
               " dims)");
  const int n = x.dim();
  auto src = ops::detail::wrap_distinct_dims(source, n, "movedim");
  auto dst = ops::detail::wrap_distinct_dims(destination, n, "movedim");
  if (n == 0) return permute(x, {});  // a 0-dim tensor has nothing to move
  std::vector<std::int64_t> order(static_cast<std::size_t>(n), -1);
  std::vector<bool> used(static_cast<std::size_t>(n), false);
  for (std::size_t i = 0; i < src.size(); ++i) {
    order[static_cast<std::size_t>(dst[i])] = src[i];
    used[static_cast<std::size_t>(src[i])] = true;
  }
  int next = 0;
  for (auto& o : order) {
    if (o >= 0) continue;
    while (used[static_cast<std::size_t>(next)]) ++next;
    o = next++;
  }
  return permute(x, order);
}
/// Dimension `source` moved to position `destination`, the others keeping their order (a view; torch.movedim).
template <class T>
Tensor<T> movedim(const Tensor<T>& x, std::int64_t source, std::int64_t destination) {
  return movedim(x, std::vector<std::int64_t>{source}, std::vector<std::int64_t>{destination});
}

/// Dimensions d0 and d1 swapped (a view); the free-function spelling of Tensor::transpose.
template <class T>
Tensor<T> transpose(const Tensor<T>& x, std::int64_t d0, std::int64_t d1) {
  ops::detail::check_defined("transpose", x);
  return x.transpose(d0, d1);
}
/// transpose(x, d0, d1) under NumPy's name (torch.swapaxes).
template <class T>
Tensor<T> swapaxes(const Tensor<T>& x, std::int64_t d0, std::int64_t d1) {
  return transpose(x, d0, d1);
}
/// transpose(x, d0, d1) under another name (torch.swapdims).
template <class T>
Tensor<T> swapdims(const Tensor<T>& x, std::int64_t d0, std::int64_t d1) {
  return transpose(x, d0, d1);
}

/// A view of x broadcast to `sizes` (stride 0 on the broadcast dimensions), as torch.expand:
/// -1 keeps a size; new dimensions may be added in front (not as -1); only size-1 dimensions
/// grow. Writing into the result writes the shared elements.
template <class T>
Tensor<T> expand(const Tensor<T>& x, const Shape& sizes) {
  ops::detail::check_defined("expand", x);
  const int n = sizes.size(), lead = n - x.dim();
  CHORUS_CHECK(lead >= 0, "expand: the number of sizes provided (", n,
               ") must be greater or equal to the number of dimensions in the tensor (", x.dim(), ", shape ", x.shape(),
               ")");
  Shape s = Shape::filled(n, 0);
  Strides st = Strides::filled(n, 0);
  for (int i = 0; i < n; ++i) {
    const std::int64_t want = sizes[i];
    if (i < lead) {
      CHORUS_CHECK(want >= 0, "expand: the expanded size ", want,
                   " is not allowed in a leading, non-existing dimension ", i, " (sizes ", sizes, ")");
      s[i] = want;
      continue;
    }
    const std::int64_t have = x.shape()[i - lead];
    if (want == -1 || want == have) {
      s[i] = have;
      st[i] = x.strides()[i - lead];
      continue;
    }
    CHORUS_CHECK(have == 1 && want >= 0, "expand: the expanded size of the tensor (", want,
                 ") must match the existing size (", have, ") at non-singleton dimension ", i, ".  Target sizes: ",
                 sizes, ".  Tensor sizes: ", x.shape());
    s[i] = want;
  }
  (void)numel_of(s);  // checked (Note [checked sizes])
  auto out = ops::detail::make_view(x, s, st, x.storage_offset());
  if constexpr (is_floating_v<T>) {
    if (autograd::needs_grad(x)) {
      auto node = autograd::make_node<ops::detail::ExpandBackward<T>, T>({&x}, x.shape());
      autograd::set_history(out, std::shared_ptr<autograd::Node<T>>(node));
    }
  }
  return out;
}
/// A view of x expanded to `other`'s shape, as expand (torch.Tensor.expand_as).
template <class T, class U>
Tensor<T> expand_as(const Tensor<T>& x, const Tensor<U>& other) {
  return expand(x, other.shape());
}

/// The lower triangle of the last two dimensions (j - i <= diagonal), the rest zero.
template <class T>
Tensor<T> tril(const Tensor<T>& x, std::int64_t diagonal = 0) {
  return ops::detail::triangle("tril", x, diagonal, true);
}
/// The upper triangle of the last two dimensions (j - i >= diagonal), the rest zero.
template <class T>
Tensor<T> triu(const Tensor<T>& x, std::int64_t diagonal = 0) {
  return ops::detail::triangle("triu", x, diagonal, false);
}

template <class T>
Tensor<T> Tensor<T>::permute(const std::vector<std::int64_t>& dims) const {
  return chorus::permute(*this, dims);
}
template <class T>
Tensor<T> Tensor<T>::movedim(std::int64_t source, std::int64_t destination) const {
  return chorus::movedim(*this, source, destination);
}
template <class T>
Tensor<T> Tensor<T>::movedim(const std::vector<std::int64_t>& source,
                             const std::vector<std::int64_t>& destination) const {
  return chorus::movedim(*this, source, destination);
}
template <class T>
Tensor<T> Tensor<T>::expand(const Shape& sizes) const {
  return chorus::expand(*this, sizes);
}
template <class T>
Tensor<T> Tensor<T>::tril(std::int64_t diagonal) const {
  return chorus::tril(*this, diagonal);
}
template <class T>
Tensor<T> Tensor<T>::triu(std::int64_t diagonal) const {
  return chorus::triu(*this, diagonal);
}

CHORUS_NAMESPACE_END

// The instances chorus::compiled holds (Note [compiled chorus] in compiled.hpp).
#define CHORUS_OPS_SHAPE_INSTANCES(X, T)                                                                        \
  X(Tensor<T> permute<T>(const Tensor<T>&, const std::vector<std::int64_t>&))                                   \
  X(Tensor<T> movedim<T>(const Tensor<T>&, const std::vector<std::int64_t>&, const std::vector<std::int64_t>&)) \
  X(Tensor<T> movedim<T>(const Tensor<T>&, std::int64_t, std::int64_t))                                         \
  X(Tensor<T> transpose<T>(const Tensor<T>&, std::int64_t, std::int64_t))                                       \
  X(Tensor<T> swapaxes<T>(const Tensor<T>&, std::int64_t, std::int64_t))                                        \
  X(Tensor<T> swapdims<T>(const Tensor<T>&, std::int64_t, std::int64_t))                                        \
  X(Tensor<T> expand<T>(const Tensor<T>&, const Shape&))                                                        \
  X(Tensor<T> tril<T>(const Tensor<T>&, std::int64_t))                                                          \
  X(Tensor<T> triu<T>(const Tensor<T>&, std::int64_t))
CHORUS_EXTERN_INSTANCES(CHORUS_OPS_SHAPE_INSTANCES, CHORUS_ALL_DTYPES)
