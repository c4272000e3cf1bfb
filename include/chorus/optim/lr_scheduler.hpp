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

#include "optimizer.hpp"

CHORUS_NAMESPACE_BEGIN
namespace optim {

class LRScheduler {
 public:
  virtual ~LRScheduler() = default;
  LRScheduler(const LRScheduler&) = delete;
  LRScheduler& operator=(const LRScheduler&) = delete;

  /// Advances one epoch (or iteration) and sets the optimizer's learning rates.
  void step() {
    check_epoch(last_epoch_ + 1);
    ++last_epoch_;
    apply();
  }

  /// The epoch the current learning rates belong to (0 after construction).
  std::int64_t last_epoch() const { return last_epoch_; }
  /// The learning rates the last step set, one per parameter group.
  std::vector<double> get_last_lr() const {
    std::vector<double> out;
    for (std::size_t g = 0; g < opt_->num_groups(); ++g) out.push_back(opt_->lr(g));
    return out;
  }
  const std::vector<double>& base_lrs() const { return base_lrs_; }
  Optimizer& optimizer() const { return *opt_; }

  /// The learning rate of a group whose base lr is `base` at `epoch` (Note [closed-form schedules]).
  virtual double lr_at(double base, std::int64_t epoch) const = 0;
  /// The momentum to set at `epoch`, for schedules that cycle it (OneCycleLR); none by default.
  virtual bool sets_momentum() const { return false; }
  virtual double momentum_at(std::size_t /*group*/, std::int64_t /*epoch*/) const { return 0.0; }
  /// The scheduler's name, recorded in checkpoints.
  virtual std::string name() const = 0;
  /// Throws when the schedule is not defined at `epoch` (OneCycleLR beyond its total_steps).
  virtual void check_epoch(std::int64_t /*epoch*/) const {}

  /// Restores a saved state (last_epoch and base lrs) and applies it to the optimizer.
  void load_state(std::int64_t last_epoch, std::vector<double> base_lrs) {
    CHORUS_CHECK(base_lrs.size() == opt_->num_groups(), name(), ": state has ", base_lrs.size(),
                 " base learning rates for ", opt_->num_groups(), " parameter groups");
    CHORUS_CHECK(last_epoch >= 0, name(), ": state has a negative epoch ", last_epoch);
    for (double b : base_lrs) CHORUS_CHECK(std::isfinite(b) && b >= 0, name(), ": state has a base lr of ", b);
    check_epoch(last_epoch);
    last_epoch_ = last_epoch;
    base_lrs_ = std::move(base_lrs);
    apply();
  }

 protected:
  explicit LRScheduler(Optimizer& opt) : opt_(&opt) {
    for (std::size_t g = 0; g < opt.num_groups(); ++g) base_lrs_.push_back(opt.lr(g));
  }
  /// Called by each concrete scheduler's constructor, once its options are checked (virtual
  /// calls are not dispatched to the derived class from the base's constructor).
  void start() {
    last_epoch_ = 0;
    apply();
  }
  std::vector<double> base_lrs_;

 private:
  void apply() {
    check_epoch(last_epoch_);
    for (std::size_t g = 0; g < opt_->num_groups(); ++g) {
      opt_->set_lr(g, lr_at(base_lrs_[g], last_epoch_));
      if (sets_momentum()) opt_->set_momentum(g, momentum_at(g, last_epoch_));
    }
  }

  Optimizer* opt_;
  std::int64_t last_epoch_ = 0;
};

/// lr = base * gamma^floor(epoch / step_size).
class StepLR final : public LRScheduler {
 public:
  StepLR(Optimizer& opt, std::int64_t step_size, double gamma = 0.1)
      : LRScheduler(opt), step_size_(step_size), gamma_(gamma) {
    CHORUS_CHECK(step_size > 0, "StepLR: step_size must be positive, got ", step_size);
    start();
  }
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
  MultiStepLR(Optimizer& opt, std::vector<std::int64_t> milestones, double gamma = 0.1)
      : LRScheduler(opt), milestones_(std::move(milestones)), gamma_(gamma) {
    CHORUS_CHECK(std::is_sorted(milestones_.begin(), milestones_.end()),
                 "MultiStepLR: milestones must be in increasing order");
    start();
  }
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
  CosineAnnealingLR(Optimizer& opt, std::int64_t t_max, double eta_min = 0.0)
      : LRScheduler(opt), t_max_(t_max), eta_min_(eta_min) {
    CHORUS_CHECK(t_max > 0, "CosineAnnealingLR: T_max must be positive, got ", t_max);
    start();
  }
  double lr_at(double base, std::int64_t epoch) const override {
    return eta_min_ + (base - eta_min_) * (1 + std::cos(std::numbers::pi * static_cast<double>(epoch) /
                                                        static_cast<double>(t_max_))) / 2;
  }
  std::string name() const override { return "CosineAnnealingLR"; }

