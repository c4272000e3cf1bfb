#pragma once
// Views (narrow/slice/select/reshape/transpose…), copies between devices and dtypes, and
// the joining and selecting of tensors (cat, stack, chunk, index_select).
#include <numeric>

#include "../compiled.hpp"
#include "common.hpp"
#include "dims.hpp"

CHORUS_NAMESPACE_BEGIN
namespace ops::detail {

template <class T>
Tensor<T> make_view(const Tensor<T>& base, const Shape& shape, const Strides& strides, std::int64_t offset) {
  auto impl = std::make_shared<TensorImpl<T>>();
  impl->storage = base.impl()->storage;
  impl->offset = offset;
  impl->shape = shape;
  impl->strides = strides;
  return Tensor<T>(std::move(impl));
}

/// Backward of narrow/select: the gradient lands in a zero tensor of the input's shape.
template <class T>
class NarrowBackward final : public autograd::Node<T> {
 public:
  NarrowBackward(Shape in_shape, int dim, std::int64_t start, std::int64_t length, bool squeezed)
      : in_(in_shape), dim_(dim), start_(start), length_(length), squeezed_(squeezed) {}
  std::string name() const override { return squeezed_ ? "SelectBackward" : "NarrowBackward"; }
  typename autograd::Node<T>::TensorList apply(typename autograd::Node<T>::TensorList&& g) override {
    auto out = zeros<T>(in_, g[0].device());
    Shape vs = in_;
    vs[dim_] = length_;
    const auto& st = out.strides();
    auto dst = make_view(out, vs, st, start_ * st[dim_]);
    backend::copy(dst, squeezed_ ? view_as_shape(g[0], vs) : g[0]);
    return {out};
  }

 private:
  Shape in_;
  int dim_;
  std::int64_t start_, length_;
  bool squeezed_;
};

/// Backward of reshape-like views: the gradient is reshaped back.
template <class T>
class ReshapeBackward final : public autograd::Node<T> {
 public:
  explicit ReshapeBackward(Shape in_shape) : in_(in_shape) {}
  std::string name() const override { return "ReshapeBackward"; }
  typename autograd::Node<T>::TensorList apply(typename autograd::Node<T>::TensorList&& g) override {
    return {view_as_shape(g[0], in_)};  // the engine hands nodes contiguous gradients
  }

 private:
  Shape in_;
};

template <class T>
class TransposeBackward final : public autograd::Node<T> {
 public:
  TransposeBackward(int d0, int d1) : d0_(d0), d1_(d1) {}
  std::string name() const override { return "TransposeBackward"; }
  typename autograd::Node<T>::TensorList apply(typename autograd::Node<T>::TensorList&& g) override {
    Shape s = g[0].shape();
    Strides st = g[0].strides();
    std::swap(s[d0_], s[d1_]);
    std::swap(st[d0_], st[d1_]);
    return {make_view(g[0], s, st, g[0].storage_offset())};
  }

 private:
  int d0_, d1_;
};

template <class T>
class ToDeviceBackward final : public autograd::Node<T> {
 public:
  explicit ToDeviceBackward(Device src) : src_(src) {}
  std::string name() const override { return "ToDeviceBackward"; }
  typename autograd::Node<T>::TensorList apply(typename autograd::Node<T>::TensorList&& g) override {
    auto out = Tensor<T>::empty(g[0].shape(), src_);
    backend::copy(out, g[0]);
    return {out};
  }

