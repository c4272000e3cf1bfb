#pragma once
// The watchdog of collectives that the host does not wait for (NCCL: Note [NCCL work]). Generic
// over what "done" means, so that its logic is tested on the CPU.
//
// Note [NCCL watchdog]
// A CUDA collective's Work::wait() only orders the waiter's stream after the collective; no host
// thread waits for it, so none would notice a stall. As PyTorch's ProcessGroupNCCL does, one
// thread per communicator polls what is in flight (every `interval`, sleeping while nothing is):
// an entry that completed is dropped; an entry past its deadline, one that failed, or a failure
// of the whole communicator (its asynchronous error) calls `on_failure` once with the reason,
// and every entry then in flight is marked failed with it, so that a later wait() throws. The
// process group's on_failure marks the group broken (Note [watchdog]), which aborts the
// communicator: the stalled kernels end and every later collective throws.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "../compiled.hpp"
#include "backend.hpp"

CHORUS_NAMESPACE_BEGIN
namespace dist {
inline namespace CHORUS_DIST_NS {
namespace detail {

class Watchdog {
 public:
  enum class Poll { Running, Done, Failed };

  /// One collective in flight.
  class Entry {
   public:
    Entry(std::string what, std::chrono::steady_clock::time_point deadline)
        : what_(std::move(what)), deadline_(deadline) {}
    virtual ~Entry() = default;
    /// Called by the watchdog thread (and by host waiters): Done, Running, or Failed with `error`.
    virtual Poll poll(std::string& error) = 0;

    const std::string& what() const { return what_; }
    std::chrono::steady_clock::time_point deadline() const { return deadline_; }
    /// Why the watchdog gave up on this entry ("" while it has not).
    std::string failure() const {
      std::lock_guard<std::mutex> lk(m_);
      return failure_;
    }
    void fail(const std::string& why) {
      std::lock_guard<std::mutex> lk(m_);
      if (failure_.empty()) failure_ = why;
    }

   private:
    std::string what_;
    std::chrono::steady_clock::time_point deadline_;
    mutable std::mutex m_;
    std::string failure_;
  };

  /// `group_error` polls the failure of the whole communicator ("" while there is none);
  /// `on_failure` runs on the watchdog thread, once, with the first reason; `on_start` runs on
  /// it first, before any poll (NCCL: makes the communicator's GPU the thread's device, Note
  /// [watchdog device]).
  Watchdog(std::function<std::string()> group_error, std::function<void(const std::string&)> on_failure,
           std::chrono::milliseconds interval = std::chrono::milliseconds(2), std::function<void()> on_start = {});
  ~Watchdog();
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;

  void watch(std::shared_ptr<Entry> e);
  /// Entries not yet seen done.
  std::size_t in_flight() const {
    std::lock_guard<std::mutex> lk(m_);
    return entries_.size();
  }
  bool fired() const { return fired_.load(); }
  void stop();

 private:
  void run();

  std::function<std::string()> group_error_;
  std::function<void(const std::string&)> on_failure_;
  std::function<void()> on_start_;
  std::chrono::milliseconds interval_;
  mutable std::mutex m_;
  std::condition_variable cv_;
  std::vector<std::shared_ptr<Entry>> entries_;
  bool stopped_ = false;
  std::atomic<bool> fired_{false};
  std::thread thread_;  // last: starts after the members it uses exist
};

}  // namespace detail
}  // namespace CHORUS_DIST_NS
}  // namespace dist
CHORUS_NAMESPACE_END

// The definitions: compiled into chorus::compiled and the MPI library, or here in the
// header-only form (Note [compiled chorus] in compiled.hpp).
#if !CHORUS_COMPILED
#include "watchdog_impl.hpp"
#endif
