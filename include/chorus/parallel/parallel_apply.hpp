#pragma once
// parallel_apply: runs one task per replica, each on its stream's worker thread.
#include <chrono>
#include <exception>
#include <optional>
#include <optional>
#include <vector>

#include "../autograd/grad_mode.hpp"
#include "../autograd/node.hpp"
#include "../core/runtime.hpp"

CHORUS_NAMESPACE_BEGIN
namespace parallel {

/// Runs fn(r) for r in [0, streams.size()): r = 0 on the calling thread (whose current stream
/// must be streams[0]), the others on their streams' workers, with the caller's grad mode.
/// Waits for all; if any failed, throws chorus::Error naming the first failed replica and its
/// device (after every replica has finished, so the next call starts clean).
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
  std::size_t failed = 0;
  for (auto& e : errors) failed += e != nullptr;
  for (std::size_t r = 0; r < n; ++r) {
    if (!errors[r]) continue;
    std::string what = "unknown exception";
    try {
      std::rethrow_exception(errors[r]);
    } catch (const std::exception& e) {
      what = e.what();
    } catch (...) {
    }
    CHORUS_FAIL("in replica ", r, " on ", streams[r]->device(), ": ", what,
                failed > 1 ? " (and " + std::to_string(failed - 1) + " more replica(s) failed)" : std::string());
  }
  std::vector<R> out;
  out.reserve(n);
  for (auto& x : results) out.push_back(std::move(*x));
  return out;
}

}  // namespace parallel
CHORUS_NAMESPACE_END
