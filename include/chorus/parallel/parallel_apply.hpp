#pragma once
// parallel_apply: runs one task per replica, each on its stream's worker thread.
#include <chrono>
#include <exception>
#include <optional>
#include <string>
#include <vector>

#include "../autograd/grad_mode.hpp"
#include "../autograd/node.hpp"
#include "../core/runtime.hpp"

CHORUS_NAMESPACE_BEGIN
namespace parallel {

/// Thrown by a replica that stopped waiting for another replica because that one failed (a
/// cancelled SyncBatchNorm reduction): a consequence, never the error reported.
class ReplicaCancelled : public Error {
 public:
  using Error::Error;
};

// Note [replica errors]
// A replica's exception leaves DataParallel as chorus::Error naming the replica and its
// device ("in replica 2 on cpu:2: ..."), with the original nested in it: std::rethrow_if_nested
// (or std::nested_exception::rethrow_nested) recovers it with its own type, as PyTorch
// re-raises a replica's exception with its type. It is the same on one device and on k, on
// the workers and on the calling thread (Note [inline small steps]). Of several failures the
// first real one is reported (lowest replica); a replica that only gave up because another
// failed (ReplicaCancelled) is never the one reported.
namespace detail {
/// True for an error that is only the consequence of another replica's failure.
inline bool is_cancellation(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const ReplicaCancelled&) {
    return true;
  } catch (...) {
    return false;
  }
}

/// Throws chorus::Error "in replica r on device: <what><suffix>" with `error` nested in it.
[[noreturn]] inline void rethrow_in_replica(const std::exception_ptr& error, std::size_t r, Device device,
                                            const std::string& suffix = {}) {
  const std::string where = "in replica " + std::to_string(r) + " on " + device.str() + ": ";
  try {
    std::rethrow_exception(error);
  } catch (const std::exception& e) {
    std::throw_with_nested(Error(where + e.what() + suffix));
  } catch (...) {
    std::throw_with_nested(Error(where + "unknown exception" + suffix));
  }
}
}  // namespace detail

/// Runs fn(r) for r in [0, streams.size()): r = 0 on the calling thread (whose current stream
/// must be streams[0]), the others on their streams' workers, with the caller's grad mode.
/// Waits for all; if any failed, throws chorus::Error naming the first failed replica and its
/// device, the original nested (Note [replica errors]), after every replica has finished, so
/// the next call starts clean.
template <class F>
auto parallel_apply(const std::vector<Stream*>& streams, F&& fn) -> std::vector<decltype(fn(std::size_t{}))> {
  using R = decltype(fn(std::size_t{}));
  const std::size_t n = streams.size();
  const bool grad_mode = autograd::is_grad_enabled();
  std::vector<Future<R>> futures;
  futures.reserve(n);
  std::vector<std::optional<Event>> joins(n);  // CUDA: each replica's stream, joined into the caller's
  for (std::size_t r = 1; r < n; ++r) {
    futures.push_back(streams[r]->async([&fn, &joins, r, grad_mode, s = streams[r]]() -> R {
      GradModeGuard g(grad_mode);
      autograd::ReplicaGuard rg(static_cast<int>(r));  // its nodes name the replica in backward errors
      R out = fn(r);
      if (s->device().is_cuda()) joins[r].emplace().record(*s);
      return out;
    }));
  }
  std::vector<std::optional<R>> results(n);
  std::vector<std::exception_ptr> errors(n);
  try {
    autograd::ReplicaGuard rg(0);
    results[0].emplace(fn(0));
  } catch (...) {
    errors[0] = std::current_exception();
  }
  for (std::size_t r = 1; r < n; ++r) {
    try {
      // Spin briefly before blocking: short replica tasks finish within microseconds.
      const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(50);
      while (!futures[r - 1].ready() && std::chrono::steady_clock::now() < until) {
      }
      results[r].emplace(futures[r - 1].get());
    } catch (...) {
      errors[r] = std::current_exception();
    }
  }
  for (std::size_t r = 1; r < n; ++r)
    if (joins[r]) joins[r]->block(current_stream(streams[r]->device()));
  std::size_t failed = 0, reported = n;
  for (std::size_t r = 0; r < n; ++r) {
    if (!errors[r] || detail::is_cancellation(errors[r])) continue;
    ++failed;
    if (reported == n) reported = r;
  }
  for (std::size_t r = 0; r < n && reported == n; ++r)
    if (errors[r]) reported = r;  // only cancellations (a caller cancelled the group)
  if (reported < n)
    detail::rethrow_in_replica(errors[reported], reported, streams[reported]->device(),
                               failed > 1 ? " (and " + std::to_string(failed - 1) + " more replica(s) failed)"
                                          : std::string());
  std::vector<R> out;
  out.reserve(n);
  for (auto& x : results) out.push_back(std::move(*x));
  return out;
}

}  // namespace parallel
CHORUS_NAMESPACE_END
