#pragma once
// The definitions of distributed/sampler.hpp (DistributedSampler's constructor and indices):
// compiled into chorus::compiled (src/distributed/local.cpp), included by sampler.hpp itself in
// the header-only form (Note [compiled chorus]).
//
// They do not depend on MPI (namespace data, not dist::CHORUS_DIST_NS), so only one library may
// hold them: chorus::compiled. The MPI library (src/distributed/mpi.cpp, linked together with
// chorus::compiled) includes this file too and gets nothing from it, or a program needing both
// libraries' objects would define these functions twice. The helpers that ask the process group
// (check_group and friends) stay in the header: they do depend on MPI.
#include "sampler.hpp"

#if !(CHORUS_COMPILED && CHORUS_DIST_MPI)
CHORUS_NAMESPACE_BEGIN
namespace data {

CHORUS_INLINE DistributedSampler::DistributedSampler(std::size_t dataset_size, int num_replicas, int rank,
                                                     DistributedSamplerOptions options)
    : n_(dataset_size), world_(num_replicas), rank_(rank), options_(options) {
  CHORUS_CHECK(num_replicas >= 1, "DistributedSampler: num_replicas must be at least 1, got ", num_replicas);
  CHORUS_CHECK(rank >= 0 && rank < num_replicas, "DistributedSampler: rank ", rank, " is not in [0, ", num_replicas,
               ")");
  const auto w = static_cast<std::size_t>(world_);
  // PyTorch: ceil((n - w) / w) with drop_last (= floor(n / w) when w does not divide n),
  // else ceil(n / w); both without n + w - 1, which wraps for a huge n.
  num_samples_ = options_.drop_last ? n_ / w : n_ / w + (n_ % w != 0);
  total_ = num_samples_ * w;  // <= n_ + w - 1 only in exact arithmetic: it may exceed size_t
  CHORUS_CHECK(num_samples_ == 0 || total_ / num_samples_ == w, "DistributedSampler: ", n_, " samples padded to a "
               "multiple of ", w, " replicas overflow a size_t");
}

CHORUS_INLINE std::vector<std::size_t> DistributedSampler::indices() const {
  std::vector<std::size_t> order(n_);
  std::iota(order.begin(), order.end(), std::size_t{0});
  if (options_.shuffle) {
    std::mt19937_64 gen(options_.seed + epoch_);
    for (std::size_t i = n_; i > 1; --i) std::swap(order[i - 1], order[uniform_below(gen, i)]);
  }
  if (total_ > n_) {  // pad by repeating the start (several times when n_ is tiny)
    CHORUS_CHECK(n_ > 0, "DistributedSampler: an empty dataset cannot be padded");
    for (std::size_t k = 0, pad = total_ - n_; k < pad; ++k) order.push_back(order[k % n_]);
  } else {
    order.resize(total_);
  }
  std::vector<std::size_t> mine;
  mine.reserve(num_samples_);
  for (std::size_t k = static_cast<std::size_t>(rank_); k < total_; k += static_cast<std::size_t>(world_))
    mine.push_back(order[k]);
  return mine;
}

}  // namespace data
CHORUS_NAMESPACE_END
#endif  // !(CHORUS_COMPILED && CHORUS_DIST_MPI)
