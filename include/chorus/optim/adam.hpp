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

namespace detail {
class AdamBase : public Optimizer {
 public:
  AdamBase(std::vector<AnyTensor> params, AdamOptions options, bool decoupled, const char* name)
      : Optimizer(std::move(params)), options(options), decoupled_(decoupled), name_(name) {
    CHORUS_CHECK(options.lr >= 0.0, name, ": invalid learning rate ", options.lr);
    CHORUS_CHECK(options.eps >= 0.0, name, ": invalid epsilon ", options.eps);
    CHORUS_CHECK(options.beta1 >= 0.0 && options.beta1 < 1.0, name, ": invalid beta1 ", options.beta1);
    CHORUS_CHECK(options.beta2 >= 0.0 && options.beta2 < 1.0, name, ": invalid beta2 ", options.beta2);
    CHORUS_CHECK(options.weight_decay >= 0.0, name, ": invalid weight_decay ", options.weight_decay);
  }

  void step() override {
    for_each_with_grad([&](auto& p, auto& g, State& s) {
      using T = typename std::decay_t<decltype(p)>::value_type;
      const double t = step_count(s) + 1.0;
      set_step_count(s, t);
      Tensor<T> m = state_tensor(s, "exp_avg", p);
      Tensor<T> v = state_tensor(s, "exp_avg_sq", p);
      Tensor<T> vmax;
      if (options.amsgrad) vmax = state_tensor(s, "max_exp_avg_sq", p);
      backend::adam_step(p, g, m, v, options.amsgrad ? &vmax : nullptr, options.lr, options.beta1, options.beta2,
                         options.eps, options.weight_decay, decoupled_, static_cast<std::int64_t>(t),
                         options.maximize);
    });
  }

  std::vector<std::string> state_keys() const override { return {"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"}; }
  std::string name() const override { return name_; }

  AdamOptions options;

 private:
  bool decoupled_;
  std::string name_;
};
}  // namespace detail

class Adam final : public detail::AdamBase {
 public:
  Adam(std::vector<AnyTensor> params, AdamOptions options = {})
      : AdamBase(std::move(params), options, false, "Adam") {}
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

/// AdamW: Adam with decoupled weight decay.
class AdamW final : public detail::AdamBase {
 public:
  AdamW(std::vector<AnyTensor> params, AdamWOptions o = {})
      : AdamBase(std::move(params), {o.lr, o.beta1, o.beta2, o.eps, o.weight_decay, o.amsgrad, o.maximize}, true,
                 "AdamW") {}
};

}  // namespace optim
CHORUS_NAMESPACE_END