 private:
  Device src_;
};

/// The gradient of x.to<To>() for a From tensor x: converted back to From, each value rounded
/// once (a node between two dtypes: Note [one graph over every dtype]).
template <class From, class To>
class ConvertBackward final : public autograd::Node<To> {
 public:
  std::string name() const override { return "ToCopyBackward"; }
  typename autograd::Node<To>::TensorList apply(typename autograd::Node<To>::TensorList&& g) override {
    return {std::move(g[0])};  // the incoming gradient, which apply_any converts
  }
  std::vector<AnyTensor> apply_any(std::vector<std::vector<AnyTensor>>&& arrived) override {
    auto g = apply(autograd::detail::gradients_in<To>(*this, std::move(arrived)));
    auto out = Tensor<From>::empty(g[0].shape(), g[0].device());
    backend::convert(out, g[0]);
    return {AnyTensor(std::move(out))};
  }
};

template <class T>
class IndexSelectBackward final : public autograd::Node<T> {
 public:
  IndexSelectBackward(Shape in_shape, int dim, Tensor<std::int64_t> index)
      : in_(in_shape), dim_(dim), index_(std::move(index)) {
    this->save_version(index_);
  }
  std::string name() const override { return "IndexSelectBackward"; }
  typename autograd::Node<T>::TensorList apply(typename autograd::Node<T>::TensorList&& g) override {
    auto out = zeros<T>(in_, g[0].device());
    std::int64_t outer, n, inner;
    split_around(in_, dim_, outer, n, inner);
    backend::index_add(g[0], outer, n, inner, index_, out);
    return {out};
  }
  void release_saved() override { index_ = Tensor<std::int64_t>(); }

 private:
  Shape in_;
  int dim_;
  Tensor<std::int64_t> index_;
};

template <class T>
class CatBackward final : public autograd::Node<T> {
 public:
  CatBackward(int dim, std::vector<std::int64_t> sizes) : dim_(dim), sizes_(std::move(sizes)) {}
  std::string name() const override { return "CatBackward"; }
  typename autograd::Node<T>::TensorList apply(typename autograd::Node<T>::TensorList&& g) override {
    typename autograd::Node<T>::TensorList out;
    std::int64_t start = 0;
    for (std::size_t i = 0; i < sizes_.size(); ++i) {
      if (this->next_edges()[i].valid()) {
        Shape s = g[0].shape();
        s[dim_] = sizes_[i];
        out.push_back(make_view(g[0], s, g[0].strides(), g[0].storage_offset() + start * g[0].strides()[dim_]));
      } else {
        out.emplace_back();
      }
      start += sizes_[i];
    }
    return out;
  }

 private:
  int dim_;
  std::vector<std::int64_t> sizes_;
};

/// Infers one -1 entry of a requested shape; checks the element count.
inline Shape infer_shape(const Shape& want, std::int64_t numel, const Shape& from) {
  Shape s = want;
  int infer = -1;
  std::int64_t known = 1;
  for (int i = 0; i < s.size(); ++i) {
    if (s[i] == -1) {
      CHORUS_CHECK(infer < 0, "reshape: only one dimension can be -1 in ", want);
      infer = i;
    } else {
      CHORUS_CHECK(s[i] >= 0, "reshape: invalid size ", s[i], " in ", want);
      CHORUS_CHECK(!__builtin_mul_overflow(known, s[i], &known), "reshape: shape ", want,
                   " is invalid for a tensor of shape ", from, " (", numel, " elements)");
    }
  }
  if (infer >= 0) {
    CHORUS_CHECK(known != 0 && numel % known == 0, "reshape: shape ", want, " is invalid for a tensor of shape ",
                 from);
    s[infer] = numel / known;
  }
  CHORUS_CHECK(numel_of(s) == numel, "reshape: shape ", want, " is invalid for a tensor of shape ", from, " (",
               numel, " elements)");
  return s;
}

}  // namespace ops::detail

template <class T>
Tensor<T> Tensor<T>::narrow(std::int64_t dim, std::int64_t start, std::int64_t length) const {
  const int d = wrap_dim_of_shape(dim, this->dim(), "narrow");
  const std::int64_t size = shape()[d];
  if (start < 0) start += size;
  // `length <= size - start`, not `start + length <= size`: the sum overflows for a huge length.
  if (!(start >= 0 && start <= size && length >= 0 && length <= size - start)) [[unlikely]] {
    std::int64_t end = 0;
    const std::string range = __builtin_add_overflow(start, length, &end)
                                  ? std::to_string(start) + " + " + std::to_string(length)
                                  : std::to_string(end);
    CHORUS_FAIL("narrow: range [", start, ", ", range, ") (start ", start, ", length ", length,
                ") is out of bounds for dimension ", d, " of size ", size, " (shape ", shape(), ")");
  }
  Shape s = shape();
  s[d] = length;
  auto out = ops::detail::make_view(*this, s, strides(), storage_offset() + start * strides()[d]);
  if (autograd::needs_grad(*this)) {
    auto node = autograd::make_node<ops::detail::NarrowBackward<T>, T>({this}, shape(), d, start, length, false);
    autograd::set_history(out, std::shared_ptr<autograd::Node<T>>(node));
  }
  return out;
}

