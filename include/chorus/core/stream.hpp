#pragma once
// Streams and events.
//
// Note [streams]
// A Stream is an ordered queue of work on one device, served by a persistent worker thread
// (for CUDA it also owns a cudaStream_t that the work launches onto). Several streams may
// exist per device (slot 0, 1, …): replicas that share a device each get their own. CPU
// operations run eagerly on the thread that calls them; a thread's *current stream* for a
// device (the worker's own stream on a worker, slot 0 elsewhere) is what autograd records
// so that backward runs each node where its forward ran, and what CUDA kernels launch onto.
// Work is moved onto a stream with post()/async(); Events order work between streams.
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <optional>
#include <variant>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>

#include "cuda_runtime.hpp"
#include "device.hpp"

CHORUS_NAMESPACE_BEGIN

class Stream;

namespace detail {
/// The streams the calling thread has made current (innermost last).
inline std::vector<Stream*>& current_stream_overrides() {
  thread_local std::vector<Stream*> v;
  return v;
}
/// The stream whose worker the calling thread is, or nullptr.
inline Stream*& worker_stream_of_thread() {
  thread_local Stream* s = nullptr;
  return s;
}
}  // namespace detail

/// A persistent thread serving a FIFO of tasks. Exceptions escaping a posted task are kept
/// and rethrown by the next drain(), so none is lost.
class Worker {
 public:
  /// Starts the thread, which runs `on_start` (if any) before its first task.
  explicit Worker(std::function<void()> on_start) : on_start_(std::move(on_start)) {
    thread_ = std::thread([this] { loop(); });
  }
  ~Worker() {
    {
      std::lock_guard<std::mutex> lk(m_);
      stop_ = true;
      stop_requested_.store(true);
    }
    cv_.notify_all();
    if (thread_.joinable()) thread_.join();
  }
  Worker(const Worker&) = delete;
  Worker& operator=(const Worker&) = delete;

  /// Queues `task` to run after every task posted before it.
  void post(std::function<void()> task) {
    bool wake;
    {
      std::lock_guard<std::mutex> lk(m_);
      q_.push_back(std::move(task));
      pending_.store(q_.size(), std::memory_order_release);
      wake = sleeping_;
    }
    if (wake) cv_.notify_one();
  }

  /// True when called on the worker's own thread.
  bool on_this_thread() const { return std::this_thread::get_id() == thread_.get_id(); }

  /// Keeps the worker spinning for new tasks, instead of sleeping, until `until` (Note
  /// [worker spin]); a later time replaces an earlier one, never the other way round.
  void keep_hot_until(std::chrono::steady_clock::time_point until) {
    const auto t = until.time_since_epoch().count();
    auto cur = hot_until_.load(std::memory_order_relaxed);
    while (cur < t && !hot_until_.compare_exchange_weak(cur, t, std::memory_order_relaxed)) {
    }
  }

  /// Lends the worker, while it has nothing to do, to large elementwise loops of other threads
  /// until `until` (Note [idle workers help]); a later time replaces an earlier one.
  void lend_until(std::chrono::steady_clock::time_point until) {
    const auto t = until.time_since_epoch().count();
    auto cur = lend_until_.load(std::memory_order_relaxed);
    while (cur < t && !lend_until_.compare_exchange_weak(cur, t, std::memory_order_relaxed)) {
    }
  }

  /// True while the worker is lent (lend_until) and waits for work with nothing queued: a
  /// task posted now starts as soon as it wakes (Note [idle workers help]).
  bool idle_and_lent() const {
    return waiting_.load(std::memory_order_acquire) && pending_.load(std::memory_order_acquire) == 0 &&
           std::chrono::steady_clock::now().time_since_epoch().count() < lend_until_.load(std::memory_order_relaxed);
  }

  /// Blocks until every task posted so far has run; rethrows the first escaped exception.
  void drain() {
    if (on_this_thread()) return;  // everything before the caller's task has run
    std::unique_lock<std::mutex> lk(m_);
    idle_cv_.wait(lk, [this] { return q_.empty() && !busy_; });
    if (error_) std::rethrow_exception(std::exchange(error_, nullptr));
  }

