#pragma once
// Parallel loops on the CPU: an OpenMP team of the calling thread's intra-op threads, or an
// idle DataParallel worker.
//
// Note [intra-op threads]
// chorus::set_num_threads(n) (threads.hpp; PyTorch's torch::set_num_threads) gives the CPU
// work started from the calling thread n threads: oneDNN's OpenMP team for convolutions (Note
// [oneDNN threads]) and float products (Note [one pool of threads] in blas.hpp), and chorus's
// own loops (elementwise ops, batch norm, pooling, the optimizer steps): parallel_for below
// splits [0, n) into one contiguous range per thread and runs them on an OpenMP team of the
// calling thread's size — the same team, so a step's threads stay hot from one kernel to the
// next instead of two pools taking turns (and spinning against each other) on the same cores.
// PyTorch's at::parallel_for does the same. chorus is header-only and is not compiled with -fopenmp (nvcc
// and the user's flags decide that), so it calls libgomp's entry point for a parallel region,
// GOMP_parallel (the ABI g++ itself emits for `#pragma omp parallel`, stable since GCC 4.9), when
// CMake found libgomp (CHORUS_HAS_GOMP; cmake/ChorusOneDNN.cmake links it); without it the loops
// stay on the calling thread. Each range is computed by one thread as the serial loop would
// compute it, and the reductions split over channels, not over the values of a channel, so
// results are bit for bit those of one thread. Loops smaller than two grains (kParallelGrain
// elements, or the caller's grain in items) stay on the calling thread.
//
// Note [idle workers help]
// During a DataParallel step over CPU devices each replica runs on its device's thread, but
// between the replicas' work the primary's thread does work of its own alone: the loss and
// its gradient, the additions of the replicas' gradients, and the optimizer step (1.4 ms of a
// 65 ms mlp-medium step), while the other devices' workers spin, waiting for the next step
// (Note [active window]). A thread with one intra-op thread (the default, and every device
// worker) therefore offers part of a large loop to a CPU worker that is spinning idle at that
// moment: the caller posts one task there and both threads take chunks from a shared counter
// until the range is done. Nothing waits for a worker that is busy: the caller takes every
// chunk a helper has not, and waits only for chunks a helper has already started; a helper
// that starts after the caller finished does nothing. No worker spins outside a DataParallel
// step, so a single-device program is unaffected. `f` must not throw.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <thread>

#include "../../core/runtime.hpp"
#include "isa.hpp"

#ifndef CHORUS_HAS_GOMP
#define CHORUS_HAS_GOMP 0
#endif
// libgomp's entry points chorus calls (Note [intra-op threads]; onednn.hpp and blas.hpp size
// the team oneDNN runs on), declared once. The omp_* ones are declared noexcept, as <omp.h>
// declares them (`throw ()`), so a program may include <omp.h> before or after chorus.
extern "C" {
void GOMP_parallel(void (*fn)(void*), void* data, unsigned num_threads, unsigned flags);
int omp_get_thread_num() noexcept;
int omp_get_num_threads() noexcept;
int omp_in_parallel() noexcept;
int omp_get_max_threads() noexcept;
void omp_set_num_threads(int) noexcept;
}

CHORUS_NAMESPACE_BEGIN
namespace backend::cpu {

namespace detail {
/// The threads the calling thread's CPU kernels may use (chorus::set_num_threads in
/// threads.hpp; Note [intra-op threads]): 1 unless set, or CHORUS_NUM_THREADS for every thread.
inline int& intra_op_threads() {
  static const int fallback = [] {
    const char* e = std::getenv("CHORUS_NUM_THREADS");
    return std::max(1, e ? std::atoi(e) : 1);
  }();
  thread_local int n = fallback;
  return n;
}

/// Makes the calling thread's next OpenMP team (oneDNN's primitives and sgemm) n threads.
inline void set_omp_team_size(int n) {
  if (omp_get_max_threads() != n) omp_set_num_threads(n);
}

#if CHORUS_HAS_GOMP
template <class F>
struct TeamLoop {
  const F* f;
  std::int64_t n;
};
/// One thread's contiguous share of a TeamLoop.
template <class F>
void team_body(void* p) {
  const auto& loop = *static_cast<const TeamLoop<F>*>(p);
  const std::int64_t t = omp_get_thread_num(), k = omp_get_num_threads();
  const std::int64_t b = loop.n * t / k, e = loop.n * (t + 1) / k;
  if (b < e) at_cpu_width([&] { (*loop.f)(b, e); });
}
#endif
}  // namespace detail

/// Loops of at least this many elements (per thread) are split.
inline constexpr std::int64_t kParallelGrain = std::int64_t{1} << 16;

/// Runs f(begin, end) over disjoint ranges covering [0, n), on the calling thread's intra-op
/// threads (Note [intra-op threads]) or partly on an idle CPU worker (Note [idle workers help]);
/// each thread gets at least `grain` items. Each range runs at the CPU's vector width (Note
/// [CPU capability]).
template <class F>
void parallel_for(std::int64_t n, std::int64_t grain, const F& f) {
  grain = std::max<std::int64_t>(grain, 1);
  (void)detail::cpu_capability_in_use();  // read (and check) CHORUS_CPU_CAPABILITY on this thread first
  if (n < 2 * grain) return at_cpu_width([&] { f(std::int64_t{0}, n); });
#if CHORUS_HAS_GOMP
  if (const int threads = detail::intra_op_threads(); threads > 1) {
    if (omp_in_parallel()) return at_cpu_width([&] { f(std::int64_t{0}, n); });
    const auto k = static_cast<unsigned>(std::min<std::int64_t>(threads, n / grain));
    detail::TeamLoop<F> loop{&f, n};
    GOMP_parallel(&detail::team_body<F>, &loop, k, 0);
    return;
  }
#endif
  Stream* helper = ::chorus::detail::Runtime::get().idle_cpu_stream();
  if (!helper) return at_cpu_width([&] { f(std::int64_t{0}, n); });
  struct Share {
    std::atomic<std::int64_t> next{0};
    std::atomic<int> inside{0};  // helpers inside; kClosed once the caller is done
  };
  constexpr int kClosed = 1 << 30;
  const std::int64_t chunk = std::max(std::max<std::int64_t>(grain / 4, 1), (n + 7) / 8);
  auto share = std::make_shared<Share>();
  auto run = [n, chunk](Share& sh, const F& fn) {
    for (;;) {
      const std::int64_t b = sh.next.fetch_add(chunk, std::memory_order_relaxed);
      if (b >= n) return;
      const std::int64_t e = std::min(n, b + chunk);
      at_cpu_width([&] { fn(b, e); });
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

/// parallel_for over n elements of an elementwise loop (kParallelGrain per thread).
template <class F>
void parallel_for(std::int64_t n, const F& f) {
  parallel_for(n, kParallelGrain, f);
}

/// The grain, in items, of a loop whose items cost `cost` elements each.
inline std::int64_t grain_for(std::int64_t cost) {
  return std::max<std::int64_t>(1, kParallelGrain / std::max<std::int64_t>(cost, 1));
}

}  // namespace backend::cpu
CHORUS_NAMESPACE_END
