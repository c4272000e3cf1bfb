#pragma once
// Activation checkpointing for users: nn::utils::checkpoint(fn, args...) (PyTorch's
// torch.utils.checkpoint.checkpoint with use_reentrant=False) and the module wrapper
// nn::Checkpoint(block). How it works: Note [activation checkpointing] in autograd/checkpoint.hpp.
#include <array>
#include <functional>
#include <memory>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "../autograd/checkpoint.hpp"
#include "module.hpp"

CHORUS_NAMESPACE_BEGIN
namespace nn {
namespace detail {

/// What a checkpointed function may return: a tensor, a std::vector of tensors or a std::tuple
/// of tensors, all of one floating dtype (the gradients the checkpoint node takes).
template <class R>
struct CheckpointResult {
  static constexpr bool ok = false;
};
template <class T>
  requires is_floating_v<T>
struct CheckpointResult<Tensor<T>> {
  static constexpr bool ok = true;
  using value_type = T;
  static std::vector<Tensor<T>> flatten(Tensor<T> r) { return {std::move(r)}; }
  static Tensor<T> unflatten(std::vector<Tensor<T>> v) { return std::move(v[0]); }
};
template <class T>
  requires is_floating_v<T>
struct CheckpointResult<std::vector<Tensor<T>>> {
  static constexpr bool ok = true;
  using value_type = T;
  static std::vector<Tensor<T>> flatten(std::vector<Tensor<T>> r) { return r; }
  static std::vector<Tensor<T>> unflatten(std::vector<Tensor<T>> v) { return v; }
};
template <class T, class... Ts>
  requires(is_floating_v<T> && (std::is_same_v<Ts, Tensor<T>> && ...))
struct CheckpointResult<std::tuple<Tensor<T>, Ts...>> {
  static constexpr bool ok = true;
  using value_type = T;
  using Tuple = std::tuple<Tensor<T>, Ts...>;
  static std::vector<Tensor<T>> flatten(Tuple r) {
    return std::apply([](auto&... t) { return std::vector<Tensor<T>>{std::move(t)...}; }, r);
  }
  static Tuple unflatten(std::vector<Tensor<T>> v) {
    return [&]<std::size_t... I>(std::index_sequence<I...>) { return Tuple(std::move(v[I])...); }(
        std::index_sequence_for<Tensor<T>, Ts...>{});
  }
};

template <class A>
struct is_tensor : std::false_type {};
template <class U>
struct is_tensor<Tensor<U>> : std::true_type {};

/// Argument `a` as the checkpointed function gets it: the input tensor in slot `slot` of
/// `inputs` (a detached copy when recomputing) if it is a tracked tensor, else `a` itself.
template <class A>
const A& checkpoint_argument(const A& a, int slot, const std::vector<AnyTensor>& inputs) {
  if constexpr (is_tensor<A>::value) {
    if (slot >= 0) return inputs[static_cast<std::size_t>(slot)].template as<typename A::value_type>();
  }
  return a;
}

/// Calls `runner(run, inputs, reads)` for fn(args...) as a graph function (what
/// autograd::checkpoint and a FullyShard unit take): `run` maps the tracked tensor arguments
/// (those that require grad, in argument order: `inputs`) to fn's outputs as a vector; `reads`
/// are the other tensor arguments. Returns the runner's outputs in fn's own form.
template <class F, class Runner, class... Args>
auto call_as_graph_function(F fn, Runner&& runner, const Args&... args) {
  using R = std::invoke_result_t<F&, const Args&...>;
  using Result = CheckpointResult<R>;
  static_assert(Result::ok,
                "nn::utils::checkpoint and dist::FullyShard: the function (or forward) must return a Tensor<T>, a "
                "std::vector<Tensor<T>> or a std::tuple of Tensor<T>, all of one floating-point type T");
  if constexpr (Result::ok) {
    using T = typename Result::value_type;
    auto saved = std::make_shared<const std::tuple<Args...>>(args...);
    std::array<int, sizeof...(Args)> slot{};
    std::vector<AnyTensor> inputs, reads;
    auto track = [&](const auto& a) -> int {
      using A = std::decay_t<decltype(a)>;
      if constexpr (is_tensor<A>::value) {
        if constexpr (is_floating_v<typename A::value_type>) {
          if (a.defined() && a.requires_grad()) {
            inputs.emplace_back(a);
            return static_cast<int>(inputs.size()) - 1;
          }
        }
        if (a.defined()) reads.emplace_back(a);
      }
      return -1;
    };
    [&]<std::size_t... I>(std::index_sequence<I...>) { ((slot[I] = track(std::get<I>(*saved))), ...); }(
        std::index_sequence_for<Args...>{});
    autograd::CheckpointFn<T> run = [fn = std::move(fn), saved, slot](const std::vector<AnyTensor>& in) mutable {
      return [&]<std::size_t... I>(std::index_sequence<I...>) {
        return Result::flatten(std::invoke(fn, checkpoint_argument(std::get<I>(*saved), slot[I], in)...));
      }(std::index_sequence_for<Args...>{});
    };
    return Result::unflatten(runner(std::move(run), std::move(inputs), std::move(reads)));
  }
}

}  // namespace detail

namespace utils {

/// Calls `fn(args...)` without keeping its activations: backward runs it again to recompute
/// them (torch.utils.checkpoint.checkpoint with use_reentrant=False; Note [activation
/// checkpointing]). The gradients equal those of calling fn directly, for its tensor arguments
/// and for every tensor it uses that requires grad (the parameters of the modules it calls).
/// `fn` returns a Tensor<T>, a std::vector<Tensor<T>> or a std::tuple of Tensor<T> (one floating
/// T); `args` are kept until backward (tensors by handle: do not change them in place). Dropout
/// inside draws the same masks again; batch norm moves its running statistics once. fn must do
/// the same operations each time it runs, and must not draw host random numbers (rand, randn);
/// SyncBatchNorm cannot train inside it. fn is kept until backward, which calls it again: capture
/// by value what it uses (a `[&]` lambda's references dangle once its scope ends), and keep the
/// objects it points to (a module) alive until then.
template <class F, class... Args>
auto checkpoint(F fn, const Args&... args) {
  return nn::detail::call_as_graph_function(
      std::move(fn),
      [](auto run, std::vector<AnyTensor> inputs, std::vector<AnyTensor> reads) {
        using T = typename decltype(run)::result_type::value_type::value_type;
        return autograd::checkpoint<T>(std::move(run), std::move(inputs), std::move(reads));
      },
      args...);
}

}  // namespace utils

/// The module `Impl`, its forward checkpointed (nn::utils::checkpoint): the same parameters,
/// buffers and names as the block it wraps, so state dicts and optimizers do not see the
/// difference. Made by nn::Checkpoint(block).
template <class Impl>
class CheckpointImpl : public Impl {
 public:
  /// Copy-constructs `block` (sharing its tensors and submodules, as Module's copy does).
  explicit CheckpointImpl(const Impl& block) : Impl(block) {}
  /// Copies the wrapped module; the copy (a replica) is alive on its own.
  CheckpointImpl(const CheckpointImpl& other) : Impl(other) {}
  CheckpointImpl& operator=(const CheckpointImpl&) = delete;