 private:
  std::int64_t t_max_;
  double eta_min_;
};

/// Linear warmup: lr = base * (start + (end - start) * min(epoch, total_iters) / total_iters).
class LinearLR final : public LRScheduler {
 public:
  LinearLR(Optimizer& opt, double start_factor = 1.0 / 3, double end_factor = 1.0, std::int64_t total_iters = 5)
      : LRScheduler(opt), start_(start_factor), end_(end_factor), total_(total_iters) {
    CHORUS_CHECK(start_factor > 0 && start_factor <= 1, "LinearLR: start_factor must be in (0, 1], got ",
                 start_factor);
    CHORUS_CHECK(end_factor >= 0 && end_factor <= 1, "LinearLR: end_factor must be in [0, 1], got ", end_factor);
    CHORUS_CHECK(total_iters > 0, "LinearLR: total_iters must be positive, got ", total_iters);
    start();
  }
  double lr_at(double base, std::int64_t epoch) const override {
    const double f = static_cast<double>(std::min(epoch, total_)) / static_cast<double>(total_);
    return base * (start_ + (end_ - start_) * f);
  }
  std::string name() const override { return "LinearLR"; }

 private:
  double start_, end_;
  std::int64_t total_;
};

struct OneCycleOptions {
  double max_lr = 0.1;              ///< the peak lr of every group
  std::int64_t total_steps = 0;     ///< iterations in the cycle (required)
  double pct_start = 0.3;           ///< fraction of the cycle spent increasing the lr
  bool cos_anneal = true;           ///< anneal_strategy 'cos' (true) or 'linear'
  bool cycle_momentum = true;       ///< cycle momentum (SGD) / beta1 (Adam) inversely to the lr
  double base_momentum = 0.85;
  double max_momentum = 0.95;
  double div_factor = 25.0;         ///< initial lr = max_lr / div_factor
  double final_div_factor = 1e4;    ///< final lr = initial lr / final_div_factor
  bool three_phase = false;
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
  OneCycleLR(Optimizer& opt, OneCycleOptions o) : LRScheduler(opt), o_(o) {
    CHORUS_CHECK(o.total_steps > 0, "OneCycleLR: total_steps must be positive, got ", o.total_steps);
    CHORUS_CHECK(o.pct_start >= 0 && o.pct_start <= 1, "OneCycleLR: pct_start must be in [0, 1], got ", o.pct_start);
    CHORUS_CHECK(o.max_lr >= 0 && o.div_factor > 0 && o.final_div_factor > 0,
                 "OneCycleLR: max_lr, div_factor and final_div_factor must be positive");
    CHORUS_CHECK(!o.cycle_momentum || opt.has_momentum(), "OneCycleLR: cycle_momentum needs an optimizer with a "
                 "momentum, and ", opt.name(), " has none");
    for (auto& b : base_lrs_) b = o.max_lr;
    const double t = static_cast<double>(o.total_steps);
    if (o.three_phase) {
      phases_ = {{o.pct_start * t - 1, 0, 1}, {2 * o.pct_start * t - 2, 1, 0}, {t - 1, 0, 2}};
    } else {
      phases_ = {{o.pct_start * t - 1, 0, 1}, {t - 1, 1, 2}};
    }
    start();
  }

  /// lr levels: 0 = initial (max / div), 1 = max, 2 = min (initial / final_div).
  double lr_at(double base, std::int64_t epoch) const override {
    const double levels[3] = {base / o_.div_factor, base, base / o_.div_factor / o_.final_div_factor};
    return interpolate(levels, epoch);
  }
  bool sets_momentum() const override { return o_.cycle_momentum; }
  double momentum_at(std::size_t, std::int64_t epoch) const override {
    // Momentum moves opposite to the lr: max at the initial/min lr, base at the peak.
    const double levels[3] = {o_.max_momentum, o_.base_momentum, o_.max_momentum};
    return interpolate(levels, epoch);
  }
  std::string name() const override { return "OneCycleLR"; }
  void check_epoch(std::int64_t epoch) const override {
    CHORUS_CHECK(epoch <= o_.total_steps, "OneCycleLR: stepped ", epoch, " times, more than total_steps = ",
                 o_.total_steps);
  }

