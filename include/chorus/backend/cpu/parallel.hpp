#pragma once
// Sharing a large elementwise loop with an idle CPU worker.
//
// Note [idle workers help]
// During a DataParallel step over CPU devices each replica runs on its device's thread, but
// between the replicas' work the primary's thread does work of its own alone: the loss and
// its gradient, the additions of the replicas' gradients, and the optimizer step (1.4 ms of a
// 65 ms mlp-medium step), while the other devices' workers spin, waiting for the next step
// (Note [active window]). A large elementwise loop (parallel_for below: the optimizer steps,
// same-shape binary ops, the loss gradient) therefore offers part of its range to a CPU
// worker that is spinning idle at that moment: the caller posts one task there and both
// threads take chunks from a shared counter until the range is done. Nothing waits for a
// worker that is busy: the caller takes every chunk a helper has not, and waits only for
// chunks a helper has already started; a helper that starts after the caller finished does
// nothing. Elementwise results do not depend on who computed which chunk, so they are the
// same bit for bit. No worker spins outside a DataParallel step, so a single-device program
// is unaffected. `f` must not throw.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>

#include "../../core/runtime.hpp"

CHORUS_NAMESPACE_BEGIN
namespace backend::cpu {

/// Loops of at least this many elements (per thread) are offered to an idle worker.
inline constexpr std::int64_t kParallelGrain = std::int64_t{1} << 16;

/// Runs f(begin, end) over disjoint ranges covering [0, n), possibly partly on an idle CPU
/// worker (Note [idle workers help]).
template <class F>
void parallel_for(std::int64_t n, const F& f) {
  if (n < 2 * kParallelGrain) return f(std::int64_t{0}, n);
  Stream* helper = ::chorus::detail::Runtime::get().idle_cpu_stream();
  if (!helper) return f(std::int64_t{0}, n);
  struct Share {
    std::atomic<std::int64_t> next{0};
    std::atomic<int> inside{0};  // helpers inside; kClosed once the caller is done
  };
  constexpr int kClosed = 1 << 30;
  const std::int64_t chunk = std::max(kParallelGrain / 4, (n + 7) / 8);
  auto share = std::make_shared<Share>();
  auto run = [n, chunk](Share& sh, const F& fn) {
    for (;;) {
      const std::int64_t b = sh.next.fetch_add(chunk, std::memory_order_relaxed);
      if (b >= n) return;
      fn(b, std::min(n, b + chunk));
    }
  };
  helper->post([share, fp = &f, run] {
    int s = share->inside.load(std::memory_order_acquire);
    do {
      if (s & kClosed) return;  // the caller finished without us: f may be gone
    } while (!share->inside.compare_exchange_weak(s, s + 1, std::memory_order_acq_rel));
    run(*share, *fp);
    share->inside.fetch_sub(1, std::memory_order_release);
  });
  run(*share, f);
  share->inside.fetch_or(kClosed, std::memory_order_acq_rel);
  while ((share->inside.load(std::memory_order_acquire) & ~kClosed) != 0) std::this_thread::yield();
}

}  // namespace backend::cpu
CHORUS_NAMESPACE_END
