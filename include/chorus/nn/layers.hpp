#pragma once
// Layers: Linear, the activations, Dropout and Sequential.
#include <cmath>
#include <concepts>
#include <memory>

#include "../ops/nn.hpp"
#include "init.hpp"
#include "module.hpp"

CHORUS_NAMESPACE_BEGIN
namespace nn {

/// Linear's options, braced in PyTorch's order (Note [layer options] in nn/module.hpp).
struct LinearOptions {
  bool bias = true;               ///< Adds the learned bias b (default true).
  Device device = Device::cpu();  ///< Where the parameters are created (default CPU).
};

/// y = x W^T + b with W: [out, in] and b: [out], initialised as torch.nn.Linear
/// (weight: kaiming_uniform with a = sqrt(5), i.e. U(±1/sqrt(in)); bias: U(±1/sqrt(in))).
template <class T = float>
class LinearImpl : public Module {
 public:
  /// `in_features` to `out_features` (both non-negative), initialised by reset_parameters().
  LinearImpl(std::int64_t in_features, std::int64_t out_features, LinearOptions options = {});
  /// Re-initialises weight and bias as torch.nn.Linear does (see above).
  void reset_parameters();

  /// x [..., in_features] to [..., out_features]: x W^T + b.
  Tensor<T> forward(const Tensor<T>& x) const { return linear(x, weight, bias); }
  std::string name() const override {
    return "Linear(" + std::to_string(in_features) + ", " + std::to_string(out_features) + ")";
  }

