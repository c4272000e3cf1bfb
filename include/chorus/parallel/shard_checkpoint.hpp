#pragma once
// Sharded checkpoints of FullyShard units (ZeRO-3) that resume on any number of members: what
// dist::FullyShardedDataParallel (a member per rank) and parallel::FullyShardedDataParallel (a
// member per device) write and read in their save_sharded / load_sharded.
//
// Note [resharding checkpoints]
// A directory holds, per member r of the N that wrote it, model-r-of-N.safetensors (its shard of
// each unit's flat parameter, "<unit>.flat_param"; member 0's also the buffers, "buffer.<name>")
// and optim-r-of-N.safetensors (an optimizer file, io::save's format, over that member's shards:
// the state of each, the groups' learning rates, the scheduler and the scaler), then index.json,
// written once every member's files are whole: the number of members that wrote it, each unit's
// parameters (name, shape, offset in the flat buffer), numel, dtypes, and the caller's metadata
// (step, data position, RNG offsets). No member ever holds more than its own shards and one
// shard of another's file. Ranks and devices write the same files.
// - Loading on M members: each unit's flat parameter is the same sequence of elements whatever
//   the world, cut into ceil(numel / world) per member; member r' of M takes [r'·S', r'·S' + S')
//   from the files whose ranges overlap it, reading only those bytes. The optimizer state is
//   elementwise for every optimizer chorus has (SGD's momentum, Adam's moments: one value per
//   element, cut the same way), plus scalars (Adam's step), the same on every member: member 0's
//   are taken.
// - What stays bitwise and what cannot: resumed on the same N, the job continues bit for bit as
//   if never stopped. Resumed on M ≠ N, the state is exact (every element restored), but the
//   following steps sum the gradients over another grouping of the batch (each of M members sums
//   its rows, then the reduce-scatter sums M partial sums) and float addition is not
//   associative: the run equals an M-member run from the same state to rounding, not bitwise.
//   The data position must be kept in global samples (not per-member batches) for the same
//   reason, and across ranks random draws (dropout) are each rank's own: M ranks draw other masks
//   than N did.
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "../compiled.hpp"
#include "../io/optimizer.hpp"
#include "../io/sharded_files.hpp"
#include "shard_unit.hpp"

CHORUS_NAMESPACE_BEGIN
namespace parallel::detail {

/// The units (with parameters, in order) whose shards a member writes or reads.
using UnitList = std::vector<const FsdpUnit*>;

/// The index of a checkpoint of `units` written by `world` members, with the caller's metadata.
CHORUS_INLINE nlohmann::json shard_index(const UnitList& units, int world, const io::Metadata& metadata);
/// Writes member `rank`'s model file into `dir`: its shards of `units` and `buffers` (member 0's).
CHORUS_INLINE void write_shard_file(const std::string& dir, const UnitList& units, int rank, int world,
                                    const std::vector<nn::Module::NamedTensor>& buffers);

/// A checkpoint directory being read (Note [resharding checkpoints]): its index, checked against
/// the units at construction, and the old members' files, opened as they are needed.
class ShardReader {
 public:
  /// Reads dir/index.json and refuses it (naming `who`) unless its units are `units` (names,
  /// sizes, dtypes, parameters).
  CHORUS_INLINE ShardReader(std::string dir, const UnitList& units, const char* who);
  const nlohmann::json& index() const { return index_; }
  /// The world that wrote it.
  int world() const { return world_; }
  /// Member `rank` of a new world: its shard of each of `units` (in the unit's shard dtype, on its
  /// device) and its optimizer state, each parameter's entries named "<index_of(k)>.<key>" for
  /// the k-th unit (appended to `state`).
  CHORUS_INLINE std::vector<AnyTensor> read(const UnitList& units, int rank,
                                            const std::function<std::size_t(std::size_t)>& index_of,
                                            std::vector<nn::Module::NamedTensor>& state);
  /// Member 0's optimizer file (its metadata: groups, scheduler, scaler).
  const io::File& first_optim() { return file(optim_, "optim", 0); }
  /// Copies the saved buffers into `buffers` (refusing a shape or dtype other than the saved one).
  CHORUS_INLINE void read_buffers(const std::vector<nn::Module::NamedTensor>& buffers);

 private:
  CHORUS_INLINE const io::File& file(std::map<int, io::File>& files, const char* kind, int q);
  CHORUS_INLINE const io::TensorRecord* record(const io::File& f, const std::string& name) const;

  std::string dir_;
  nlohmann::json index_;
  int world_ = 0;
  std::map<int, io::File> model_, optim_;
};

/// Copies `shards[k]` into units[k]'s shard (bumping its version: the optimizer's view changed).
CHORUS_INLINE void set_shards(const UnitList& units, const std::vector<AnyTensor>& shards);

}  // namespace parallel::detail
CHORUS_NAMESPACE_END

#if !CHORUS_COMPILED
#include "shard_checkpoint_impl.hpp"
#endif