 private:
  // Note [worker spin]: a worker that has just run a task spins briefly before sleeping, so
  // the next task of a step (DataParallel posts several in quick succession) starts in well
  // under a microsecond instead of after a futex wake-up (~10 us on a loaded VM, 100 us on
  // others). While a step is in flight (keep_hot_until: DataParallel's active window, like
  // OpenMP's active wait policy) it keeps spinning past that, yielding the core to any other
  // runnable thread, so that forward, backward and the optimizer step of one training step
  // never pay a wake-up.
  static constexpr auto kSpin = std::chrono::microseconds(50);

  void loop() {
    if (on_start_) on_start_();
    std::unique_lock<std::mutex> lk(m_);
    for (;;) {
      if (q_.empty() && !stop_) {
        lk.unlock();
        using clock = std::chrono::steady_clock;
        const auto start = clock::now();
        const auto brief = start + kSpin;
        waiting_.store(true, std::memory_order_release);
        for (auto now = start; pending_.load(std::memory_order_acquire) == 0 && !stop_requested_.load();
             now = clock::now()) {
          if (now >= brief) {
            if (now.time_since_epoch().count() >= hot_until_.load(std::memory_order_relaxed)) break;
            std::this_thread::yield();  // a hot wait gives way to threads with work
          }
        }
        lk.lock();
      }
      sleeping_ = true;
      cv_.wait(lk, [this] { return stop_ || !q_.empty(); });
      sleeping_ = false;
      if (q_.empty()) return;  // stop requested and drained
      waiting_.store(false, std::memory_order_release);
      auto task = std::move(q_.front());
      q_.pop_front();
      pending_.store(q_.size(), std::memory_order_release);
      busy_ = true;
      lk.unlock();
      std::exception_ptr failure;  // kept past the catch block: see Future
      try {
        task();
      } catch (...) {
        failure = std::current_exception();
      }
      task = nullptr;
      lk.lock();
      if (failure && !error_) error_ = std::move(failure);
      busy_ = false;
      if (q_.empty()) idle_cv_.notify_all();
    }
  }

  std::function<void()> on_start_;
  std::mutex m_;
  std::condition_variable cv_, idle_cv_;
  std::deque<std::function<void()>> q_;
  bool stop_ = false, busy_ = false, sleeping_ = false;
  std::atomic<std::size_t> pending_{0};
  std::atomic<bool> stop_requested_{false};
  std::atomic<bool> waiting_{false};  // spinning or asleep, waiting for a task
  std::atomic<std::chrono::steady_clock::rep> hot_until_{0};  // steady_clock ticks
  std::atomic<std::chrono::steady_clock::rep> lend_until_{0};  // steady_clock ticks
  std::exception_ptr error_;
  std::thread thread_;
};

/// The result of Stream::async: get() waits for it and returns the value or rethrows the
/// exception. The worker hands the exception over under the state's lock and keeps no
/// reference to it, so it is destroyed on the thread that called get() (exception objects
/// are reference-counted inside the uninstrumented C++ runtime, which ThreadSanitizer
/// cannot see; handing them over this way keeps every access ordered).
template <class R>
class Future {
  using Value = std::conditional_t<std::is_void_v<R>, std::monostate, R>;
  struct State {
    std::mutex m;
    std::condition_variable cv;
    std::atomic<bool> ready{false};
    std::optional<Value> value;
    std::exception_ptr error;

    template <class F>
    void run(F& f) {
      std::optional<Value> v;
      std::exception_ptr e;
      try {
        if constexpr (std::is_void_v<R>) {
          f();
          v.emplace();
        } else {
          v.emplace(f());
        }
      } catch (...) {
        e = std::current_exception();
      }
      {
        std::lock_guard<std::mutex> lk(m);
        value = std::move(v);
        error = std::move(e);
        ready.store(true, std::memory_order_release);
      }
      cv.notify_all();
    }
  };

 public:
  Future() : state_(std::make_shared<State>()) {}
  /// True once the task has finished (a cheap check, for spinning).
  bool ready() const { return state_->ready.load(std::memory_order_acquire); }
  /// Waits for the task; returns its value or rethrows its exception.
  R get() {
    std::unique_lock<std::mutex> lk(state_->m);
    state_->cv.wait(lk, [this] { return state_->ready.load(std::memory_order_relaxed); });
    if (state_->error) {
      auto e = std::move(state_->error);
      state_->error = nullptr;
      lk.unlock();
      std::rethrow_exception(std::move(e));
    }
    if constexpr (!std::is_void_v<R>) return std::move(*state_->value);
  }

 private:
  std::shared_ptr<State> state_;
  friend class Stream;
};

