#pragma once
// The definitions of distributed/watchdog.hpp (the watchdog's thread): compiled into
// chorus::compiled and the MPI library (src/distributed/local.cpp, mpi.cpp), included by
// watchdog.hpp itself in the header-only form (Note [compiled chorus]).
#include "watchdog.hpp"

CHORUS_NAMESPACE_BEGIN
namespace dist {
inline namespace CHORUS_DIST_NS {
namespace detail {

CHORUS_INLINE Watchdog::Watchdog(std::function<std::string()> group_error,
                                 std::function<void(const std::string&)> on_failure, std::chrono::milliseconds interval,
                                 std::function<void()> on_start)
    : group_error_(std::move(group_error)), on_failure_(std::move(on_failure)), on_start_(std::move(on_start)),
      interval_(interval), thread_([this] { run(); }) {}

CHORUS_INLINE Watchdog::~Watchdog() { stop(); }

CHORUS_INLINE void Watchdog::watch(std::shared_ptr<Entry> e) {
  {
    std::lock_guard<std::mutex> lk(m_);
    entries_.push_back(std::move(e));
  }
  cv_.notify_one();
}

CHORUS_INLINE void Watchdog::stop() {
  {
    std::lock_guard<std::mutex> lk(m_);
    if (stopped_) return;
    stopped_ = true;
  }
  cv_.notify_one();
  thread_.join();
}

CHORUS_INLINE void Watchdog::run() {
  if (on_start_) on_start_();
  for (;;) {
    std::vector<std::shared_ptr<Entry>> now;
    {
      std::unique_lock<std::mutex> lk(m_);
      cv_.wait(lk, [&] { return stopped_ || !entries_.empty(); });
      if (stopped_) return;
      now = entries_;
    }
    std::string reason;
    std::vector<std::shared_ptr<Entry>> finished;
    const auto t = std::chrono::steady_clock::now();
    for (auto& e : now) {
      std::string err;
      const Poll p = e->poll(err);
      if (p == Poll::Done) {
        finished.push_back(e);
      } else if (reason.empty()) {
        if (p == Poll::Failed) reason = e->what() + " failed: " + err;
        else if (t > e->deadline()) reason = e->what() + " timed out";
      }
    }
    if (reason.empty() && group_error_) {
      const auto err = group_error_();
      if (!err.empty()) reason = "the NCCL communicator failed: " + err;
    }
    {
      std::lock_guard<std::mutex> lk(m_);
      std::erase_if(entries_, [&](const auto& e) {
        return std::find(finished.begin(), finished.end(), e) != finished.end();
      });
      if (!reason.empty()) {
        for (auto& e : entries_) e->fail(reason);
        entries_.clear();
      }
    }
    if (!reason.empty() && !fired_.exchange(true) && on_failure_) on_failure_(reason);
    std::unique_lock<std::mutex> lk(m_);
    cv_.wait_for(lk, interval_, [&] { return stopped_; });
    if (stopped_) return;
  }
}

}  // namespace detail
}  // namespace CHORUS_DIST_NS
}  // namespace dist
CHORUS_NAMESPACE_END
