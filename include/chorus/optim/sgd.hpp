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

class SGD final : public Optimizer {
 public:
  SGD(std::vector<AnyTensor> params, SGDOptions options) : Optimizer(std::move(params)), options(options) {
    CHORUS_CHECK(options.lr >= 0.0, "SGD: invalid learning rate ", options.lr);
    CHORUS_CHECK(options.momentum >= 0.0, "SGD: invalid momentum ", options.momentum);
    CHORUS_CHECK(options.weight_decay >= 0.0, "SGD: invalid weight_decay ", options.weight_decay);
    CHORUS_CHECK(!options.nesterov || (options.momentum > 0.0 && options.dampening == 0.0),
                 "SGD: Nesterov momentum requires a momentum and zero dampening");
  }

  void step() override {
    for_each_with_grad([&](auto& p, auto& g, State& s) {
      using T = typename std::decay_t<decltype(p)>::value_type;
      if (options.momentum != 0.0) {
        const bool first = s.find("momentum_buffer") == s.end();
        Tensor<T> buf = state_tensor(s, "momentum_buffer", p);
        backend::sgd_step(p, g, &buf, options.lr, options.momentum, options.dampening, options.weight_decay,
                          options.nesterov, first, options.maximize);
      } else {
        backend::sgd_step<T>(p, g, nullptr, options.lr, 0.0, options.dampening, options.weight_decay, false, false,
                             options.maximize);
      }
    });
  }

  std::vector<std::string> state_keys() const override { return {"momentum_buffer"}; }
  std::string name() const override { return "SGD"; }

  SGDOptions options;
};

}  // namespace optim
CHORUS_NAMESPACE_END
