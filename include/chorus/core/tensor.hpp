#pragma once
// Tensor<T>: a strided view of a Storage on one device, with autograd metadata.
//
// Tensor is a handle (shared ownership of a TensorImpl), like torch::Tensor: copying a Tensor
// shares data. Member functions that are differentiable operations are declared here and
// defined in ops/ (the only layer that pairs a kernel with its backward); include
// <chorus/chorus.hpp> (or the ops headers) to use them.
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "clone_scope.hpp"
#include "dtype.hpp"
#include "shape.hpp"
#include "storage.hpp"

#include <optional>  // the sequence-model operators' methods (argmax's dim, max's (values, indices))
#include <tuple>

CHORUS_NAMESPACE_BEGIN

namespace autograd {
class NodeBase;
template <class T>
class Node;
}

/// The state a Tensor<T> handle shares: where its elements are (storage, offset, shape,
/// strides) and its autograd metadata.
template <class T>
struct TensorImpl {
  Storage storage;          ///< the memory the elements live in (shared by views)
  std::int64_t offset = 0;  ///< position of the first element in the storage, in elements
  Shape shape;              ///< the sizes
  Strides strides;          ///< the step between neighbours along each dimension, in elements

  // Autograd metadata. A tensor with grad_fn is the output of a recorded op; a tensor with
  // requires_grad and no grad_fn is a leaf whose gradient accumulates into `grad`.
  bool requires_grad = false;   ///< whether gradients flow to this tensor (torch's requires_grad)
  std::uint32_t output_nr = 0;  ///< which output of grad_fn this tensor is
  /// The node that produced this tensor, of any dtype (Note [one graph over every dtype]).
  std::shared_ptr<autograd::NodeBase> grad_fn;
  std::shared_ptr<TensorImpl<T>> grad;  ///< a leaf's accumulated gradient (null before the first backward)
  std::weak_ptr<autograd::Node<T>> grad_accumulator;  ///< the node that accumulates a leaf's gradient, while alive
  /// Another process keeps this parameter's gradient (ZeRO-2: DistributedDataParallel::
  /// shard_gradients): a norm over the parameters taken here alone would be wrong.
  bool grad_on_other_rank = false;
  /// A FullyShardedDataParallel shard: its gradient is this rank's part of the flat gradient only.
  bool grad_is_shard = false;
  /// Another tensor, on the device that steps this parameter, keeps its gradient (ZeRO-2 in one
  /// process: DataParallel::shard_gradients, Note [sharded gradients in one process]): grad() and
  /// set_grad() read and write the keeper's, and backward accumulates there.
  std::shared_ptr<TensorImpl<T>> grad_keeper;

  /// The storage's device (cpu:0 without storage).
  Device device() const { return storage ? storage->device() : Device{}; }
  /// Pointer to the first element (null without storage).
  T* data() const { return storage ? static_cast<T*>(storage->data()) + offset : nullptr; }
};

/// An n-dimensional array of T on one device with autograd (torch.Tensor); a handle: copies
/// share the data.
template <class T>
class Tensor {
  static_assert(is_supported_scalar_v<T>, "chorus tensors hold float, double, int64_t, bfloat16 or half");

 public:
  using value_type = T;        ///< the element type
  using Impl = TensorImpl<T>;  ///< the shared state a handle points to

  /// An undefined tensor (no impl).
  Tensor() = default;
  /// A handle to `impl`.
  explicit Tensor(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}

  /// Copies and moves share the impl; inside a CloneScope a copy is the scope's deep copy
  /// (Note [deep copy through copy constructors] in core/clone_scope.hpp).
  ///@{
  Tensor(const Tensor& o) : impl_(o.impl_) {
    if (impl_) [[likely]]
      if (auto* scope = CloneScope::active()) [[unlikely]]
        impl_ = scope->map_tensor(impl_);
  }
  Tensor(Tensor&&) noexcept = default;
  Tensor& operator=(const Tensor& o) {
    Tensor tmp(o);
    impl_ = std::move(tmp.impl_);
    return *this;
  }
  Tensor& operator=(Tensor&&) noexcept = default;
  ///@}
  ~Tensor() = default;

  /// Allocates an uninitialised contiguous tensor.
  static Tensor empty(const Shape& shape, Device device = Device::cpu()) {
    // Sizes, element count, strides and byte count are all checked (Note [checked sizes]).
    const std::size_t nbytes = checked_nbytes(numel_of(shape), sizeof(T), shape);
    auto impl = std::make_shared<Impl>();
    impl->strides = contiguous_strides(shape);
    impl->storage = make_storage(device, nbytes);
    impl->shape = shape;
    return Tensor(std::move(impl));
  }

