#pragma once
// Optimizer: the parameters it updates and the per-parameter state it keeps.
#include <map>
#include <string>
#include <unordered_set>
#include <vector>

#include "../compiled.hpp"
#include "../core/any_tensor.hpp"
#include "../core/profiler.hpp"
#include "../ops/ops.hpp"

CHORUS_NAMESPACE_BEGIN
namespace optim {

/// A parameter group: parameters that share options (PyTorch's param_groups), e.g. norms and
/// biases without weight decay. Optimizers take one options struct or a list of groups.
template <class Options>
struct ParamGroup {
  std::vector<AnyTensor> params;  ///< The group's parameters.
  Options options;                ///< The options the group's parameters are updated with.
};

namespace detail {
/// The parameter lists of `groups`, in order (what the Optimizer base is built from).
template <class Options>
std::vector<std::vector<AnyTensor>> params_of(const std::vector<ParamGroup<Options>>& groups) {
  std::vector<std::vector<AnyTensor>> out;
  for (const auto& g : groups) out.push_back(g.params);
  return out;
}
}  // namespace detail

/// Base class of the optimizers (torch.optim.Optimizer): holds the parameters, their groups and
/// the per-parameter state; subclasses implement step().
class Optimizer {
 public:
  /// All parameters in one group.
  explicit Optimizer(std::vector<AnyTensor> params);

  /// Parameters in groups; parameter i (in the flattened order) belongs to group group_of(i).
  explicit Optimizer(std::vector<std::vector<AnyTensor>> groups);
  CHORUS_INLINE virtual ~Optimizer();
  Optimizer(const Optimizer&) = delete;
  Optimizer& operator=(const Optimizer&) = delete;

  /// Applies one update to every parameter that has a gradient.
  virtual void step() = 0;

  /// Clears (set_to_none, the default) or zeroes the parameters' gradients.
  void zero_grad(bool set_to_none = true);

  /// The parameters, all groups flattened in order.
  const std::vector<AnyTensor>& parameters() const { return params_; }

  /// Parameter groups: how many, which group parameter i belongs to.
  ///@{
  std::size_t num_groups() const { return num_groups_; }
  std::size_t group_of(std::size_t i) const { return group_of_.at(i); }
  ///@}

  /// The learning rate of a group (what learning-rate schedulers read and set).
  ///@{
  virtual double lr(std::size_t group) const = 0;
  virtual void set_lr(std::size_t group, double lr) = 0;
  ///@}
  /// The momentum of a group (SGD's momentum, Adam's beta1), for schedulers that cycle it;
  /// has_momentum() is false for an optimizer without one.
  virtual bool has_momentum() const { return false; }
  /// The momentum of a group; throws for an optimizer without one.
  CHORUS_INLINE virtual double momentum(std::size_t group) const;
  /// Sets the momentum of a group; throws for an optimizer without one.
  CHORUS_INLINE virtual void set_momentum(std::size_t group, double m);

  /// Per-parameter state: for parameter i, named tensors (momentum_buffer, exp_avg, …).
  /// Scalars such as Adam's step are one-element float64 tensors, so all state is tensors.
  /// (Virtual: a sharded optimizer holds only its shard and gathers the rest on request.)
  using State = std::map<std::string, AnyTensor>;
  /// The state of every parameter, in parameters() order.
  virtual const std::vector<State>& state() const { return state_; }

  /// Replaces the state (for checkpoints): one entry per parameter, each tensor matching
  /// what step() would create. Throws without changing anything when it does not fit.
  CHORUS_INLINE virtual void load_state(std::vector<State> state);

  /// Makes state() readable on rank `to` where the state is sharded over processes (a
  /// collective of ZeroRedundancyOptimizer: every rank calls it); nothing for the others.
  virtual void consolidate_state_dict(int to = 0) { (void)to; }

  /// Whether a gradient of this optimizer's parameters was inf or NaN anywhere, given whether
  /// one was in this process (`found_here`; GradScaler, Note [loss scaling]). The plain
  /// optimizer's gradients are all here; ZeroRedundancyOptimizer asks every rank (a collective).
  virtual bool found_inf_anywhere(bool found_here) const { return found_here; }

  /// The state key names this optimizer uses (for checkpoints and validation).
  virtual std::vector<std::string> state_keys() const = 0;
  /// The optimizer's name ("SGD", "Adam", …), recorded in checkpoints.
  virtual std::string name() const = 0;

 protected:
  /// Throws unless `state` has one fitting entry per parameter (load_state's check).
  void validate_states(const std::vector<State>& state) const;
  /// Throws unless every entry of `s` is one of state_keys() and matches parameter i ("step": a
  /// one-element float64 tensor; the others: the parameter's dtype and shape).
  CHORUS_INLINE virtual void validate_state(std::size_t i, const State& s) const;