template <class T>
Tensor<T> Tensor<T>::slice(std::int64_t dim, std::int64_t start, std::int64_t end) const {
  const int d = wrap_dim_of_shape(dim, this->dim(), "slice");
  const std::int64_t size = shape()[d];
  if (start < 0) start += size;
  if (end < 0) end += size;
  start = std::clamp<std::int64_t>(start, 0, size);
  end = std::clamp<std::int64_t>(end, start, size);
  return narrow(d, start, end - start);
}

template <class T>
Tensor<T> Tensor<T>::select(std::int64_t dim, std::int64_t index) const {
  const int d = wrap_dim_of_shape(dim, this->dim(), "select");
  const std::int64_t size = shape()[d];
  if (index < 0) index += size;
  CHORUS_CHECK(index >= 0 && index < size, "select: index ", index, " is out of bounds for dimension ", d,
               " of size ", size);
  Shape s = shape();
  Strides st = strides();
  s.erase(d);
  st.erase(d);
  auto out = ops::detail::make_view(*this, s, st, storage_offset() + index * strides()[d]);
  if (autograd::needs_grad(*this)) {
    auto node = autograd::make_node<ops::detail::NarrowBackward<T>, T>({this}, shape(), d, index, 1, true);
    autograd::set_history(out, std::shared_ptr<autograd::Node<T>>(node));
  }
  return out;
}

template <class T>
Tensor<T> Tensor<T>::contiguous() const {
  if (is_contiguous()) return *this;
  return clone();
}

template <class T>
Tensor<T> Tensor<T>::clone() const {
  auto out = Tensor<T>::empty(shape(), device());
  backend::copy(out, *this);
  if (autograd::needs_grad(*this)) {
    auto node = autograd::make_node<ops::detail::IdentityBackward<T>, T>({this}, "CloneBackward");
    autograd::set_history(out, std::shared_ptr<autograd::Node<T>>(node));
  }
  return out;
}

template <class T>
Tensor<T> Tensor<T>::view(const Shape& want) const {
  Shape s = ops::detail::infer_shape(want, numel(), shape());
  CHORUS_CHECK(is_contiguous(), "view: tensor of shape ", shape(),
               " is not contiguous; use reshape() (which copies) instead");
  auto out = ops::detail::make_view(*this, s, contiguous_strides(s), storage_offset());
  if (autograd::needs_grad(*this)) {
    auto node = autograd::make_node<ops::detail::ReshapeBackward<T>, T>({this}, shape());
    autograd::set_history(out, std::shared_ptr<autograd::Node<T>>(node));
  }
  return out;
}

template <class T>
Tensor<T> Tensor<T>::reshape(const Shape& want) const {
  return is_contiguous() ? view(want) : contiguous().view(want);
}

template <class T>
Tensor<T> Tensor<T>::flatten(std::int64_t start_dim, std::int64_t end_dim) const {
  if (dim() == 0) return reshape(Shape{1});
  const int s0 = wrap_dim(start_dim, dim()), s1 = wrap_dim(end_dim, dim());
  CHORUS_CHECK(s0 <= s1, "flatten: start_dim ", s0, " is after end_dim ", s1);
  Shape s;
  for (int i = 0; i < s0; ++i) s.push_back(shape()[i]);
  std::int64_t m = numel_of(Shape(std::span<const std::int64_t>(shape().begin() + s0, shape().begin() + s1 + 1)));
  s.push_back(m);
  for (int i = s1 + 1; i < dim(); ++i) s.push_back(shape()[i]);
  return reshape(s);
}

template <class T>
Tensor<T> Tensor<T>::unsqueeze(std::int64_t dim) const {
  const int d = wrap_dim(dim, this->dim() + 1);
  Shape s = shape();
  s.insert(d, 1);
  return reshape(s);
}

