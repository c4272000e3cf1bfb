#pragma once
// Which forward arguments DataParallel can hand to its replicas (Note [nested arguments]).
#include <functional>
#include <memory>
#include <optional>
#include <ranges>
#include <tuple>
#include <type_traits>
#include <utility>
#include <variant>

#include "../core/any_tensor.hpp"

CHORUS_NAMESPACE_BEGIN
namespace parallel::detail {

template <class X>
struct is_tensor : std::false_type {};
template <class T>
struct is_tensor<Tensor<T>> : std::true_type {};
template <class X>
inline constexpr bool is_tensor_v = is_tensor<std::decay_t<X>>::value;

// Note [nested arguments]
// DataParallel scatters each argument that is a Tensor and hands every other argument to each
// replica as it is. A tensor inside another argument (a tuple, pair, vector, optional, map,
// variant, pointer, AnyTensor) would reach every replica whole: each would run the whole
// batch and the gathered output would have k times the rows. Until nested arguments are
// scattered, such an argument is refused at compile time (contains_tensor). A tensor inside a
// user's own struct cannot be seen this way: pass tensors as Tensor arguments.
template <class X>
struct contains_tensor;
template <class X>
inline constexpr bool contains_tensor_v = contains_tensor<std::remove_cvref_t<X>>::value;
template <class X>
struct contains_tensor : std::false_type {};
template <class T>
struct contains_tensor<Tensor<T>> : std::true_type {};
template <>
struct contains_tensor<AnyTensor> : std::true_type {};
template <class... Ts>
struct contains_tensor<std::tuple<Ts...>> : std::bool_constant<(contains_tensor_v<Ts> || ...)> {};
template <class A, class B>
struct contains_tensor<std::pair<A, B>> : std::bool_constant<contains_tensor_v<A> || contains_tensor_v<B>> {};
template <class... Ts>
struct contains_tensor<std::variant<Ts...>> : std::bool_constant<(contains_tensor_v<Ts> || ...)> {};
template <class X>
struct contains_tensor<std::optional<X>> : contains_tensor<std::remove_cvref_t<X>> {};
template <class X>
struct contains_tensor<X*> : contains_tensor<std::remove_cvref_t<X>> {};
template <class X>
struct contains_tensor<std::shared_ptr<X>> : contains_tensor<std::remove_cvref_t<X>> {};
template <class X, class D>
struct contains_tensor<std::unique_ptr<X, D>> : contains_tensor<std::remove_cvref_t<X>> {};
template <class X>
struct contains_tensor<std::reference_wrapper<X>> : contains_tensor<std::remove_cvref_t<X>> {};
template <class X>
  requires std::ranges::range<X>
struct contains_tensor<X> : contains_tensor<std::remove_cvref_t<std::ranges::range_value_t<X>>> {};

/// An argument DataParallel can hand to its replicas: a Tensor (scattered) or a value that
/// holds no tensor (copied to each replica).
template <class A>
inline constexpr bool is_replicable_argument_v = is_tensor_v<A> || !contains_tensor_v<A>;

template <class A>
constexpr void check_argument() {
  static_assert(is_replicable_argument_v<A>,
                "DataParallel: this forward argument holds tensors but is not itself a Tensor (a tuple, pair, "
                "vector, optional, pointer, AnyTensor...): it would reach every replica whole, unsplit (Note "
                "[nested arguments]). Pass each tensor as a Tensor argument of forward");
}

}  // namespace parallel::detail
CHORUS_NAMESPACE_END
