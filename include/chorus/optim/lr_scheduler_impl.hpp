#pragma once
// The definitions of optim/lr_scheduler.hpp: compiled into chorus::compiled
// (src/optim/lr_scheduler.cpp), included by lr_scheduler.hpp itself in the header-only form
// (Note [compiled chorus]).
#include "lr_scheduler.hpp"

CHORUS_NAMESPACE_BEGIN
namespace optim {

// LRScheduler

CHORUS_INLINE void LRScheduler::step() {
  check_epoch(last_epoch_ + 1);
  ++last_epoch_;
  apply();
}

CHORUS_INLINE std::vector<double> LRScheduler::get_last_lr() const {
  std::vector<double> out;
  for (std::size_t g = 0; g < opt_->num_groups(); ++g) out.push_back(opt_->lr(g));
  return out;
}

CHORUS_INLINE void LRScheduler::check_state(std::int64_t last_epoch, const std::vector<double>& base_lrs) const {
  CHORUS_CHECK(base_lrs.size() == opt_->num_groups(), name(), ": state has ", base_lrs.size(),
               " base learning rates for ", opt_->num_groups(), " parameter groups");
  CHORUS_CHECK(last_epoch >= 0, name(), ": state has a negative epoch ", last_epoch);
  for (double b : base_lrs) CHORUS_CHECK(std::isfinite(b) && b >= 0, name(), ": state has a base lr of ", b);
  check_epoch(last_epoch);
}

CHORUS_INLINE void LRScheduler::load_state(std::int64_t last_epoch, std::vector<double> base_lrs) {
  check_state(last_epoch, base_lrs);
  last_epoch_ = last_epoch;
  base_lrs_ = std::move(base_lrs);
  apply();
}

CHORUS_INLINE LRScheduler::LRScheduler(Optimizer& opt) : opt_(&opt) {
  for (std::size_t g = 0; g < opt.num_groups(); ++g) base_lrs_.push_back(opt.lr(g));
}

CHORUS_INLINE void LRScheduler::apply() {
  check_epoch(last_epoch_);
  for (std::size_t g = 0; g < opt_->num_groups(); ++g) {
    opt_->set_lr(g, lr_at(base_lrs_[g], last_epoch_));
    if (sets_momentum()) opt_->set_momentum(g, momentum_at(g, last_epoch_));
  }
}

// StepLR, MultiStepLR, CosineAnnealingLR, LinearLR

CHORUS_INLINE StepLR::StepLR(Optimizer& opt, std::int64_t step_size, double gamma)
    : LRScheduler(opt), step_size_(step_size), gamma_(gamma) {
  CHORUS_CHECK(step_size > 0, "StepLR: step_size must be positive, got ", step_size);
  start();
}

CHORUS_INLINE MultiStepLR::MultiStepLR(Optimizer& opt, std::vector<std::int64_t> milestones, double gamma)
    : LRScheduler(opt), milestones_(std::move(milestones)), gamma_(gamma) {
  CHORUS_CHECK(std::is_sorted(milestones_.begin(), milestones_.end()),
               "MultiStepLR: milestones must be in increasing order");
  start();
}

CHORUS_INLINE CosineAnnealingLR::CosineAnnealingLR(Optimizer& opt, std::int64_t t_max, double eta_min)
    : LRScheduler(opt), t_max_(t_max), eta_min_(eta_min) {
  CHORUS_CHECK(t_max > 0, "CosineAnnealingLR: T_max must be positive, got ", t_max);
  start();
}

CHORUS_INLINE LinearLR::LinearLR(Optimizer& opt, LinearLROptions o)
    : LRScheduler(opt), start_(o.start_factor), end_(o.end_factor), total_(o.total_iters) {
  CHORUS_CHECK(o.start_factor > 0 && o.start_factor <= 1, "LinearLR: start_factor must be in (0, 1], got ",
               o.start_factor);
  CHORUS_CHECK(o.end_factor >= 0 && o.end_factor <= 1, "LinearLR: end_factor must be in [0, 1], got ", o.end_factor);
  CHORUS_CHECK(o.total_iters > 0, "LinearLR: total_iters must be positive, got ", o.total_iters);
  start();
}

// OneCycleLR

CHORUS_INLINE OneCycleLR::OneCycleLR(Optimizer& opt, OneCycleOptions o) : LRScheduler(opt), o_(o) {
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

CHORUS_INLINE double OneCycleLR::lr_at(double base, std::int64_t epoch) const {
  const double levels[3] = {base / o_.div_factor, base, base / o_.div_factor / o_.final_div_factor};
  return interpolate(levels, epoch);
}

CHORUS_INLINE double OneCycleLR::momentum_at(std::size_t, std::int64_t epoch) const {
  // Momentum moves opposite to the lr: max at the initial/min lr, base at the peak.
  const double levels[3] = {o_.max_momentum, o_.base_momentum, o_.max_momentum};
  return interpolate(levels, epoch);
}

CHORUS_INLINE void OneCycleLR::check_epoch(std::int64_t epoch) const {
  CHORUS_CHECK(epoch <= o_.total_steps, "OneCycleLR: stepped ", epoch, " times, more than total_steps = ",
               o_.total_steps);
}

CHORUS_INLINE double OneCycleLR::interpolate(const double (&levels)[3], std::int64_t epoch) const {
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

// SequentialLR

CHORUS_INLINE SequentialLR::SequentialLR(Optimizer& opt, std::vector<Scheduler> schedulers,
                                         std::vector<std::int64_t> milestones)
    : LRScheduler(opt), milestones_(std::move(milestones)) {
  for (auto& s : schedulers) schedulers_.push_back(s.ptr());
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

CHORUS_INLINE double SequentialLR::lr_at(double base, std::int64_t epoch) const {
  const auto [i, local] = active(epoch);
  return schedulers_[i]->lr_at(base, local);
}

CHORUS_INLINE void SequentialLR::check_epoch(std::int64_t epoch) const {
  const auto [i, local] = active(epoch);
  schedulers_[i]->check_epoch(local);
}

CHORUS_INLINE std::string SequentialLR::name() const {
  std::string n = "SequentialLR(";
  for (std::size_t i = 0; i < schedulers_.size(); ++i) {
    if (i) n += ',';
    n += schedulers_[i]->name();
  }
  n += ')';
  return n;
}

CHORUS_INLINE std::pair<std::size_t, std::int64_t> SequentialLR::active(std::int64_t epoch) const {
  const auto i = static_cast<std::size_t>(std::upper_bound(milestones_.begin(), milestones_.end(), epoch) -
                                          milestones_.begin());
  return {i, i == 0 ? epoch : epoch - milestones_[i - 1]};
}

}  // namespace optim
CHORUS_NAMESPACE_END
