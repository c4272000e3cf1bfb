#pragma once
// The definitions of distributed/stats_reducer.hpp (ProcessStatsReducer, whose vtable goes with
// them): compiled into chorus::compiled and the MPI library (src/distributed/local.cpp, mpi.cpp),
// included by stats_reducer.hpp itself in the header-only form (Note [compiled chorus]).
#include "stats_reducer.hpp"

CHORUS_NAMESPACE_BEGIN
namespace dist {
inline namespace CHORUS_DIST_NS {
namespace detail {

CHORUS_INLINE void ProcessStatsReducer::all_reduce_sum(Tensor<float>& t) { reduce(t); }
CHORUS_INLINE void ProcessStatsReducer::all_reduce_sum(Tensor<double>& t) { reduce(t); }
CHORUS_INLINE std::int64_t ProcessStatsReducer::all_reduce_sum(std::int64_t count) {
  auto t = from_vector<std::int64_t>({count});
  reduce(t);
  return t.item();
}
CHORUS_INLINE int ProcessStatsReducer::size() const { return group_.world_size(); }

}  // namespace detail
}  // namespace CHORUS_DIST_NS
}  // namespace dist
CHORUS_NAMESPACE_END
