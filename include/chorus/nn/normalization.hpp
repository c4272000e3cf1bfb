#pragma once
// BatchNorm1d/2d, SyncBatchNorm and LayerNorm.
#include <optional>
#include <utility>

#include "../ops/nn.hpp"
#include "init.hpp"
#include "module.hpp"

CHORUS_NAMESPACE_BEGIN
namespace nn {

/// Batch norm's options, braced in PyTorch's order (Note [layer options] in nn/module.hpp).
struct BatchNormOptions {
  double eps = 1e-5;  ///< Added to the variance for numerical stability (default 1e-5).
  /// Weight of the new batch statistic in the running estimate; nullopt: a cumulative
  /// average (1 / num_batches_tracked), as PyTorch's momentum=None.
  std::optional<double> momentum = 0.1;
  bool affine = true;               ///< Learns a per-channel weight and bias (default true).
  bool track_running_stats = true;  ///< Keeps the running statistics that eval() normalises with (default true).
  Device device = Device::cpu();    ///< Where the parameters and buffers are created (default CPU).
};

namespace detail {
/// Which input ranks a batch-norm layer accepts: 1d [N, C] or [N, C, L], 2d [N, C, H, W],
/// 0 for SyncBatchNorm (any [N, C, *]).
template <int Dim>
void check_bn_input(const char* layer, std::int64_t C, const Shape& s) {
  const int d = s.size();
  const bool ok = Dim == 1 ? (d == 2 || d == 3) : Dim == 2 ? d == 4 : d >= 2;
  CHORUS_CHECK(ok, layer, ": expected ",
               Dim == 1 ? "a 2-D or 3-D input [N, C(, L)]" : Dim == 2 ? "a 4-D input [N, C, H, W]" : "an input [N, C, *]",
               ", got shape ", s);
  CHORUS_CHECK(s[1] == C, layer, ": input of shape ", s, " has ", s[1], " channels, expected ", C);
}
}  // namespace detail

namespace detail {
inline void convert_sync_batchnorm(Module& module);
}  // namespace detail

/// What every batch-norm layer shares, whatever its scalar type: whether it is synchronised
/// (SyncBatchNorm, or converted to one: Note [converting to SyncBatchNorm]).
class BatchNormBase : public Module {
 public:
  /// True for a synchronised layer (SyncBatchNorm, or converted to one).
  bool is_sync() const { return sync_; }
  bool meets_other_replicas() const override { return sync_; }

 protected:
  /// A layer, synchronised when `sync` is true.
  explicit BatchNormBase(bool sync) : sync_(sync) {}
  /// The PyTorch class name: SyncBatchNorm when synchronised, else BatchNorm1d (`dim` 1) or BatchNorm2d.
  const char* layer_name(int dim) const { return sync_ ? "SyncBatchNorm" : dim == 1 ? "BatchNorm1d" : "BatchNorm2d"; }

 private:
  friend void detail::convert_sync_batchnorm(Module& module);
  bool sync_;
};

/// Batch normalisation over dim 1, as torch.nn.BatchNorm{1,2}d: parameters `weight` (ones)
/// and `bias` (zeros) when affine; buffers `running_mean` (zeros), `running_var` (ones) and
/// `num_batches_tracked` (int64 scalar) when tracking running statistics. Training
/// normalises with batch statistics and updates the running ones; eval() uses the running
/// ones. Sync = true (SyncBatchNorm, or a layer converted to one: is_sync()) takes the
/// statistics over every participant of the thread's StatsReducer (Note [statistics
/// reducer]); under DataParallel without Sync each
/// replica normalises its own chunk and replica 0's running statistics are the primary's
/// (the others' updates are discarded at the next replication), as nn.DataParallel does.
template <class T, int Dim, bool Sync = false>
class BatchNormImpl : public BatchNormBase {
 public:
  /// Over `num_features` channels (C of the input), initialised by reset_parameters().
  explicit BatchNormImpl(std::int64_t num_features, BatchNormOptions options = {})
      : BatchNormBase(Sync), num_features(num_features), options(options) {
    CHORUS_CHECK(num_features > 0, layer_name(), ": num_features must be positive, got ", num_features);
    CHORUS_CHECK(options.eps > 0, layer_name(), ": eps must be positive, got ", options.eps);
    CHORUS_CHECK(!options.momentum || (*options.momentum >= 0 && *options.momentum <= 1), layer_name(),
                 ": momentum must be in [0, 1], got ", options.momentum.value_or(0));
    const Device d = options.device;
    if (options.affine) {
      register_parameter("weight", &BatchNormImpl::weight, Tensor<T>::empty(Shape{num_features}, d));
      register_parameter("bias", &BatchNormImpl::bias, Tensor<T>::empty(Shape{num_features}, d));
    }
    if (options.track_running_stats) {
      register_buffer("running_mean", &BatchNormImpl::running_mean, Tensor<T>::empty(Shape{num_features}, d));
      register_buffer("running_var", &BatchNormImpl::running_var, Tensor<T>::empty(Shape{num_features}, d));
      register_buffer("num_batches_tracked", &BatchNormImpl::num_batches_tracked, zeros<std::int64_t>(Shape{}, d));
    }
    reset_parameters();
  }

