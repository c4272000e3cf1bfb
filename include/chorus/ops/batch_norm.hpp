#pragma once
// Batch normalisation: batch_norm (as torch.nn.functional.batch_norm), optionally synchronised
// across the replicas of a DataParallel or the processes of a job through a StatsReducer, and
// its backward. ops/nn.hpp includes it.
#include <memory>
#include <utility>

#include "../compiled.hpp"
#include "../backend/nn.hpp"
#include "elementwise.hpp"
#include "view.hpp"

CHORUS_NAMESPACE_BEGIN

/// Sums per-channel statistics across the participants of one normalisation (the replicas
/// of a DataParallel, or the processes of a distributed job).
///
/// Note [statistics reducer]
/// SyncBatchNorm needs one collective: an in-place sum, called by every participant in the
/// same order (twice in forward, once in backward). Whoever runs the participants provides
/// it: DataParallel installs one per replica for the duration of a forward
/// (parallel/data_parallel.hpp), a process group can do the same around a
/// DistributedDataParallel forward. The batch-norm backward keeps the reducer it saw in
/// forward, so the backward reduction joins the same participants. Every participant must
/// call each reduction; one that does not (a replica that skips the layer) makes the
/// others fail after a timeout rather than hang.
class StatsReducer {
 public:
  virtual ~StatsReducer() = default;
  /// Replaces `t` (contiguous, same shape everywhere) by its sum over the participants.
  ///@{
  virtual void all_reduce_sum(Tensor<float>& t) = 0;
  virtual void all_reduce_sum(Tensor<double>& t) = 0;
  ///@}
  /// The sum of a host count over the participants.
  virtual std::int64_t all_reduce_sum(std::int64_t count) = 0;
  /// Number of participants.
  virtual int size() const = 0;
};

namespace ops::detail {
inline std::shared_ptr<StatsReducer>& current_reducer_slot() {
  thread_local std::shared_ptr<StatsReducer> slot;
  return slot;
}
}  // namespace ops::detail

/// The reducer installed on this thread (null outside a synchronised forward).
inline const std::shared_ptr<StatsReducer>& current_stats_reducer() { return ops::detail::current_reducer_slot(); }

/// Installs `reducer` as this thread's statistics reducer until the scope ends.
class StatsReducerScope {
 public:
  /// Installs `reducer` (null: none), keeping the previous one to restore on destruction.
  explicit StatsReducerScope(std::shared_ptr<StatsReducer> reducer)
      : previous_(std::exchange(ops::detail::current_reducer_slot(), std::move(reducer))) {}
  ~StatsReducerScope() { ops::detail::current_reducer_slot() = std::move(previous_); }
  StatsReducerScope(const StatsReducerScope&) = delete;
  StatsReducerScope& operator=(const StatsReducerScope&) = delete;

 private:
  std::shared_ptr<StatsReducer> previous_;
};

namespace ops::detail {

/// Note [batch norm backward]
/// With x̂ = (x - μ)·σ⁻¹ over the normalised set of `count` values per channel,
/// dx = w·σ⁻¹·(dy - mean(dy) - x̂·mean(dy·x̂)). The two means are the only coupling between
/// the values of a channel, so SyncBatchNorm all-reduces Σdy and Σdy·(x-μ) (one [2C]
/// reduction) and everything else stays local. dw and db are the local sums: the
/// replicas' (or processes') parameter gradients are summed by DataParallel (or DDP).
template <class T>
class BatchNormBackward final : public autograd::Node<T> {
 public:
  BatchNormBackward(Tensor<T> x, Tensor<T> w, Tensor<T> mean, Tensor<T> invstd, double count, bool has_w, bool has_b,
                    std::shared_ptr<StatsReducer> reducer)
      : x_(std::move(x)), w_(std::move(w)), mean_(std::move(mean)), invstd_(std::move(invstd)), count_(count),
        has_w_(has_w), has_b_(has_b), reducer_(std::move(reducer)) {}
  std::string name() const override { return "BatchNormBackward"; }
  typename autograd::Node<T>::TensorList apply(typename autograd::Node<T>::TensorList&& grads) override {
    using A = backend::bn_acc_t<T>;
    auto gy = contiguous_data(grads[0]);
    const Device dev = gy.device();
    const std::int64_t N = x_.shape()[0], C = x_.shape()[1], S = x_.numel() / std::max<std::int64_t>(N * C, 1);
    const auto& e = this->next_edges();
    Tensor<T> gx, gw, gb;
    if (has_w_ && e[1].valid()) gw = Tensor<T>::empty(Shape{C}, dev);  // dw = Σ dy·x̂ (local)
    if (has_b_ && e[1 + has_w_].valid()) gb = Tensor<T>::empty(Shape{C}, dev);  // db = Σ dy (local)
    // Σdy and Σdy·(x-μ) in one 2-D reduction; dw and db fall out of the same pass.
    auto sums = Tensor<A>::empty(Shape{2 * C}, dev);
    backend::bn_backward_reduce(gy.data(), x_.data(), N, C, S, mean_.data(), invstd_.data(), sums.data(),
                                gw.defined() ? gw.data() : nullptr, gb.defined() ? gb.data() : nullptr, dev);
    // The others wait for this participant's share even when it needs no input gradient.
    if (reducer_) reducer_->all_reduce_sum(sums);
    if (e[0].valid()) {
      gx = Tensor<T>::empty(x_.shape(), dev);
      backend::bn_backward_input(gy.data(), x_.data(), N, C, S, mean_.data(), invstd_.data(),
                                 has_w_ ? w_.data() : static_cast<const T*>(nullptr), sums.data(), 1.0 / count_,
                                 gx.data(), dev);
    }
    typename autograd::Node<T>::TensorList out{gx};
    if (has_w_) out.push_back(gw);
    if (has_b_) out.push_back(gb);
    return out;
  }
  void release_saved() override {
    x_ = Tensor<T>();
    w_ = Tensor<T>();
    mean_ = Tensor<T>();
    invstd_ = Tensor<T>();
  }