  /// The input and output feature counts.
  ///@{
  std::int64_t in_features, out_features;
  ///@}
  LinearOptions options;  ///< The options it was built with.
  /// The parameters: weight W [out, in] and bias b [out] (undefined without bias).
  ///@{
  Tensor<T> weight, bias;
  ///@}
};

template <class T>
LinearImpl<T>::LinearImpl(std::int64_t in_features, std::int64_t out_features, LinearOptions options)
    : in_features(in_features), out_features(out_features), options(options) {
  CHORUS_CHECK(in_features >= 0 && out_features >= 0, "Linear(", in_features, ", ", out_features,
               "): feature counts must be non-negative");
  register_parameter("weight", &LinearImpl::weight,
                     Tensor<T>::empty(Shape{out_features, in_features}, options.device));
  if (options.bias)
    register_parameter("bias", &LinearImpl::bias, Tensor<T>::empty(Shape{out_features}, options.device));
  reset_parameters();
}

template <class T>
void LinearImpl<T>::reset_parameters() {
  init::kaiming_uniform_(weight, std::sqrt(5.0));
  if (bias.defined()) {
    const double bound = in_features > 0 ? 1.0 / std::sqrt(static_cast<double>(in_features)) : 0.0;
    init::uniform_(bias, -bound, bound);
  }
}

/// Holder (Note [layer options] in nn/module.hpp): `LinearT<T>(4, 2, {.bias = false})`.
template <class T = float>
class LinearT : public ModuleHolder<LinearImpl<T>> {
 public:
  using ModuleHolder<LinearImpl<T>>::ModuleHolder;
  /// Constructs the implementation: LinearImpl(in_features, out_features, options).
  explicit LinearT(std::int64_t in_features, std::int64_t out_features, LinearOptions options = {})
      : ModuleHolder<LinearImpl<T>>(std::make_shared<LinearImpl<T>>(in_features, out_features, options)) {}
};
using Linear = LinearT<float>;  ///< LinearT over float tensors.

#define CHORUS_ACTIVATION_MODULE(Name, fn)                              \
  class Name##Impl : public Module {                                  \
   public:                                                            \
    template <class T>                                                \
    Tensor<T> forward(const Tensor<T>& x) const {                     \
      return chorus::fn(x);                                           \
    }                                                                 \
    std::string name() const override { return #Name; }               \
  };                                                                  \
  using Name = ModuleHolder<Name##Impl>

CHORUS_ACTIVATION_MODULE(ReLU, relu);
CHORUS_ACTIVATION_MODULE(GELU, gelu);
CHORUS_ACTIVATION_MODULE(Tanh, tanh);
CHORUS_ACTIVATION_MODULE(Sigmoid, sigmoid);
CHORUS_ACTIVATION_MODULE(SiLU, silu);
#undef CHORUS_ACTIVATION_MODULE

/// Zeroes inputs with probability p while training (scaled by 1/(1-p)); identity in eval().
class DropoutImpl : public Module {
 public:
  /// Dropout with probability `p` in [0, 1].
  explicit DropoutImpl(double p = 0.5) : p(p) {
    CHORUS_CHECK(p >= 0.0 && p <= 1.0, "Dropout: probability must be in [0, 1], got ", p);
  }
  /// chorus::dropout(x, p) while training; x itself in eval().
  template <class T>
  Tensor<T> forward(const Tensor<T>& x) const {
    return chorus::dropout(x, p, is_training());
  }
  std::string name() const override { return "Dropout(p=" + std::to_string(p) + ")"; }
  double p;  ///< The probability of zeroing an element.
};
using Dropout = ModuleHolder<DropoutImpl>;  ///< Holder of DropoutImpl: `nn::Dropout(0.1)`.

/// Zeroes whole channels (dim 1) with probability p while training, as torch.nn.Dropout2d.
class Dropout2dImpl : public Module {
 public:
  /// Channel dropout with probability `p` in [0, 1].
  explicit Dropout2dImpl(double p = 0.5) : p(p) {
    CHORUS_CHECK(p >= 0.0 && p <= 1.0, "Dropout2d: probability must be in [0, 1], got ", p);
  }
  /// chorus::dropout2d(x, p) on x [N, C, *] while training; x itself in eval().
  template <class T>
  Tensor<T> forward(const Tensor<T>& x) const {
    return chorus::dropout2d(x, p, is_training());
  }
  std::string name() const override { return "Dropout2d(p=" + std::to_string(p) + ")"; }
  double p;  ///< The probability of zeroing a channel.
};
using Dropout2d = ModuleHolder<Dropout2dImpl>;  ///< Holder of Dropout2dImpl: `nn::Dropout2d(0.1)`.

/// Flattens dims [start_dim, end_dim] into one (default: all but the batch dim), as torch.nn.Flatten.
class FlattenImpl : public Module {
 public:
  /// Flattens dims [start_dim, end_dim] (negative dims count from the end).
  explicit FlattenImpl(std::int64_t start_dim = 1, std::int64_t end_dim = -1) : start_dim(start_dim), end_dim(end_dim) {}
  /// x.flatten(start_dim, end_dim).
  template <class T>
  Tensor<T> forward(const Tensor<T>& x) const {
    return x.flatten(start_dim, end_dim);
  }
  std::string name() const override { return "Flatten"; }
  /// The first and last dims flattened (inclusive).
  ///@{
  std::int64_t start_dim, end_dim;
  ///@}
};
using Flatten = ModuleHolder<FlattenImpl>;  ///< Holder of FlattenImpl: `nn::Flatten()` flattens all but dim 0.

namespace detail {
/// A module Sequential can chain: forward(Tensor<T>) returns a Tensor<T>.
template <class Impl, class T>
concept chains_tensor_of = requires(Impl& m, const Tensor<T>& x) {
  { m.forward(x) } -> std::convertible_to<Tensor<T>>;
};
}  // namespace detail

/// Runs its submodules in order. Build it from holders: Sequential(Linear(4, 8), ReLU(), …).
/// `seq[i]` / `seq->ptr(i)` return the i-th module (negative i counts from the end, as in
/// Python), `seq->ptr<LinearImpl<float>>(i)` and `seq->at<LinearImpl<float>>(i)` as that type.
template <class T = float>
class SequentialImpl : public Module {
 public:
  SequentialImpl() = default;
  /// Appends `modules` in order (push_back).
  template <class... Ms>
    requires(sizeof...(Ms) > 0)
  explicit SequentialImpl(Ms&&... modules) {
    (push_back(std::forward<Ms>(modules)), ...);
  }

