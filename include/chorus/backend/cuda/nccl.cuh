#pragma once
// NCCL communicators (RAII) for a set of distinct GPUs in one process.
#include <nccl.h>

#include <mutex>
#include <string>
#include <vector>

#include "../../core/cuda_runtime.hpp"
#include "../../core/dtype.hpp"
#include "host_policy.hpp"

#define CHORUS_NCCL_CHECK(expr)                                                                       \
  do {                                                                                                \
    ncclResult_t chorus_nr_ = (expr);                                                                 \
    if (chorus_nr_ != ncclSuccess) [[unlikely]]                                                       \
      ::chorus::detail::throw_error("NCCL error: ", ncclGetErrorString(chorus_nr_), " in ", #expr, " at ", \
                                    __FILE__, ":", __LINE__);                                         \
  } while (0)

CHORUS_NAMESPACE_BEGIN
namespace backend::cuda {

inline ncclDataType_t nccl_type(DType d) {
  switch (d) {
    case DType::Float32: return ncclFloat32;
    case DType::Float64: return ncclFloat64;
    case DType::Int64: return ncclInt64;
    case DType::BFloat16: return ncclBfloat16;
    case DType::Float16: return ncclFloat16;
  }
  return ncclFloat32;
}

/// One NCCL communicator per device (ncclCommInitAll); rank r is devices[r]. Collectives are
/// issued for all ranks from the calling thread inside ncclGroupStart/End.
///
/// Note [one NCCL issuer at a time]: DataParallel reduces gradient buckets from several worker
/// threads (one per replica stream) while the main thread may broadcast. NCCL requires every
/// rank of a communicator to see its collectives in the same order; two threads interleaving
/// their per-rank calls (thread A issues rank 0, thread B ranks 0 and 1, then A rank 1) give
/// ranks different orders and hang with three or more GPUs. Each collective is therefore issued
/// for all ranks under one mutex, group start to group end, so every rank sees one order.
class NcclComms {
 public:
  explicit NcclComms(const std::vector<int>& devices) : devices_(devices) {
    for (std::size_t i = 0; i < devices.size(); ++i)
      for (std::size_t j = 0; j < i; ++j)
        CHORUS_CHECK(devices[i] != devices[j], "NCCL: device cuda:", devices[i],
                     " appears twice; NCCL refuses a communicator with a repeated device (use the copy path)");
    comms_.resize(devices.size());
    CHORUS_NCCL_CHECK(ncclCommInitAll(comms_.data(), checked_int(static_cast<std::int64_t>(devices.size()), "devices"),
                                      devices.data()));
  }
  ~NcclComms() {
    for (auto c : comms_)
      if (c) (void)ncclCommDestroy(c);
  }

  /// Collectives issued so far (tests: the serialised issue count matches the calls).
  std::int64_t issued() const {
    std::lock_guard<std::mutex> lk(issue_m_);
    return issued_;
  }
  NcclComms(const NcclComms&) = delete;
  NcclComms& operator=(const NcclComms&) = delete;

  std::size_t size() const { return comms_.size(); }
  int device(std::size_t r) const { return devices_[r]; }

  /// bufs[r] (count elements on rank r) = bufs[root].
  void broadcast(const std::vector<void*>& bufs, std::size_t count, DType dt, int root,
                 const std::vector<cudaStream_t>& streams) {
    group([&](std::size_t r) {
      return ncclBroadcast(bufs[r], bufs[r], count, nccl_type(dt), root, comms_[r], streams[r]);
    });
  }
  /// recv (on root) = sum over ranks of send[r].
  void reduce(const std::vector<const void*>& send, void* recv, std::size_t count, DType dt, int root,
              const std::vector<cudaStream_t>& streams) {
    group([&](std::size_t r) {
      return ncclReduce(send[r], static_cast<int>(r) == root ? recv : nullptr, count, nccl_type(dt), ncclSum, root,
                        comms_[r], streams[r]);
    });
  }
  /// bufs[r] = sum over ranks of bufs[r], in place.
  void all_reduce(const std::vector<void*>& bufs, std::size_t count, DType dt, const std::vector<cudaStream_t>& streams) {
    group([&](std::size_t r) {
      return ncclAllReduce(bufs[r], bufs[r], count, nccl_type(dt), ncclSum, comms_[r], streams[r]);
    });
  }

  /// Throws when a communicator reported an asynchronous error (a failed peer, say).
  void check_async() const {
    for (std::size_t r = 0; r < comms_.size(); ++r) {
      ncclResult_t async = ncclSuccess;
      CHORUS_NCCL_CHECK(ncclCommGetAsyncError(comms_[r], &async));
      CHORUS_CHECK(async == ncclSuccess, "NCCL asynchronous error on rank ", r, " (cuda:", devices_[r],
                   "): ", ncclGetErrorString(async));
    }
  }

 private:
  template <class F>
  void group(F&& issue) {
    std::lock_guard<std::mutex> lk(issue_m_);  // Note [one NCCL issuer at a time]
    ++issued_;
    check_async();
    CHORUS_NCCL_CHECK(ncclGroupStart());
    ncclResult_t first = ncclSuccess;
    for (std::size_t r = 0; r < comms_.size(); ++r) {
      ::chorus::cuda::DeviceGuard g(devices_[r]);
      const ncclResult_t res = issue(r);
      if (first == ncclSuccess) first = res;
    }
    const ncclResult_t end = ncclGroupEnd();
    CHORUS_NCCL_CHECK(first);
    CHORUS_NCCL_CHECK(end);
  }

  std::vector<int> devices_;
  std::vector<ncclComm_t> comms_;
  mutable std::mutex issue_m_;
  std::int64_t issued_ = 0;
};

}  // namespace backend::cuda
CHORUS_NAMESPACE_END
