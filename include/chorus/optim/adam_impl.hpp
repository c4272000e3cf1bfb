#pragma once
// The definitions of optim/adam.hpp: compiled into chorus::compiled (src/optim/optim.cpp, which
// instantiates AdamBase for AdamOptions and AdamWOptions), included by adam.hpp itself in the
// header-only form (Note [compiled chorus]).
#include "adam.hpp"

CHORUS_NAMESPACE_BEGIN
namespace optim {
namespace detail {

template <class Options>
AdamBase<Options>::AdamBase(std::vector<ParamGroup<Options>> groups, bool decoupled, const char* name)
    : GroupedOptimizer<Options>(std::move(groups)), decoupled_(decoupled), name_(name) {
  for (std::size_t i = 0; i < this->num_groups(); ++i) {
    const auto& options = this->options(i);
    CHORUS_CHECK(options.lr >= 0.0, name, ": invalid learning rate ", options.lr, " (group ", i, ")");
    CHORUS_CHECK(options.eps >= 0.0, name, ": invalid epsilon ", options.eps, " (group ", i, ")");
    CHORUS_CHECK(options.beta1 >= 0.0 && options.beta1 < 1.0, name, ": invalid beta1 ", options.beta1, " (group ", i,
                 ")");
    CHORUS_CHECK(options.beta2 >= 0.0 && options.beta2 < 1.0, name, ": invalid beta2 ", options.beta2, " (group ", i,
                 ")");
    CHORUS_CHECK(options.weight_decay >= 0.0, name, ": invalid weight_decay ", options.weight_decay, " (group ", i,
                 ")");
  }
}

template <class Options>
void AdamBase<Options>::set_momentum(std::size_t group, double m) {
  CHORUS_CHECK(m >= 0.0 && m < 1.0, name_, ": invalid beta1 ", m, " for group ", group);
  this->options(group).beta1 = m;
}

template <class Options>
void AdamBase<Options>::step() {
  const profiler::Scope span(profiler::Category::optimizer, [&] { return name() + ".step"; });
  this->for_each_with_grad([&](auto& p, auto& g, State& s, std::size_t group) {
    using T = typename std::decay_t<decltype(p)>::value_type;
    const Options& options = this->options(group);
    const double t = this->step_count(s) + 1.0;
    this->set_step_count(s, t);
    Tensor<T> m = this->state_tensor(s, "exp_avg", p);
    Tensor<T> v = this->state_tensor(s, "exp_avg_sq", p);
    Tensor<T> vmax;
    if (options.amsgrad) vmax = this->state_tensor(s, "max_exp_avg_sq", p);
    backend::adam_step(p, g, m, v, options.amsgrad ? &vmax : nullptr, options.lr, options.beta1, options.beta2,
                       options.eps, options.weight_decay, decoupled_, static_cast<std::int64_t>(t),
                       options.maximize);
  });
}

}  // namespace detail

CHORUS_INLINE Adam::Adam(std::vector<AnyTensor> params, AdamOptions options)
    : Adam(std::vector<ParamGroup<AdamOptions>>{{std::move(params), options}}) {}
CHORUS_INLINE Adam::Adam(std::vector<ParamGroup<AdamOptions>> groups) : AdamBase(std::move(groups), false, "Adam") {}

CHORUS_INLINE AdamW::AdamW(std::vector<AnyTensor> params, AdamWOptions options)
    : AdamW(std::vector<ParamGroup<AdamWOptions>>{{std::move(params), options}}) {}
CHORUS_INLINE AdamW::AdamW(std::vector<ParamGroup<AdamWOptions>> groups) : AdamBase(std::move(groups), true, "AdamW") {}

}  // namespace optim
CHORUS_NAMESPACE_END