 private:
  struct Phase {
    double end_step;
    int from, to;
  };
  double interpolate(const double (&levels)[3], std::int64_t epoch) const {
    const double step = static_cast<double>(epoch);
    double start_step = 0;
    for (std::size_t i = 0; i < phases_.size(); ++i) {
      const auto& ph = phases_[i];
      if (step <= ph.end_step || i + 1 == phases_.size()) {
        // A phase of no steps (e.g. pct_start * total_steps = 1) is already at its end;
        // PyTorch divides by zero there.
        const double span = ph.end_step - start_step;
        double pct = span > 0 ? (step - start_step) / span : 1.0;
        const double a = levels[ph.from], b = levels[ph.to];
        if (o_.cos_anneal) return b + (a - b) / 2 * (std::cos(std::numbers::pi * pct) + 1);
        pct = std::min(pct, 1.0);  // epoch total_steps: Note [one-cycle end]
        return (b - a) * pct + a;
      }
      start_step = ph.end_step;
    }
    return levels[0];  // unreachable: the last phase always matches
  }

  OneCycleOptions o_;
  std::vector<Phase> phases_;
};

/// Runs schedulers one after another: scheduler i (i >= 1) takes over at milestones[i - 1] and
/// sees epochs counted from its milestone (torch.optim.lr_scheduler.SequentialLR). The
/// schedulers must be built on the same optimizer; their base lrs are this one's.
class SequentialLR final : public LRScheduler {
 public:
  SequentialLR(Optimizer& opt, std::vector<std::shared_ptr<LRScheduler>> schedulers, std::vector<std::int64_t> milestones)
      : LRScheduler(opt), schedulers_(std::move(schedulers)), milestones_(std::move(milestones)) {
    CHORUS_CHECK(!schedulers_.empty(), "SequentialLR: no schedulers");
    CHORUS_CHECK(milestones_.size() + 1 == schedulers_.size(), "SequentialLR: ", schedulers_.size(),
                 " schedulers need ", schedulers_.size() - 1, " milestones, got ", milestones_.size());
    CHORUS_CHECK(std::is_sorted(milestones_.begin(), milestones_.end()),
                 "SequentialLR: milestones must be in increasing order");
    for (auto& s : schedulers_) {
      CHORUS_CHECK(s && &s->optimizer() == &opt, "SequentialLR: every scheduler must drive the same optimizer");
      CHORUS_CHECK(!s->sets_momentum(), "SequentialLR: ", s->name(), " cycles momentum, which is not supported here");
    }
    // The first scheduler's constructor may have changed the lrs: the base is what it recorded.
    base_lrs_ = schedulers_.front()->base_lrs();
    start();
  }
  double lr_at(double base, std::int64_t epoch) const override {
    const auto [i, local] = active(epoch);
    return schedulers_[i]->lr_at(base, local);
  }
  /// The active scheduler's limit, at its own epoch (PyTorch steps it, and it raises there).
  void check_epoch(std::int64_t epoch) const override {
    const auto [i, local] = active(epoch);
    schedulers_[i]->check_epoch(local);
  }
  std::string name() const override {
    std::string n = "SequentialLR(";
    for (std::size_t i = 0; i < schedulers_.size(); ++i) {
      if (i) n += ',';
      n += schedulers_[i]->name();
    }
    n += ')';
    return n;
  }

 private:
  // The scheduler in charge at `epoch`, and the epoch it sees (counted from its milestone).
  std::pair<std::size_t, std::int64_t> active(std::int64_t epoch) const {
    const auto i = static_cast<std::size_t>(std::upper_bound(milestones_.begin(), milestones_.end(), epoch) -
                                            milestones_.begin());
    return {i, i == 0 ? epoch : epoch - milestones_[i - 1]};
  }

  std::vector<std::shared_ptr<LRScheduler>> schedulers_;
  std::vector<std::int64_t> milestones_;
};

}  // namespace optim
CHORUS_NAMESPACE_END
