#pragma once
// Grad mode: whether operations record the autograd graph on this thread.
#include "../config.hpp"

CHORUS_NAMESPACE_BEGIN
namespace autograd {
namespace detail {
inline bool& grad_enabled_slot() {
  thread_local bool on = true;
  return on;
}
}  // namespace detail

/// True when operations on the calling thread record the autograd graph (torch.is_grad_enabled).
inline bool is_grad_enabled() { return detail::grad_enabled_slot(); }
/// Turns graph recording on or off for the calling thread (torch.set_grad_enabled).
inline void set_grad_enabled(bool on) { detail::grad_enabled_slot() = on; }

namespace detail {
/// 0 outside a checkpointed function, 1 in its forward, 2 while backward recomputes it.
inline int& checkpoint_phase() {
  thread_local int phase = 0;
  return phase;
}
}  // namespace detail

/// True while the calling thread runs a checkpointed function, in forward or recomputing it
/// (Note [activation checkpointing] in autograd/checkpoint.hpp).
inline bool in_checkpoint() { return detail::checkpoint_phase() != 0; }
/// True while backward recomputes a checkpointed function: a layer skips there what must happen
/// once per forward (batch norm's running statistics).
inline bool is_recomputing() { return detail::checkpoint_phase() == 2; }
}  // namespace autograd

/// Sets grad mode for the scope of the guard (restoring the previous mode afterwards).
class GradModeGuard {
 public:
  /// Enables grad mode when `enabled`, disables it otherwise.
  explicit GradModeGuard(bool enabled) : prev_(autograd::is_grad_enabled()) {
    autograd::set_grad_enabled(enabled);
  }
  ~GradModeGuard() { autograd::set_grad_enabled(prev_); }
  GradModeGuard(const GradModeGuard&) = delete;
  GradModeGuard& operator=(const GradModeGuard&) = delete;

 private:
  bool prev_;
};

/// Disables graph recording in its scope (torch::NoGradGuard).
class NoGradGuard : public GradModeGuard {
 public:
  NoGradGuard() : GradModeGuard(false) {}
};

CHORUS_NAMESPACE_END
