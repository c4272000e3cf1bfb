#pragma once
// DistributedSampler: each rank's share of a dataset, as torch.utils.data.DistributedSampler.
//
// Every epoch, every rank draws the same order (a permutation seeded by seed + epoch, or
// 0 … n-1), pads it by repeating its start to a multiple of the world size (or, with
// drop_last, cuts it down to one), and takes every world-th index starting at its rank — so the
// ranks together see the dataset exactly once, plus the padding (samples a second rank sees again).
// Call set_epoch(e) at the start of each epoch, or every epoch repeats the first one's order.
// The permutation is chorus's own Fisher-Yates over std::mt19937_64 (std::shuffle's algorithm
// differs between standard libraries, and all ranks must agree).
//
// As in PyTorch, DistributedSampler(dataset) takes the world size and rank from the default
// process group (dist::init()); pass num_replicas and rank to use others.
#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

#include "../compiled.hpp"
#include "../data/dataset.hpp"
#include "../error.hpp"
#include "process_group.hpp"

CHORUS_NAMESPACE_BEGIN
namespace data {

/// DistributedSampler's options, as torch.utils.data.DistributedSampler's: `{.shuffle = false}`.
struct DistributedSamplerOptions {
  bool shuffle = true;     ///< draw a new permutation every epoch (else the order 0 … n-1)
  std::uint64_t seed = 0;  ///< the permutation of epoch e is seeded by seed + e; the same on every rank
  bool drop_last = false;  ///< cut the order down to a multiple of the world size instead of padding it
};

/// Each rank's share of a dataset's indices, as torch.utils.data.DistributedSampler: every epoch
/// the ranks draw one order and rank r takes every num_replicas()-th index from r.
class DistributedSampler {
 public:
  /// The share of rank `rank` out of `num_replicas` of a dataset of `dataset_size` samples.
  DistributedSampler(std::size_t dataset_size, int num_replicas, int rank, DistributedSamplerOptions options = {});
  /// A rank's share of `dataset` (anything with size()).
  template <data::Dataset D>
  DistributedSampler(const D& dataset, int num_replicas, int rank, DistributedSamplerOptions options = {})
      : DistributedSampler(static_cast<std::size_t>(dataset.size()), num_replicas, rank, options) {}
  /// This process's share of `dataset`: num_replicas and rank are the default process group's
  /// world size and rank, as torch.utils.data.DistributedSampler(dataset) takes them.
  template <data::Dataset D>
  explicit DistributedSampler(const D& dataset, DistributedSamplerOptions options = {})
      : DistributedSampler(static_cast<std::size_t>(dataset.size()), group_world_size(), group_rank(), options) {}

  /// Makes the next indices() use the order of epoch `epoch` (same on every rank).
  void set_epoch(std::uint64_t epoch) { epoch_ = epoch; }
  /// The epoch set by set_epoch() (0 before).
  std::uint64_t epoch() const { return epoch_; }
  /// Samples per rank and epoch.
  std::size_t size() const { return num_samples_; }
  /// Samples per epoch over all ranks (including the padding).
  std::size_t total_size() const { return total_; }
  /// The rank whose share this is.
  int rank() const { return rank_; }
  /// The number of ranks the dataset is shared among.
  int num_replicas() const { return world_; }

  /// This rank's indices for the current epoch.
  std::vector<std::size_t> indices() const;

 private:
  static void check_group() {
    CHORUS_CHECK(dist::is_initialized(), "DistributedSampler: no num_replicas and rank were given, and the default "
                 "process group is not initialised (call chorus::dist::init() first, or pass num_replicas and rank)");
  }
  static int group_world_size() {
    check_group();
    return dist::world_size();
  }
  static int group_rank() {
    check_group();
    return dist::rank();
  }

  // Unbiased draw from [0, bound) (rejection sampling; the same on every platform).
  static std::size_t uniform_below(std::mt19937_64& gen, std::size_t bound) {
    const std::uint64_t b = bound, limit = UINT64_MAX - UINT64_MAX % b;
    std::uint64_t x;
    do x = gen();
    while (x >= limit);
    return static_cast<std::size_t>(x % b);
  }

  std::size_t n_;
  int world_, rank_;
  DistributedSamplerOptions options_;
  std::size_t num_samples_ = 0, total_ = 0;
  std::uint64_t epoch_ = 0;
};

}  // namespace data
CHORUS_NAMESPACE_END

// The definitions: compiled into chorus::compiled, or here in the header-only form (Note
// [compiled chorus] in compiled.hpp).
#if !CHORUS_COMPILED
#include "sampler_impl.hpp"
#endif
