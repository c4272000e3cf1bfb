#pragma once
// The definitions of parallel/stats_reducer.hpp (ReplicaStatsGroup's non-template members, its
// reducers): compiled into chorus::compiled (src/parallel/parallel.cpp), included by
// stats_reducer.hpp itself in the header-only form (Note [compiled chorus]).
#include "stats_reducer.hpp"

CHORUS_NAMESPACE_BEGIN
namespace parallel {

CHORUS_INLINE ReplicaStatsGroup::ReplicaStatsGroup(int size, std::chrono::milliseconds timeout)
    : size_(size), timeout_(timeout), slots_(static_cast<std::size_t>(size)), counts_(static_cast<std::size_t>(size)) {
  CHORUS_CHECK(size > 0, "ReplicaStatsGroup: size must be positive, got ", size);
}

CHORUS_INLINE std::shared_ptr<StatsReducer> ReplicaStatsGroup::member(int rank) {
  CHORUS_CHECK(rank >= 0 && rank < size_, "ReplicaStatsGroup: rank ", rank, " out of range for ", size_, " replicas");
  return std::make_shared<detail::ReplicaStatsReducer>(shared_from_this(), rank);
}

CHORUS_INLINE std::int64_t ReplicaStatsGroup::all_reduce(int rank, std::int64_t v) {
  if (size_ == 1) return v;
  counts_[rank] = v;
  barrier(rank, "post");
  std::int64_t s = 0;
  for (auto c : counts_) s += c;
  barrier(rank, "read");
  return s;
}

CHORUS_INLINE void ReplicaStatsGroup::cancel(int rank) {
  std::lock_guard lk(m_);
  if (cancelled_by_ < 0) cancelled_by_ = rank;
  cv_.notify_all();
}

CHORUS_INLINE void ReplicaStatsGroup::give_up(int rank, const char* phase, const std::string& why) const {
  throw ReplicaCancelled("replica " + std::to_string(rank) + " stopped waiting (" + phase +
                         ") for the other replicas (SyncBatchNorm statistics, FullyShard parameters): " + why);
}

CHORUS_INLINE void ReplicaStatsGroup::barrier(int rank, const char* phase) {
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
      CHORUS_FAIL("replica ", rank, " waited ", timeout_.count(), " ms (", phase, ") for ", size_ - arrived_, " of ",
                  size_, " replicas to reach the same SyncBatchNorm reduction or FullyShard unit; every replica "
                  "must run the same SyncBatchNorm layers and FullyShard units in the same order");
  }
  if (generation_ == gen) {  // cancelled while waiting
    --arrived_;
    give_up(rank, phase, "replica " + std::to_string(cancelled_by_) + " failed");
  }
}

namespace detail {
CHORUS_INLINE void ReplicaStatsReducer::all_reduce_sum(Tensor<float>& t) { group_->all_reduce(rank_, t); }
CHORUS_INLINE void ReplicaStatsReducer::all_reduce_sum(Tensor<double>& t) { group_->all_reduce(rank_, t); }
CHORUS_INLINE std::int64_t ReplicaStatsReducer::all_reduce_sum(std::int64_t count) {
  return group_->all_reduce(rank_, count);
}
}  // namespace detail

}  // namespace parallel
CHORUS_NAMESPACE_END