  /// Resets running_mean to zeros, running_var to ones and num_batches_tracked to 0 (when tracking).
  void reset_running_stats() {
    if (!options.track_running_stats) return;
    NoGradGuard g;
    running_mean.fill_(T(0));
    running_var.fill_(T(1));
    num_batches_tracked.fill_(0);
  }
  /// Resets the running statistics, and weight to ones and bias to zeros (when affine).
  void reset_parameters() {
    reset_running_stats();
    if (options.affine) {
      init::ones_(weight);
      init::zeros_(bias);
    }
  }

  /// Normalises x [N, C, *] per channel (see above); training also updates the running statistics.
  Tensor<T> forward(const Tensor<T>& x) const {
    if (is_sync()) detail::check_bn_input<0>(layer_name(), num_features, x.shape());
    else detail::check_bn_input<Dim>(layer_name(), num_features, x.shape());
    const bool training = is_training();
    CHORUS_CHECK(!(is_sync() && training && autograd::in_checkpoint()), layer_name(),
                 " cannot train inside a checkpointed function: recomputing it in backward would meet the other "
                 "replicas' statistics at another time (Note [activation checkpointing])");
    // Recomputing a checkpointed function repeats the batch statistics, not their update.
    const bool update = training && options.track_running_stats && !autograd::is_recomputing();
    const bool cumulative = update && !options.momentum;
    if (update) {
      NoGradGuard g;
      backend::unary(num_batches_tracked, num_batches_tracked, backend::fn::AddScalar{1.0});
    }
    std::shared_ptr<StatsReducer> reducer;
    if (is_sync() && training) reducer = current_stats_reducer();
    // momentum=None: the kernel reads 1 / num_batches_tracked on the device (no item(), no
    // host sync; Note [batch-norm statistics]).
    const bool use_running = update || !training;
    return ops::detail::batch_norm_impl(x, use_running ? running_mean : Tensor<T>(),
                                        use_running ? running_var : Tensor<T>(), weight, bias, training,
                                        options.momentum.value_or(0.0), options.eps, std::move(reducer),
                                        cumulative ? &num_batches_tracked : nullptr);
  }
  std::string name() const override { return std::string(layer_name()) + "(" + std::to_string(num_features) + ")"; }

  std::int64_t num_features;  ///< The number of channels C.
  BatchNormOptions options;   ///< The options it was built with.
  /// Parameters weight and bias (when affine), buffers running_mean and running_var (when
  /// tracking running statistics), each [num_features]; undefined otherwise.
  ///@{
  Tensor<T> weight, bias, running_mean, running_var;
  ///@}
  Tensor<std::int64_t> num_batches_tracked;  ///< Training batches seen (0-dim buffer, when tracking).

