#pragma once
// The definitions of optim/sgd.hpp: compiled into chorus::compiled (src/optim/optim.cpp),
// included by sgd.hpp itself in the header-only form (Note [compiled chorus]).
#include "sgd.hpp"

CHORUS_NAMESPACE_BEGIN
namespace optim {

CHORUS_INLINE SGD::SGD(std::vector<AnyTensor> params, SGDOptions options)
    : SGD(std::vector<ParamGroup<SGDOptions>>{{std::move(params), options}}) {}

CHORUS_INLINE SGD::SGD(std::vector<ParamGroup<SGDOptions>> groups) : GroupedOptimizer(std::move(groups)) {
  for (std::size_t i = 0; i < num_groups(); ++i) {
    const auto& options = this->options(i);
    CHORUS_CHECK(options.lr >= 0.0, "SGD: invalid learning rate ", options.lr, " (group ", i, ")");
    CHORUS_CHECK(options.momentum >= 0.0, "SGD: invalid momentum ", options.momentum, " (group ", i, ")");
    CHORUS_CHECK(options.weight_decay >= 0.0, "SGD: invalid weight_decay ", options.weight_decay, " (group ", i, ")");
    CHORUS_CHECK(!options.nesterov || (options.momentum > 0.0 && options.dampening == 0.0),
                 "SGD: Nesterov momentum requires a momentum and zero dampening (group ", i, ")");
  }
}

CHORUS_INLINE void SGD::set_momentum(std::size_t group, double m) {
  CHORUS_CHECK(m >= 0.0, "SGD: invalid momentum ", m, " for group ", group);
  options(group).momentum = m;
}

CHORUS_INLINE void SGD::step() {
  const profiler::Scope span(profiler::Category::optimizer, "SGD.step");
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

}  // namespace optim
CHORUS_NAMESPACE_END
