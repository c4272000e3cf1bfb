#pragma once
// Adam and AdamW, exactly torch.optim.Adam / AdamW's documented rules:
//   t <- t + 1;  Adam: g <- g + weight_decay * p;  AdamW: p <- p * (1 - lr * weight_decay);
//   m <- b1 m + (1 - b1) g;  v <- b2 v + (1 - b2) g^2;  (amsgrad: vmax <- max(vmax, v), v̂ = vmax)
//   p <- p - lr / (1 - b1^t) * m / (sqrt(v̂) / sqrt(1 - b2^t) + eps).
#include "optimizer.hpp"

CHORUS_NAMESPACE_BEGIN
namespace optim {

struct AdamOptions {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  bool amsgrad = false;
  bool maximize = false;
};

/// AdamW's options: Adam's, with PyTorch's AdamW default weight_decay of 1e-2.
struct AdamWOptions {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 1e-2;
  bool amsgrad = false;
  bool maximize = false;
};

namespace detail {
template <class Options>
class AdamBase : public GroupedOptimizer<Options> {
 public:
  using State = Optimizer::State;
  AdamBase(std::vector<ParamGroup<Options>> groups, bool decoupled, const char* name)
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

  bool has_momentum() const override { return true; }
  double momentum(std::size_t group) const override { return this->options(group).beta1; }
  void set_momentum(std::size_t group, double m) override {
    CHORUS_CHECK(m >= 0.0 && m < 1.0, name_, ": invalid beta1 ", m, " for group ", group);
    this->options(group).beta1 = m;
  }

  void step() override {
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

  std::vector<std::string> state_keys() const override { return {"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"}; }
  std::string name() const override { return name_; }

 private:
  bool decoupled_;
  std::string name_;
};
}  // namespace detail

class Adam final : public detail::AdamBase<AdamOptions> {
 public:
  Adam(std::vector<AnyTensor> params, AdamOptions options = {})
      : Adam(std::vector<ParamGroup<AdamOptions>>{{std::move(params), options}}) {}
  explicit Adam(std::vector<ParamGroup<AdamOptions>> groups) : AdamBase(std::move(groups), false, "Adam") {}
};

/// AdamW: Adam with decoupled weight decay.
class AdamW final : public detail::AdamBase<AdamWOptions> {
 public:
  AdamW(std::vector<AnyTensor> params, AdamWOptions options = {})
      : AdamW(std::vector<ParamGroup<AdamWOptions>>{{std::move(params), options}}) {}
  explicit AdamW(std::vector<ParamGroup<AdamWOptions>> groups) : AdamBase(std::move(groups), true, "AdamW") {}
};

}  // namespace optim
CHORUS_NAMESPACE_END
