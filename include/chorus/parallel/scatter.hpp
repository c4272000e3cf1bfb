#pragma once
// scatter: the tensors of an argument (nested in tuples, vectors, maps, ...) split across
// devices, as torch.nn.parallel.scatter; values without tensors copied (Note [nested arguments]).
// Differentiable: a slice's gradient flows back into the tensor it was cut from.
#include <string>
#include <vector>

#include "../compiled.hpp"
#include "../core/profiler.hpp"
#include "arguments.hpp"
#include "chunk_plan.hpp"
#include "data_parallel_options.hpp"

CHORUS_NAMESPACE_BEGIN
namespace parallel {
namespace detail {

/// The size every tensor of a call is split along, and the first tensor's (wrapped) dim.
struct SplitSize {
  std::int64_t batch = -1;  // -1: no defined tensor to split
  int dim = 0;
};

/// dims[i] for element i, `fallback` past the end of the list.
inline std::int64_t dim_at(const std::vector<std::int64_t>& dims, std::size_t i, std::int64_t fallback) {
  return i < dims.size() ? dims[i] : fallback;
}

/// Finds the split size of a call's tensors and checks that they agree, naming the tensor that
/// does not: `what` is "argument" (named "argument 1[0]") or "input" (named "input[0]").
class SplitMeasure {
 public:
  enum Naming { Numbered, Indexed, Whole };  // "argument 1[0]", "input[1][0]", "input[0]"
  SplitMeasure(const char* who, const char* what, const char* dims_name, Naming naming)
      : who_(who), what_(what), dims_name_(dims_name), naming_(naming) {}

  /// Adds the tensors of element `index`, split along `dim` (`listed`: taken from the dim list).
  template <class A>
  void add(const A& a, std::size_t index, std::int64_t dim, bool listed) {
    if (dim == kBroadcast) return;  // not split: measures nothing
    auto leaf = [&](const auto& t, const LeafPath& path) {
      if (!t.defined()) {  // an undefined tensor inside a container reaches every replica undefined
        CHORUS_CHECK(path.parent != nullptr, who_, ": ", name(index, path), " is an undefined tensor");
        return;
      }
      const std::int64_t d = dim < 0 ? dim + t.dim() : dim;
      CHORUS_CHECK(d >= 0 && d < t.dim(), who_, ": ", name(index, path), " of shape ", t.shape(),
                   " has no dimension ", dim, " to split along",
                   listed ? " (" + std::string(dims_name_) + "[" + std::to_string(index) + "] = " + std::to_string(dim) + ")"
                          : std::string());
      const std::int64_t n = t.shape()[static_cast<int>(d)];
      if (size_.batch < 0) {
        size_.batch = n;
        size_.dim = static_cast<int>(d);
        first_ = name(index, path);
      }
      CHORUS_CHECK(n == size_.batch, who_, ": tensors disagree in the size they are split along: ", first_, " has ",
                   size_.batch, " in dimension ", size_.dim, ", ", name(index, path), " has ", n, " in dimension ", d);
    };
    for_each_tensor(a, LeafPath{}, leaf);
  }
  const SplitSize& size() const { return size_; }

