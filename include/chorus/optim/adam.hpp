#pragma once
// Adam and AdamW, exactly torch.optim.Adam / AdamW's documented rules:
//   t <- t + 1;  Adam: g <- g + weight_decay * p;  AdamW: p <- p * (1 - lr * weight_decay);
//   m <- b1 m + (1 - b1) g;  v <- b2 v + (1 - b2) g^2;  (amsgrad: vmax <- max(vmax, v), v̂ = vmax)
//   p <- p - lr / (1 - b1^t) * m / (sqrt(v̂) / sqrt(1 - b2^t) + eps).
#include "optimizer.hpp"

CHORUS_NAMESPACE_BEGIN
namespace optim {

/// Adam's options (torch.optim.Adam's arguments; betas is split into beta1 and beta2).
struct AdamOptions {
  double lr = 1e-3;            ///< Learning rate (default 1e-3).
  double beta1 = 0.9;          ///< Coefficient of the running average of the gradient (betas[0]), in [0, 1).
  double beta2 = 0.999;        ///< Coefficient of the running average of the squared gradient (betas[1]), in [0, 1).
  double eps = 1e-8;           ///< Term added to the denominator for numerical stability.
  double weight_decay = 0.0;   ///< L2 penalty: weight_decay * p is added to the gradient (default 0).
  bool amsgrad = false;        ///< Use the AMSGrad variant (the maximum of the squared-gradient averages).
  bool maximize = false;       ///< Maximize the objective: step along the gradient instead of against it.
};

/// AdamW's options: Adam's, with PyTorch's AdamW default weight_decay of 1e-2.
struct AdamWOptions {
  double lr = 1e-3;            ///< Learning rate (default 1e-3).
  double beta1 = 0.9;          ///< Coefficient of the running average of the gradient (betas[0]), in [0, 1).
  double beta2 = 0.999;        ///< Coefficient of the running average of the squared gradient (betas[1]), in [0, 1).
  double eps = 1e-8;           ///< Term added to the denominator for numerical stability.
  double weight_decay = 1e-2;  ///< Decoupled weight decay: each step scales p by 1 - lr * weight_decay (default 1e-2).
  bool amsgrad = false;        ///< Use the AMSGrad variant (the maximum of the squared-gradient averages).
  bool maximize = false;       ///< Maximize the objective: step along the gradient instead of against it.
};

namespace detail {
template <class Options>
class AdamBase : public GroupedOptimizer<Options> {
 public:
  using State = Optimizer::State;
  AdamBase(std::vector<ParamGroup<Options>> groups, bool decoupled, const char* name);

  bool has_momentum() const override { return true; }
  double momentum(std::size_t group) const override { return this->options(group).beta1; }
  CHORUS_INLINE void set_momentum(std::size_t group, double m) override;

  CHORUS_INLINE void step() override;

  std::vector<std::string> state_keys() const override { return {"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"}; }
  std::string name() const override { return name_; }

 private:
  bool decoupled_;
  std::string name_;
};

// Compiled into chorus::compiled for chorus's two option structs (src/optim/optim.cpp, Note
// [compiled chorus]); AdamBase's members are defined in adam_impl.hpp, which a unit of the
// compiled form does not see, so there AdamBase serves only these two.
#if CHORUS_COMPILED
extern template class GroupedOptimizer<AdamOptions>;
extern template class GroupedOptimizer<AdamWOptions>;
extern template class AdamBase<AdamOptions>;
extern template class AdamBase<AdamWOptions>;
#endif
}  // namespace detail

/// Adam (torch.optim.Adam), with L2 weight decay added to the gradient.
class Adam final : public detail::AdamBase<AdamOptions> {
 public:
  /// One group of parameters with `options`; throws on an invalid option.
  Adam(std::vector<AnyTensor> params, AdamOptions options = {});
  /// Parameter groups, each with its own options; throws on an invalid option.
  explicit Adam(std::vector<ParamGroup<AdamOptions>> groups);
};

/// AdamW: Adam with decoupled weight decay.
class AdamW final : public detail::AdamBase<AdamWOptions> {
 public:
  /// One group of parameters with `options`; throws on an invalid option.
  AdamW(std::vector<AnyTensor> params, AdamWOptions options = {});
  /// Parameter groups, each with its own options; throws on an invalid option.
  explicit AdamW(std::vector<ParamGroup<AdamWOptions>> groups);
};

}  // namespace optim
CHORUS_NAMESPACE_END

// The definitions: compiled into chorus::compiled, or here in the header-only form (Note
// [compiled chorus] in compiled.hpp).
#if !CHORUS_COMPILED
#include "adam_impl.hpp"
#endif