 private:
  Tensor<T> x_, w_, mean_, invstd_;
  double count_;
  bool has_w_, has_b_;
  std::shared_ptr<StatsReducer> reducer_;
};

/// A float copy of a 16-bit tensor through the differentiable conversion (undefined stays
/// undefined): Note [16-bit CNN operators] in ops/nn.hpp.
template <class T>
Tensor<float> float_copy(const Tensor<T>& t) {
  return t.defined() ? t.template to<float>() : Tensor<float>();
}

/// batch_norm, with momentum = 1 / *num_batches read on the device when `num_batches` is given
/// (the cumulative average of BatchNorm's momentum=None; Note [batch-norm statistics]).
template <class T>
Tensor<T> batch_norm_impl(const Tensor<T>& x, const Tensor<T>& running_mean, const Tensor<T>& running_var,
                          const Tensor<T>& weight, const Tensor<T>& bias, bool training, double momentum, double eps,
                          std::shared_ptr<StatsReducer> reducer, const Tensor<std::int64_t>* num_batches) {
  static_assert(is_floating_v<T>, "batch_norm: floating-point tensors only");
  using A = backend::bn_acc_t<T>;
  check_defined("batch_norm", x);
  CHORUS_CHECK(x.dim() >= 2, "batch_norm: expected an input [N, C, *] with at least 2 dimensions, got shape ",
               x.shape());
  const std::int64_t N = x.shape()[0], C = x.shape()[1];
  const std::int64_t S = N * C > 0 ? x.numel() / (N * C) : 0;
  const Device dev = x.device();
  auto check_vec = [&](const Tensor<T>& t, const char* what) {
    if (!t.defined()) return;
    check_same_device("batch_norm", x, t);
    CHORUS_CHECK(t.dim() == 1 && t.shape()[0] == C, "batch_norm: ", what, " of shape ", t.shape(), " does not match ",
                 C, " channels of input ", x.shape());
    CHORUS_CHECK(t.is_contiguous(), "batch_norm: ", what, " must be contiguous");
  };
  check_vec(running_mean, "running_mean");
  check_vec(running_var, "running_var");
  check_vec(weight, "weight");
  check_vec(bias, "bias");
  CHORUS_CHECK(running_mean.defined() == running_var.defined(),
               "batch_norm: give both running_mean and running_var, or neither");
  CHORUS_CHECK(eps > 0, "batch_norm: eps must be positive, got ", eps);
  if (num_batches) {
    check_same_device("batch_norm", x, *num_batches);
    CHORUS_CHECK(num_batches->numel() == 1, "batch_norm: num_batches_tracked must have one element, got shape ",
                 num_batches->shape());
  }
  if constexpr (is_reduced_floating_v<T>) {  // Note [16-bit CNN operators]
    Tensor<float> rm, rv;
    if (running_mean.defined()) {
      rm = running_mean.detach().template to<float>();
      rv = running_var.detach().template to<float>();
    }
    auto y = batch_norm_impl(x.template to<float>(), rm, rv, float_copy(weight), float_copy(bias), training, momentum,
                             eps, std::move(reducer), num_batches);
    if (training && running_mean.defined()) {  // the updated statistics, each rounded once
      backend::convert(running_mean, rm);
      backend::convert(running_var, rv);
    }
    return y.template to<T>();
  } else {
    const bool use_batch = training || !running_mean.defined();
    auto wc = weight.defined() ? contiguous_data(weight.detach()) : Tensor<T>();
    auto bc = bias.defined() ? contiguous_data(bias.detach()) : Tensor<T>();
    const T* wp = weight.defined() ? wc.data() : nullptr;
    const T* bp = bias.defined() ? bc.data() : nullptr;
    auto xc = contiguous_data(x.detach());
    auto out = Tensor<T>::empty(x.shape(), dev);
    auto mean = Tensor<T>::empty(Shape{C}, dev), invstd = Tensor<T>::empty(Shape{C}, dev);
    if (!use_batch) {  // evaluation: the running statistics are constants
      backend::copy(mean, running_mean);
      backend::unary(running_var, invstd, backend::fn::AddScalar{eps});
      backend::unary(invstd, invstd, backend::fn::PowScalar{-0.5});
      if (autograd::needs_grad(x, weight, bias)) {
        // y = x·(w σ⁻¹) + (b - μ w σ⁻¹): record it with the differentiable ops (an affine map).
        Shape bshape = Shape::filled(x.dim(), 1);
        bshape[1] = C;
        auto scale = weight.defined() ? mul(weight, invstd) : invstd;
        auto shift = neg(mul(mean, scale));
        if (bias.defined()) shift = add(shift, bias);
        return add(mul(x, scale.reshape(bshape)), shift.reshape(bshape));
      }
      backend::bn_apply(xc.data(), N, C, S, mean.data(), invstd.data(), wp, bp, out.data(), dev);
      return out;
    }
    const std::int64_t local = N * S;
    const std::int64_t count = reducer ? reducer->all_reduce_sum(local) : local;
    CHORUS_CHECK(count > 1, "batch_norm: expected more than 1 value per channel when training, got input of shape ",
                 x.shape(), reducer ? " (summed over the synchronised participants)" : "");
    backend::BnFinish<T> fin;
    fin.count = static_cast<double>(count);
    fin.eps = eps;
    fin.mean = mean.data();
    fin.invstd = invstd.data();
    if (running_mean.defined()) {
      fin.running_mean = running_mean.data();
      fin.running_var = running_var.data();
      fin.momentum = momentum;
      fin.num_batches = num_batches ? num_batches->data() : nullptr;
    }
    if (!reducer) {  // statistics, finish and running statistics: one 2-D reduction
      backend::bn_stats<T, A>(xc.data(), N, C, S, nullptr, nullptr, &fin, dev);
    } else {
      // Local Welford statistics; then Σ count·mean → the global mean, and each participant's
      // M2 around it → Σ = the global M2 (two [C] reductions, no second pass over x).
      auto local_mean = Tensor<A>::empty(Shape{C}, dev), m2 = Tensor<A>::empty(Shape{C}, dev);
      auto global_mean = Tensor<A>::empty(Shape{C}, dev);
      backend::bn_stats<T, A>(xc.data(), N, C, S, local_mean.data(), m2.data(), nullptr, dev);
      backend::unary(local_mean, global_mean, backend::fn::MulScalar{static_cast<double>(local)});
      reducer->all_reduce_sum(global_mean);
      backend::bn_sync_stats(local_mean.data(), static_cast<double>(local), static_cast<double>(count),
                             global_mean.data(), m2.data(), C, dev);
      reducer->all_reduce_sum(m2);
      backend::bn_finish(global_mean.data(), m2.data(), C, fin, dev);
    }
    backend::bn_apply(xc.data(), N, C, S, mean.data(), invstd.data(), wp, bp, out.data(), dev);
    if (autograd::needs_grad(x, weight, bias)) {
      auto node = autograd::make_node<BatchNormBackward<T>, T>(
          {&x, weight.defined() ? &weight : nullptr, bias.defined() ? &bias : nullptr}, xc, wc, mean, invstd,
          double(count), weight.defined(), bias.defined(), std::move(reducer));
      auto& edges = node->mutable_next_edges();
      if (!bias.defined()) edges.erase(edges.begin() + 2);
      if (!weight.defined()) edges.erase(edges.begin() + 1);
      autograd::set_history(out, std::shared_ptr<autograd::Node<T>>(node));
    }
    return out;
  }
}
}  // namespace ops::detail

