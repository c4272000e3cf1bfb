#pragma once
// The statistics reducer of DataParallel's replicas (Note [statistics reducer], ops/nn.hpp):
// SyncBatchNorm in replica r sums its per-channel statistics with the other replicas'.
#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "../compiled.hpp"
#include "../ops/nn.hpp"
#include "parallel_apply.hpp"

CHORUS_NAMESPACE_BEGIN
namespace parallel {

/// The replicas of one DataParallel forward as participants of a sum (and of the gathers and
/// reduce-scatters of a one-process FullyShardedDataParallel). Each reduction is two
/// barriers: every replica posts its tensor and waits for the others, sums all of them in
/// replica order on its own device (so every replica gets the same bits), waits until every
/// replica has read every input, then overwrites its tensor. A replica that never arrives
/// makes the others fail after `timeout` instead of hanging (Note [cancelled reductions]).
///
/// Note [cancelled reductions]
/// A replica that fails before it reaches a reduction (a bad index in its chunk) never
/// arrives: DataParallel cancels the group for it (cancel()), and every replica waiting in,
/// or later entering, a barrier of the group throws ReplicaCancelled at once, which
/// parallel_apply never reports in place of the failure itself (Note [replica errors]). In
/// backward (the batch-norm backward keeps the reducer it saw in forward) the engine stops
/// scheduling after a failure, so the replicas whose reduction node would never run are
/// found the same way: a waiter checks autograd::backward_failed() every kBackwardPoll and
/// gives up (Note [giving up in backward]). The timeout stays for a replica that is alive
/// but takes another path (skips a SyncBatchNorm layer) or hangs.
class ReplicaStatsGroup : public std::enable_shared_from_this<ReplicaStatsGroup> {
 public:
  /// A group of `size` replicas (ranks 0 … size-1; positive) whose waits fail after `timeout` (default 5 minutes).
  explicit ReplicaStatsGroup(int size, std::chrono::milliseconds timeout = std::chrono::minutes(5));

  /// The reducer replica `rank` uses.
  std::shared_ptr<StatsReducer> member(int rank);

  /// t = the sum of every replica's `t`, added in replica order on t's device (same bits on every replica).
  template <class T>
  void all_reduce(int rank, Tensor<T>& t) {
    if (size_ == 1) return;
    mark_ready(rank, t);  // Note [device statistics reduction]
    slots_[rank] = &t;
    barrier(rank, "post");
    Tensor<T> acc;
    for (int j = 0; j < size_; ++j) {
      const auto& src = *static_cast<const Tensor<T>*>(slots_[j]);
      CHORUS_CHECK(src.shape() == t.shape(), "SyncBatchNorm: replica ", j, " reduces a tensor of shape ", src.shape(),
                   ", replica ", rank, " one of shape ", t.shape());
      wait_ready(rank, j, t);
      auto here = src.to(t.device());
      acc = acc.defined() ? add(acc, here) : (j == rank ? here.clone() : here);
    }
    mark_read(rank, t);
    barrier(rank, "read");
    wait_reads(rank, t);
    backend::copy(t, acc);
  }

  /// The sum of every replica's `v`.
  std::int64_t all_reduce(int rank, std::int64_t v);

  // The collectives of FullyShard units over one process's devices (parallel::
  // FullyShardedDataParallel, Note [fully sharded parameters]), with the same two barriers.

  /// full = every replica's `part`, in replica order (full holds size() · part's elements).
  template <class T>
  void all_gather(int rank, const Tensor<T>& part, const Tensor<T>& full) {
    const std::int64_t n = part.numel();
    CHORUS_CHECK(full.numel() == n * size_, "FullyShardedDataParallel: replica ", rank, " gathers ", n,
                 " elements a replica into ", full.numel());
    exchange(rank, part, full, [&](int j, const Tensor<T>& src) {
      CHORUS_CHECK(src.numel() == n, "FullyShardedDataParallel: replica ", j, " gathers ", src.numel(),
                   " elements, replica ", rank, " ", n, "; every replica must run the same units in the same order");
      backend::copy(full.narrow(0, j * n, n), src);  // straight into place, from any device
    });
  }

  /// part = the sum over the replicas, in replica order, of elements [rank·n, rank·n + n) of
  /// their `full` (n = part's elements).
  template <class T>
  void reduce_scatter(int rank, const Tensor<T>& full, const Tensor<T>& part) {
    const std::int64_t n = part.numel();
    Tensor<T> other;  // another device's slice, copied here
    exchange(rank, full, part, [&](int j, const Tensor<T>& src) {
      CHORUS_CHECK(src.numel() == n * size_, "FullyShardedDataParallel: replica ", j, " reduces ", src.numel(),
                   " elements, replica ", rank, " ", n * size_, "; every replica must run the same units in the same "
                   "order");
      const auto slice = src.narrow(0, rank * n, n);
      if (j == 0) {
        backend::copy(part, slice);
        return;
      }
      const Tensor<T>* term = &slice;
      if (slice.device() != part.device()) {
        if (!other.defined()) other = Tensor<T>::empty(part.shape(), part.device());
        backend::copy(other, slice);
        term = &other;
      }
      backend::binary_same(part, *term, part, backend::fn::Add{});
    });
  }

