#pragma once
// Loss functions as fused operations: mse_loss, cross_entropy, nll_loss.
#include "../compiled.hpp"
#include "elementwise.hpp"

CHORUS_NAMESPACE_BEGIN

/// How a loss reduces its per-element values: keep them (None), average them (Mean) or add them (Sum).
enum class Reduction { None, Mean, Sum };

namespace ops::detail {

template <class T>
class MseBackward final : public autograd::Node<T> {
 public:
  MseBackward(Tensor<T> a, Tensor<T> b, Reduction r) : a_(std::move(a)), b_(std::move(b)), r_(r) {
    this->save_version(a_);
    this->save_version(b_);
  }
  std::string name() const override { return "MseLossBackward"; }
  typename autograd::Node<T>::TensorList apply(typename autograd::Node<T>::TensorList&& g) override {
    const auto& e = this->next_edges();
    Tensor<T> ga, gb;
    if (e[0].valid()) ga = Tensor<T>::empty(a_.shape(), a_.device());
    if (e[1].valid()) gb = Tensor<T>::empty(b_.shape(), b_.device());
    const double scale = r_ == Reduction::Mean ? 2.0 / static_cast<double>(std::max<std::int64_t>(a_.numel(), 1)) : 2.0;
    backend::squared_error_backward(a_, b_, g[0], scale, ga.defined() ? &ga : nullptr, gb.defined() ? &gb : nullptr);
    return {ga, gb};
  }
  void release_saved() override {
    a_ = Tensor<T>();
    b_ = Tensor<T>();
  }

 private:
  Tensor<T> a_, b_;
  Reduction r_;
};

template <class T>
Tensor<T> reduce_rows(const Tensor<T>& per_row, Reduction r, double mean_count) {
  if (r == Reduction::None) return per_row;
  auto out = Tensor<T>::empty(Shape{}, per_row.device());
  if (per_row.numel() == 0 || mean_count == 0) {
    backend::fill(out, r == Reduction::Sum ? T(0) : std::numeric_limits<T>::quiet_NaN());
  } else {
    backend::sum_all(per_row, out, r == Reduction::Mean ? 1.0 / mean_count : 1.0);
  }
  return out;
}

/// Backward of cross_entropy / nll_loss: g is a scalar (Mean/Sum) or per row (None).
template <class T>
class ClassLossBackward final : public autograd::Node<T> {
 public:
  /// `count` is the number of targets that take part; on a GPU it is `count_t` (one element on
  /// the device), so that nothing waits for the device (Note [device-side validation]).
  ClassLossBackward(bool nll, Tensor<T> input, Tensor<std::int64_t> target, std::int64_t ignore, Reduction r,
                    double count, Tensor<T> count_t)
      : nll_(nll),
        input_(std::move(input)),
        target_(std::move(target)),
        ignore_(ignore),
        r_(r),
        count_(count),
        count_t_(std::move(count_t)) {
    this->save_version(input_);
    this->save_version(target_);
  }
  std::string name() const override { return nll_ ? "NllLossBackward" : "CrossEntropyBackward"; }
  typename autograd::Node<T>::TensorList apply(typename autograd::Node<T>::TensorList&& g) override {
    Tensor<T> gs = g[0];
    std::int64_t stride = 1;
    if (r_ != Reduction::None) {
      stride = 0;
      if (r_ == Reduction::Mean) {
        if (count_t_.defined()) {  // g / count on the device (count 0: every row is ignored, grads are 0)
          auto scaled = Tensor<T>::empty(gs.shape(), gs.device());
          backend::binary_same(contiguous_data(gs), count_t_, scaled, backend::fn::Div{});
          gs = scaled;
        } else {
          gs = unary_forward(gs, backend::fn::MulScalar{count_ ? 1.0 / count_ : 0.0});
        }
      }
    }
    auto grad = Tensor<T>::empty(input_.shape(), input_.device());
    if (input_.numel() == 0) return {grad};
    if (nll_) {
      backend::nll_backward(target_, input_.shape()[1], ignore_, gs, stride, grad);
    } else {
      backend::cross_entropy_backward(input_, target_, ignore_, gs, stride, grad);
    }
    return {grad};
  }
  void release_saved() override {
    input_ = Tensor<T>();
    target_ = Tensor<std::int64_t>();
    count_t_ = Tensor<T>();
  }