/// An ordered queue of work on one device (see Note [streams]).
class Stream {
 public:
  /// Stream `slot` of `device` (the runtime makes them: get_stream()); its worker thread starts when first used.
  Stream(Device device, int slot) : device_(device), slot_(slot) {}
  ~Stream() {
    worker_.reset();  // joins before the CUDA stream goes away
#if CHORUS_CUDA
    if (handle_) {
      int prev = 0;
      (void)cuda::tolerate(cudaGetDevice(&prev));
      (void)cuda::tolerate(cudaSetDevice(device_.index));
      (void)cuda::tolerate(cudaStreamDestroy(handle_));
      (void)cuda::tolerate(cudaSetDevice(prev));
    }
#endif
  }
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;

  /// The device the stream's work runs on.
  Device device() const { return device_; }
  /// The stream's number among its device's streams (0 is the default).
  int slot() const { return slot_; }
  /// "<device>/stream<slot>", e.g. "cpu:0/stream1".
  std::string str() const { return device_.str() + "/stream" + std::to_string(slot_); }

  /// True on this stream's worker thread.
  bool is_worker_thread() const { return detail::worker_stream_of_thread() == this; }

  /// Runs `task` on this stream's worker, after everything posted before it.
  void post(std::function<void()> task) { worker().post(std::move(task)); }

  /// Like post(), returning a Future for the result (or the exception) of `f`.
  template <class F>
  auto async(F&& f) -> Future<std::invoke_result_t<F&>> {
    using R = std::invoke_result_t<F&>;
    Future<R> fut;
    post([state = fut.state_, f = std::forward<F>(f)]() mutable { state->run(f); });
    return fut;
  }

  /// Blocks until all work posted to (and, for CUDA, launched on) this stream has finished.
  void synchronize() {
    {
      std::unique_lock<std::mutex> lk(m_);
      if (worker_) {
        lk.unlock();
        worker_->drain();
      }
    }
#if CHORUS_CUDA
    if (device_.is_cuda()) {
      CHORUS_CUDA_CHECK(cudaStreamSynchronize(handle()));
      cuda::check_device_asserts();  // Note [device-side validation]
    }
#endif
  }

  /// Keeps this stream's worker spinning for new work until `until` (Note [worker spin]).
  void keep_hot_until(std::chrono::steady_clock::time_point until) { worker().keep_hot_until(until); }

  /// Lends this stream's worker to other threads' large elementwise loops while it is idle,
  /// until `until` (Note [idle workers help]).
  void lend_until(std::chrono::steady_clock::time_point until) { worker().lend_until(until); }

  /// True when this stream's worker is lent and waits for work with nothing queued (Note [idle
  /// workers help]); false for a stream without a worker.
  bool idle_and_lent() const {
    std::lock_guard<std::mutex> lk(m_);
    return worker_ != nullptr && worker_->idle_and_lent();
  }

  /// True once the worker thread exists (a stream never posted to has none).
  bool has_worker() const {
    std::lock_guard<std::mutex> lk(m_);
    return worker_ != nullptr;
  }

#if CHORUS_CUDA
  /// The CUDA stream (non-blocking with respect to the legacy default stream). Every kernel
  /// launch and allocation asks for it: after the first call it is one atomic load.
  cudaStream_t handle() {
    if (cudaStream_t h = ready_handle_.load(std::memory_order_acquire)) return h;
    CHORUS_CHECK(device_.is_cuda(), "Stream::handle() on ", device_, ": only CUDA streams have one");
    std::call_once(handle_once_, [this] {
      cuda::DeviceGuard g(device_.index);
      CHORUS_CUDA_CHECK(cudaStreamCreateWithFlags(&handle_, cudaStreamNonBlocking));
      ready_handle_.store(handle_, std::memory_order_release);
    });
    return handle_;
  }
#endif

 private:
  Worker& worker() {
    std::lock_guard<std::mutex> lk(m_);
    if (!worker_) {
      worker_ = std::make_unique<Worker>([this] {
        detail::worker_stream_of_thread() = this;
        detail::current_stream_overrides().push_back(this);
#if CHORUS_CUDA
        if (device_.is_cuda()) (void)cuda::tolerate(cudaSetDevice(device_.index));
#endif
      });
    }
    return *worker_;
  }

  Device device_;
  int slot_;
  mutable std::mutex m_;
  std::unique_ptr<Worker> worker_;
#if CHORUS_CUDA
  std::once_flag handle_once_;
  cudaStream_t handle_ = nullptr;
  std::atomic<cudaStream_t> ready_handle_{nullptr};
#endif
};

