#pragma once
// Which forward arguments and outputs DataParallel can split and join (Note [nested arguments]),
// and the walks over the tensors inside them.
#include <array>
#include <concepts>
#include <cstddef>
#include <functional>
#include <iterator>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <variant>
#include <vector>

#include "../compiled.hpp"
#include "../core/any_tensor.hpp"

CHORUS_NAMESPACE_BEGIN
namespace parallel::detail {

template <class X>
struct is_tensor : std::false_type {};
template <class T>
struct is_tensor<Tensor<T>> : std::true_type {};
template <class X>
inline constexpr bool is_tensor_v = is_tensor<std::remove_cvref_t<X>>::value;

// Note [nested arguments]
// DataParallel scatters every tensor of an argument, as PyTorch's scatter does: a Tensor, and
// the tensors inside a std::tuple, std::pair, std::array, std::vector, std::optional, the active
// alternative of a std::variant (PyTorch's dict of mixed values is a
// std::map<std::string, std::variant<Tensor<float>, int, ...>>) or a string-keyed std::map /
// std::unordered_map (nested as deep as wanted), each split along its argument's scatter dim;
// every other value is copied to each replica, and an undefined tensor inside such a container
// reaches every replica undefined (an LSTM's "no initial state").
// Outputs of the same forms are gathered: each tensor joined along its output's gather dim, a
// 0-dim tensor stacked into one value per replica, a non-tensor value taken from replica 0
// after checking that every replica returned the same. A tensor that DataParallel cannot see
// into -- an AnyTensor, behind a pointer, smart pointer or reference_wrapper, or in another
// container (std::list, std::set, std::span, ...) -- would reach every replica whole (each
// would run the whole batch, the gathered output would have k times the rows), so such an
// argument or output is refused at compile time (contains_tensor); so is an output variant
// (the replicas could return different alternatives). A tensor inside a user's
// own struct cannot be seen this way: pass it in one of the forms above.
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
  requires requires(X& x) {
    std::begin(x);
    std::end(x);
  }
struct contains_tensor<X> : contains_tensor<std::remove_cvref_t<decltype(*std::begin(std::declval<X&>()))>> {};

// The containers DataParallel sees into.
template <class X>
struct is_tuple_like : std::false_type {};  // std::tuple, std::pair: elements of their own types
template <class... Ts>
struct is_tuple_like<std::tuple<Ts...>> : std::true_type {};
template <class A, class B>
struct is_tuple_like<std::pair<A, B>> : std::true_type {};
template <class X>
struct is_array : std::false_type {};
template <class X, std::size_t N>
struct is_array<std::array<X, N>> : std::true_type {};
template <class X>
struct is_vector : std::false_type {};
template <class X, class A>
struct is_vector<std::vector<X, A>> : std::true_type {};
template <class X>
struct is_string_map : std::false_type {};
template <class V, class C, class A>
struct is_string_map<std::map<std::string, V, C, A>> : std::true_type {};
template <class V, class H, class E, class A>
struct is_string_map<std::unordered_map<std::string, V, H, E, A>> : std::true_type {};
template <class X>
struct is_optional : std::false_type {};
template <class X>
struct is_optional<std::optional<X>> : std::true_type {};
template <class X>
struct is_variant : std::false_type {};
template <class... Ts>
struct is_variant<std::variant<Ts...>> : std::true_type {};

/// X can be scattered (as an argument) and gathered (as an output, when `output`): its tensors
/// all lie in containers DataParallel sees into; values without tensors are copied (an output's
/// must compare with ==, to check that the replicas agree).
template <class X, bool output>
constexpr bool splittable() {
  using D = std::remove_cvref_t<X>;
  if constexpr (is_tensor_v<D>) {
    return true;
  } else if constexpr (!contains_tensor_v<D>) {
    return !output || std::equality_comparable<D>;
  } else if constexpr (is_tuple_like<D>::value) {
    return []<std::size_t... I>(std::index_sequence<I...>) {
      return (splittable<std::tuple_element_t<I, D>, output>() && ...);
    }(std::make_index_sequence<std::tuple_size_v<D>>{});
  } else if constexpr (is_array<D>::value || is_vector<D>::value || is_optional<D>::value) {
    return splittable<typename D::value_type, output>();
  } else if constexpr (is_string_map<D>::value) {
    return splittable<typename D::mapped_type, output>();
  } else if constexpr (is_variant<D>::value) {
    // An argument's active alternative is split as that alternative would be; an output's
    // could differ between the replicas.
    if constexpr (output) return false;
    else
      return []<std::size_t... I>(std::index_sequence<I...>) {
        return (splittable<std::variant_alternative_t<I, D>, false>() && ...);
      }(std::make_index_sequence<std::variant_size_v<D>>{});
  } else {
    return false;  // AnyTensor, a pointer, another container holding tensors
  }
}

/// An argument DataParallel can hand to its replicas (Note [nested arguments]).
template <class A>
inline constexpr bool is_replicable_argument_v = splittable<A, false>();

template <class A>
constexpr void check_argument() {
  static_assert(splittable<A, false>(),
                "DataParallel: this forward argument holds tensors DataParallel cannot split (an AnyTensor, or a "
                "tensor behind a pointer, smart pointer or reference_wrapper, or in a container other than "
                "std::tuple/pair/array/vector/optional/variant/map<std::string, ...>): it would reach every replica "
                "whole, unsplit (Note [nested arguments])");
}
template <class R>
constexpr void check_output() {
  static_assert(splittable<R, true>(),
                "DataParallel: forward returns tensors DataParallel cannot gather (an AnyTensor, or a tensor behind a "
                "pointer or variant, or in a container other than std::tuple/pair/array/vector/optional/"
                "map<std::string, ...>), or a value without tensors that is not comparable with == (Note [nested "
                "arguments])");
}

/// Where a tensor lies inside an argument or output: a chain of positions and keys, printed
/// as "[1][\"h\"]" (built on the stack while walking; printed only for an error).
struct LeafPath {
  const LeafPath* parent = nullptr;
  std::size_t index = 0;
  const std::string* key = nullptr;  // a map's key, else `index` is the position
  std::string str() const;
};

/// Calls f(tensor, path) for every tensor inside x (undefined ones too), in order.
template <class X, class F>
void for_each_tensor(const X& x, const LeafPath& path, F& f) {
  using D = std::remove_cvref_t<X>;
  if constexpr (is_tensor_v<D>) {
    f(x, path);
  } else if constexpr (!contains_tensor_v<D>) {
    return;
  } else if constexpr (is_tuple_like<D>::value) {
    [&]<std::size_t... I>(std::index_sequence<I...>) {
      (for_each_tensor(std::get<I>(x), LeafPath{&path, I, nullptr}, f), ...);
    }(std::make_index_sequence<std::tuple_size_v<D>>{});
  } else if constexpr (is_array<D>::value || is_vector<D>::value) {
    for (std::size_t i = 0; i < x.size(); ++i) for_each_tensor(x[i], LeafPath{&path, i, nullptr}, f);
  } else if constexpr (is_string_map<D>::value) {
    for (const auto& [k, v] : x) for_each_tensor(v, LeafPath{&path, 0, &k}, f);
  } else if constexpr (is_optional<D>::value) {
    if (x) for_each_tensor(*x, path, f);
  } else if constexpr (is_variant<D>::value) {
    std::visit([&](const auto& v) { for_each_tensor(v, path, f); }, x);
  }
}

template <class X, class F>
std::remove_cvref_t<X> map_tensors(const X& x, F& f);

/// map_tensors of a variant: the active alternative mapped, the same alternative.
template <std::size_t I, class D, class F>
D map_variant(const D& x, F& f) {
  if constexpr (I + 1 < std::variant_size_v<D>)
    if (x.index() != I) return map_variant<I + 1>(x, f);
  return D(std::in_place_index<I>, map_tensors(std::get<I>(x), f));
}

/// A copy of x with every tensor t replaced by f(t) (values without tensors copied as they are).
template <class X, class F>
std::remove_cvref_t<X> map_tensors(const X& x, F& f) {
  using D = std::remove_cvref_t<X>;
  if constexpr (is_tensor_v<D>) {
    return f(x);
  } else if constexpr (!contains_tensor_v<D>) {
    return x;
  } else if constexpr (is_tuple_like<D>::value) {
    return std::apply([&](const auto&... e) { return D(map_tensors(e, f)...); }, x);
  } else if constexpr (is_array<D>::value) {
    return [&]<std::size_t... I>(std::index_sequence<I...>) {
      return D{map_tensors(x[I], f)...};
    }(std::make_index_sequence<std::tuple_size_v<D>>{});
  } else if constexpr (is_vector<D>::value) {
    D out;
    out.reserve(x.size());
    for (const auto& e : x) out.push_back(map_tensors(e, f));
    return out;
  } else if constexpr (is_string_map<D>::value) {
    D out;
    for (const auto& [k, v] : x) out.emplace(k, map_tensors(v, f));
    return out;
  } else if constexpr (is_variant<D>::value) {
    return map_variant<0>(x, f);
  } else {
    static_assert(is_optional<D>::value, "map_tensors: a type check_argument refuses");
    return x ? D(map_tensors(*x, f)) : D();
  }
}

/// The number of top-level elements a per-element dim list (scatter_dims of an argument list,
/// gather_dims of an output) may name for X: a tuple's or pair's elements, else one.
template <class X>
constexpr std::size_t top_level_size() {
  if constexpr (is_tuple_like<std::remove_cvref_t<X>>::value) return std::tuple_size_v<std::remove_cvref_t<X>>;
  else return 1;
}

}  // namespace parallel::detail
CHORUS_NAMESPACE_END

// The definitions: compiled into chorus::compiled, or here in the header-only form (Note
// [compiled chorus] in compiled.hpp).
#if !CHORUS_COMPILED
#include "arguments_impl.hpp"
#endif