/// Batch normalisation over dim 1 of x [N, C, *] (as torch.nn.functional.batch_norm).
/// Training: normalises with the batch statistics — summed over the participants of
/// `reducer` when one is given (Note [statistics reducer]) — and, when running_mean/var are
/// defined, updates them in place: r = (1 - momentum)·r + momentum·stat (variance unbiased).
/// Evaluation: normalises with running_mean/var.
template <class T>
Tensor<T> batch_norm(const Tensor<T>& x, const Tensor<T>& running_mean, const Tensor<T>& running_var,
                     const Tensor<T>& weight = Tensor<T>(), const Tensor<T>& bias = Tensor<T>(), bool training = true,
                     double momentum = 0.1, double eps = 1e-5, std::shared_ptr<StatsReducer> reducer = nullptr) {
  return ops::detail::batch_norm_impl(x, running_mean, running_var, weight, bias, training, momentum, eps,
                                      std::move(reducer), nullptr);
}

CHORUS_NAMESPACE_END

// The instances chorus::compiled holds (Note [compiled chorus] in compiled.hpp).
#define CHORUS_OPS_BATCH_NORM_FLOAT_INSTANCES(X, T)                                                                                                                         \
  X(Tensor<T> batch_norm<T>(const Tensor<T>&, const Tensor<T>&, const Tensor<T>&, const Tensor<T>&, const Tensor<T>&, bool, double, double, std::shared_ptr<StatsReducer>))
CHORUS_EXTERN_INSTANCES(CHORUS_OPS_BATCH_NORM_FLOAT_INSTANCES, CHORUS_FLOATING_DTYPES)