  // ---- properties ----
  /// True when the handle refers to a tensor (torch's defined()).
  bool defined() const { return impl_ != nullptr; }
  /// The shared impl (null when undefined).
  const std::shared_ptr<Impl>& impl() const { return impl_; }
  /// The sizes (torch.Tensor.shape).
  const Shape& shape() const { return checked().shape; }
  /// The sizes, as shape() (torch.Tensor.sizes).
  const Shape& sizes() const { return shape(); }
  /// The size of dimension `d`, negative counting from the end (torch.Tensor.size(d)).
  std::int64_t size(std::int64_t d) const { return shape()[wrap_dim_of_shape(d, dim(), "size")]; }
  /// The number of dimensions (torch.Tensor.dim).
  int dim() const { return shape().size(); }
  /// The number of elements (torch.Tensor.numel).
  std::int64_t numel() const { return numel_of(shape()); }
  /// The strides, in elements (torch.Tensor.stride()).
  const Strides& strides() const { return checked().strides; }
  /// The stride of dimension `d`, in elements (torch.Tensor.stride(d)).
  std::int64_t stride(std::int64_t d) const { return strides()[wrap_dim_of_shape(d, dim(), "stride")]; }
  /// The position of the first element in the storage, in elements (torch.Tensor.storage_offset).
  std::int64_t storage_offset() const { return checked().offset; }
  /// The device the data is on.
  Device device() const { return checked().device(); }
  /// The element type, dtype_of<T>().
  static constexpr DType dtype() { return dtype_of<T>(); }
  /// True when the elements are in row-major order with no gaps (size-1 dimensions' strides ignored).
  bool is_contiguous() const {
    const auto& im = checked();
    std::int64_t expect = 1;
    for (int i = im.shape.size() - 1; i >= 0; --i) {
      if (im.shape[i] != 1 && im.strides[i] != expect) return false;
      expect *= im.shape[i];
    }
    return true;
  }
  /// Pointer to the first element (a device pointer for CUDA tensors).
  T* data() const { return checked().data(); }
  /// True when both tensors view the same storage.
  bool same_storage(const Tensor& o) const { return checked().storage == o.checked().storage; }

  // ---- autograd ----
  /// Whether gradients flow to this tensor (torch.Tensor.requires_grad; false when undefined).
  bool requires_grad() const { return impl_ && impl_->requires_grad; }
  /// True when no recorded operation produced this tensor (torch.Tensor.is_leaf).
  bool is_leaf() const { return !impl_ || impl_->grad_fn == nullptr; }
  /// The autograd node that produced this tensor (null for a leaf; torch.Tensor.grad_fn).
  const std::shared_ptr<autograd::NodeBase>& grad_fn() const { return checked().grad_fn; }
  /// Which output of grad_fn() this tensor is.
  std::uint32_t output_nr() const { return checked().output_nr; }

  /// Sets requires_grad on a leaf (like torch's requires_grad_). Returns *this.
  Tensor& requires_grad_(bool on = true) {
    auto& im = checked();
    CHORUS_CHECK(is_floating_v<T> || !on, "only floating-point tensors can require gradients (got ",
                 dtype_name(dtype()), ")");
    CHORUS_CHECK(im.grad_fn == nullptr || on,
                 "requires_grad_(false) on a non-leaf tensor: use detach() instead");
    im.requires_grad = on;
    return *this;
  }

  /// The accumulated gradient of a leaf (undefined before the first backward). Under
  /// DataParallel::shard_gradients it is on the device whose shard steps this parameter.
  Tensor grad() const {
    const auto& im = checked();
    return Tensor(im.grad_keeper ? im.grad_keeper->grad : im.grad);
  }
  /// The device grad() is on: this tensor's, or where DataParallel::shard_gradients keeps it.
  Device grad_device() const {
    const auto& im = checked();
    return im.grad_keeper ? im.grad_keeper->device() : im.device();
  }
  /// Replaces (or clears, with an undefined tensor) the accumulated gradient. The gradient
  /// must match this tensor's shape and grad_device() (its device, as PyTorch requires of an
  /// assigned .grad), and be contiguous (backward and the optimizers write it in place as a flat
  /// array).
  void set_grad(const Tensor& g) const {
    auto& im = checked();
    if (im.grad_keeper) return Tensor(im.grad_keeper).set_grad(g);
    if (g.defined()) {
      CHORUS_CHECK(g.shape() == im.shape, "set_grad: gradient of shape ", g.shape(), " for a tensor of shape ",
                   im.shape);
      CHORUS_CHECK(g.device() == im.device(), "set_grad: gradient on ", g.device(), " for a tensor on ",
                   im.device());
      CHORUS_CHECK(g.is_contiguous(), "set_grad: the gradient (shape ", g.shape(), ") is not contiguous");
      CHORUS_CHECK(g.impl_ != impl_, "set_grad: a tensor cannot be its own gradient");
    }
    im.grad = g.impl_;
  }

