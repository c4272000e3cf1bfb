#pragma once
// gather: per-device outputs joined along a dimension on one device (differentiable; its
// backward sends each device its slice of the gradient), also outputs that nest tensors in
// tuples, vectors, maps and optionals (Note [nested arguments]), as torch.nn.parallel.gather.
#include <limits>
#include <string>
#include <vector>

#include "../compiled.hpp"
#include "../ops/ops.hpp"
#include "arguments.hpp"

CHORUS_NAMESPACE_BEGIN
namespace parallel {
namespace detail {

template <class T>
class GatherBackward final : public autograd::Node<T> {
 public:
  GatherBackward(int dim, std::vector<std::int64_t> sizes, std::vector<Device> devices, bool stacked)
      : dim_(dim), sizes_(std::move(sizes)), devices_(std::move(devices)), stacked_(stacked) {}
  std::string name() const override { return "GatherBackward"; }
  typename autograd::Node<T>::TensorList apply(typename autograd::Node<T>::TensorList&& g) override {
    typename autograd::Node<T>::TensorList out;
    std::int64_t start = 0;
    for (std::size_t i = 0; i < sizes_.size(); ++i) {
      if (!this->next_edges()[i].valid()) {
        out.emplace_back();
      } else {
        Tensor<T> part = g[0].narrow(dim_, start, sizes_[i]);
        if (stacked_) part = ops::detail::view_as_shape(ops::detail::contiguous_data(part), Shape{});
        auto moved = Tensor<T>::empty(part.shape(), devices_[i]);
        backend::copy(moved, part);
        out.push_back(std::move(moved));
      }
      start += sizes_[i];
    }
    return out;
  }

