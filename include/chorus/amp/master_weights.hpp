#pragma once
// Float32 master weights for a 16-bit model (mixed-precision training).
//
// Note [the form of mixed precision]
// PyTorch's autocast changes, inside a scope, the dtype an operator returns: a float model's
// linear layers hand back float16 tensors. chorus's types are static (a layer's forward returns
// Tensor<T>, and LinearT<float> holds Tensor<float> members), so an autocast over a float model
// could only compute in 16 bits and store the result in float again: twice the activation
// memory of PyTorch's, a second rounding, and no 16-bit tensor for the next product to read.
// The form that fits is the one DeepSpeed's and Megatron's bf16 optimizers use: the model is
// a 16-bit model (the layers are templates over the scalar type: nn::LinearT<bfloat16>), so its
// matrix products, convolutions and activations are in 16 bits (products accumulate in float:
// the GEMMs run with a float compute type), its norms and softmaxes compute in float and round
// once (Note [16-bit through float]), and the loss is taken in float32 from logits converted
// with .to<float>() (differentiable: Note [one graph over every dtype]). The optimizer steps
// float32 copies of the parameters (the master weights, with the optimizer state beside them):
// a 16-bit parameter would lose every update smaller than half its ulp (2^-9 of its value in
// bfloat16), which a learning rate of 1e-4 does all the time. Under DataParallel the replicas
// receive the 16-bit parameters: half the broadcast bytes of float32.
//
//   nn::TransformerEncoderLayerT<bfloat16> layer(...);     // the 16-bit model
//   amp::MasterWeights master(layer->parameters());       // float32 copies
//   optim::AdamW opt(master.parameters(), {.lr = 1e-4});  // steps the copies
//   auto loss = F::cross_entropy(layer(x).to<float>(), y);
//   opt.zero_grad(); loss.backward(); master.step(opt);   // grads in, step, weights out
//
// float16 adds a GradScaler (its range ends at 65504): master.step(scaler, opt), then
// scaler.update(). Gradient clipping is an option of the step, applied to the masters'
// float32 gradients (unscaled first where a scaler is given): master.step(opt, {.max_norm = 1.0}).
#include <optional>
#include <utility>
#include <vector>

#include "../compiled.hpp"
#include "../core/any_tensor.hpp"
#include "../optim/optimizer.hpp"
#include "grad_scaler.hpp"

CHORUS_NAMESPACE_BEGIN
namespace amp {

/// What MasterWeights::step does between moving the gradients in and stepping.
struct MasterStepOptions {
  std::optional<double> max_norm;  ///< clip the masters' gradients to this total norm (clip_grad_norm_)
  double norm_type = 2.0;          ///< the norm's order (> 0, or infinity)
};

/// Float32 master copies of a 16-bit model's parameters, which the optimizer steps in its place
/// (Note [the form of mixed precision]).
class MasterWeights {
 public:
  /// Float32 master copies of the 16-bit parameters among `model_params` (a float32 or
  /// float64 parameter is its own master: stepped as it is, never copied).
  explicit MasterWeights(const std::vector<AnyTensor>& model_params);

  /// What the optimizer steps: the masters, in the order of the model's parameters.
  const std::vector<AnyTensor>& parameters() const { return master_; }
  /// The masters of some of the model's parameters (for an optimizer's parameter groups).
  std::vector<AnyTensor> of(const std::vector<AnyTensor>& model_params) const;

  /// Adds each 16-bit parameter's gradient into its master's (converted exactly to float32;
  /// accumulating when the master already has one) and clears it on the model.
  void grads_to_master();

  /// Writes each master into its 16-bit parameter, rounded once.
  void master_to_model();

  /// grads_to_master(), clipping when asked, opt.step(), master_to_model(): `opt` must step
  /// parameters() (or of()).
  void step(optim::Optimizer& opt, MasterStepOptions options = {});
  /// The same with loss scaling (float16): the masters' gradients are unscaled (before any
  /// clipping) and checked, and the step and the write-back are skipped when one was inf or
  /// NaN. Returns whether the optimizer stepped; call scaler.update() after it, as with
  /// scaler.step(opt).
  bool step(GradScaler& scaler, optim::Optimizer& opt, MasterStepOptions options = {});

  /// The number of model parameters (each with its master).
  std::size_t size() const { return model_.size(); }
  /// Whether parameter i has a master copy (false: a float32/float64 parameter, its own master).
  bool is_copy(std::size_t i) const { return model_.at(i).impl_key() != master_.at(i).impl_key(); }

 private:
  /// f(16-bit parameter, its float32 master) for each parameter that has a copy, no grad mode.
  template <class F>
  void for_each_copy(F&& f) {
    NoGradGuard no_grad;
    for (std::size_t i = 0; i < model_.size(); ++i) {
      if (!is_copy(i)) continue;
      model_[i].visit([&](const auto& t) {
        using T = typename std::decay_t<decltype(t)>::value_type;
        if constexpr (is_reduced_floating_v<T>) f(t, master_[i].as<float>());
      });
    }
  }

  std::vector<AnyTensor> model_;   // the model's parameters
  std::vector<AnyTensor> master_;  // their masters (the parameter itself where it is not 16-bit)
};

}  // namespace amp
CHORUS_NAMESPACE_END

// The definitions: compiled into chorus::compiled, or here in the header-only form (Note
// [compiled chorus] in compiled.hpp).
#if !CHORUS_COMPILED
#include "master_weights_impl.hpp"
#endif
