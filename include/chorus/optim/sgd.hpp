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

class SGD final : public detail::GroupedOptimizer<SGDOptions> {
 public:
  SGD(std::vector<AnyTensor> params, SGDOptions options) : SGD(std::vector<ParamGroup<SGDOptions>>{{std::move(params), options}}) {}
  explicit SGD(std::vector<ParamGroup<SGDOptions>> groups) : GroupedOptimizer(std::move(groups)) {
    for (std::size_t i = 0; i < num_groups(); ++i) {
      const auto& options = this->options(i);
      CHORUS_CHECK(options.lr >= 0.0, "SGD: invalid learning rate ", options.lr, " (group ", i, ")");
      CHORUS_CHECK(options.momentum >= 0.0, "SGD: invalid momentum ", options.momentum, " (group ", i, ")");
      CHORUS_CHECK(options.weight_decay >= 0.0, "SGD: invalid weight_decay ", options.weight_decay, " (group ", i, ")");
      CHORUS_CHECK(!options.nesterov || (options.momentum > 0.0 && options.dampening == 0.0),
                   "SGD: Nesterov momentum requires a momentum and zero dampening (group ", i, ")");
    }
  }

  bool has_momentum() const override { return true; }
  double momentum(std::size_t group) const override { return options(group).momentum; }
  void set_momentum(std::size_t group, double m) override {
    CHORUS_CHECK(m >= 0.0, "SGD: invalid momentum ", m, " for group ", group);
    options(group).momentum = m;
  }

  void step() override {
    for_each_with_grad([&](auto& p, auto& g, State& s, std::size_t group) {
      using T = typename std::decay_t<decltype(p)>::value_type;
      const SGDOptions& options = this->options(group);
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
};

}  // namespace optim
CHORUS_NAMESPACE_END