  /// The version counter of this tensor's data (Note [version counter]; PyTorch's _version).
  std::uint64_t version() const {
    const auto& st = checked().storage;
    return st ? st->version() : 0;
  }
  /// Marks this tensor's data as written in place (for code that writes through data()).
  void bump_version() const {
    if (const auto& st = checked().storage) st->bump_version();
  }

  /// A tensor sharing this one's data, cut off from the autograd graph.
  Tensor detach() const {
    auto impl = std::make_shared<Impl>();
    const auto& im = checked();
    impl->storage = im.storage;
    impl->offset = im.offset;
    impl->shape = im.shape;
    impl->strides = im.strides;
    return Tensor(std::move(impl));
  }

  // ---- defined in ops/ (differentiable or needing a kernel) ----
  /// The `length` elements of dimension `dim` from `start` (negative: from the end); a view (torch.narrow).
  Tensor narrow(std::int64_t dim, std::int64_t start, std::int64_t length) const;
  /// Elements [start, end) of dimension `dim`, bounds wrapped and clamped as Python's `t[start:end]`; a view.
  Tensor slice(std::int64_t dim, std::int64_t start, std::int64_t end) const;
  /// Index `index` of dimension `dim`, that dimension removed; a view (torch.select).
  Tensor select(std::int64_t dim, std::int64_t index) const;
  /// Row `index` of dim 0 (select(0, index)), as PyTorch's `t[index]`.
  Tensor operator[](std::int64_t index) const { return select(0, index); }
  /// The elements in `shape` (one -1 is inferred): a view when contiguous, else a copy (torch.reshape).
  Tensor reshape(const Shape& shape) const;
  /// A view with `shape` (one -1 is inferred); throws unless contiguous (torch.Tensor.view).
  Tensor view(const Shape& shape) const;
  /// Dimensions start_dim..end_dim merged into one, through reshape (torch.flatten; 0-dim gives [1]).
  Tensor flatten(std::int64_t start_dim = 0, std::int64_t end_dim = -1) const;
  /// A size-1 dimension inserted at `dim` (torch.unsqueeze).
  Tensor unsqueeze(std::int64_t dim) const;
  /// Dimension `dim` removed when its size is 1, else the tensor unchanged (torch.squeeze(dim)).
  Tensor squeeze(std::int64_t dim) const;
  /// Dimensions `d0` and `d1` swapped; a view (torch.transpose).
  Tensor transpose(std::int64_t d0, std::int64_t d1) const;
  /// The transpose of a 2-D tensor; a 0-D or 1-D tensor as it is (torch.t).
  Tensor t() const;
  // Sequence-model operators (ops/shape.hpp, index.hpp, minmax.hpp, statistics.hpp, reduce.hpp).
  /// The dimensions reordered: output dimension i is input dimension dims[i]; a view (torch.permute).
  Tensor permute(const std::vector<std::int64_t>& dims) const;
  /// Dimensions `source` moved to positions `destination`, the others keeping their order; a view
  /// (torch.movedim).
  ///@{
  Tensor movedim(std::int64_t source, std::int64_t destination) const;
  Tensor movedim(const std::vector<std::int64_t>& source, const std::vector<std::int64_t>& destination) const;
  ///@}
  /// A view broadcast to `sizes` (stride 0; -1 keeps a size, only size-1 dimensions grow; torch.expand).
  Tensor expand(const Shape& sizes) const;
  /// The lower triangle of the last two dimensions (j - i <= diagonal), the rest zero (torch.tril).
  Tensor tril(std::int64_t diagonal = 0) const;
  /// The upper triangle of the last two dimensions (j - i >= diagonal), the rest zero (torch.triu).
  Tensor triu(std::int64_t diagonal = 0) const;
  /// The values that `index` picks along `dim` (torch.gather).
  Tensor gather(std::int64_t dim, const Tensor<std::int64_t>& index) const;
  /// A copy with `src` added at the positions `index` names along `dim`; repeats add up (torch.scatter_add).
  Tensor scatter_add(std::int64_t dim, const Tensor<std::int64_t>& index, const Tensor& src) const;
  /// A copy with `value` where `mask` is nonzero, mask and tensor broadcast together (torch.masked_fill).
  Tensor masked_fill(const Tensor<std::int64_t>& mask, double value) const;
  /// Sum over `dims` (an empty list: all), each kept as size 1 with keepdim (torch.sum).
  Tensor sum(const std::vector<std::int64_t>& dims, bool keepdim = false) const;
  /// Mean over `dims` (an empty list: all), each kept as size 1 with keepdim (torch.mean).
  Tensor mean(const std::vector<std::int64_t>& dims, bool keepdim = false) const;
  // A braced list of dims (`{}`: all of them) picks these (Note [braced dim lists] in ops/reduce.hpp).
  /// Sum over a braced list of dims (`{}`: all of them; torch.sum).
  Tensor sum(std::initializer_list<std::int64_t> dims, bool keepdim = false) const;
  /// Mean over a braced list of dims (`{}`: all of them; torch.mean).
  Tensor mean(std::initializer_list<std::int64_t> dims, bool keepdim = false) const;
  /// Inclusive cumulative sum along `dim` (torch.cumsum).
  Tensor cumsum(std::int64_t dim) const;
  /// The largest element, 0-dim; NaN if any element is NaN; throws when empty (torch.max).
  Tensor max() const;
  /// The smallest element, 0-dim; NaN if any element is NaN; throws when empty (torch.min).
  Tensor min() const;
  /// (values, indices) of the maxima along `dim` (torch.max(dim, keepdim)).
  std::tuple<Tensor, Tensor<std::int64_t>> max(std::int64_t dim, bool keepdim = false) const;
  /// (values, indices) of the minima along `dim` (torch.min(dim, keepdim)).
  std::tuple<Tensor, Tensor<std::int64_t>> min(std::int64_t dim, bool keepdim = false) const;
  /// The maximum over `dims` (empty: all; torch.amax).
  Tensor amax(const std::vector<std::int64_t>& dims = {}, bool keepdim = false) const;
  /// The minimum over `dims` (empty: all; torch.amin).
  Tensor amin(const std::vector<std::int64_t>& dims = {}, bool keepdim = false) const;
  /// Index of the first maximum along `dim`, or into the flattened tensor without a dim (torch.argmax).
  Tensor<std::int64_t> argmax(std::optional<std::int64_t> dim = std::nullopt, bool keepdim = false) const;
  /// Index of the first minimum along `dim`, or into the flattened tensor without a dim (torch.argmin).
  Tensor<std::int64_t> argmin(std::optional<std::int64_t> dim = std::nullopt, bool keepdim = false) const;
  /// The k largest (or smallest) elements along `dim` and their indices, always sorted (torch.topk).
  std::tuple<Tensor, Tensor<std::int64_t>> topk(std::int64_t k, std::int64_t dim = -1, bool largest = true,
                                                bool sorted = true) const;
  /// log(sum(exp(x))) over `dims`, computed stably (torch.logsumexp).
  ///@{
  Tensor logsumexp(const std::vector<std::int64_t>& dims, bool keepdim = false) const;
  Tensor logsumexp(std::int64_t dim, bool keepdim = false) const;
  Tensor logsumexp(std::initializer_list<std::int64_t> dims, bool keepdim = false) const;
  ///@}
  /// Variance over `dims` (empty: all) divided by N - correction, 1 being unbiased (torch.var).
  ///@{
  Tensor var(const std::vector<std::int64_t>& dims = {}, double correction = 1.0, bool keepdim = false) const;
  Tensor var(std::int64_t dim, double correction = 1.0, bool keepdim = false) const;
  Tensor var(std::initializer_list<std::int64_t> dims, double correction = 1.0, bool keepdim = false) const;
  ///@}
  /// The variance over all elements, unbiased or not (torch.var(unbiased)); only a bool.
  template <class B>
    requires std::is_same_v<B, bool>
  Tensor var(B unbiased) const;  // only a bool: an int is a dim
  /// Standard deviation, sqrt(var) with var's arguments (torch.std).
  ///@{
  Tensor std(const std::vector<std::int64_t>& dims = {}, double correction = 1.0, bool keepdim = false) const;
  Tensor std(std::int64_t dim, double correction = 1.0, bool keepdim = false) const;
  Tensor std(std::initializer_list<std::int64_t> dims, double correction = 1.0, bool keepdim = false) const;
  ///@}
  /// The standard deviation over all elements, unbiased or not (torch.std(unbiased)); only a bool.
  template <class B>
    requires std::is_same_v<B, bool>
  Tensor std(B unbiased) const;
  /// The vector p-norm (sum |x|^p)^(1/p) over `dims`, all elements when none are given (torch.norm).
  ///@{
  Tensor norm(double p = 2.0) const;
  Tensor norm(double p, const std::vector<std::int64_t>& dims, bool keepdim = false) const;
  Tensor norm(double p, std::int64_t dim, bool keepdim = false) const;
  Tensor norm(double p, std::initializer_list<std::int64_t> dims, bool keepdim = false) const;
  ///@}
  /// This tensor when contiguous, else a contiguous copy (torch.Tensor.contiguous).
  Tensor contiguous() const;
  /// A contiguous copy of the data, differentiable (torch.clone).
  Tensor clone() const;
  /// This tensor on `device`: itself when already there, else a differentiable copy (torch.Tensor.to).
  Tensor to(Device device) const;
  /// The entries along `dim` at the positions of the 1-D `index`, copied (torch.index_select).
  Tensor index_select(std::int64_t dim, const Tensor<std::int64_t>& index) const;
  /// Sum of all elements, 0-dim (torch.sum).
  Tensor sum() const;
  /// Sum over `dim`, kept as size 1 with keepdim (torch.sum).
  Tensor sum(std::int64_t dim, bool keepdim = false) const;
  /// Mean of all elements, 0-dim (NaN when empty; torch.mean).
  Tensor mean() const;
  /// Mean over `dim`, kept as size 1 with keepdim (torch.mean).
  Tensor mean(std::int64_t dim, bool keepdim = false) const;
  /// Matrix product, batch dimensions broadcast (torch.matmul; floating point only).
  Tensor matmul(const Tensor& other) const;
  /// Batched matrix product of [B, M, K] and [B, K, N] (torch.bmm).
  Tensor bmm(const Tensor& other) const;
  /// The method forms of the unary operators (LibTorch's x.abs(), x.exp(), ...): each is its
  /// free function (chorus::abs(x), ...), differentiable the same way.
  ///@{
  Tensor neg() const;
  Tensor abs() const;
  Tensor exp() const;
  Tensor log() const;
  Tensor sqrt() const;
  Tensor square() const;
  Tensor pow(double exponent) const;
  Tensor sin() const;
  Tensor cos() const;
  Tensor tanh() const;
  Tensor sigmoid() const;
  Tensor relu() const;
  Tensor gelu() const;
  ///@}
  /// min(max(x, min), max), either bound optional but one given (torch.clamp).
  Tensor clamp(std::optional<double> min, std::optional<double> max = std::nullopt) const;
  /// max(x, min) (torch.clamp_min).
  Tensor clamp_min(double min) const;
  /// min(x, max) (torch.clamp_max).
  Tensor clamp_max(double max) const;
  /// exp(x) / sum(exp(x)) along `dim` (torch.softmax).
  Tensor softmax(std::int64_t dim) const;
  /// log(softmax(x)) along `dim`, computed stably (torch.log_softmax).
  Tensor log_softmax(std::int64_t dim) const;
  /// A copy with elements converted to U (this tensor when U is T); recorded by autograd between floating types.
  template <class U>
  Tensor<U> to() const;

