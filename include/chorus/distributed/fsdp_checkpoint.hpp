#pragma once
// Sharded checkpoints of a FullyShardedDataParallel that resume on any number of ranks
// (FullyShardedDataParallel::save_sharded / load_sharded), and their conversion into one plain
// file (dist::consolidate_sharded).
//
// Note [resharding checkpoints]
// A directory holds, per rank r of the N that wrote it, model-r-of-N.safetensors (its shard of
// each unit's flat parameter, "<unit>.flat_param"; rank 0's also the buffers, "buffer.<name>")
// and optim-r-of-N.safetensors (its optimizer's file, io::save: the state of each shard, the
// groups' learning rates, the scheduler and the scaler), then index.json, written by rank 0 once
// every rank's files are whole: the world it was written by, each unit's parameters (name, shape,
// offset in the flat buffer), numel, dtypes, and the caller's metadata (step, data position, RNG
// offsets). No rank ever holds more than its own shards and one shard of another's file.
// - Loading on M ranks: each unit's flat parameter is the same sequence of elements whatever the
//   world, cut into ceil(numel / world) per rank; rank r' of M takes [r'·S', r'·S' + S') from the
//   files whose ranges overlap it, reading only those bytes. The optimizer state is elementwise
//   for every optimizer chorus has (SGD's momentum, Adam's moments: one value per element, cut
//   the same way), plus scalars (Adam's step), the same on every rank: rank 0's are taken.
// - What stays bitwise and what cannot: resumed on the same N, the job continues bit for bit as
//   if never stopped. Resumed on M ≠ N, the state is exact (every element restored), but the
//   following steps average the gradients over another grouping of the batch (each of M ranks
//   sums its rows, then the reduce-scatter sums M partial sums) and float addition is not
//   associative: the run equals an M-rank run from the same state to rounding, not bitwise. The
//   data position must be kept in global samples (not per-rank batches) for the same reason, and
//   random draws (dropout) are each rank's own: M ranks draw other masks than N did.
// - A directory missing index.json, or whose units differ from the model's (names, shapes,
//   dtypes), is refused before anything changes; a world other than the writer's is the point.
#include <string>
#include <vector>

#include "../compiled.hpp"
#include "../io/optimizer.hpp"
#include "../io/safetensors.hpp"
#include "../parallel/shard_unit.hpp"
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
