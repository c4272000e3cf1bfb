#pragma once
// Learning-rate schedulers, torch.optim.lr_scheduler's semantics: constructing one records each
// group's learning rate as its base and applies the schedule at epoch 0; step() advances the
// epoch (or the iteration, for OneCycleLR and warmup by steps) and sets every group's lr.
//
// Note [closed-form schedules]
// PyTorch's schedulers update the lr recursively (chainable form) and document the closed form
// they equal when a scheduler runs alone. chorus computes the closed form from (base lr, epoch):
// the same values up to rounding, and the whole scheduler state is (last_epoch, base lrs), so a
// checkpoint restores it exactly (io/safetensors.hpp saves it with the optimizer). Schedules are
// combined with SequentialLR (e.g. LinearLR warmup, then CosineAnnealingLR), not by chaining two
// schedulers on one optimizer.
#include <algorithm>
#include <cmath>
#include <memory>
#include <numbers>
#include <string>
#include <utility>
#include <vector>

#include <concepts>

#include "../compiled.hpp"
#include "optimizer.hpp"

CHORUS_NAMESPACE_BEGIN
namespace optim {

/// Base class of the learning-rate schedulers (torch.optim.lr_scheduler.LRScheduler): sets each
/// group's lr to lr_at(base lr, epoch) (Note [closed-form schedules]).
class LRScheduler {
 public:
  virtual ~LRScheduler() = default;
  LRScheduler(const LRScheduler&) = delete;
  LRScheduler& operator=(const LRScheduler&) = delete;
  /// Movable, so that SequentialLR can take schedulers by value.
  LRScheduler(LRScheduler&&) noexcept = default;
  LRScheduler& operator=(LRScheduler&&) = delete;

  /// Advances one epoch (or iteration) and sets the optimizer's learning rates.
  void step();

  /// The epoch the current learning rates belong to (0 after construction).
  std::int64_t last_epoch() const { return last_epoch_; }
  /// The learning rates the last step set, one per parameter group.
  std::vector<double> get_last_lr() const;
  /// The base learning rates the schedule is computed from, one per parameter group.
  const std::vector<double>& base_lrs() const { return base_lrs_; }
  /// The optimizer whose learning rates this scheduler sets.
  Optimizer& optimizer() const { return *opt_; }

  /// The learning rate of a group whose base lr is `base` at `epoch` (Note [closed-form schedules]).
  virtual double lr_at(double base, std::int64_t epoch) const = 0;
  /// The momentum to set at `epoch`, for schedules that cycle it (OneCycleLR); none by default.
  ///@{
  virtual bool sets_momentum() const { return false; }
  virtual double momentum_at(std::size_t /*group*/, std::int64_t /*epoch*/) const { return 0.0; }
  ///@}
  /// The scheduler's name, recorded in checkpoints.
  virtual std::string name() const = 0;
  /// Throws when the schedule is not defined at `epoch` (OneCycleLR beyond its total_steps).
  virtual void check_epoch(std::int64_t /*epoch*/) const {}

  /// Restores a saved state (last_epoch and base lrs) and applies it to the optimizer.
  void load_state(std::int64_t last_epoch, std::vector<double> base_lrs);
  /// Throws where load_state would refuse that state; changes nothing.
  void check_state(std::int64_t last_epoch, const std::vector<double>& base_lrs) const;

 protected:
  /// Records each group's current lr as its base lr; the concrete scheduler then calls start().
  explicit LRScheduler(Optimizer& opt);
  /// Called by each concrete scheduler's constructor, once its options are checked (virtual
  /// calls are not dispatched to the derived class from the base's constructor).
  void start() {
    last_epoch_ = 0;
    apply();
  }
  std::vector<double> base_lrs_;  ///< The base learning rates, one per parameter group.

 private:
  void apply();

  Optimizer* opt_;
  std::int64_t last_epoch_ = 0;
};

/// lr = base * gamma^floor(epoch / step_size).
class StepLR final : public LRScheduler {
 public:
  /// Decays the lr by `gamma` every `step_size` epochs (step_size > 0).
  StepLR(Optimizer& opt, std::int64_t step_size, double gamma = 0.1);
  double lr_at(double base, std::int64_t epoch) const override {
    return base * std::pow(gamma_, static_cast<double>(epoch / step_size_));
  }
  std::string name() const override { return "StepLR"; }