  /// Appends a module (a holder or a std::shared_ptr to an implementation), named by position.
  template <class M>
  void push_back(M module) {
    using Impl = typename decltype(impl_of(module))::element_type;
    constexpr bool chains = detail::chains_tensor_of<Impl, T>;
    static_assert(chains,
                  "nn::SequentialT<T> chains Tensor<T> to Tensor<T> (nn::Sequential is SequentialT<float>): every "
                  "module in it needs a forward(Tensor<T>) returning Tensor<T>. A layer of another scalar type, such "
                  "as nn::LinearT<double> inside nn::Sequential, cannot be chained: build the layers and the "
                  "Sequential of one scalar type (nn::SequentialT<double> for double layers).");
    if constexpr (chains) {
      register_module(std::to_string(calls_.size()), module);
      calls_.push_back(&call<Impl>);
    }
  }

  /// Passes x through each module in order and returns the last output (x itself when empty).
  Tensor<T> forward(Tensor<T> x) const {
    const auto& children = named_children();
    for (std::size_t i = 0; i < calls_.size(); ++i) {
      const detail::LayerSpan span(*children[i].module);  // Note [layer spans]
      x = calls_[i](*children[i].module, x);
    }
    return x;
  }
  /// The number of modules.
  std::size_t size() const { return calls_.size(); }
  std::string name() const override { return "Sequential"; }

  /// The module at `index` (bounds-checked; negative counts from the end).
  std::shared_ptr<Module> ptr(std::int64_t index) const { return named_children()[checked_index(index)].module; }
  /// The module at `index` as implementation type M (nn::LinearImpl<float>, …); an error if it is another.
  template <class M>
  std::shared_ptr<M> ptr(std::int64_t index) const {
    static_assert(std::is_base_of_v<Module, M>,
                  "Sequential::ptr<M> / at<M>: M is a module implementation such as nn::LinearImpl<float> "
                  "(for a holder, name its ImplType: ptr<nn::Linear::ImplType>(i))");
    auto m = ptr(index);
    auto typed = std::dynamic_pointer_cast<M>(m);
    CHORUS_CHECK(typed != nullptr, "Sequential: module ", index, " is ", m->name(), ", not the type requested");
    return typed;
  }
  /// The module at `index` as implementation type M, by reference (checked as ptr<M>).
  template <class M>
  M& at(std::int64_t index) const {
    return *ptr<M>(index);
  }
  /// The module at `index`, as ptr(index).
  std::shared_ptr<Module> operator[](std::int64_t index) const { return ptr(index); }

 private:
  using Call = Tensor<T> (*)(Module&, const Tensor<T>&);
  template <class Impl>
  static Tensor<T> call(Module& m, const Tensor<T>& x) {
    return static_cast<Impl&>(m).forward(x);
  }
  template <class M>
  static auto impl_of(const M& m) {
    if constexpr (requires { typename M::ImplType; }) return m.ptr();
    else return m;
  }
  std::size_t checked_index(std::int64_t index) const {
    const auto n = static_cast<std::int64_t>(calls_.size());
    CHORUS_CHECK(index >= -n && index < n, "Sequential: index ", index, " is out of range for a Sequential of ", n,
                 " module(s)");
    return static_cast<std::size_t>(index < 0 ? index + n : index);
  }
  // The modules themselves live in the registry (so copies remap them); only the calls are here.
  std::vector<Call> calls_;
};

/// Holder of SequentialImpl<T>, chaining Tensor<T> to Tensor<T>.
template <class T = float>
using SequentialT = ModuleHolder<SequentialImpl<T>>;
using Sequential = SequentialT<float>;  ///< SequentialT over float tensors.

}  // namespace nn
CHORUS_NAMESPACE_END