template <class T>
Tensor<T> Tensor<T>::squeeze(std::int64_t dim) const {
  const int d = wrap_dim(dim, this->dim());
  if (this->dim() == 0 || shape()[d] != 1) return *this;  // a 0-dim tensor squeezes to itself, as in PyTorch
  Shape s = shape();
  s.erase(d);
  return reshape(s);
}

template <class T>
Tensor<T> Tensor<T>::transpose(std::int64_t d0, std::int64_t d1) const {
  const int a = ops::detail::wrap_op_dim(d0, dim(), "transpose");
  const int b = ops::detail::wrap_op_dim(d1, dim(), "transpose");
  Shape s = shape();
  Strides st = strides();
  std::swap(s[a], s[b]);
  std::swap(st[a], st[b]);
  auto out = ops::detail::make_view(*this, s, st, storage_offset());
  if (autograd::needs_grad(*this)) {
    auto node = autograd::make_node<ops::detail::TransposeBackward<T>, T>({this}, a, b);
    autograd::set_history(out, std::shared_ptr<autograd::Node<T>>(node));
  }
  return out;
}

template <class T>
Tensor<T> Tensor<T>::t() const {
  CHORUS_CHECK(dim() <= 2, "t(): expects a tensor with at most 2 dimensions, got shape ", shape());
  return dim() < 2 ? *this : transpose(0, 1);
}

template <class T>
Tensor<T> Tensor<T>::to(Device device) const {
  if (device == this->device()) return *this;
  check_device(device);
  profiler::Scope span(profiler::Category::copy, [&] { return "copy to " + device.str(); });
  if (span.active()) {
    span.set_device(device);
    span.set_bytes(numel() * static_cast<std::int64_t>(sizeof(T)));
  }
  auto out = Tensor<T>::empty(shape(), device);
  backend::copy(out, *this);
  if (autograd::needs_grad(*this)) {
    auto node = autograd::make_node<ops::detail::ToDeviceBackward<T>, T>({this}, this->device());
    autograd::set_history(out, std::shared_ptr<autograd::Node<T>>(node));
  }
  return out;
}

template <class T>
template <class U>
Tensor<U> Tensor<T>::to() const {
  if constexpr (std::is_same_v<T, U>) {
    return *this;
  } else {
    // Note [conversions and autograd]
    // A conversion between floating dtypes is differentiable, as in PyTorch: its node takes the
    // Tensor<U> gradient and hands a Tensor<T> one into T's part of the graph (one engine walks
    // both: Note [one graph over every dtype]). To an integer dtype nothing is recorded.
    auto src = ops::detail::contiguous_data(*this);
    auto out = Tensor<U>::empty(shape(), device());
    backend::convert(out, src);
    if constexpr (is_floating_v<T> && is_floating_v<U>) {
      if (autograd::needs_grad(*this)) {
        auto node = autograd::make_node<ops::detail::ConvertBackward<T, U>, T>({this});
        autograd::set_history(out, node);
      }
    }
    return out;
  }
}

template <class T>
std::vector<T> Tensor<T>::to_vector() const {
  auto src = ops::detail::contiguous_data(*this);
  std::vector<T> out(static_cast<std::size_t>(numel()));
  copy_bytes(out.data(), Device::cpu(), src.data(), device(), out.size() * sizeof(T));
  return out;
}

template <class T>
T Tensor<T>::item() const {
  CHORUS_CHECK(numel() == 1, "item(): tensor of shape ", shape(), " has ", numel(), " elements, not 1");
  T v{};
  copy_bytes(&v, Device::cpu(), data(), device(), sizeof(T));
  return v;
}

namespace ops::detail {
template <class T>
void check_inplace(const Tensor<T>& t, const char* op) {
  CHORUS_CHECK(!(autograd::is_grad_enabled() && t.requires_grad() && t.is_leaf()), op,
               ": a leaf tensor that requires grad is used in an in-place operation (wrap it in NoGradGuard)");
  CHORUS_CHECK(!(autograd::is_grad_enabled() && t.grad_fn()), op,
               ": in-place operations on tensors recorded by autograd are not supported");
  // An expanded view (stride 0 along a dimension of more than one element) would take every
  // write to one location, the last one winning: refused, as PyTorch does.
  for (std::int64_t d = 0; d < t.dim(); ++d)
    CHORUS_CHECK(!(t.strides()[d] == 0 && t.shape()[d] > 1), op,
                 ": more than one element of the written-to tensor refers to a single memory location (shape ",
                 t.shape(), " has stride 0 along dimension ", d, ", an expanded view); write into a clone() instead");
}
}  // namespace ops::detail

