#pragma once
// The NCCL backend of the process group (Note [process group backends]): CUDA tensors, and every
// tensor under torchrun (CPU tensors then travel through the GPU). Empty without CUDA.
#include "backend.hpp"

#if CHORUS_CUDA
#include <cstring>
#include <thread>

#include "../backend/cuda/nccl.cuh"
#include "../core/stream.hpp"
#include "../ops/ops.hpp"
#include "watchdog.hpp"

CHORUS_NAMESPACE_BEGIN
namespace dist {
inline namespace CHORUS_DIST_NS {
namespace detail {

// Note [NCCL work]
// A collective on CUDA tensors is ordered, not waited for (as in PyTorch's ProcessGroupNCCL): it
// runs on the communicator's stream after an event recorded on the issuing stream, and
// Work::wait() makes the waiter's current stream wait for its completion event and returns at
// once; the host never spins per gradient bucket. Both events come from the event pool (none is
// created per collective). The timeout is kept by the watchdog (Note [NCCL watchdog]). Where the
// host needs the result (CPU tensors staged through the GPU under torchrun, and barrier()),
// wait() polls the completion event on the host, clearing the "not ready" answers it gets
// (Note [tolerated CUDA errors]). The buffers are recorded on the communicator's stream, so that
// a Work dropped without wait() does not let the allocator reuse memory NCCL still reads.

/// One NCCL communicator over the whole group for this process's GPU, on a dedicated stream,
/// created non-blocking so that a stalled collective can be aborted (Note [watchdog]). Every
/// call on the communicator is made under its lock (the watchdog polls it from its thread).
///
/// Note [NCCL stream lifetime]: the caching allocator remembers the stream of every block a
/// collective used (record_stream) and records an event on it when the block is freed, which may
/// be long after the group is gone (dist::shutdown() or a second ProcessGroup destroyed before
/// the model's parameters and gradient buckets). A destroyed stream's handle is invalid there
/// (undefined behaviour; CUDA may even hand the value to a new stream), so, like the runtime's
/// streams (Note [per-thread lookups]), the communicator's stream is never destroyed once a
/// collective may have used it: one stream per group made in the process's lifetime.
class NcclGroup {
 public:
  NcclGroup(const ncclUniqueId& id, int rank, int world, int device, std::chrono::milliseconds timeout)
      : device_(device), timeout_(timeout) {
    ::chorus::cuda::DeviceGuard g(device_);
    CHORUS_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    const ncclResult_t rc = cleared(ncclCommInitRankConfig(&comm_, world, id, rank, &config));
    if (rc != ncclSuccess && rc != ncclInProgress) {
      comm_ = nullptr;
      destroy_stream();
      CHORUS_FAIL("NCCL error: ", ncclGetErrorString(rc), " in ncclCommInitRankConfig (rank ", rank, " of ", world,
                  " on cuda:", device, ")");
    }
    try {
      settle("ncclCommInitRank", timeout);
    } catch (...) {  // the destructor does not run for a constructor that throws
      abort();
      destroy_stream();
      throw;
    }
  }
  ~NcclGroup() { close(); }  // the stream stays (Note [NCCL stream lifetime])
  NcclGroup(const NcclGroup&) = delete;
  NcclGroup& operator=(const NcclGroup&) = delete;

  int device() const { return device_; }
  cudaStream_t stream() const { return stream_; }

  /// NCCL queries streams and events inside its calls; a "not ready" answer it got stays in the
  /// thread's last-error slot, where the next check_launch() would blame a chorus kernel for it
  /// (Note [tolerated CUDA errors]). Cleared after every NCCL call; other codes stay for the checks.
  static ncclResult_t cleared(ncclResult_t r) {
    if (cudaPeekAtLastError() == cudaErrorNotReady) (void)cudaGetLastError();
    return r;
  }
  /// Calls issue(comm) under the lock; throws if the communicator was aborted.
  template <class F>
  ncclResult_t issue(const std::string& what, F&& f) {
    std::lock_guard<std::mutex> lk(m_);
    CHORUS_CHECK(comm_, "dist: ", what, ": the NCCL communicator was aborted (the process group is broken)");
    return cleared(f(comm_));
  }

  /// Waits (host side) until the communicator has no operation in progress.
  void settle(const std::string& what, std::chrono::milliseconds timeout) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    for (;;) {
      ncclResult_t state = ncclSuccess;
      {
        std::lock_guard<std::mutex> lk(m_);
        CHORUS_CHECK(comm_, "dist: ", what, ": the NCCL communicator was aborted (the process group is broken)");
        CHORUS_NCCL_CHECK(cleared(ncclCommGetAsyncError(comm_, &state)));
      }
      if (state == ncclSuccess) return;
      if (state != ncclInProgress) CHORUS_FAIL("NCCL error in ", what, ": ", ncclGetErrorString(state));
      if (std::chrono::steady_clock::now() > deadline) {
        abort();
        CHORUS_FAIL("dist: ", what, " did not complete within ", timeout.count(), " ms (NCCL communicator aborted)");
      }
      std::this_thread::yield();
    }
  }
  /// The communicator's asynchronous error, if any (ncclInProgress, and an aborted
  /// communicator, count as none: the abort had its reason).
  std::string async_error() {
    std::lock_guard<std::mutex> lk(m_);
    if (!comm_) return {};
    ncclResult_t state = ncclSuccess;
    if (cleared(ncclCommGetAsyncError(comm_, &state)) != ncclSuccess) return "ncclCommGetAsyncError failed";
    return state == ncclSuccess || state == ncclInProgress ? std::string() : ncclGetErrorString(state);
  }
  void abort() noexcept {
    std::lock_guard<std::mutex> lk(m_);
    if (comm_) (void)cleared(ncclCommAbort(comm_));
    comm_ = nullptr;
  }

 private:
  // Note [NCCL teardown]: ncclCommFinalize on a non-blocking communicator answers ncclInProgress;
  // the communicator may be destroyed only once its state (ncclCommGetAsyncError) is
  // ncclSuccess. One that does not get there within the timeout, or fails, is aborted instead.
  void close() noexcept {
    std::lock_guard<std::mutex> lk(m_);
    if (!comm_) return;
    bool finalized = false;
    const ncclResult_t rc = cleared(ncclCommFinalize(comm_));
    if (rc == ncclSuccess || rc == ncclInProgress) {
      const auto deadline = std::chrono::steady_clock::now() + timeout_;
      for (;;) {
        ncclResult_t state = ncclSuccess;
        if (ncclCommGetAsyncError(comm_, &state) != ncclSuccess || (state != ncclSuccess && state != ncclInProgress))
          break;
        if (state == ncclSuccess) {
          finalized = true;
          break;
        }
        if (std::chrono::steady_clock::now() > deadline) break;
        std::this_thread::yield();
      }
    }
    (void)cleared(finalized ? ncclCommDestroy(comm_) : ncclCommAbort(comm_));
    comm_ = nullptr;
  }
  // Only before any collective ran (a failed construction): no block can name the stream yet.
  void destroy_stream() noexcept {
    if (stream_) (void)::chorus::cuda::tolerate(cudaStreamDestroy(stream_));
    stream_ = nullptr;
  }

  int device_;
  std::chrono::milliseconds timeout_;
  cudaStream_t stream_ = nullptr;
  std::mutex m_;
  ncclComm_t comm_ = nullptr;
};

/// A collective's completion on the GPU: its event (from the pool) as the watchdog and the
/// waiter see it (Note [NCCL work]).
class NcclPending final : public Watchdog::Entry {
 public:
  NcclPending(std::string what, std::chrono::steady_clock::time_point deadline, int device)
      : Entry(std::move(what), deadline), device_(device), event_(::chorus::cuda::EventPool::get().acquire(device)) {}
  ~NcclPending() override { ::chorus::cuda::EventPool::get().release(device_, event_); }
  cudaEvent_t event() const { return event_; }
  Watchdog::Poll poll(std::string& error) override {
    const cudaError_t q = ::chorus::cuda::tolerate(cudaEventQuery(event_));  // "not ready" is an answer
    if (q == cudaSuccess) return Watchdog::Poll::Done;
    if (q == cudaErrorNotReady) return Watchdog::Poll::Running;
    error = std::string(cudaGetErrorName(q)) + " (" + cudaGetErrorString(q) + ")";
    return Watchdog::Poll::Failed;
  }

 private:
  int device_;
  cudaEvent_t event_;
};

/// Collectives over NCCL on the communicator's stream, ordered after the tensors' current
/// streams; CPU tensors (torchrun) are staged through the GPU.
class NcclBackend final : public Backend {
 public:
  /// `bootstrap` shares the NCCL unique id from rank 0 (MPI); null under torchrun, where
  /// NCCL_COMM_ID gives every rank the same id.
  NcclBackend(GroupState& state, Backend* bootstrap) : state_(state), bootstrap_(bootstrap) {}
  ~NcclBackend() override {
    if (watchdog_) watchdog_->stop();  // before the communicator it polls goes away
  }
  NcclBackend(const NcclBackend&) = delete;
  NcclBackend& operator=(const NcclBackend&) = delete;

  void all_reduce(const std::shared_ptr<Work>& work, const AnyTensor& t, ReduceOp op) override {
    all_reduce(work, t, op, /*host_wait=*/false);
  }
  void reduce(const std::shared_ptr<Work>& work, const AnyTensor& t, ReduceOp op, int root) override {
    t.visit([&](const auto& x) {
      collective(work, x, x, false, [&](const auto& in, const auto&, ncclComm_t c, cudaStream_t s) {
        return ncclReduce(in.data(), in.data(), static_cast<std::size_t>(in.numel()),
                          backend::cuda::nccl_type(in.dtype()), op == ReduceOp::Sum ? ncclSum : ncclAvg, root, c, s);
      });
    });
  }
  void broadcast(const std::shared_ptr<Work>& work, const AnyTensor& t, int root) override {
    t.visit([&](const auto& x) {
      collective(work, x, x, false, [&](const auto& in, const auto&, ncclComm_t c, cudaStream_t s) {
        return ncclBroadcast(in.data(), in.data(), static_cast<std::size_t>(in.numel()),
                             backend::cuda::nccl_type(in.dtype()), root, c, s);
      });
    });
  }
  void all_gather(const std::shared_ptr<Work>& work, const AnyTensor& in, const AnyTensor& out) override {
    in.visit([&](const auto& x) {
      using T = typename std::decay_t<decltype(x)>::value_type;
      collective(work, x, out.template as<T>(), false, [&](const auto& i, const auto& o, ncclComm_t c, cudaStream_t s) {
        return ncclAllGather(i.data(), o.data(), static_cast<std::size_t>(i.numel()),
                             backend::cuda::nccl_type(i.dtype()), c, s);
      });
    });
  }
  void reduce_scatter(const std::shared_ptr<Work>& work, const AnyTensor& in, const AnyTensor& out,
                      ReduceOp op) override {
    in.visit([&](const auto& x) {
      using T = typename std::decay_t<decltype(x)>::value_type;
      collective(work, x, out.template as<T>(), false, [&](const auto& i, const auto& o, ncclComm_t c, cudaStream_t s) {
        return ncclReduceScatter(i.data(), o.data(), static_cast<std::size_t>(o.numel()),
                                 backend::cuda::nccl_type(i.dtype()), op == ReduceOp::Sum ? ncclSum : ncclAvg, c, s);
      });
    });
  }
  void barrier(const std::shared_ptr<Work>& work) override {
    // A one-element all-reduce, waited for on the host: a barrier holds the caller.
    auto one = Tensor<float>::empty(Shape{1}, state_.default_device());
    backend::fill(one, 1.0f);
    work->keep.push_back(AnyTensor(one));
    all_reduce(work, AnyTensor(one), ReduceOp::Sum, /*host_wait=*/true);
  }
  void abort() noexcept override {
    if (group_) group_->abort();
  }
  /// The communicator's stream (null before the first collective).
  cudaStream_t stream() const { return group_ ? group_->stream() : nullptr; }

 private:
  void all_reduce(const std::shared_ptr<Work>& work, const AnyTensor& t, ReduceOp op, bool host_wait) {
    t.visit([&](const auto& x) {
      collective(work, x, x, host_wait, [&](const auto& in, const auto&, ncclComm_t c, cudaStream_t s) {
        return ncclAllReduce(in.data(), in.data(), static_cast<std::size_t>(in.numel()),
                             backend::cuda::nccl_type(in.dtype()), op == ReduceOp::Sum ? ncclSum : ncclAvg, c, s);
      });
    });
  }

  /// The NCCL communicator for `device` (made by the first CUDA collective, on every rank).
  NcclGroup& group(Device device) {
    CHORUS_CHECK(device.is_cuda(), "dist: NCCL needs a CUDA device, got ", device);
    if (group_) {
      CHORUS_CHECK(group_->device() == device.index, "dist: this process already talks to the group from cuda:",
                   group_->device(), "; one device per process (got a tensor on ", device, ")");
      return *group_;
    }
    ncclUniqueId id;
    if (!bootstrap_ || state_.world == 1) {
      // With NCCL_COMM_ID set (torchrun), every rank gets the same id: the root's address.
      CHORUS_NCCL_CHECK(ncclGetUniqueId(&id));
    } else {
      if (state_.rank == 0) CHORUS_NCCL_CHECK(ncclGetUniqueId(&id));
      auto bytes = Tensor<std::int64_t>::empty(Shape{(sizeof(id) + 7) / 8}, Device::cpu(0));
      std::memcpy(bytes.data(), &id, sizeof(id));
      auto work = std::make_shared<Work>("broadcast of the NCCL unique id" + state_.where());
      work->group = &state_;
      work->keep.push_back(AnyTensor(bytes));
      bootstrap_->broadcast(work, AnyTensor(bytes), 0);
      work->wait(state_.timeout);
      std::memcpy(&id, bytes.data(), sizeof(id));
    }
    group_ = std::make_unique<NcclGroup>(id, state_.rank, state_.world, device.index, state_.timeout);
    // Note [watchdog device]: the watchdog thread queries events of this GPU. A thread that never
    // chose a device runs CUDA calls on device 0, creating a context there: every rank of an
    // 8-GPU node would hold one on GPU 0 (hundreds of MiB each). So it chooses this one first.
    watchdog_ = std::make_unique<Watchdog>(
        [g = group_.get()] { return g->async_error(); },
        [s = &state_](const std::string& why) { s->mark_broken(why); }, std::chrono::milliseconds(2),
        [d = device.index] { (void)::chorus::cuda::tolerate(cudaSetDevice(d)); });
    return *group_;
  }

  /// Runs an NCCL collective on the communicator's stream after the issuing stream, staging CPU
  /// tensors through the GPU (torchrun); `out` holds the result once the Work is waited for
  /// (Note [NCCL work]).
  template <class T, class Issue>
  void collective(const std::shared_ptr<Work>& work, const Tensor<T>& in, const Tensor<T>& out, bool host_wait,
                  Issue&& issue) {
    const bool staged = !in.device().is_cuda();
    const Device dev = staged ? state_.default_device() : in.device();
    auto& g = group(dev);
    Tensor<T> din = staged ? in.to(dev) : in;
    Tensor<T> dout = staged ? (is_same(in, out) ? din : Tensor<T>::empty(out.shape(), dev)) : out;
    ::chorus::cuda::DeviceGuard guard(g.device());
    {
      // A pooled event: cudaStreamWaitEvent captures its state, so it may go back at once.
      auto& pool = ::chorus::cuda::EventPool::get();
      cudaEvent_t ready = pool.acquire(g.device());
      cudaError_t e = cudaEventRecord(ready, current_stream(dev).handle());
      if (e == cudaSuccess) e = cudaStreamWaitEvent(g.stream(), ready, 0);
      pool.release(g.device(), ready);
      CHORUS_CUDA_CHECK(e);
    }
    const ncclResult_t rc = g.issue(work->what(), [&](ncclComm_t c) { return issue(din, dout, c, g.stream()); });
    if (rc != ncclSuccess && rc != ncclInProgress) {
      state_.mark_broken(work->what() + ": " + ncclGetErrorString(rc));
      CHORUS_FAIL("NCCL error in ", work->what(), ": ", ncclGetErrorString(rc));
    }
    g.settle(work->what(), state_.timeout);  // non-blocking communicator: enqueued
    auto pending = std::make_shared<NcclPending>(work->what(), std::chrono::steady_clock::now() + state_.timeout,
                                                 g.device());
    CHORUS_CUDA_CHECK(cudaEventRecord(pending->event(), g.stream()));
    // The allocator must not hand these blocks out again before NCCL is done with them.
    auto& alloc = static_cast<CudaCachingAllocator&>(allocator_of(dev));
    alloc.record_stream(din.data(), g.stream(), g.device());
    if (!is_same(din, dout)) alloc.record_stream(dout.data(), g.stream(), g.device());
    work->keep.push_back(AnyTensor(din));
    work->keep.push_back(AnyTensor(dout));
    watchdog_->watch(pending);
    auto* state = &state_;
    work->on_wait = [state, pending, dev, dout, out, staged, host_wait](std::chrono::steady_clock::time_point deadline) {
      if (staged || host_wait) wait_on_host(*state, *pending, deadline);
      const auto failed = pending->failure();
      CHORUS_CHECK(failed.empty(), "dist: ", pending->what(), ": ", failed,
                   " (NCCL communicator aborted; the process group is now broken)");
      ::chorus::cuda::DeviceGuard g(dev.index);
      CHORUS_CUDA_CHECK(cudaStreamWaitEvent(current_stream(dev).handle(), pending->event(), 0));
      if (staged) backend::copy(out, dout.to(out.device()));
    };
    work->finish();
  }

  static void wait_on_host(GroupState& state, NcclPending& p, std::chrono::steady_clock::time_point deadline) {
    for (;;) {
      std::string err;
      const auto q = p.poll(err);
      if (q == Watchdog::Poll::Done) return;
      if (!p.failure().empty()) return;  // the watchdog gave up on it: the caller throws
      if (q == Watchdog::Poll::Failed || std::chrono::steady_clock::now() > deadline) {
        const std::string why = q == Watchdog::Poll::Failed ? " failed: " + err : std::string(" timed out");
        state.mark_broken(p.what() + why);
        CHORUS_FAIL("dist: ", p.what(), why == " timed out" ? " did not complete within the timeout" : why,
                    " (NCCL communicator aborted; the process group is now broken)");
      }
      std::this_thread::yield();
    }
  }

  GroupState& state_;
  Backend* bootstrap_;
  std::unique_ptr<NcclGroup> group_;
  std::unique_ptr<Watchdog> watchdog_;
};

}  // namespace detail
}  // namespace CHORUS_DIST_NS
}  // namespace dist
CHORUS_NAMESPACE_END
#endif  // CHORUS_CUDA
