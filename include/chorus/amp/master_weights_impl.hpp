#pragma once
// The definitions of amp/master_weights.hpp (MasterWeights): compiled into chorus::compiled
// (src/amp/amp.cpp), included by master_weights.hpp itself in the header-only form (Note
// [compiled chorus]).
#include <unordered_set>

#include "../nn/utils.hpp"
#include "master_weights.hpp"

CHORUS_NAMESPACE_BEGIN
namespace amp {

CHORUS_INLINE MasterWeights::MasterWeights(const std::vector<AnyTensor>& model_params) {
  NoGradGuard no_grad;
  std::unordered_set<const void*> seen;
  for (std::size_t i = 0; i < model_params.size(); ++i) {
    const auto& p = model_params[i];
    CHORUS_CHECK(p.defined(), "MasterWeights: parameter ", i, " is an undefined tensor");
    CHORUS_CHECK(seen.insert(p.impl_key()).second, "MasterWeights: parameter ", i,
                 " appears more than once (it would get two masters); module.parameters() lists a tied parameter "
                 "once");
    CHORUS_CHECK(p.dtype() != DType::Int64, "MasterWeights: parameter ", i, " is an integer tensor");
    p.visit([&](const auto& t) {
      using T = typename std::decay_t<decltype(t)>::value_type;
      CHORUS_CHECK(t.is_leaf(), "MasterWeights: parameter ", i, " is not a leaf tensor (it was computed by an op)");
      if constexpr (is_reduced_floating_v<T>) {
        auto m = t.template to<float>();
        m.requires_grad_(t.requires_grad());
        model_.push_back(p);
        master_.push_back(AnyTensor(std::move(m)));
      } else {
        model_.push_back(p);
        master_.push_back(p);
      }
    });
  }
}

CHORUS_INLINE std::vector<AnyTensor> MasterWeights::of(const std::vector<AnyTensor>& model_params) const {
  std::vector<AnyTensor> out;
  for (std::size_t i = 0; i < model_params.size(); ++i) {
    const void* key = model_params[i].impl_key();
    std::size_t k = 0;
    while (k < model_.size() && model_[k].impl_key() != key) ++k;
    CHORUS_CHECK(k < model_.size(), "MasterWeights::of: parameter ", i, " (", dtype_name(model_params[i].dtype()),
                 " ", model_params[i].shape(), ") is not one of the model parameters it was made from");
    out.push_back(master_[k]);
  }
  return out;
}

CHORUS_INLINE void MasterWeights::grads_to_master() {
  for_each_copy([](const auto& t, const Tensor<float>& m) {
    auto g = t.grad();
    if (!g.defined()) return;
    auto gf = g.template to<float>();
    if (m.grad().defined()) {
      auto acc = m.grad();
      backend::binary_same(acc, gf, acc, backend::fn::Add{});
      acc.bump_version();
    } else {
      m.set_grad(gf);
    }
    t.set_grad({});
  });
}

CHORUS_INLINE void MasterWeights::master_to_model() {
  for_each_copy([](const auto& t, const Tensor<float>& m) {
    backend::convert(t, m);
    t.bump_version();
  });
}

CHORUS_INLINE void MasterWeights::step(optim::Optimizer& opt, MasterStepOptions options) {
  grads_to_master();
  if (options.max_norm) (void)nn::utils::clip_grad_norm_(master_, *options.max_norm, options.norm_type);
  opt.step();
  master_to_model();
}

CHORUS_INLINE bool MasterWeights::step(GradScaler& scaler, optim::Optimizer& opt, MasterStepOptions options) {
  grads_to_master();
  if (options.max_norm) {  // PyTorch's order: unscale, clip, then the scaler's step
    scaler.unscale_(opt);
    (void)nn::utils::clip_grad_norm_(master_, *options.max_norm, options.norm_type);
  }
  const bool stepped = scaler.step(opt);
  if (stepped) master_to_model();
  return stepped;
}

}  // namespace amp
CHORUS_NAMESPACE_END