/// Makes `stream` the calling thread's current stream for its device while alive.
class StreamGuard {
 public:
  /// Pushes `stream` as the current stream; the destructor pops it.
  explicit StreamGuard(Stream& stream) { detail::current_stream_overrides().push_back(&stream); }
  ~StreamGuard() { detail::current_stream_overrides().pop_back(); }
  StreamGuard(const StreamGuard&) = delete;
  StreamGuard& operator=(const StreamGuard&) = delete;
};

/// A point in a stream's work. record() marks it; synchronize() waits for it on the host;
/// block(s) makes later work on stream s wait for it.
class Event {
 public:
  Event() : state_(std::make_shared<State>()) {}

  /// Marks the end of the work on `stream` so far. For CPU streams this is the work posted to
  /// the worker (eager work done by the calling thread has already finished).
  void record(Stream& stream) {
    auto st = std::make_shared<State>();
    state_ = st;
    device_ = stream.device();
#if CHORUS_CUDA
    if (stream.device().is_cuda()) {
      // The event must belong to the stream's device (Note [cross-device stream uses]); it
      // comes from that device's pool and goes back there when the last copy of this Event
      // lets go of it.
      cuda::DeviceGuard g(stream.device().index);
      st->cuda_device = stream.device().index;
      st->cuda_event = cuda::EventPool::get().acquire(st->cuda_device);
      CHORUS_CUDA_CHECK(cudaEventRecord(st->cuda_event, stream.handle()));
      st->done = true;  // host side is complete; the GPU side is the CUDA event
      return;
    }
#endif
    if (stream.is_worker_thread() || !stream.has_worker()) {
      st->done = true;
      return;
    }
    st->done = false;
    stream.post([st] { st->complete(); });
  }

  /// Blocks the calling thread until the recorded work has finished.
  void synchronize() const {
    state_->wait();
#if CHORUS_CUDA
    if (state_->cuda_event) {
      CHORUS_CUDA_CHECK(cudaEventSynchronize(state_->cuda_event));
      cuda::check_device_asserts();
    }
#endif
  }

  /// True when the recorded work has finished (a never-recorded event is complete).
  bool query() const {
    {
      std::lock_guard<std::mutex> lk(state_->m);
      if (!state_->done) return false;
    }
#if CHORUS_CUDA
    if (state_->cuda_event) {
      // cudaErrorNotReady is an answer, not a failure: clear it (Note [tolerated CUDA errors]).
      const cudaError_t e = cuda::tolerate(cudaEventQuery(state_->cuda_event));
      CHORUS_CHECK(e == cudaSuccess || e == cudaErrorNotReady, "Event::query on cuda:", state_->cuda_device, ": ",
                   cudaGetErrorString(e));
      return e == cudaSuccess;
    }
#endif
    return true;
  }

  /// Makes work submitted to `stream` after this call wait for the recorded work.
  void block(Stream& stream) const {
#if CHORUS_CUDA
    if (state_->cuda_event && stream.device().is_cuda()) {
      cuda::DeviceGuard g(stream.device().index);
      CHORUS_CUDA_CHECK(cudaStreamWaitEvent(stream.handle(), state_->cuda_event, 0));
      return;
    }
#endif
    if (stream.is_worker_thread()) {
      synchronize();
      return;
    }
    if (query()) return;
    auto st = state_;
    stream.post([st] {
      st->wait();
#if CHORUS_CUDA
      if (st->cuda_event) CHORUS_CUDA_CHECK(cudaEventSynchronize(st->cuda_event));
#endif
    });
  }

 private:
  struct State {
    std::mutex m;
    std::condition_variable cv;
    bool done = true;
#if CHORUS_CUDA
    cudaEvent_t cuda_event = nullptr;
    int cuda_device = -1;
    ~State() {
      if (cuda_event) cuda::EventPool::get().release(cuda_device, cuda_event);
    }
#endif
    State() = default;
    void complete() {
      {
        std::lock_guard<std::mutex> lk(m);
        done = true;
      }
      cv.notify_all();
    }
    void wait() {
      std::unique_lock<std::mutex> lk(m);
      cv.wait(lk, [this] { return done; });
    }
  };
  std::shared_ptr<State> state_;
  Device device_;
};

CHORUS_NAMESPACE_END
