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

#include "../ops/nn.hpp"
#include "parallel_apply.hpp"

CHORUS_NAMESPACE_BEGIN
namespace parallel {

/// The replicas of one DataParallel forward as participants of a sum. Each reduction is two
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
  explicit ReplicaStatsGroup(int size, std::chrono::milliseconds timeout = std::chrono::minutes(5))
      : size_(size), timeout_(timeout), slots_(static_cast<std::size_t>(size)), counts_(static_cast<std::size_t>(size)) {
    CHORUS_CHECK(size > 0, "ReplicaStatsGroup: size must be positive, got ", size);
  }

  /// The reducer replica `rank` uses.
  std::shared_ptr<StatsReducer> member(int rank);

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

  std::int64_t all_reduce(int rank, std::int64_t v) {
    if (size_ == 1) return v;
    counts_[rank] = v;
    barrier(rank, "post");
    std::int64_t s = 0;
    for (auto c : counts_) s += c;
    barrier(rank, "read");
    return s;
  }

  int size() const { return size_; }

  /// Replica `rank` failed and will reach no reduction: every waiter, now or later, gives up
  /// (Note [cancelled reductions]).
  void cancel(int rank) {
    std::lock_guard lk(m_);
    if (cancelled_by_ < 0) cancelled_by_ = rank;
    cv_.notify_all();
  }
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

  [[noreturn]] void give_up(int rank, const char* phase, const std::string& why) const {
    throw ReplicaCancelled("SyncBatchNorm: replica " + std::to_string(rank) + " stopped waiting (" + phase +
                           ") for the other replicas' statistics: " + why);
  }

  void barrier(int rank, const char* phase) {
    std::unique_lock lk(m_);
    if (cancelled_by_ >= 0) give_up(rank, phase, "replica " + std::to_string(cancelled_by_) + " failed");
    const auto gen = generation_;
    if (++arrived_ == size_) {
      arrived_ = 0;
      ++generation_;
      cv_.notify_all();
      return;
    }
    const bool in_backward = autograd::in_backward();
    const auto deadline = std::chrono::steady_clock::now() + timeout_;
    for (;;) {
      const auto until = in_backward ? std::min(deadline, std::chrono::steady_clock::now() + kBackwardPoll) : deadline;
      if (cv_.wait_until(lk, until, [&] { return generation_ != gen || cancelled_by_ >= 0; })) break;
      if (in_backward && autograd::backward_failed()) {
        --arrived_;  // this reduction will never complete; leave it as it was for nobody
        give_up(rank, phase, "the backward pass failed in another node");
      }
      if (std::chrono::steady_clock::now() >= deadline)
        CHORUS_FAIL("SyncBatchNorm: replica ", rank, " waited ", timeout_.count(), " ms (", phase, ") for ",
                    size_ - arrived_, " of ", size_,
                    " replicas to reach the same statistics reduction; every replica must run the same "
                    "SyncBatchNorm layers in the same order");
    }
    if (generation_ == gen) {  // cancelled while waiting
      --arrived_;
      give_up(rank, phase, "replica " + std::to_string(cancelled_by_) + " failed");
    }
  }

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
  void all_reduce_sum(Tensor<float>& t) override { group_->all_reduce(rank_, t); }
  void all_reduce_sum(Tensor<double>& t) override { group_->all_reduce(rank_, t); }
  std::int64_t all_reduce_sum(std::int64_t count) override { return group_->all_reduce(rank_, count); }
  int size() const override { return group_->size(); }

 private:
  std::shared_ptr<ReplicaStatsGroup> group_;
  int rank_;
};
}  // namespace detail

inline std::shared_ptr<StatsReducer> ReplicaStatsGroup::member(int rank) {
  CHORUS_CHECK(rank >= 0 && rank < size_, "ReplicaStatsGroup: rank ", rank, " out of range for ", size_, " replicas");
  return std::make_shared<detail::ReplicaStatsReducer>(shared_from_this(), rank);
}

}  // namespace parallel
CHORUS_NAMESPACE_END