template <class T>
Tensor<T>& Tensor<T>::fill_(T value) {
  ops::detail::check_inplace(*this, "fill_");
  if (is_contiguous()) {
    backend::fill(*this, value);
  } else {
    backend::copy(*this, full<T>(shape(), value, device()));
  }
  bump_version();  // Note [version counter]
  return *this;
}

template <class T>
Tensor<T>& Tensor<T>::zero_() {
  return fill_(T(0));
}

template <class T>
Tensor<T>& Tensor<T>::copy_(const Tensor<T>& src) {
  ops::detail::check_inplace(*this, "copy_");
  CHORUS_CHECK(src.shape() == shape(), "copy_: source shape ", src.shape(), " differs from destination shape ",
               shape());
  if (same_storage(src) && numel() > 0) {
    if (storage_offset() == src.storage_offset() && strides() == src.strides()) return *this;  // x.copy_(x)
    // Source and destination may overlap (x[0:3].copy_(x[1:4])): memcpy over overlapping bytes
    // is undefined and the strided loop would read elements it already overwrote. Copy
    // through a temporary.
    auto tmp = Tensor<T>::empty(src.shape(), src.device());
    backend::copy(tmp, src);
    backend::copy(*this, tmp);
  } else {
    backend::copy(*this, src);
  }
  bump_version();  // Note [version counter]
  return *this;
}

template <class T>
Tensor<T> Tensor<T>::index_select(std::int64_t dim, const Tensor<std::int64_t>& index) const {
  const int d = wrap_dim_of_shape(dim, this->dim(), "index_select");
  CHORUS_CHECK(index.dim() == 1, "index_select: index must be 1-D, got shape ", index.shape());
  ops::detail::check_same_device("index_select", *this, index);
  auto idx = ops::detail::contiguous_data(index);
  const std::int64_t size = shape()[d];
  if (idx.device().is_cpu()) {  // on a GPU the kernel validates (Note [device-side validation])
    const std::int64_t* p = idx.data();
    for (std::int64_t i = 0; i < idx.numel(); ++i)
      CHORUS_CHECK(p[i] >= 0 && p[i] < size, "index_select: index ", p[i], " at position ", i,
                   " is out of range for dimension ", d, " of size ", size);
  }
  auto src = ops::detail::contiguous_data(*this);
  Shape s = shape();
  s[d] = idx.numel();
  auto out = Tensor<T>::empty(s, device());
  std::int64_t outer, n, inner;
  ops::detail::split_around(shape(), d, outer, n, inner);
  backend::index_select(src, outer, n, inner, idx, out, d);
  if constexpr (is_floating_v<T>) {
    if (autograd::needs_grad(*this)) {
      auto node = autograd::make_node<ops::detail::IndexSelectBackward<T>, T>({this}, shape(), d, idx);
      autograd::set_history(out, std::shared_ptr<autograd::Node<T>>(node));
    }
  }
  return out;
}

