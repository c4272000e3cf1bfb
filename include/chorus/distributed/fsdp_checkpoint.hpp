#pragma once
// Sharded checkpoints of a FullyShardedDataParallel that resume on any number of ranks
// (FullyShardedDataParallel::save_sharded / load_sharded), and their conversion into one plain
// file (dist::consolidate_sharded).
//
// (Note [resharding checkpoints] in parallel/shard_checkpoint.hpp.)
#include <string>
#include <vector>

#include "../compiled.hpp"
#include "../io/optimizer.hpp"
#include "../io/safetensors.hpp"
#include "../parallel/shard_checkpoint.hpp"
#include "process_group.hpp"

CHORUS_NAMESPACE_BEGIN
namespace dist {
inline namespace CHORUS_DIST_NS {
namespace detail {
using parallel::detail::FsdpUnit;
/// Writes this rank's files into `dir` and, once all are whole, rank 0 the index (a collective).
CHORUS_INLINE void save_fsdp_sharded(nn::Module& root, const std::vector<std::shared_ptr<FsdpUnit>>& units,
                                     ProcessGroup& group, const optim::Optimizer& opt, const std::string& dir,
                                     const io::TrainingState& with, const io::Metadata& metadata);
/// Reads a directory written by any number of ranks into this rank's shards, optimizer and the
/// module's buffers; returns the metadata saved with it (every rank reads; no collective).
CHORUS_INLINE io::Metadata load_fsdp_sharded(nn::Module& root, const std::vector<std::shared_ptr<FsdpUnit>>& units,
                                             ProcessGroup& group, optim::Optimizer& opt, const std::string& dir,
                                             const io::TrainingState& with);
}  // namespace detail

/// One plain safetensors file from a sharded checkpoint directory (Note [resharding
/// checkpoints]): every parameter whole under the module's name, in the shards' dtype (float32
/// master values for a 16-bit module with float32 shards), and the buffers: what chorus::load
/// and PyTorch's load_state_dict (safetensors.torch.load_file) take. It holds the whole model in
/// this process; the optimizer state is not in it.
CHORUS_INLINE void consolidate_sharded(const std::string& dir, const std::string& path);

}  // namespace CHORUS_DIST_NS
}  // namespace dist
CHORUS_NAMESPACE_END

#if !CHORUS_COMPILED
#include "fsdp_checkpoint_impl.hpp"
#endif