 private:
  std::int64_t step_size_;
  double gamma_;
};

/// lr = base * gamma^(number of milestones <= epoch).
class MultiStepLR final : public LRScheduler {
 public:
  /// Decays the lr by `gamma` at each of the `milestones` (epochs, in increasing order).
  MultiStepLR(Optimizer& opt, std::vector<std::int64_t> milestones, double gamma = 0.1);
  double lr_at(double base, std::int64_t epoch) const override {
    const auto passed = std::upper_bound(milestones_.begin(), milestones_.end(), epoch) - milestones_.begin();
    return base * std::pow(gamma_, static_cast<double>(passed));
  }
  std::string name() const override { return "MultiStepLR"; }

 private:
  std::vector<std::int64_t> milestones_;
  double gamma_;
};

/// lr = eta_min + (base - eta_min) * (1 + cos(pi * epoch / T_max)) / 2 (SGDR without restarts).
class CosineAnnealingLR final : public LRScheduler {
 public:
  /// Anneals the lr from its base to `eta_min` over `t_max` epochs (t_max > 0).
  CosineAnnealingLR(Optimizer& opt, std::int64_t t_max, double eta_min = 0.0);
  double lr_at(double base, std::int64_t epoch) const override {
    return eta_min_ + (base - eta_min_) * (1 + std::cos(std::numbers::pi * static_cast<double>(epoch) /
                                                        static_cast<double>(t_max_))) / 2;
  }
  std::string name() const override { return "CosineAnnealingLR"; }

 private:
  std::int64_t t_max_;
  double eta_min_;
};

/// LinearLR's options (torch.optim.lr_scheduler.LinearLR's arguments).
struct LinearLROptions {
  double start_factor = 1.0 / 3;  ///< the first epoch's factor, in (0, 1]
  double end_factor = 1.0;        ///< the factor from total_iters on, in [0, 1]
  std::int64_t total_iters = 5;   ///< epochs of the ramp
};

/// Linear warmup: lr = base * (start + (end - start) * min(epoch, total_iters) / total_iters):
/// `optim::LinearLR warmup(opt, {.start_factor = 0.1, .total_iters = 100});`.
class LinearLR final : public LRScheduler {
 public:
  /// Ramps the lr factor from start_factor to end_factor over total_iters epochs; throws on an
  /// option out of range.
  explicit LinearLR(Optimizer& opt, LinearLROptions options = {});
  double lr_at(double base, std::int64_t epoch) const override {
    const double f = static_cast<double>(std::min(epoch, total_)) / static_cast<double>(total_);
    return base * (start_ + (end_ - start_) * f);
  }
  std::string name() const override { return "LinearLR"; }

 private:
  double start_, end_;
  std::int64_t total_;
};

/// OneCycleLR's options (torch.optim.lr_scheduler.OneCycleLR's arguments).
struct OneCycleOptions {
  double max_lr = 0.1;              ///< the peak lr of every group
  std::int64_t total_steps = 0;     ///< iterations in the cycle (required)
  double pct_start = 0.3;           ///< fraction of the cycle spent increasing the lr
  bool cos_anneal = true;           ///< anneal_strategy 'cos' (true) or 'linear'
  bool cycle_momentum = true;       ///< cycle momentum (SGD) / beta1 (Adam) inversely to the lr
  double base_momentum = 0.85;      ///< the momentum at the peak lr (the cycle's lowest)
  double max_momentum = 0.95;       ///< the momentum at the initial and final lr (the cycle's highest)
  double div_factor = 25.0;         ///< initial lr = max_lr / div_factor
  double final_div_factor = 1e4;    ///< final lr = initial lr / final_div_factor
  bool three_phase = false;         ///< anneal back to the initial lr, then to the final lr (three phases)
};

/// The 1cycle policy (Smith & Topin 2017), torch.optim.lr_scheduler.OneCycleLR: stepped once
/// per batch. Its base lrs are the groups' max lr; the optimizer's own lr is overwritten.
///
/// Note [one-cycle end]
/// PyTorch's loop (optimizer.step(); scheduler.step(); total_steps times) ends with the scheduler
/// at epoch total_steps, one past the epoch of the last optimizer step; one more step raises
/// ("stepped total_steps + 1 times"), here as in PyTorch. At epoch total_steps PyTorch
/// extrapolates the last phase (pct > 1). The cosine then comes back up from the final lr
/// (chorus gives the same value); the linear anneal overshoots below the final lr, to a negative
/// lr with the default factors (and beta1 past max_momentum), which chorus's optimizers refuse:
/// every such run would end in an error. No optimizer step of the loop uses that value, so the
/// linear anneal holds its end there instead (pct capped at 1: the final lr and momentum), which
/// also keeps a stray extra optimizer step from ascending the gradient.
class OneCycleLR final : public LRScheduler {
 public:
  /// Sets every group's base lr to max_lr; throws on an invalid option, or if cycle_momentum is
  /// set and the optimizer has no momentum.
  OneCycleLR(Optimizer& opt, OneCycleOptions o);