/// Concatenates tensors along `dim` (all other sizes equal, one device).
template <class T>
Tensor<T> cat(const std::vector<Tensor<T>>& tensors, std::int64_t dim = 0) {
  CHORUS_CHECK(!tensors.empty(), "cat: expected a non-empty list of tensors");
  const auto& first = tensors[0];
  ops::detail::check_defined("cat", first);
  const int d = wrap_dim_of_shape(dim, first.dim(), "cat");
  Shape out_shape = first.shape();
  out_shape[d] = 0;
  std::vector<std::int64_t> sizes;
  bool grad = false;
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const auto& t = tensors[i];
    ops::detail::check_defined("cat", t);
    ops::detail::check_same_device("cat", first, t);
    bool ok = t.dim() == first.dim();
    for (int k = 0; ok && k < t.dim(); ++k) ok = k == d || t.shape()[k] == first.shape()[k];
    CHORUS_CHECK(ok, "cat: tensor ", i, " has shape ", t.shape(), ", incompatible with shape ", first.shape(),
                 " along dimension ", d);
    CHORUS_CHECK(!__builtin_add_overflow(out_shape[d], t.shape()[d], &out_shape[d]), "cat: the sizes along dimension ",
                 d, " add up to more than an int64 holds");
    sizes.push_back(t.shape()[d]);
    grad = grad || t.requires_grad();
  }
  auto out = Tensor<T>::empty(out_shape, first.device());
  std::int64_t start = 0;
  for (const auto& t : tensors) {
    Shape s = out_shape;
    s[d] = t.shape()[d];
    backend::copy(ops::detail::make_view(out, s, out.strides(), start * out.strides()[d]), t);
    start += t.shape()[d];
  }
  if (grad && autograd::is_grad_enabled()) {
    auto node = std::make_shared<ops::detail::CatBackward<T>>(d, sizes);
    for (const auto& t : tensors) node->add_next_edge(autograd::gradient_edge(t));
    autograd::set_history(out, std::shared_ptr<autograd::Node<T>>(node));
  }
  return out;
}

/// Stacks equally shaped tensors along a new dimension `dim`.
template <class T>
Tensor<T> stack(const std::vector<Tensor<T>>& tensors, std::int64_t dim = 0) {
  CHORUS_CHECK(!tensors.empty(), "stack: expected a non-empty list of tensors");
  std::vector<Tensor<T>> parts;
  parts.reserve(tensors.size());
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    CHORUS_CHECK(tensors[i].shape() == tensors[0].shape(), "stack: tensor ", i, " has shape ", tensors[i].shape(),
                 " but tensor 0 has shape ", tensors[0].shape());
    parts.push_back(tensors[i].unsqueeze(dim));
  }
  return cat(parts, dim);
}

/// Splits into pieces of `size` along `dim` (the last may be smaller), as views.
template <class T>
std::vector<Tensor<T>> split(const Tensor<T>& t, std::int64_t size, std::int64_t dim = 0) {
  CHORUS_CHECK(size > 0, "split: size must be positive, got ", size);
  const int d = wrap_dim_of_shape(dim, t.dim(), "split");
  std::vector<Tensor<T>> out;
  // Advancing by min(size, n - s) keeps s <= n; s += size would overflow for a huge size.
  const std::int64_t n = t.shape()[d];
  for (std::int64_t s = 0; s < n; s += std::min(size, n - s)) out.push_back(t.narrow(d, s, std::min(size, n - s)));
  return out;
}

/// torch.chunk: pieces of ceil(n / chunks) along `dim`; may return fewer than `chunks`.
template <class T>
std::vector<Tensor<T>> chunk(const Tensor<T>& t, std::int64_t chunks, std::int64_t dim = 0) {
  CHORUS_CHECK(chunks > 0, "chunk: number of chunks must be positive, got ", chunks);
  const int d = wrap_dim_of_shape(dim, t.dim(), "chunk");
  const std::int64_t n = t.shape()[d];
  if (n == 0) return {t};
  return split(t, n / chunks + (n % chunks != 0), d);  // ceil without n + chunks - 1 (overflows)
}

CHORUS_NAMESPACE_END

// The instances chorus::compiled holds (Note [compiled chorus] in compiled.hpp).
#define CHORUS_OPS_VIEW_INSTANCES(X, T)                                            \
  X(Tensor<T> cat<T>(const std::vector<Tensor<T>>&, std::int64_t))                 \
  X(Tensor<T> stack<T>(const std::vector<Tensor<T>>&, std::int64_t))               \
  X(std::vector<Tensor<T>> split<T>(const Tensor<T>&, std::int64_t, std::int64_t)) \
  X(std::vector<Tensor<T>> chunk<T>(const Tensor<T>&, std::int64_t, std::int64_t))
CHORUS_EXTERN_INSTANCES(CHORUS_OPS_VIEW_INSTANCES, CHORUS_ALL_DTYPES)