  /// Calls f(index, param, grad) with typed tensors for each floating-point parameter that has a
  /// gradient.
  template <class F>
  void with_grads(F&& f) {
    for (std::size_t i = 0; i < params_.size(); ++i) {
      params_[i].visit([&](auto& p) {
        using T = typename std::decay_t<decltype(p)>::value_type;
        if constexpr (is_floating_v<T>) {
          auto grad = p.grad();
          if (grad.defined()) f(i, p, grad);
        }
      });
    }
  }

  /// Calls f(param, grad, state, group) with typed tensors for each parameter that has a gradient.
  /// Every gradient is checked before any parameter is updated: a bad one leaves the step
  /// undone, not half done (no parameter moved, no optimizer state advanced). State tensors
  /// follow their parameter to its device (Note [optimizer state follows the parameters]).
  template <class F>
  void for_each_with_grad(F&& f) {
    NoGradGuard g;
    check_grads();
    with_grads([&](std::size_t i, auto& p, auto&) { follow_parameter(state_[i], p.device()); });
    with_grads([&](std::size_t i, auto& p, auto& grad) {
      f(p, grad, state_[i], group_of_[i]);
      p.bump_version();  // an in-place update (Note [version counter])
    });
  }

  /// Throws, naming the parameter, when a gradient cannot be stepped with (before any update).
  void check_grads();

  // Note [optimizer state follows the parameters]
  // Module::to and DataParallel::to move parameters in place (the optimizer's handles stay
  // valid), but the per-parameter state (momentum, Adam's moments) was made on the old
  // device. Each step moves a parameter's state tensors to the parameter's device before
  // using them, as PyTorch's load_state_dict casts state to its parameter's device: an
  // optimizer keeps working after its model moved, with the same numbers. The "step" count
  // is a host scalar and stays where it is.
  /// Moves the state tensors other than "step" to `device` (Note [optimizer state follows the
  /// parameters]).
  static void follow_parameter(State& s, Device device);

  /// The state tensor `key` of a parameter, created as zeros on first use.
  template <class T>
  static Tensor<T> state_tensor(State& s, const std::string& key, const Tensor<T>& like) {
    auto it = s.find(key);
    if (it == s.end()) it = s.emplace(key, zeros_like(like)).first;
    return it->second.as<T>();
  }
  /// The "step" count of a parameter's state (0 before its first step).
  static double step_count(State& s) {
    auto it = s.find("step");
    return it == s.end() ? 0.0 : it->second.as<double>().item();
  }
  /// Sets the "step" count of a parameter's state (stored as a one-element float64 tensor).
  static void set_step_count(State& s, double step) { s["step"] = AnyTensor(scalar_tensor<double>(step)); }

  std::vector<AnyTensor> params_;      ///< The parameters, all groups flattened in order.
  std::vector<std::size_t> group_of_;  ///< The group of each parameter.
  std::size_t num_groups_ = 0;         ///< The number of parameter groups.
  std::vector<State> state_;           ///< The state of each parameter.
};

namespace detail {
/// An optimizer with one options struct per parameter group (Options has an `lr`).
template <class Options>
class GroupedOptimizer : public Optimizer {
 public:
  using options_type = Options;
  ~GroupedOptimizer() override;
  /// The options of a group (group 0 is the only one of an optimizer built from one list).
  Options& options(std::size_t group = 0) { return options_.at(group); }
  const Options& options(std::size_t group = 0) const { return options_.at(group); }

  double lr(std::size_t group) const override { return options(group).lr; }
  void set_lr(std::size_t group, double lr) override {
    CHORUS_CHECK(lr >= 0.0, name(), ": invalid learning rate ", lr, " for group ", group);
    options(group).lr = lr;
  }

 protected:
  explicit GroupedOptimizer(std::vector<ParamGroup<Options>> groups)
      : Optimizer(params_of(groups)), options_(options_of(groups)) {}

 private:
  static std::vector<Options> options_of(const std::vector<ParamGroup<Options>>& groups) {
    std::vector<Options> out;
    for (const auto& g : groups) out.push_back(g.options);
    return out;
  }
  std::vector<Options> options_;
};

// Out of the class, so that a unit that sees the instance declared extern calls the library's.
template <class Options>
GroupedOptimizer<Options>::~GroupedOptimizer() = default;
}  // namespace detail

/// Splits parameters into two groups the way ResNet and transformer recipes do: tensors of
/// one dimension (biases, norm weights) get no weight decay; the rest get `options`.
/// Either group may be empty.
template <class Options>
std::vector<ParamGroup<Options>> weight_decay_groups(const std::vector<AnyTensor>& params, Options options) {
  ParamGroup<Options> decay{{}, options}, no_decay{{}, options};
  no_decay.options.weight_decay = 0.0;
  for (const auto& p : params) (p.shape().size() <= 1 ? no_decay : decay).params.push_back(p);
  return {decay, no_decay};
}

}  // namespace optim
CHORUS_NAMESPACE_END

// The definitions: compiled into chorus::compiled, or here in the header-only form (Note
// [compiled chorus] in compiled.hpp).
#if !CHORUS_COMPILED
#include "optimizer_impl.hpp"
#endif