 private:
  std::string name(std::size_t index, const LeafPath& path) const;
  const char* who_;
  const char* what_;
  const char* dims_name_;
  Naming naming_;
  SplitSize size_;
  std::string first_;
};

/// Rows [offset, offset + size) along `dim` of every tensor of `a`, on `device` (all of each,
/// for kBroadcast; undefined tensors stay undefined); a value without tensors as it is (a
/// reference, not a copy).
template <class A>
decltype(auto) scatter_part(const A& a, std::int64_t dim, std::int64_t offset, std::int64_t size, Device device) {
  auto part = [&](const auto& t) {
    if (!t.defined()) return t;
    profiler::Scope span(profiler::Category::copy, "scatter");
    if (span.active()) {
      span.set_device(device);
      using T = typename std::remove_cvref_t<decltype(t)>::value_type;
      const std::int64_t rows = dim == kBroadcast ? 1 : std::max<std::int64_t>(t.size(dim), 1);
      span.set_bytes(t.numel() / rows * (dim == kBroadcast ? 1 : size) * static_cast<std::int64_t>(sizeof(T)));
    }
    if (dim == kBroadcast) return t.to(device);
    return t.narrow(dim < 0 ? dim + t.dim() : dim, offset, size).to(device);
  };
  if constexpr (is_tensor_v<A>) return part(a);
  else if constexpr (!contains_tensor_v<A>) return (a);
  else return map_tensors(a, part);
}

/// Every tensor of `a` moved to `device` (a no-op for those already there).
template <class A>
decltype(auto) move_part(const A& a, Device device) {
  auto move = [&](const auto& t) { return t.defined() ? t.to(device) : t; };
  if constexpr (is_tensor_v<A>) return move(a);
  else if constexpr (!contains_tensor_v<A>) return (a);
  else return map_tensors(a, move);
}

/// Calls f(element, index) for a tuple's or pair's elements, else f(x, 0).
template <class X, class F>
void for_each_top(const X& x, F&& f) {
  if constexpr (is_tuple_like<std::remove_cvref_t<X>>::value) {
    [&]<std::size_t... I>(std::index_sequence<I...>) {
      (f(std::get<I>(x), I), ...);
    }(std::make_index_sequence<std::tuple_size_v<std::remove_cvref_t<X>>>{});
  } else {
    f(x, std::size_t{0});
  }
}

CHORUS_INLINE void check_dims_fit(const char* who, const char* dims_name, std::size_t dims, std::size_t elements,
                                  const char* elements_name);

}  // namespace detail

/// torch.nn.parallel.scatter: `input` cut into one piece per chunk of the batch (Note [chunk
/// plan]: there may be fewer pieces than devices), piece r on devices[r]. Every tensor inside
/// `input` (Note [nested arguments]) is split along `dims[i]` for a tuple's or pair's element i
/// (a single value: dims[0]; past the list: 0); values without tensors are copied, and an input
/// without any tensor is copied once per device, as PyTorch's.
template <class A>
std::vector<std::remove_cvref_t<A>> scatter(const A& input, const std::vector<Device>& devices,
                                            const std::vector<std::int64_t>& dims) {
  using D = std::remove_cvref_t<A>;
  detail::check_argument<A>();
  CHORUS_CHECK(!devices.empty(), "scatter: no devices");
  for (const auto& d : devices) check_device(d);
  constexpr bool tuple = detail::is_tuple_like<D>::value;
  detail::check_dims_fit("scatter", "dims", dims.size(), detail::top_level_size<A>(),
                         tuple ? "elements in the input" : "input (not a tuple)");
  detail::SplitMeasure measure("scatter", "input", "dims", tuple ? detail::SplitMeasure::Indexed
                                                                  : detail::SplitMeasure::Whole);
  detail::for_each_top(input, [&](const auto& e, std::size_t i) { measure.add(e, i, detail::dim_at(dims, i, 0), i < dims.size()); });
  const auto batch = measure.size().batch;
  if (batch < 0) return std::vector<D>(devices.size(), input);
  const auto plan = plan_chunks(batch, devices.size());
  std::vector<D> out;
  out.reserve(plan.used());
  for (std::size_t r = 0; r < plan.used(); ++r) {
    if constexpr (tuple) {
      out.push_back([&]<std::size_t... I>(std::index_sequence<I...>) {
        return D(detail::scatter_part(std::get<I>(input), detail::dim_at(dims, I, 0), plan.offsets[r], plan.sizes[r],
                                      devices[r])...);
      }(std::make_index_sequence<std::tuple_size_v<D>>{}));
    } else {
      out.push_back(detail::scatter_part(input, detail::dim_at(dims, 0, 0), plan.offsets[r], plan.sizes[r], devices[r]));
    }
  }
  return out;
}
/// scatter with every tensor split along `dim` (torch.nn.parallel.scatter(inputs, devices, dim)).
template <class A>
std::vector<std::remove_cvref_t<A>> scatter(const A& input, const std::vector<Device>& devices, std::int64_t dim = 0) {
  std::vector<std::int64_t> dims(detail::top_level_size<A>(), dim);
  return scatter(input, devices, dims);
}

}  // namespace parallel
CHORUS_NAMESPACE_END

// The definitions: compiled into chorus::compiled, or here in the header-only form (Note
// [compiled chorus] in compiled.hpp).
#if !CHORUS_COMPILED
#include "scatter_impl.hpp"
#endif
