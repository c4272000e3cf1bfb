#pragma once
// The definitions of distributed/backend.hpp (Work::wait, the environment, GroupState): compiled
// into chorus::compiled and the MPI library (src/distributed/local.cpp, mpi.cpp), included by
// backend.hpp itself in the header-only form (Note [compiled chorus]).
#include "backend.hpp"

CHORUS_NAMESPACE_BEGIN
namespace dist {
inline namespace CHORUS_DIST_NS {

namespace detail {
CHORUS_INLINE std::string env(const char* name) {
  const char* v = std::getenv(name);
  return v ? std::string(v) : std::string();
}
CHORUS_INLINE int env_int(const char* name, int fallback) {
  const auto v = env(name);
  if (v.empty()) return fallback;
  try {
    return std::stoi(v);
  } catch (...) {
    CHORUS_FAIL("dist: environment variable ", name, "='", v, "' is not an integer");
  }
}
CHORUS_INLINE bool mpi_launcher_present() {
  for (const char* v : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMI_RANK", "PMIX_RANK", "MPI_LOCALNRANKS"})
    if (std::getenv(v)) return true;
  return false;
}

CHORUS_INLINE int checked_int_count(std::int64_t n, const std::string& what) {
  CHORUS_CHECK(n >= 0 && n <= std::int64_t{std::numeric_limits<int>::max()}, "dist: ", what, " of ", n,
               " elements: MPI takes at most 2^31 - 1 elements per call; split the tensor");
  return static_cast<int>(n);
}

CHORUS_INLINE void GroupState::mark_broken(const std::string& why) {
  std::lock_guard<std::mutex> lk(m_);
  if (broken_.empty()) broken_ = why;
  for (auto* b : backends_) b->abort();
}
CHORUS_INLINE void GroupState::add_backend(Backend* b) {
  std::lock_guard<std::mutex> lk(m_);
  backends_.push_back(b);
}

CHORUS_INLINE Device GroupState::default_device() const {
  const auto devs = available_devices();
  if (!devs.empty() && devs[0].is_cuda()) {
    const int n = static_cast<int>(devs.size());
    return Device::cuda(local_rank % n);
  }
  return Device::cpu(0);
}
CHORUS_INLINE std::string GroupState::where() const {
  return " on rank " + std::to_string(rank) + " of " + std::to_string(world);
}
}  // namespace detail

CHORUS_INLINE void Work::wait(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lk(m_);
  const auto deadline = start_ + timeout;
  struct Waiting {  // the communication thread polls without sleeping meanwhile (Note [polling collectives])
    Waiting() { detail::collective_waiters().fetch_add(1, std::memory_order_relaxed); }
    ~Waiting() { detail::collective_waiters().fetch_sub(1, std::memory_order_relaxed); }
  };
  bool done = false;
  {
    const Waiting waiting;
    // The waiting thread's time, as communication (Note [profiled collectives]): nested in a
    // backward node it is no computation, and what it waits for is not hidden.
    const profiler::Scope span(profiler::Category::communication, [this] {
      return "wait for " + what_.substr(0, what_.find_first_of("( "));
    });
    done = cv_.wait_until(lk, deadline, [this] { return done_; });
  }
  if (!done) {
    lk.unlock();
    std::ostringstream msg;
    msg << "dist: " << what_ << " did not complete within " << std::chrono::duration<double>(timeout).count()
        << " s (a rank stopped participating?); the process group is now broken";
    if (group) group->mark_broken(what_ + " timed out");
    CHORUS_FAIL(msg.str());
  }
  if (!error_.empty()) {
    lk.unlock();
    if (group) group->mark_broken(what_ + ": " + error_);
    CHORUS_FAIL("dist: ", what_, " failed: ", error_);
  }
  auto f = std::move(on_wait);
  on_wait = nullptr;
  lk.unlock();
  if (f) f(deadline);
}

}  // namespace CHORUS_DIST_NS
}  // namespace dist
CHORUS_NAMESPACE_END