 private:
  bool nll_;
  Tensor<T> input_;
  Tensor<std::int64_t> target_;
  std::int64_t ignore_;
  Reduction r_;
  double count_;
  Tensor<T> count_t_;
};

template <class T>
Tensor<T> class_loss(bool nll, const Tensor<T>& input, const Tensor<std::int64_t>& target, Reduction r,
                     std::int64_t ignore_index) {
  const char* op = nll ? "nll_loss" : "cross_entropy";
  check_defined(op, input);
  check_defined(op, target, "target");
  check_same_device(op, input, target);
  CHORUS_CHECK(input.dim() == 2, op, ": input must be [batch, classes], got shape ", input.shape());
  CHORUS_CHECK(target.dim() == 1 && target.shape()[0] == input.shape()[0], op, ": target of shape ", target.shape(),
               " does not match input of shape ", input.shape(), " (expected [", input.shape()[0], "])");
  auto x = contiguous_data(input);
  auto t = contiguous_data(target);
  const auto N = x.shape()[0], C = x.shape()[1];
  auto per_row = Tensor<T>::empty(Shape{N}, x.device());
  double count = 0;
  Tensor<T> count_t;  // on a GPU: the count, on the device
  Tensor<T> out;
  if (N > 0) {
    CHORUS_CHECK(C > 0, op, ": input has no classes (shape ", input.shape(), ")");
    if (x.device().is_cpu()) {  // validate and count eagerly
      const std::int64_t* tp = t.data();
      for (std::int64_t i = 0; i < N; ++i) {
        if (tp[i] == ignore_index) continue;
        CHORUS_CHECK(tp[i] >= 0 && tp[i] < C, op, ": target ", tp[i], " at index ", i, " is out of range for ", C,
                     " classes");
        ++count;
      }
    } else {  // the kernels validate; the count stays on the device (Note [device-side validation])
      count_t = Tensor<T>::empty(Shape{}, x.device());
      backend::count_not_ignored(t, ignore_index, count_t);
    }
    nll ? backend::nll_forward(x, t, ignore_index, per_row) : backend::cross_entropy_forward(x, t, ignore_index, per_row);
  }
  if (count_t.defined() && r == Reduction::Mean) {
    auto total = Tensor<T>::empty(Shape{}, x.device());
    backend::sum_all(per_row, total, 1.0);
    out = Tensor<T>::empty(Shape{}, x.device());
    backend::binary_same(total, count_t, out, backend::fn::Div{});  // count 0: NaN, as on the CPU
  } else {
    out = reduce_rows(per_row, r, count);
  }
  if (autograd::needs_grad(input)) {
    auto node = autograd::make_node<ClassLossBackward<T>, T>({&input}, nll, x.detach(), t, ignore_index, r, count,
                                                             count_t);
    autograd::set_history(out, std::shared_ptr<autograd::Node<T>>(node));
  }
  return out;
}

}  // namespace ops::detail

namespace nn::functional {

/// Mean (or summed, or elementwise) squared error; input and target must have one shape.
template <class T>
Tensor<T> mse_loss(const Tensor<T>& input, const Tensor<T>& target, Reduction reduction = Reduction::Mean) {
  ops::detail::check_defined("mse_loss", input);
  ops::detail::check_defined("mse_loss", target, "target");
  ops::detail::check_same_device("mse_loss", input, target);
  CHORUS_CHECK(input.shape() == target.shape(), "mse_loss: input shape ", input.shape(), " and target shape ",
               target.shape(), " differ");
  auto a = ops::detail::contiguous_data(input), b = ops::detail::contiguous_data(target);
  Tensor<T> out;
  if (reduction == Reduction::None) {
    auto d = ops::detail::binary_forward("mse_loss", a, b, backend::fn::Sub{});
    out = ops::detail::binary_forward("mse_loss", d, d, backend::fn::Mul{});
  } else {
    out = Tensor<T>::empty(Shape{}, a.device());
    if (a.numel() == 0) {
      backend::fill(out, reduction == Reduction::Sum ? T(0) : std::numeric_limits<T>::quiet_NaN());
    } else {
      backend::squared_error_sum(a, b, out, reduction == Reduction::Mean ? 1.0 / static_cast<double>(a.numel()) : 1.0);
    }
  }
  if (autograd::needs_grad(input, target)) {
    auto node = autograd::make_node<ops::detail::MseBackward<T>, T>({&input, &target}, a.detach(), b.detach(),
                                                                    reduction);
    autograd::set_history(out, std::shared_ptr<autograd::Node<T>>(node));
  }
  return out;
}

// cross_entropy is in ops/cross_entropy.hpp (its options form is built from later operators).

/// Negative log likelihood of log-probabilities [N, C] against class indices [N].
template <class T>
Tensor<T> nll_loss(const Tensor<T>& log_probs, const Tensor<std::int64_t>& target,
                   Reduction reduction = Reduction::Mean, std::int64_t ignore_index = -100) {
  return ops::detail::class_loss(true, log_probs, target, reduction, ignore_index);
}

}  // namespace nn::functional
CHORUS_NAMESPACE_END

// The instances chorus::compiled holds (Note [compiled chorus] in compiled.hpp).
#define CHORUS_OPS_LOSS_INSTANCES(X, T)                                                                                 \
  X(Tensor<T> nn::functional::mse_loss<T>(const Tensor<T>&, const Tensor<T>&, Reduction))                               \
  X(Tensor<T> nn::functional::nll_loss<T>(const Tensor<T>&, const Tensor<std::int64_t>&, Reduction, std::int64_t))
CHORUS_EXTERN_INSTANCES(CHORUS_OPS_LOSS_INSTANCES, CHORUS_ALL_DTYPES)