 private:
  const char* layer_name() const { return BatchNormBase::layer_name(Dim); }
};

/// BatchNorm1d's implementation: input [N, C] or [N, C, L].
template <class T = float>
using BatchNorm1dImpl = BatchNormImpl<T, 1>;
/// BatchNorm2d's implementation: input [N, C, H, W].
template <class T = float>
using BatchNorm2dImpl = BatchNormImpl<T, 2>;
/// SyncBatchNorm's implementation: input [N, C, *], statistics over every replica.
template <class T = float>
using SyncBatchNormImpl = BatchNormImpl<T, 0, true>;

/// Holder of a batch-norm layer (Note [layer options] in nn/module.hpp):
/// `BatchNorm2dT<T>(16, {.momentum = 0.01})`.
template <class T, int Dim, bool Sync>
class BatchNormHolder : public ModuleHolder<BatchNormImpl<T, Dim, Sync>> {
 public:
  using ModuleHolder<BatchNormImpl<T, Dim, Sync>>::ModuleHolder;
  /// Constructs the implementation: BatchNormImpl(num_features, options).
  explicit BatchNormHolder(std::int64_t num_features, BatchNormOptions options = {})
      : ModuleHolder<BatchNormImpl<T, Dim, Sync>>(std::make_shared<BatchNormImpl<T, Dim, Sync>>(num_features, options)) {}
};

/// Note [converting to SyncBatchNorm]
/// PyTorch's SyncBatchNorm.convert_sync_batchnorm(module) swaps every BatchNorm*d in the tree
/// for a SyncBatchNorm holding the same parameters, buffers and options. Here the parents
/// hold their layers in typed members (`nn::BatchNorm2d bn;`) and call them through those
/// (Sequential through a call fixed at push_back), so an object of another type could not
/// take a layer's place. The conversion therefore happens in place: the layer becomes
/// synchronised (is_sync(); it names itself SyncBatchNorm, accepts any [N, C, *] input and
/// meets the other replicas), keeping its parameters, buffers and options by construction.
/// As in PyTorch, convert before wrapping the module in DataParallel (which looks for
/// synchronised layers when it is built); the statistics are reduced across DataParallel's
/// replicas (Note [statistics reducer]), so there is no process_group argument.
inline void detail::convert_sync_batchnorm(Module& module) {
  if (auto* bn = dynamic_cast<BatchNormBase*>(&module)) bn->sync_ = true;
  for (const auto& child : module.named_children()) convert_sync_batchnorm(*child.module);
}

/// Holder of BatchNorm1dImpl<T>, as torch.nn.BatchNorm1d.
template <class T = float>
using BatchNorm1dT = BatchNormHolder<T, 1, false>;
/// Holder of BatchNorm2dImpl<T>, as torch.nn.BatchNorm2d.
template <class T = float>
using BatchNorm2dT = BatchNormHolder<T, 2, false>;
/// Batch norm whose statistics cover every replica of a DataParallel (and, through the same
/// StatsReducer, every process of a distributed job); alone it is a plain batch norm.
template <class T = float>
class SyncBatchNormT : public BatchNormHolder<T, 0, true> {
 public:
  using BatchNormHolder<T, 0, true>::BatchNormHolder;
  /// Makes every BatchNorm in `module`'s tree (any scalar type) a SyncBatchNorm, in place,
  /// and returns the module (Note [converting to SyncBatchNorm]).
  template <class M>
  static M convert_sync_batchnorm(M&& module) {
    detail::convert_sync_batchnorm(module_of(module));
    return std::forward<M>(module);
  }
};
using BatchNorm1d = BatchNorm1dT<float>;      ///< BatchNorm1dT over float tensors.
using BatchNorm2d = BatchNorm2dT<float>;      ///< BatchNorm2dT over float tensors.
using SyncBatchNorm = SyncBatchNormT<float>;  ///< SyncBatchNormT over float tensors.

/// LayerNorm's options, braced in PyTorch's order (Note [layer options] in nn/module.hpp).
struct LayerNormOptions {
  double eps = 1e-5;               ///< Added to the variance for numerical stability (default 1e-5).
  bool elementwise_affine = true;  ///< Learns a `weight` of normalized_shape (default true).
  bool bias = true;                ///< With elementwise_affine: a `bias` too (PyTorch 2.1's bias=False has none).
  Device device = Device::cpu();   ///< Where the parameters are created (default CPU).
};

/// Layer normalisation over the trailing `normalized_shape`, as torch.nn.LayerNorm
/// (parameters `weight` = ones, `bias` = zeros of that shape; no bias with .bias = false).
template <class T = float>
class LayerNormImpl : public Module {
 public:
  /// Normalises over the trailing dims `normalized_shape` (non-empty).
  explicit LayerNormImpl(Shape normalized_shape, LayerNormOptions options = {})
      : normalized_shape(normalized_shape), options(options) {
    CHORUS_CHECK(normalized_shape.size() > 0 && numel_of(normalized_shape) > 0,
                 "LayerNorm: normalized_shape must be non-empty, got ", normalized_shape);
    CHORUS_CHECK(options.eps > 0, "LayerNorm: eps must be positive, got ", options.eps);
    if (options.elementwise_affine) {
      register_parameter("weight", &LayerNormImpl::weight, ones<T>(normalized_shape, options.device));
      if (options.bias) register_parameter("bias", &LayerNormImpl::bias, zeros<T>(normalized_shape, options.device));
    }
  }
  /// Normalises over the last dim, of size `dim`.
  explicit LayerNormImpl(std::int64_t dim, LayerNormOptions options = {}) : LayerNormImpl(Shape{dim}, options) {}
  /// layer_norm of x over its trailing normalized_shape dims; same shape as x.
  Tensor<T> forward(const Tensor<T>& x) const { return layer_norm(x, normalized_shape, weight, bias, options.eps); }
  std::string name() const override { return "LayerNorm"; }

  Shape normalized_shape;    ///< The trailing dims normalised over.
  LayerNormOptions options;  ///< The options it was built with.
  /// The parameters, of normalized_shape: weight (ones) and bias (zeros); undefined when left out.
  ///@{
  Tensor<T> weight, bias;
  ///@}
};
/// Holder (Note [layer options] in nn/module.hpp): `LayerNormT<T>({4, 5}, {.eps = 1e-6})`.
template <class T = float>
class LayerNormT : public ModuleHolder<LayerNormImpl<T>> {
 public:
  using ModuleHolder<LayerNormImpl<T>>::ModuleHolder;
  /// Constructs the implementation: LayerNormImpl(normalized_shape, options).
  explicit LayerNormT(Shape normalized_shape, LayerNormOptions options = {})
      : ModuleHolder<LayerNormImpl<T>>(std::make_shared<LayerNormImpl<T>>(normalized_shape, options)) {}
  /// Constructs the implementation: LayerNormImpl(dim, options), over the last dim.
  explicit LayerNormT(std::int64_t dim, LayerNormOptions options = {}) : LayerNormT(Shape{dim}, options) {}
};
using LayerNorm = LayerNormT<float>;  ///< LayerNormT over float tensors.

}  // namespace nn
CHORUS_NAMESPACE_END
