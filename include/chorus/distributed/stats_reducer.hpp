#pragma once
// SyncBatchNorm across processes: the process group as the StatsReducer of a
// DistributedDataParallel forward (Note [statistics reducer]; the replicas' one is
// parallel/stats_reducer.hpp).
//
// Note [process statistics reducer]
// DistributedDataParallel installs one for the duration of a training forward of a module that
// holds a SyncBatchNorm; the batch-norm backward keeps it, so the backward reduction joins the
// same ranks. Each reduction is a blocking all-reduce on the process group, ordered with the
// gradient buckets' all-reduces by the order in which this rank issues them: every rank runs the
// same layers in the same order (as in PyTorch), and a rank that does not makes the others fail
// at the group's timeout (Note [watchdog]) rather than hang. A rank's batch may differ in size
// from the others': the element count is summed too.
#include <cstdint>

#include "../compiled.hpp"
#include "../ops/nn.hpp"
#include "process_group.hpp"

CHORUS_NAMESPACE_BEGIN
namespace dist {
inline namespace CHORUS_DIST_NS {
namespace detail {

class ProcessStatsReducer final : public StatsReducer {
 public:
  explicit ProcessStatsReducer(ProcessGroup& group) : group_(group) {}
  CHORUS_INLINE void all_reduce_sum(Tensor<float>& t) override;
  CHORUS_INLINE void all_reduce_sum(Tensor<double>& t) override;
  CHORUS_INLINE std::int64_t all_reduce_sum(std::int64_t count) override;
  CHORUS_INLINE int size() const override;

 private:
  template <class T>
  void reduce(Tensor<T>& t) {
    group_.all_reduce_async(t, ReduceOp::Sum, "SyncBatchNorm statistics all_reduce")->wait(group_.timeout());
  }
  ProcessGroup& group_;
};

}  // namespace detail
}  // namespace CHORUS_DIST_NS
}  // namespace dist
CHORUS_NAMESPACE_END

// The definitions: compiled into chorus::compiled and the MPI library, or here in the
// header-only form (Note [compiled chorus] in compiled.hpp).
#if !CHORUS_COMPILED
#include "stats_reducer_impl.hpp"
#endif