  /// Impl's forward, its activations recomputed in backward.
  template <class... Args>
  auto forward(const Args&... args) {
    std::weak_ptr<const int> alive = alive_;
    return utils::checkpoint(
        [this, alive](const Args&... a) {
          CHORUS_CHECK(!alive.expired(), "checkpoint: a checkpointed module (nn::Checkpoint) was destroyed before "
                                         "backward, which runs its forward again; keep the model alive until then");
          return Impl::forward(a...);
        },
        args...);
  }
  /// The wrapped module's name() inside `Checkpoint(...)`.
  std::string name() const override { return "Checkpoint(" + Impl::name() + ")"; }

 private:
  std::shared_ptr<const int> alive_ = std::make_shared<const int>(0);
};

/// `block` (a holder such as nn::TransformerEncoderLayer or a user module's holder) with its
/// forward checkpointed: its activations are dropped after forward and recomputed in backward
/// (PyTorch's checkpoint_wrapper, without the renamed parameters). It shares the block's
/// parameters and buffers, under the block's own names.
template <class Holder>
class Checkpoint : public ModuleHolder<CheckpointImpl<typename Holder::ImplType>> {
  using Impl = typename Holder::ImplType;

 public:
  using ModuleHolder<CheckpointImpl<Impl>>::ModuleHolder;
  /// Wraps the module `block` holds (a copy of its Impl that shares its parameters and buffers).
  explicit Checkpoint(const Holder& block)
      : ModuleHolder<CheckpointImpl<Impl>>(std::make_shared<CheckpointImpl<Impl>>(*block)) {}
};
/// Deduces Checkpoint's holder type: `nn::Checkpoint(layer)` for a holder `layer`.
template <class Holder>
  requires requires { typename Holder::ImplType; }
Checkpoint(const Holder&) -> Checkpoint<Holder>;

}  // namespace nn
CHORUS_NAMESPACE_END