  /// The elements in row-major order, copied to the host.
  std::vector<T> to_vector() const;
  /// The value of a one-element tensor, copied to the host; throws otherwise (torch.Tensor.item).
  T item() const;
  /// The single value as U (PyTorch's `t.item<float>()`), converted with a check: a value U
  /// cannot hold (NaN, an infinity or an out-of-range value to an integer type, a finite value
  /// beyond a narrower floating type's range) is an error, never a wrap or undefined cast.
  template <class U>
  U item() const;
  /// Sets every element to 0; returns *this (torch.Tensor.zero_).
  Tensor& zero_();
  /// Sets every element to `value`; returns *this (torch.Tensor.fill_).
  Tensor& fill_(T value);
  /// Copies `src` (same shape, any device; no broadcasting) into this tensor; returns *this (torch.Tensor.copy_).
  Tensor& copy_(const Tensor& src);
  /// In-place arithmetic, `other` broadcast to this tensor's shape; none is recorded by
  /// autograd (use them under NoGradGuard or on detach()): Note [in-place arithmetic] in
  /// ops/inplace.hpp. `add_(other, alpha)` adds alpha * other, as LibTorch's.
  ///@{
  Tensor& add_(const Tensor& other, double alpha = 1.0);
  Tensor& sub_(const Tensor& other, double alpha = 1.0);
  Tensor& mul_(const Tensor& other);
  Tensor& div_(const Tensor& other);
  Tensor& add_(double other);
  Tensor& sub_(double other);
  Tensor& mul_(double other);
  Tensor& div_(double other);
  ///@}
  /// add_, sub_, mul_ and div_ as operators (torch's +=, -=, *=, /=); returns *this.
  ///@{
  Tensor& operator+=(const Tensor& other) { return add_(other); }
  Tensor& operator-=(const Tensor& other) { return sub_(other); }
  Tensor& operator*=(const Tensor& other) { return mul_(other); }
  Tensor& operator/=(const Tensor& other) { return div_(other); }
  Tensor& operator+=(double other) { return add_(other); }
  Tensor& operator-=(double other) { return sub_(other); }
  Tensor& operator*=(double other) { return mul_(other); }
  Tensor& operator/=(double other) { return div_(other); }
  ///@}

