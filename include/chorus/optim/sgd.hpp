#pragma once
// Stochastic gradient descent, exactly torch.optim.SGD's documented rule:
//   g <- grad (+ weight_decay * p);  if momentum: b <- g on the first step, else
//   b <- momentum * b + (1 - dampening) * g;  g <- nesterov ? g + momentum * b : b;
//   p <- p - lr * g   (with maximize, grad is negated first).
#include "optimizer.hpp"

CHORUS_NAMESPACE_BEGIN
namespace optim {

struct SGDOptions {
  double lr = 0.01;
  double momentum = 0.0;
  double dampening = 0.0;
  double weight_decay = 0.0;
  bool nesterov = false;
  bool maximize = false;
};

// The options holder of SGD is compiled into chorus::compiled (Note [compiled chorus]).
#if CHORUS_COMPILED
extern template class detail::GroupedOptimizer<SGDOptions>;
#endif

class SGD final : public detail::GroupedOptimizer<SGDOptions> {
 public:
  SGD(std::vector<AnyTensor> params, SGDOptions options);
  explicit SGD(std::vector<ParamGroup<SGDOptions>> groups);

  bool has_momentum() const override { return true; }
  double momentum(std::size_t group) const override { return options(group).momentum; }
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
