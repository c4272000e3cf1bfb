#pragma once
// The definitions of optim/optimizer.hpp: compiled into chorus::compiled (src/optim/optim.cpp),
// included by optimizer.hpp itself in the header-only form (Note [compiled chorus]).
#include <unordered_set>

#include "optimizer.hpp"

CHORUS_NAMESPACE_BEGIN
namespace optim {

CHORUS_INLINE Optimizer::~Optimizer() = default;

CHORUS_INLINE Optimizer::Optimizer(std::vector<AnyTensor> params)
    : Optimizer(std::vector<std::vector<AnyTensor>>{std::move(params)}) {}

CHORUS_INLINE Optimizer::Optimizer(std::vector<std::vector<AnyTensor>> groups) {
  CHORUS_CHECK(!groups.empty(), "optimizer: no parameter groups");
  for (std::size_t g = 0; g < groups.size(); ++g)
    for (auto& p : groups[g]) {
      params_.push_back(std::move(p));
      group_of_.push_back(g);
    }
  num_groups_ = groups.size();
  // As PyTorch: an empty list is almost always a mistake (parameters() of the wrong module,
  // or taken before the layers were registered).
  CHORUS_CHECK(!params_.empty(), "optimizer got an empty parameter list");
  std::unordered_set<const void*> seen;
  for (std::size_t i = 0; i < params_.size(); ++i) {
    const auto& p = params_[i];
    CHORUS_CHECK(p.defined(), "optimizer: parameter ", i, " is an undefined tensor");
    CHORUS_CHECK(p.dtype() != DType::Int64, "optimizer: parameter ", i, " is an integer tensor");
    p.visit([&](const auto& t) {
      CHORUS_CHECK(t.is_leaf(), "optimizer: parameter ", i, " is not a leaf tensor (it was computed by an op)");
    });
    CHORUS_CHECK(seen.insert(p.impl_key()).second, "optimizer: parameter ", i, " appears more than once");
  }
  state_.resize(params_.size());
}

CHORUS_INLINE void Optimizer::zero_grad(bool set_to_none) {
  NoGradGuard g;
  for (auto& p : params_)
    p.visit([&](auto& t) {
      if (!t.grad().defined()) return;
      if (set_to_none) t.set_grad({});
      else t.grad().zero_();
    });
}

CHORUS_INLINE double Optimizer::momentum(std::size_t group) const {
  CHORUS_FAIL(name(), " has no momentum (group ", group, ")");
}

CHORUS_INLINE void Optimizer::set_momentum(std::size_t group, double m) {
  CHORUS_FAIL(name(), " has no momentum to set to ", m, " (group ", group, ")");
}

CHORUS_INLINE void Optimizer::load_state(std::vector<State> state) {
  validate_states(state);
  state_ = std::move(state);
}

CHORUS_INLINE void Optimizer::validate_states(const std::vector<State>& state) const {
  CHORUS_CHECK(state.size() == params_.size(), "optimizer state has ", state.size(), " entries for ",
               params_.size(), " parameters");
  for (std::size_t i = 0; i < state.size(); ++i) validate_state(i, state[i]);
}

CHORUS_INLINE void Optimizer::validate_state(std::size_t i, const State& s) const {
  for (const auto& [k, v] : s) {
    bool known = false;
    for (const auto& key : state_keys()) known = known || key == k;
    CHORUS_CHECK(known, "optimizer state of parameter ", i, ": unknown entry '", k, "'");
    if (k == "step") {
      CHORUS_CHECK(v.dtype() == DType::Float64 && v.numel() == 1, "optimizer state of parameter ", i,
                   ": 'step' must be a one-element float64 tensor");
      continue;
    }
    CHORUS_CHECK(v.dtype() == params_[i].dtype() && v.shape() == params_[i].shape(), "optimizer state of parameter ",
                 i, ": '", k, "' has ", dtype_name(v.dtype()), " ", v.shape(), ", expected ",
                 dtype_name(params_[i].dtype()), " ", params_[i].shape());
  }
}

CHORUS_INLINE void Optimizer::check_grads() {
  with_grads([](std::size_t i, auto& p, auto& grad) {
    CHORUS_CHECK(p.is_contiguous() && grad.is_contiguous(), "optimizer: parameter ", i,
                 " or its gradient is not contiguous");
    CHORUS_CHECK(grad.shape() == p.shape(), "optimizer: gradient of parameter ", i, " has shape ", grad.shape(),
                 ", the parameter has shape ", p.shape());
    CHORUS_CHECK(grad.device() == p.device(), "optimizer: gradient of parameter ", i, " is on ", grad.device(),
                 ", the parameter on ", p.device());
  });
}

// Note [optimizer state follows the parameters] is in optimizer.hpp.
CHORUS_INLINE void Optimizer::follow_parameter(State& s, Device device) {
  for (auto& [key, value] : s)
    if (key != "step" && value.device() != device)
      value = value.visit([&](const auto& t) { return AnyTensor(t.to(device)); });
}

}  // namespace optim
CHORUS_NAMESPACE_END
