#pragma once
// cross_entropy with PyTorch's keyword arguments: a class weight, label smoothing, and inputs
// of any rank ([C], [N, C], [N, C, d1, ...]). The plain case is ops/loss.hpp's fused kernel;
// the others are built from it and the operators above (log_softmax, comparisons, selection).
#include "../compiled.hpp"
#include "index.hpp"
#include "loss.hpp"
#include "reduce.hpp"

CHORUS_NAMESPACE_BEGIN
namespace nn::functional {

/// cross_entropy's options, in torch.nn.functional.cross_entropy's order:
/// `cross_entropy(logits, target, {.weight = w, .ignore_index = 0, .label_smoothing = 0.1})`.
template <class T>
struct CrossEntropyOptions {
  Tensor<T> weight = {};              ///< per-class rescaling [C] (undefined: every class 1)
  std::int64_t ignore_index = -100;   ///< targets of this class count for nothing
  Reduction reduction = Reduction::Mean;  ///< Mean: divided by the targets' summed weights
  double label_smoothing = 0.0;       ///< in [0, 1]: the target mixes in the uniform distribution
};

/// Cross entropy of logits [N, C] (or [C], or [N, C, d1, ...] with target [N, d1, ...]) against
/// class indices, as torch.nn.functional.cross_entropy with its weight, ignore_index,
/// reduction and label_smoothing. Reduction::None gives the target's shape.
template <class T>
Tensor<T> cross_entropy(const Tensor<T>& input, const Tensor<std::int64_t>& target, const CrossEntropyOptions<T>& o) {
  ops::detail::check_defined("cross_entropy", input);
  ops::detail::check_defined("cross_entropy", target, "target");
  CHORUS_CHECK(o.label_smoothing >= 0.0 && o.label_smoothing <= 1.0,
               "cross_entropy: label_smoothing must be in [0, 1], got ", o.label_smoothing);
  CHORUS_CHECK(input.dim() >= 1, "cross_entropy: input must have a class dimension, got a 0-dim tensor");
  const std::int64_t C = input.dim() == 1 ? input.size(0) : input.size(1);
  Tensor<T> x;
  Tensor<std::int64_t> t;
  if (input.dim() == 1) {  // one example: target is a 0-dim class index
    CHORUS_CHECK(target.dim() == 0, "cross_entropy: for input of shape ", input.shape(),
                 " (one example) the target must be a 0-dim class index, got shape ", target.shape());
    x = input.unsqueeze(0);
    t = target.reshape(Shape{1});
  } else if (input.dim() == 2) {
    x = input;
    t = target;
  } else {
    std::vector<std::int64_t> expected{input.size(0)};
    for (std::int64_t d = 2; d < input.dim(); ++d) expected.push_back(input.size(d));
    CHORUS_CHECK(target.shape() == Shape(expected), "cross_entropy: target of shape ", target.shape(),
                 " does not match input of shape ", input.shape(), " (expected ", Shape(expected), ")");
    x = input.movedim(1, -1).reshape(Shape{-1, C});
    t = target.reshape(Shape{-1});
  }
  const Shape rows = target.shape();
  if (!o.weight.defined() && o.label_smoothing == 0.0) {  // the fused kernel
    auto out = ops::detail::class_loss(false, x, t, o.reduction, o.ignore_index);
    return o.reduction == Reduction::None ? out.reshape(rows) : out;
  }
  if (o.weight.defined()) {
    CHORUS_CHECK(o.weight.dim() == 1 && o.weight.size(0) == C, "cross_entropy: weight must be [", C,
                 "] (one per class), got shape ", o.weight.shape());
    ops::detail::check_same_device("cross_entropy", input, o.weight);
  }
  // Per row: w[t] * -log p[t] (0 where ignored; the fused kernel checks the targets), mixed
  // with the smoothing term -sum_c w[c] log p[c] / C.
  auto nll = ops::detail::class_loss(false, x, t, Reduction::None, o.ignore_index);
  const auto ignored = eq(t, static_cast<double>(o.ignore_index));
  const auto counted = ne(t, static_cast<double>(o.ignore_index)).template to<T>();
  const auto weight_of_row =
      o.weight.defined() ? o.weight.index_select(0, t.masked_fill(ignored, 0.0)) * counted : counted;
  auto loss = nll * weight_of_row;
  if (o.label_smoothing > 0.0) {
    auto logp = log_softmax(x, 1);
    auto smooth = (o.weight.defined() ? logp * o.weight : logp).sum(1).neg() * counted;
    loss = loss * (1.0 - o.label_smoothing) + smooth * (o.label_smoothing / static_cast<double>(C));
  }
  if (o.reduction == Reduction::None) return loss.reshape(rows);
  if (o.reduction == Reduction::Sum) return loss.sum();
  return loss.sum() / weight_of_row.sum();  // no counted target: 0 / 0, NaN, as PyTorch
}

/// The short form: cross_entropy(logits, target, reduction, ignore_index), any rank as above
/// (log_softmax + nll, fused).
template <class T>
Tensor<T> cross_entropy(const Tensor<T>& input, const Tensor<std::int64_t>& target,
                        Reduction reduction = Reduction::Mean, std::int64_t ignore_index = -100) {
  if constexpr (is_floating_v<T>) {
    if (input.dim() != 2)
      return cross_entropy(input, target, CrossEntropyOptions<T>{.ignore_index = ignore_index, .reduction = reduction});
  }
  return ops::detail::class_loss(false, input, target, reduction, ignore_index);
}

}  // namespace nn::functional
CHORUS_NAMESPACE_END

// The instances chorus::compiled holds (Note [compiled chorus] in compiled.hpp).
#define CHORUS_OPS_CROSS_ENTROPY_INSTANCES(X, T) \
  X(Tensor<T> nn::functional::cross_entropy<T>(const Tensor<T>&, const Tensor<std::int64_t>&, \
                                               const nn::functional::CrossEntropyOptions<T>&))
CHORUS_EXTERN_INSTANCES(CHORUS_OPS_CROSS_ENTROPY_INSTANCES, CHORUS_FLOATING_DTYPES)
#define CHORUS_OPS_CROSS_ENTROPY_SHORT_INSTANCES(X, T) \
  X(Tensor<T> nn::functional::cross_entropy<T>(const Tensor<T>&, const Tensor<std::int64_t>&, Reduction, std::int64_t))
CHORUS_EXTERN_INSTANCES(CHORUS_OPS_CROSS_ENTROPY_SHORT_INSTANCES, CHORUS_ALL_DTYPES)