  /// t = replica 0's t.
  template <class T>
  void broadcast(int rank, const Tensor<T>& t) {
    exchange(rank, t, t, [&](int j, const Tensor<T>& src) {
      if (j == 0 && rank != 0) backend::copy(t, src.to(t.device()));
    });
  }

  /// The number of replicas in the group.
  int size() const { return size_; }

  /// Replica `rank` failed and will reach no reduction: every waiter, now or later, gives up
  /// (Note [cancelled reductions]).
  void cancel(int rank);
  /// Whether some replica has cancelled the group.
  bool cancelled() const {
    std::lock_guard lk(m_);
    return cancelled_by_ >= 0;
  }

  /// How often a waiter inside a backward pass checks whether that pass failed elsewhere.
  static constexpr auto kBackwardPoll = std::chrono::milliseconds(2);

 private:
  // Note [device statistics reduction]
  // On GPUs a reduction never waits on the host: each replica records an event on its stream
  // when its tensor is ready (before the "post" barrier) and another when it has read every
  // other replica's tensor (before the "read" barrier); a replica's stream waits for the
  // others' "ready" events before reading their tensors and for their "read" events before
  // overwriting its own. The barriers order the host side (every event is recorded before
  // anyone waits on it, and re-recorded only after everyone waited on it). CPU devices run
  // eagerly on the calling threads: the barriers alone order them.
  template <class T>
  void mark_ready(int rank, const Tensor<T>& t) {
    if (t.device().is_cuda()) ready_[rank].record(current_stream(t.device()));
  }
  template <class T>
  void wait_ready(int rank, int j, const Tensor<T>& t) {
    if (t.device().is_cuda() && j != rank) ready_[j].block(current_stream(t.device()));
  }
  template <class T>
  void mark_read(int rank, const Tensor<T>& t) {
    if (t.device().is_cuda()) read_[rank].record(current_stream(t.device()));
  }
  template <class T>
  void wait_reads(int rank, const Tensor<T>& t) {
    if (!t.device().is_cuda()) return;
    for (int j = 0; j < size_; ++j)
      if (j != rank) read_[j].block(current_stream(t.device()));
  }
  static std::vector<Event> make_events(int size) {
    return std::vector<Event>(size > 0 ? static_cast<std::size_t>(size) : 0);
  }

  [[noreturn]] void give_up(int rank, const char* phase, const std::string& why) const;

  /// Posts `mine`, reads every replica's posted tensor through read(j, tensor) (on `out`'s
  /// device, in replica order), and returns once every replica has read every other's: `mine`
  /// may then be freed or overwritten.
  template <class T, class Read>
  void exchange(int rank, const Tensor<T>& mine, const Tensor<T>& out, Read&& read) {
    if (size_ == 1) {
      read(0, mine);
      return;
    }
    mark_ready(rank, mine);
    slots_[rank] = &mine;
    barrier(rank, "post");
    for (int j = 0; j < size_; ++j) {
      wait_ready(rank, j, out);
      read(j, *static_cast<const Tensor<T>*>(slots_[j]));
    }
    mark_read(rank, out);
    barrier(rank, "read");
    wait_reads(rank, mine);
  }

  void barrier(int rank, const char* phase);

  int size_;
  std::chrono::milliseconds timeout_;
  std::vector<const void*> slots_;
  std::vector<std::int64_t> counts_;
  std::vector<Event> ready_ = make_events(size_), read_ = make_events(size_);  // Note [device statistics reduction]
  mutable std::mutex m_;
  std::condition_variable cv_;
  int arrived_ = 0;
  std::uint64_t generation_ = 0;
  int cancelled_by_ = -1;  // the replica that cancelled the group (Note [cancelled reductions])
};

namespace detail {
class ReplicaStatsReducer final : public StatsReducer {
 public:
  ReplicaStatsReducer(std::shared_ptr<ReplicaStatsGroup> group, int rank) : group_(std::move(group)), rank_(rank) {}
  CHORUS_INLINE void all_reduce_sum(Tensor<float>& t) override;
  CHORUS_INLINE void all_reduce_sum(Tensor<double>& t) override;
  CHORUS_INLINE std::int64_t all_reduce_sum(std::int64_t count) override;
  int size() const override { return group_->size(); }

 private:
  std::shared_ptr<ReplicaStatsGroup> group_;
  int rank_;
};
}  // namespace detail

}  // namespace parallel
CHORUS_NAMESPACE_END

// The definitions: compiled into chorus::compiled, or here in the header-only form (Note
// [compiled chorus] in compiled.hpp).
#if !CHORUS_COMPILED
#include "stats_reducer_impl.hpp"
#endif
