#pragma once
// Stochastic gradient descent, exactly torch.optim.SGD's documented rule:
//   g <- grad (+ weight_decay * p);  if momentum: b <- g on the first step, else
//   b <- momentum * b + (1 - dampening) * g;  g <- nesterov ? g + momentum * b : b;
//   p <- p - lr * g   (with maximize, grad is negated first).
#include "optimizer.hpp"

CHORUS_NAMESPACE_BEGIN
namespace optim {

/// SGD's options (torch.optim.SGD's arguments).
struct SGDOptions {
  double lr = 0.01;            ///< Learning rate (default 0.01).
  double momentum = 0.0;       ///< Momentum factor (default 0: no momentum buffer).
  double dampening = 0.0;      ///< Dampening for momentum: the gradient enters the buffer scaled by 1 - dampening.
  double weight_decay = 0.0;   ///< L2 penalty: weight_decay * p is added to the gradient (default 0).
  bool nesterov = false;       ///< Nesterov momentum (needs momentum > 0 and zero dampening).
  bool maximize = false;       ///< Maximize the objective: step along the gradient instead of against it.
};

// The options holder of SGD is compiled into chorus::compiled (Note [compiled chorus]).
#if CHORUS_COMPILED
extern template class detail::GroupedOptimizer<SGDOptions>;
#endif

/// Stochastic gradient descent with optional momentum, Nesterov momentum and weight decay
/// (torch.optim.SGD).
class SGD final : public detail::GroupedOptimizer<SGDOptions> {
 public:
  /// One group of parameters with `options`; throws on an invalid option.
  SGD(std::vector<AnyTensor> params, SGDOptions options);
  /// Parameter groups, each with its own options; throws on an invalid option.
  explicit SGD(std::vector<ParamGroup<SGDOptions>> groups);

  bool has_momentum() const override { return true; }
  /// The momentum factor of a group.
  double momentum(std::size_t group) const override { return options(group).momentum; }
  /// Sets the momentum factor of a group; throws if `m` is negative.
  CHORUS_INLINE void set_momentum(std::size_t group, double m) override;

  CHORUS_INLINE void step() override;

  std::vector<std::string> state_keys() const override { return {"momentum_buffer"}; }
  std::string name() const override { return "SGD"; }
};

}  // namespace optim
CHORUS_NAMESPACE_END

// The definitions: compiled into chorus::compiled, or here in the header-only form (Note
// [compiled chorus] in compiled.hpp).
#if !CHORUS_COMPILED
#include "sgd_impl.hpp"
#endif