  /// lr levels: 0 = initial (max / div), 1 = max, 2 = min (initial / final_div).
  CHORUS_INLINE double lr_at(double base, std::int64_t epoch) const override;
  bool sets_momentum() const override { return o_.cycle_momentum; }
  /// The momentum at `epoch`, moving opposite to the lr between base_momentum and max_momentum.
  CHORUS_INLINE double momentum_at(std::size_t, std::int64_t epoch) const override;
  std::string name() const override { return "OneCycleLR"; }
  CHORUS_INLINE void check_epoch(std::int64_t epoch) const override;

 private:
  struct Phase {
    double end_step;
    int from, to;
  };
  double interpolate(const double (&levels)[3], std::int64_t epoch) const;

  OneCycleOptions o_;
  std::vector<Phase> phases_;
};

/// Runs schedulers one after another: scheduler i (i >= 1) takes over at milestones[i - 1] and
/// sees epochs counted from its milestone (torch.optim.lr_scheduler.SequentialLR). The
/// schedulers must be built on the same optimizer; their base lrs are this one's. They are
/// taken by value (or shared):
///   optim::SequentialLR s(opt, {optim::LinearLR(opt, {.start_factor = 0.1, .total_iters = 10}),
///                               optim::CosineAnnealingLR(opt, 90)}, {10});
class SequentialLR final : public LRScheduler {
 public:
  /// One of the schedulers: moved in from a scheduler, or a shared one.
  class Scheduler {
   public:
    /// Takes a scheduler by moving it into a new shared one.
    template <class S>
      requires std::derived_from<S, LRScheduler>
    Scheduler(S&& scheduler) : ptr_(std::make_shared<S>(std::move(scheduler))) {}  // NOLINT
    /// Shares `scheduler`.
    template <class S>
      requires std::derived_from<S, LRScheduler>
    Scheduler(std::shared_ptr<S> scheduler) : ptr_(std::move(scheduler)) {}  // NOLINT
    /// The scheduler.
    const std::shared_ptr<LRScheduler>& ptr() const { return ptr_; }

   private:
    std::shared_ptr<LRScheduler> ptr_;
  };
  /// Runs `schedulers` in turn, switching at `milestones` (one fewer, in increasing order); throws
  /// unless every scheduler drives `opt` and none cycles momentum.
  SequentialLR(Optimizer& opt, std::vector<Scheduler> schedulers, std::vector<std::int64_t> milestones);
  CHORUS_INLINE double lr_at(double base, std::int64_t epoch) const override;
  /// The active scheduler's limit, at its own epoch (PyTorch steps it, and it raises there).
  CHORUS_INLINE void check_epoch(std::int64_t epoch) const override;
  CHORUS_INLINE std::string name() const override;

 private:
  // The scheduler in charge at `epoch`, and the epoch it sees (counted from its milestone).
  std::pair<std::size_t, std::int64_t> active(std::int64_t epoch) const;

  std::vector<std::shared_ptr<LRScheduler>> schedulers_;
  std::vector<std::int64_t> milestones_;
};

}  // namespace optim
CHORUS_NAMESPACE_END

// The definitions: compiled into chorus::compiled, or here in the header-only form (Note
// [compiled chorus] in compiled.hpp).
#if !CHORUS_COMPILED
#include "lr_scheduler_impl.hpp"
#endif
