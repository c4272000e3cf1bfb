#pragma once
// All differentiable operations.
#include "../compiled.hpp"
#include "common.hpp"
#include "elementwise.hpp"
#include "factory.hpp"
#include "inplace.hpp"
#include "linalg.hpp"
#include "loss.hpp"
#include "nn.hpp"
#include "print.hpp"
#include "reduce.hpp"
#include "view.hpp"

// The sequence-model operators, last: chorus::max, min, abs, ... would hide the math library's
// overloads from an unqualified call in a kernel header parsed after them.
#include "index.hpp"
#include "minmax.hpp"
#include "shape.hpp"
#include "statistics.hpp"
// Attention, built from the operators above.
#include "attention.hpp"
// cross_entropy's options form (class weight, label smoothing, any rank), built from them too.
#include "cross_entropy.hpp"

// The instances chorus::compiled holds (Note [compiled chorus] in compiled.hpp): Tensor<T>
// whole for the floating dtypes (its members defined in the headers above), and for int64 the
// members an integer tensor has (matmul, norm, backward and the like are floating-point only).
#define CHORUS_OPS_TENSOR_INSTANCES(X, T) X(class Tensor<T>)
CHORUS_EXTERN_INSTANCES(CHORUS_OPS_TENSOR_INSTANCES, CHORUS_FLOATING_DTYPES)
#define CHORUS_OPS_INT_TENSOR_INSTANCES(X, T)                                                                  \
  X(Tensor<T> Tensor<T>::gather(std::int64_t, const Tensor<std::int64_t>&) const)                              \
  X(Tensor<T> Tensor<T>::scatter_add(std::int64_t, const Tensor<std::int64_t>&, const Tensor&) const)          \
  X(Tensor<T> Tensor<T>::masked_fill(const Tensor<std::int64_t>&, double) const)                               \
  X(Tensor<T> Tensor<T>::permute(const std::vector<std::int64_t>&) const)                                      \
  X(Tensor<T> Tensor<T>::movedim(std::int64_t, std::int64_t) const)                                            \
  X(Tensor<T> Tensor<T>::movedim(const std::vector<std::int64_t>&, const std::vector<std::int64_t>&) const)    \
  X(Tensor<T> Tensor<T>::expand(const Shape&) const)                                                           \
  X(Tensor<T> Tensor<T>::tril(std::int64_t) const)                                                             \
  X(Tensor<T> Tensor<T>::triu(std::int64_t) const)                                                             \
  X(Tensor<T>& Tensor<T>::add_(const Tensor&, double))                                                         \
  X(Tensor<T>& Tensor<T>::sub_(const Tensor&, double))                                                         \
  X(Tensor<T>& Tensor<T>::mul_(const Tensor&))                                                                 \
  X(Tensor<T>& Tensor<T>::add_(double))                                                                        \
  X(Tensor<T>& Tensor<T>::sub_(double))                                                                        \
  X(Tensor<T>& Tensor<T>::mul_(double))                                                                        \
  X(Tensor<T> Tensor<T>::max() const)                                                                          \
  X(Tensor<T> Tensor<T>::min() const)                                                                          \
  X(std::tuple<Tensor<T>, Tensor<std::int64_t>> Tensor<T>::max(std::int64_t, bool) const)                      \
  X(std::tuple<Tensor<T>, Tensor<std::int64_t>> Tensor<T>::min(std::int64_t, bool) const)                      \
  X(Tensor<T> Tensor<T>::amax(const std::vector<std::int64_t>&, bool) const)                                   \
  X(Tensor<T> Tensor<T>::amin(const std::vector<std::int64_t>&, bool) const)                                   \
  X(Tensor<std::int64_t> Tensor<T>::argmax(std::optional<std::int64_t>, bool) const)                           \
  X(Tensor<std::int64_t> Tensor<T>::argmin(std::optional<std::int64_t>, bool) const)                           \
  X(std::tuple<Tensor<T>, Tensor<std::int64_t>> Tensor<T>::topk(std::int64_t, std::int64_t, bool, bool) const) \
  X(Tensor<T> Tensor<T>::sum() const)                                                                          \
  X(Tensor<T> Tensor<T>::sum(std::int64_t, bool) const)                                                        \
  X(Tensor<T> Tensor<T>::mean() const)                                                                         \
  X(Tensor<T> Tensor<T>::mean(std::int64_t, bool) const)                                                       \
  X(Tensor<T> Tensor<T>::sum(const std::vector<std::int64_t>&, bool) const)                                    \
  X(Tensor<T> Tensor<T>::mean(const std::vector<std::int64_t>&, bool) const)                                   \
  X(Tensor<T> Tensor<T>::sum(std::initializer_list<std::int64_t>, bool) const)                                 \
  X(Tensor<T> Tensor<T>::mean(std::initializer_list<std::int64_t>, bool) const)                                \
  X(Tensor<T> Tensor<T>::cumsum(std::int64_t) const)                                                           \
  X(Tensor<T> Tensor<T>::narrow(std::int64_t, std::int64_t, std::int64_t) const)                               \
  X(Tensor<T> Tensor<T>::slice(std::int64_t, std::int64_t, std::int64_t) const)                                \
  X(Tensor<T> Tensor<T>::select(std::int64_t, std::int64_t) const)                                             \
  X(Tensor<T> Tensor<T>::contiguous() const)                                                                   \
  X(Tensor<T> Tensor<T>::clone() const)                                                                        \
  X(Tensor<T> Tensor<T>::view(const Shape&) const)                                                             \
  X(Tensor<T> Tensor<T>::reshape(const Shape&) const)                                                          \
  X(Tensor<T> Tensor<T>::flatten(std::int64_t, std::int64_t) const)                                            \
  X(Tensor<T> Tensor<T>::unsqueeze(std::int64_t) const)                                                        \
  X(Tensor<T> Tensor<T>::squeeze(std::int64_t) const)                                                          \
  X(Tensor<T> Tensor<T>::transpose(std::int64_t, std::int64_t) const)                                          \
  X(Tensor<T> Tensor<T>::t() const)                                                                            \
  X(Tensor<T> Tensor<T>::to(Device) const)                                                                     \
  X(std::vector<T> Tensor<T>::to_vector() const)                                                               \
  X(Tensor<T>& Tensor<T>::fill_(T))                                                                            \
  X(Tensor<T>& Tensor<T>::zero_())                                                                             \
  X(Tensor<T>& Tensor<T>::copy_(const Tensor<T>&))                                                             \
  X(Tensor<T> Tensor<T>::index_select(std::int64_t, const Tensor<std::int64_t>&) const)
CHORUS_EXTERN_INSTANCES(CHORUS_OPS_INT_TENSOR_INSTANCES, CHORUS_INT_DTYPES)
// The conversions between dtypes (Tensor<T>::to<U>, ops/view.hpp), from each dtype T.
#define CHORUS_OPS_CONVERT_INSTANCES(X, T)                 \
  X(Tensor<float> Tensor<T>::to<float>() const)            \
  X(Tensor<double> Tensor<T>::to<double>() const)          \
  X(Tensor<bfloat16> Tensor<T>::to<bfloat16>() const)      \
  X(Tensor<half> Tensor<T>::to<half>() const)              \
  X(Tensor<std::int64_t> Tensor<T>::to<std::int64_t>() const)
CHORUS_EXTERN_INSTANCES(CHORUS_OPS_CONVERT_INSTANCES, CHORUS_ALL_DTYPES)
