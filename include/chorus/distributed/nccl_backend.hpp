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

CHORUS_NAMESPACE_BEGIN
namespace dist {
inline namespace CHORUS_DIST_NS {
namespace detail {

/// One NCCL communicator over the whole group for this process's GPU, on a dedicated stream,
/// created non-blocking so that a stalled collective can be aborted (Note [watchdog]).
class NcclGroup {
 public:
  NcclGroup(const ncclUniqueId& id, int rank, int world, int device, std::chrono::milliseconds timeout)
      : device_(device) {
    ::chorus::cuda::DeviceGuard g(device_);
    CHORUS_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    const ncclResult_t rc = ncclCommInitRankConfig(&comm_, world, id, rank, &config);
    if (rc != ncclSuccess && rc != ncclInProgress) {
      (void)cudaStreamDestroy(stream_);
      CHORUS_FAIL("NCCL error: ", ncclGetErrorString(rc), " in ncclCommInitRankConfig (rank ", rank, " of ", world,
                  " on cuda:", device, ")");
    }
    settle("ncclCommInitRank", timeout);
  }
  ~NcclGroup() {
    if (comm_) (void)(aborted_ ? ncclSuccess : ncclCommFinalize(comm_)), (void)ncclCommDestroy(comm_);
    if (stream_) (void)cudaStreamDestroy(stream_);
  }
  NcclGroup(const NcclGroup&) = delete;
  NcclGroup& operator=(const NcclGroup&) = delete;

  int device() const { return device_; }
  cudaStream_t stream() const { return stream_; }
  ncclComm_t comm() const { return comm_; }

  /// Waits (host side) until the communicator has no operation in progress.
  void settle(const char* what, std::chrono::milliseconds timeout) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    for (;;) {
      ncclResult_t state = ncclSuccess;
      CHORUS_NCCL_CHECK(ncclCommGetAsyncError(comm_, &state));
      if (state == ncclSuccess) return;
      if (state != ncclInProgress) CHORUS_FAIL("NCCL error in ", what, ": ", ncclGetErrorString(state));
      if (std::chrono::steady_clock::now() > deadline) {
        abort();
        CHORUS_FAIL("dist: ", what, " did not complete within ", timeout.count(), " ms (NCCL communicator aborted)");
      }
      std::this_thread::yield();
    }
  }
  /// The communicator's asynchronous error, if any (ncclInProgress counts as none).
  std::string async_error() const {
    ncclResult_t state = ncclSuccess;
    if (ncclCommGetAsyncError(comm_, &state) != ncclSuccess) return "ncclCommGetAsyncError failed";
    return state == ncclSuccess || state == ncclInProgress ? std::string() : ncclGetErrorString(state);
  }
  void abort() {
    if (!aborted_ && comm_) (void)ncclCommAbort(comm_), comm_ = nullptr;
    aborted_ = true;
  }

 private:
  int device_;
  cudaStream_t stream_ = nullptr;
  ncclComm_t comm_ = nullptr;
  bool aborted_ = false;
};

/// Collectives over NCCL on the communicator's stream, ordered after the tensors' current
/// streams; CPU tensors (torchrun) are staged through the GPU.
class NcclBackend final : public Backend {
 public:
  /// `bootstrap` shares the NCCL unique id from rank 0 (MPI); null under torchrun, where
  /// NCCL_COMM_ID gives every rank the same id.
  NcclBackend(GroupState& state, Backend* bootstrap) : state_(state), bootstrap_(bootstrap) {}
  NcclBackend(const NcclBackend&) = delete;
  NcclBackend& operator=(const NcclBackend&) = delete;

  void all_reduce(const std::shared_ptr<Work>& work, const AnyTensor& t, ReduceOp op) override {
    t.visit([&](const auto& x) {
      collective(work, x, x, [&](const auto& in, const auto&, NcclGroup& g) {
        return ncclAllReduce(in.data(), in.data(), static_cast<std::size_t>(in.numel()),
                             backend::cuda::nccl_type(in.dtype()), op == ReduceOp::Sum ? ncclSum : ncclAvg, g.comm(),
                             g.stream());
      });
    });
  }
  void broadcast(const std::shared_ptr<Work>& work, const AnyTensor& t, int root) override {
    t.visit([&](const auto& x) {
      collective(work, x, x, [&](const auto& in, const auto&, NcclGroup& g) {
        return ncclBroadcast(in.data(), in.data(), static_cast<std::size_t>(in.numel()),
                             backend::cuda::nccl_type(in.dtype()), root, g.comm(), g.stream());
      });
    });
  }
  void all_gather(const std::shared_ptr<Work>& work, const AnyTensor& in, const AnyTensor& out) override {
    in.visit([&](const auto& x) {
      using T = typename std::decay_t<decltype(x)>::value_type;
      collective(work, x, out.template as<T>(), [&](const auto& i, const auto& o, NcclGroup& g) {
        return ncclAllGather(i.data(), o.data(), static_cast<std::size_t>(i.numel()),
                             backend::cuda::nccl_type(i.dtype()), g.comm(), g.stream());
      });
    });
  }
  void barrier(const std::shared_ptr<Work>& work) override {
    // A one-element all-reduce is a barrier.
    auto one = Tensor<float>::empty(Shape{1}, state_.default_device());
    backend::fill(one, 1.0f);
    work->keep.push_back(AnyTensor(one));
    all_reduce(work, AnyTensor(one), ReduceOp::Sum);
  }
  void abort() noexcept override {
    if (group_) group_->abort();
  }

 private:
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
    return *group_;
  }

  /// Runs an NCCL collective on the group's stream after the tensors' current streams, staging
  /// CPU tensors through the GPU (torchrun); `out` is filled once the Work is waited for.
  /// Work::wait watches the collective's completion event against the timeout (Note
  /// [watchdog]) and orders the current stream after it.
  template <class T, class Issue>
  void collective(const std::shared_ptr<Work>& work, const Tensor<T>& in, const Tensor<T>& out, Issue&& issue) {
    const bool staged = !in.device().is_cuda();
    const Device dev = staged ? state_.default_device() : in.device();
    auto& g = group(dev);
    Tensor<T> din = staged ? in.to(dev) : in;
    Tensor<T> dout = staged ? (is_same(in, out) ? din : Tensor<T>::empty(out.shape(), dev)) : out;
    ::chorus::cuda::DeviceGuard guard(g.device());
    Stream* cur = &current_stream(dev);
    cudaEvent_t ready = nullptr, finished = nullptr;
    CHORUS_CUDA_CHECK(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming));
    CHORUS_CUDA_CHECK(cudaEventCreateWithFlags(&finished, cudaEventDisableTiming));
    CHORUS_CUDA_CHECK(cudaEventRecord(ready, cur->handle()));
    CHORUS_CUDA_CHECK(cudaStreamWaitEvent(g.stream(), ready, 0));
    (void)cudaEventDestroy(ready);
    const ncclResult_t rc = issue(din, dout, g);
    if (rc != ncclSuccess && rc != ncclInProgress) {
      (void)cudaEventDestroy(finished);
      state_.mark_broken(work->what() + ": " + ncclGetErrorString(rc));
      CHORUS_FAIL("NCCL error in ", work->what(), ": ", ncclGetErrorString(rc));
    }
    g.settle(work->what().c_str(), state_.timeout);  // non-blocking communicator: enqueued
    CHORUS_CUDA_CHECK(cudaEventRecord(finished, g.stream()));
    record_stream(din.data(), dev, *cur);
    if (!is_same(din, dout)) record_stream(dout.data(), dev, *cur);
    work->keep.push_back(AnyTensor(din));
    work->keep.push_back(AnyTensor(dout));
    const std::string what = work->what();
    work->on_wait = [this, finished, cur, dout, out, staged, what](std::chrono::steady_clock::time_point deadline) {
      for (;;) {
        const cudaError_t q = cudaEventQuery(finished);
        if (q == cudaSuccess) break;
        if (q != cudaErrorNotReady) CHORUS_CUDA_CHECK(q);
        const auto err = group_ ? group_->async_error() : std::string();
        if (!err.empty() || std::chrono::steady_clock::now() > deadline) {
          state_.mark_broken(what + (err.empty() ? " timed out" : ": " + err));
          CHORUS_FAIL("dist: ", what, err.empty() ? " did not complete within the timeout" : " failed: " + err,
                      " (NCCL communicator aborted; the process group is now broken)");
        }
        std::this_thread::yield();
      }
      CHORUS_CUDA_CHECK(cudaStreamWaitEvent(cur->handle(), finished, 0));
      (void)cudaEventDestroy(finished);
      if (staged) backend::copy(out, dout.to(out.device()));
    };
    work->finish();
  }

  GroupState& state_;
  Backend* bootstrap_;
  std::unique_ptr<NcclGroup> group_;
};

}  // namespace detail
}  // namespace CHORUS_DIST_NS
}  // namespace dist
CHORUS_NAMESPACE_END
#endif  // CHORUS_CUDA