 private:
  int dim_;
  std::vector<std::int64_t> sizes_;
  std::vector<Device> devices_;
  bool stacked_;
};

}  // namespace detail

/// Joins `parts` (one per device, equal shapes but for `dim`) along `dim` on `device`.
/// 0-dim parts (a per-replica loss, say) are stacked into a vector, as torch's Gather does.
template <class T>
Tensor<T> gather(const std::vector<Tensor<T>>& parts, std::int64_t dim, Device device) {
  CHORUS_CHECK(!parts.empty(), "gather: no tensors");
  for (std::size_t i = 0; i < parts.size(); ++i)
    CHORUS_CHECK(parts[i].defined(), "gather: output of replica ", i, " is an undefined tensor");
  const bool stacked = parts[0].dim() == 0;
  const int d = stacked ? 0 : wrap_dim(dim, parts[0].dim());
  Shape shape = stacked ? Shape{0} : parts[0].shape();
  shape[d] = 0;
  std::vector<std::int64_t> sizes;
  std::vector<Device> devices;
  bool grad = false;
  for (std::size_t i = 0; i < parts.size(); ++i) {
    const auto& p = parts[i];
    bool ok = p.dim() == parts[0].dim();
    for (int k = 0; ok && k < p.dim(); ++k) ok = k == d || p.shape()[k] == parts[0].shape()[k];
    CHORUS_CHECK(ok, "gather: output of replica ", i, " has shape ", p.shape(), ", incompatible with replica 0's ",
                 parts[0].shape(), " along dimension ", d);
    const std::int64_t n = stacked ? 1 : p.shape()[d];
    shape[d] += n;
    sizes.push_back(n);
    devices.push_back(p.device());
    grad = grad || p.requires_grad();
  }
  auto out = Tensor<T>::empty(shape, device);
  std::int64_t start = 0;
  for (std::size_t i = 0; i < parts.size(); ++i) {
    auto slot = out.detach().narrow(d, start, sizes[i]);
    backend::copy(slot, stacked ? ops::detail::view_as_shape(parts[i].detach().contiguous(), Shape{1}) : parts[i]);
    start += sizes[i];
  }
  if (grad && autograd::is_grad_enabled()) {
    auto node = std::make_shared<detail::GatherBackward<T>>(d, sizes, devices, stacked);
    for (const auto& p : parts) node->add_next_edge(autograd::gradient_edge(p));
    autograd::set_history(out, std::shared_ptr<autograd::Node<T>>(node));
  }
  return out;
}

namespace detail {

/// The whole batch's loss from the replicas' losses (one value each, replica r's a mean over
/// `counts[r]` elements: its rows, or its targets not ignored) on `device`: Reduction::Mean
/// weights each by its share of the counts (a replica that counted nothing, whose mean is NaN,
/// weighs nothing; all of them counting nothing give NaN, as the gathered loss would),
/// Reduction::Sum adds them. Differentiable: one gather of the scalars, then a weighted sum on
/// `device`.
template <class T>
Tensor<T> combine_losses(const std::vector<Tensor<T>>& losses, const std::vector<std::int64_t>& counts,
                         Reduction reduction, Device device) {
  CHORUS_CHECK(reduction != Reduction::None, "combine_losses: the replicas' losses combine by Reduction::Mean or "
                                             "Reduction::Sum, not None");
  std::vector<Tensor<T>> scalars;
  for (std::size_t r = 0; r < losses.size(); ++r) {
    CHORUS_CHECK(losses[r].defined() && losses[r].numel() == 1, "DataParallel::forward_loss: the criterion returned ",
                 losses[r].defined() ? "a tensor of shape " + losses[r].shape().str() : std::string("an undefined tensor"),
                 " in replica ", r, "; it must return one value (a reduced loss)");
    scalars.push_back(losses[r].dim() == 0 ? losses[r] : losses[r].reshape(Shape{}));
  }
  if (reduction == Reduction::Sum) return sum(gather(scalars, 0, device));
  std::int64_t total = 0;
  for (auto c : counts) total += c;
  if (total == 0) return mul(sum(gather(scalars, 0, device)), std::numeric_limits<double>::quiet_NaN());
  std::vector<Tensor<T>> counted;
  std::vector<T> share;
  for (std::size_t r = 0; r < losses.size(); ++r) {
    if (counts[r] == 0) continue;
    counted.push_back(scalars[r]);
    share.push_back(static_cast<T>(static_cast<double>(counts[r]) / static_cast<double>(total)));
  }
  return sum(mul(gather(counted, 0, device), from_vector(share, device)));
}

/// Joins the replicas' values of one output (`parts`, one per replica) found at `path`.
template <class X>
X gather_nested(const std::vector<X>& parts, std::int64_t dim, Device device, const LeafPath& path) {
  auto where = [&] { return "output" + path.str(); };
  if constexpr (is_tensor_v<X>) {
    const bool defined = parts[0].defined();
    for (std::size_t r = 1; r < parts.size(); ++r)
      CHORUS_CHECK(parts[r].defined() == defined, "gather: ", where(), " is ", defined ? "defined" : "undefined",
                   " in replica 0 but not in replica ", r);
    if (!defined) return X();  // undefined in every replica (PyTorch's None)
    try {
      return parallel::gather(parts, dim, device);
    } catch (const Error& e) {
      throw Error(std::string(e.what()) + " (" + where() + ")");
    }
  } else if constexpr (!contains_tensor_v<X>) {
    for (std::size_t r = 1; r < parts.size(); ++r)
      CHORUS_CHECK(parts[r] == parts[0], "gather: ", where(), " (not a tensor) differs between replica 0 and replica ",
                   r, "; a value that is not a tensor is taken from replica 0, so every replica must return the same");
    return parts[0];
  } else if constexpr (is_tuple_like<X>::value || is_array<X>::value) {
    auto column = [&]<std::size_t I>(std::integral_constant<std::size_t, I>) {
      using E = std::remove_cvref_t<decltype(std::get<I>(parts[0]))>;
      std::vector<E> col;
      col.reserve(parts.size());
      for (const auto& p : parts) col.push_back(std::get<I>(p));
      return gather_nested(col, dim, device, LeafPath{&path, I, nullptr});
    };
    return [&]<std::size_t... I>(std::index_sequence<I...>) {
      return X{column(std::integral_constant<std::size_t, I>{})...};
    }(std::make_index_sequence<std::tuple_size_v<X>>{});
  } else if constexpr (is_vector<X>::value) {
    X out;
    for (std::size_t r = 1; r < parts.size(); ++r)
      CHORUS_CHECK(parts[r].size() == parts[0].size(), "gather: ", where(), " has ", parts[0].size(),
                   " elements in replica 0 but ", parts[r].size(), " in replica ", r);
    for (std::size_t i = 0; i < parts[0].size(); ++i) {
      std::vector<typename X::value_type> col;
      for (const auto& p : parts) col.push_back(p[i]);
      out.push_back(gather_nested(col, dim, device, LeafPath{&path, i, nullptr}));
    }
    return out;
  } else if constexpr (is_string_map<X>::value) {
    X out;
    for (const auto& [key, value] : parts[0]) {
      std::vector<typename X::mapped_type> col{value};
      for (std::size_t r = 1; r < parts.size(); ++r) {
        auto it = parts[r].find(key);
        CHORUS_CHECK(it != parts[r].end(), "gather: ", where(), " has key \"", key, "\" in replica 0 but not in replica ", r);
        col.push_back(it->second);
      }
      out.emplace(key, gather_nested(col, dim, device, LeafPath{&path, 0, &key}));
    }
    for (std::size_t r = 1; r < parts.size(); ++r)
      CHORUS_CHECK(parts[r].size() == parts[0].size(), "gather: ", where(), " has ", parts[r].size(),
                   " keys in replica ", r, " but ", parts[0].size(), " in replica 0");
    return out;
  } else {
    static_assert(is_optional<X>::value, "gather_nested: a type check_output refuses");
    for (std::size_t r = 1; r < parts.size(); ++r)
      CHORUS_CHECK(parts[r].has_value() == parts[0].has_value(), "gather: ", where(), " is ",
                   parts[0] ? "set" : "empty", " in replica 0 but not in replica ", r);
    if (!parts[0]) return X();
    std::vector<typename X::value_type> col;
    for (const auto& p : parts) col.push_back(*p);
    return X(gather_nested(col, dim, device, path));
  }
}

/// Joins the replicas' outputs: a tuple's or pair's element i along dims[i], anything else
/// along dims[0] (past the list: `fallback`).
template <class R>
R gather_outputs(const std::vector<R>& outs, const std::vector<std::int64_t>& dims, std::int64_t fallback,
                 Device device) {
  CHORUS_CHECK(!outs.empty(), "gather: no outputs");
  const LeafPath root{};
  if constexpr (is_tuple_like<R>::value) {
    auto column = [&]<std::size_t I>(std::integral_constant<std::size_t, I>) {
      using E = std::tuple_element_t<I, R>;
      std::vector<E> col;
      col.reserve(outs.size());
      for (const auto& o : outs) col.push_back(std::get<I>(o));
      return gather_nested(col, I < dims.size() ? dims[I] : fallback, device, LeafPath{&root, I, nullptr});
    };
    return [&]<std::size_t... I>(std::index_sequence<I...>) {
      return R(column(std::integral_constant<std::size_t, I>{})...);
    }(std::make_index_sequence<std::tuple_size_v<R>>{});
  } else {
    return gather_nested(outs, dims.empty() ? fallback : dims[0], device, LeafPath{});
  }
}

}  // namespace detail

/// torch.nn.parallel.gather: the replicas' outputs (one per replica, of one form: Note [nested
/// arguments]) joined on `target_device`, every tensor along `dim` (0-dim tensors stacked).
template <class R>
R gather(const std::vector<R>& outputs, Device target_device, std::int64_t dim = 0) {
  detail::check_output<R>();
  check_device(target_device);
  return detail::gather_outputs(outputs, {}, dim, target_device);
}

}  // namespace parallel
CHORUS_NAMESPACE_END

// The instances chorus::compiled holds (Note [compiled chorus] in compiled.hpp).
#define CHORUS_PARALLEL_GATHER_INSTANCES(X, T)                                          \
  X(Tensor<T> parallel::gather<T>(const std::vector<Tensor<T>>&, std::int64_t, Device))
CHORUS_EXTERN_INSTANCES(CHORUS_PARALLEL_GATHER_INSTANCES, CHORUS_ALL_DTYPES)
