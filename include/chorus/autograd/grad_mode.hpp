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

inline bool is_grad_enabled() { return detail::grad_enabled_slot(); }
inline void set_grad_enabled(bool on) { detail::grad_enabled_slot() = on; }
}  // namespace autograd

/// Sets grad mode for the scope of the guard (restoring the previous mode afterwards).
class GradModeGuard {
 public:
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