  /// Computes gradients of this tensor (a scalar, or with `gradient` of its shape) with
  /// respect to the leaves of its graph, accumulating them into their grad().
  void backward(const Tensor& gradient = Tensor(), bool retain_graph = false) const;

  friend bool operator==(const Tensor& a, const Tensor& b) = delete;  // ambiguous: use equal()

 private:
  Impl& checked() const {
    CHORUS_CHECK(impl_ != nullptr, "operation on an undefined Tensor");
    return *impl_;
  }
  std::shared_ptr<Impl> impl_;
};

namespace detail {
template <class U, class T>
U checked_item_cast_arithmetic(T v);
/// `v` as U, or an error when U cannot represent it (see Tensor::item<U>).
template <class U, class T>
U checked_item_cast(T v) {
  if constexpr (is_reduced_floating_v<T>) {
    return checked_item_cast<U>(static_cast<float>(v));  // exact
  } else if constexpr (is_reduced_floating_v<U>) {
    static_assert(std::is_arithmetic_v<T>);
    const U r(v);  // rounded once; a finite value that becomes infinite is refused
    const bool finite = !std::isnan(static_cast<double>(v)) && !std::isinf(static_cast<double>(v));
    CHORUS_CHECK(!(finite && std::isinf(static_cast<float>(r))), "item(): the value ", v, " cannot be converted to ",
                 dtype_name(dtype_of<U>()), " without overflow");
    return r;
  } else {
    return checked_item_cast_arithmetic<U>(v);
  }
}

template <class U, class T>
U checked_item_cast_arithmetic(T v) {
  static_assert(std::is_arithmetic_v<U> && std::is_arithmetic_v<T>, "item<U>(): U must be an arithmetic type");
  using LU = std::numeric_limits<U>;
  if constexpr (std::is_same_v<U, bool>) {
    return v != T(0);
  } else {
    bool ok = true;
    if constexpr (LU::is_integer && std::numeric_limits<T>::is_integer) {
      ok = std::in_range<U>(v);
    } else if constexpr (LU::is_integer) {  // truncation toward zero must land in [lowest, max]
      const long double x = v, top = std::ldexp(1.0L, LU::digits);  // max + 1, a power of two
      ok = x < top && (LU::is_signed ? x >= -top : x > -1.0L);  // false for NaN
    } else if constexpr (!std::numeric_limits<T>::is_integer && sizeof(T) > sizeof(U)) {
      ok = !std::isfinite(v) || (v >= static_cast<T>(LU::lowest()) && v <= static_cast<T>(LU::max()));
    }
    CHORUS_CHECK(ok, "item(): the value ", v, " cannot be converted to the requested type without overflow");
    return static_cast<U>(v);
  }
}
}  // namespace detail

template <class T>
template <class U>
U Tensor<T>::item() const {
  return detail::checked_item_cast<U>(item());
}

/// True when two tensor handles refer to the same impl.
template <class T>
bool is_same(const Tensor<T>& a, const Tensor<T>& b) {
  return a.impl() == b.impl();
}

CHORUS_NAMESPACE_END
