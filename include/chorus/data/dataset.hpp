#pragma once
// Datasets: anything with size() and get(i). get(i) returns a Tensor or an Example
// (data + target); a dataset may also offer get_batch(indices) to build a batch at once.
#include <concepts>
#include <cstddef>
#include <tuple>
#include <vector>

#include "../compiled.hpp"
#include "../ops/ops.hpp"

CHORUS_NAMESPACE_BEGIN
namespace data {

/// One example, or a batch of them: the input data and its target.
template <class Data, class Target>
struct Example {
  Data data;      ///< The input.
  Target target;  ///< The target (label).
};

/// A dataset: size() and get(i) for i in [0, size()).
template <class D>
concept Dataset = requires(const D& d, std::size_t i) {
  { d.size() } -> std::convertible_to<std::size_t>;
  d.get(i);
};

/// What get() of dataset type D returns.
template <class D>
using example_t = decltype(std::declval<const D&>().get(std::size_t{}));

/// A dataset that builds whole batches from a list of indices (faster than get() per item).
template <class D>
concept BatchDataset = Dataset<D> && requires(const D& d, const std::vector<std::size_t>& idx) {
  { d.get_batch(idx) } -> std::same_as<example_t<D>>;
};

/// Stacks items along a new dimension 0 (items are tensors or Examples of tensors).
template <class T>
Tensor<T> stack_batch(const std::vector<Tensor<T>>& items) {
  NoGradGuard g;
  return stack(items, 0);
}
/// Stacks the items' data and their targets separately: an Example of two batches.
template <class A, class B>
Example<A, B> stack_batch(const std::vector<Example<A, B>>& items) {
  std::vector<A> data;
  std::vector<B> target;
  data.reserve(items.size());
  target.reserve(items.size());
  for (const auto& e : items) {
    data.push_back(e.data);
    target.push_back(e.target);
  }
  return {stack_batch(data), stack_batch(target)};
}

/// Examples held as two tensors whose dimension 0 indexes the examples.
template <class T, class U>
class TensorDataset {
 public:
  /// Examples data[i], target[i]; throws unless both have dimension 0 of the same size.
  TensorDataset(Tensor<T> data, Tensor<U> target) : data_(std::move(data)), target_(std::move(target)) {
    CHORUS_CHECK(data_.dim() >= 1 && target_.dim() >= 1 && data_.size(0) == target_.size(0),
                 "TensorDataset: data of shape ", data_.shape(), " and target of shape ", target_.shape(),
                 " disagree in dimension 0");
  }
  /// The number of examples (the size of dimension 0).
  std::size_t size() const { return static_cast<std::size_t>(data_.size(0)); }
  /// The data and the targets (PyTorch's `dataset.tensors`): `auto [x, y] = ds.tensors();`.
  std::tuple<Tensor<T>, Tensor<U>> tensors() const { return {data_, target_}; }
  /// Example i: data[i] and target[i], contiguous.
  Example<Tensor<T>, Tensor<U>> get(std::size_t i) const {
    CHORUS_CHECK(i < size(), "TensorDataset: index ", i, " out of range for ", size(), " examples");
    return {data_.select(0, static_cast<std::int64_t>(i)).contiguous(),
            target_.select(0, static_cast<std::int64_t>(i)).contiguous()};
  }
  /// The examples `idx`, stacked along dimension 0 (index_select, without recording grad).
  Example<Tensor<T>, Tensor<U>> get_batch(const std::vector<std::size_t>& idx) const {
    std::vector<std::int64_t> v(idx.begin(), idx.end());
    for (auto i : idx) CHORUS_CHECK(i < size(), "TensorDataset: index ", i, " out of range for ", size(), " examples");
    auto index = from_vector<std::int64_t>(v, Shape{static_cast<std::int64_t>(v.size())}, data_.device());
    NoGradGuard g;
    return {data_.index_select(0, index), target_.index_select(0, index)};
  }

 private:
  Tensor<T> data_;
  Tensor<U> target_;
};

}  // namespace data
CHORUS_NAMESPACE_END

// The instances chorus::compiled holds (Note [compiled chorus] in compiled.hpp).
#define CHORUS_DATA_DATASET_INSTANCES(X, T)                        \
  X(Tensor<T> data::stack_batch<T>(const std::vector<Tensor<T>>&))
CHORUS_EXTERN_INSTANCES(CHORUS_DATA_DATASET_INSTANCES, CHORUS_ALL_DTYPES)
