#pragma once
// ZeroRedundancyOptimizer: PyTorch's torch.distributed.optim.ZeroRedundancyOptimizer (ZeRO
// stage 1) over chorus's process group. Each rank keeps the optimizer state of its shard of
// the parameters only, steps that shard, and the updated parameters travel from their owners
// to every rank.
//
// Note [ZeRO-1 over the process group]
// - Partition (PyTorch's _partition_parameters): group by group, the parameters sorted by size
//   (largest first; ties in their order) each go to the rank holding the fewest elements so
//   far (ties: the lowest rank). Every rank computes the same partition from the shapes alone.
// - The wrapped optimizer (`local_optimizer()`) is an O over the rank's own parameters, with
//   the same groups and options, so its updates are the plain optimizer's, bit for bit, given
//   the same gradients. As in PyTorch, the gradients must already be the job's (averaged by
//   DistributedDataParallel, or reduced by the caller): this class does not reduce them.
// - step() then sends each owner's parameters to every rank: one broadcast per (owner, dtype),
//   of the owner's parameters packed in index order, all in flight at once.
// - Checkpoints: consolidate_state_dict(to) (a collective) gathers every parameter's state on
//   rank `to`, whose state() then equals the plain optimizer's, so io::save writes the same
//   file; state() elsewhere, or after a later step, is an error rather than a partial state.
//   load_state (what io::load calls on every rank) takes the whole state and keeps the shard.
// - Clipping by the global norm: clip_grad_norm_ (a collective) has each rank take the norm of its
//   own parameters' gradients, gathers those and clips its own by the total — what its shard
//   steps — so it works whether the gradients are whole on every rank (DDP) or sharded (ZeRO-2,
//   DistributedDataParallel::shard_gradients); found_inf_anywhere gathers GradScaler's inf
//   checks alike.
// - Checkpoints that reshard (Note [resharding checkpoints] in fsdp_checkpoint.hpp, for ZeRO-1/2):
//   save_sharded(dir) has each rank write optim-r-of-N.safetensors, its own parameters' state
//   under their global indices (the plain optimizer's file, cut by owner), the groups, the
//   scheduler and the scaler, and rank 0 an index.json (world, each parameter's shape, dtype and
//   owner, the caller's metadata); nothing is gathered. load_sharded(dir) on any world takes each
//   of its parameters' state whole from the file of its old owner (a parameter's state never
//   spans files), scalars and the rest from rank 0's, and loads that through io::load's checks.
//   The model is whole on every rank: rank 0 saves it with chorus::save.
// - A rank that owns no parameter (more ranks than parameters) still needs an O to answer
//   lr() and friends: it gets one over a single zero-element placeholder, which never has a
//   gradient and so never steps.
#include <algorithm>
#include <functional>
#include <memory>
#include <numeric>
#include <optional>
#include <utility>
#include <vector>

#include "../compiled.hpp"
#include "../io/optimizer.hpp"
#include "../nn/utils.hpp"
#include "../optim/optimizer.hpp"
#include "process_group.hpp"

CHORUS_NAMESPACE_BEGIN
namespace dist {
inline namespace CHORUS_DIST_NS {

namespace detail {
// What ZeroRedundancyOptimizer<O> does that does not depend on O (Note [ZeRO-1 over the process
// group]; zero_redundancy_optimizer_impl.hpp).

/// The device of the parameters (one device per process).
CHORUS_INLINE Device zero_device(const std::vector<AnyTensor>& params);
/// The partition over `w` ranks of `opt`'s parameters: owner[i] steps parameter i.
CHORUS_INLINE void zero_partition(const optim::Optimizer& opt, int w, std::vector<int>& owner);
/// consolidate_state_dict(to)'s checks, before anything changes.
CHORUS_INLINE void zero_check_consolidate(ProcessGroup& group, int to);
/// Every parameter's state, from its owner to every rank (a collective): `local` (the shard's
/// optimizer) holds the state of parameters local_index, in that order.
CHORUS_INLINE std::vector<optim::Optimizer::State> zero_gather_state(ProcessGroup& group, const optim::Optimizer& local,
                                                                     const std::vector<AnyTensor>& params,
                                                                     const std::vector<int>& owner,
                                                                     const std::vector<std::size_t>& local_index);
/// state()'s check: the state was consolidated on this rank (`rank`) since the last step.
CHORUS_INLINE void zero_check_consolidated(bool consolidated, int rank);
/// The norm of the gradients of every rank's own parameters (`local_index` here), gathered from
/// every rank; clips this rank's own by it (a collective; Note [ZeRO-1 over the process group]).
CHORUS_INLINE double zero_clip_grad_norm(ProcessGroup& group, const std::vector<AnyTensor>& params,
                                         const std::vector<std::size_t>& local_index, Device device, double max_norm,
                                         double norm_type);
/// Whether `mine` holds on any rank (a collective).
CHORUS_INLINE bool zero_any_rank(ProcessGroup& group, bool mine, Device device);
/// save_sharded: this rank's file (`local_state` of the parameters `local_index`) into `dir`, then
/// rank 0's index (a collective).
CHORUS_INLINE void zero_save_sharded(ProcessGroup& group, const optim::Optimizer& opt,
                                     const std::vector<optim::Optimizer::State>& local_state,
                                     const std::vector<std::size_t>& local_index, const std::vector<int>& owner,
                                     const std::string& dir, const io::TrainingState& with,
                                     const io::Metadata& metadata);
/// load_sharded: the state of this rank's parameters (by `owner`) from a directory any world wrote.
CHORUS_INLINE io::Metadata zero_load_sharded(ProcessGroup& group, optim::Optimizer& opt, const std::vector<int>& owner,
                                             const std::string& dir, const io::TrainingState& with);
/// One broadcast per (owner, dtype) of the owner's parameters packed in index order.
CHORUS_INLINE void zero_sync_parameters(ProcessGroup& group, const std::vector<AnyTensor>& params,
                                        const std::vector<int>& owner, Device device);
}  // namespace detail

/// PyTorch's ZeroRedundancyOptimizer: `ZeroRedundancyOptimizer<optim::Adam> opt(ddp.parameters(),
/// {.lr = 1e-3})` (Note [ZeRO-1 over the process group]). Every rank constructs it with the same
/// parameters and calls step() together; learning-rate schedulers, clip_grad_norm_ and
/// io::save / io::load work on it as on the plain optimizer (save after consolidate_state_dict).
template <class O>
class ZeroRedundancyOptimizer final : public optim::Optimizer {
 public:
  using Options = typename O::options_type;  ///< O's options (optim::AdamOptions for optim::Adam)

  /// Over `params`, one group with `options`, sharded over `group` (default: dist::init()).
  ZeroRedundancyOptimizer(std::vector<AnyTensor> params, Options options, ProcessGroup* group = nullptr)
      : ZeroRedundancyOptimizer(std::vector<optim::ParamGroup<Options>>{{std::move(params), options}}, group) {}

  /// Over parameter groups, each with its own options, sharded over `group` (default: dist::init()).
  explicit ZeroRedundancyOptimizer(std::vector<optim::ParamGroup<Options>> groups, ProcessGroup* group = nullptr)
      : Optimizer(optim::detail::params_of(groups)), group_(group ? *group : dist::init()) {
    device_ = detail::zero_device(params_);
    partition();
    std::vector<optim::ParamGroup<Options>> mine;
    for (std::size_t g = 0; g < groups.size(); ++g) mine.push_back({{}, groups[g].options});
    for (std::size_t i = 0; i < params_.size(); ++i)
      if (owner_[i] == group_.rank()) {
        local_index_.push_back(i);
        mine[group_of(i)].params.push_back(params_[i]);
      }
    if (local_index_.empty()) mine[0].params.push_back(AnyTensor(Tensor<float>::empty(Shape{0}, device_)));
    local_.emplace(std::move(mine));
    group_.add_collective_step(params_);  // Note [DDP join]: a rank out of data must take part in step()
  }
  ~ZeroRedundancyOptimizer() override { group_.remove_collective_step(params_); }
  ZeroRedundancyOptimizer(const ZeroRedundancyOptimizer&) = delete;
  ZeroRedundancyOptimizer& operator=(const ZeroRedundancyOptimizer&) = delete;

  /// Steps this rank's shard, then brings every rank's updated parameters to every rank (a
  /// collective: every rank calls it).
  void step() override {
    group_.check_usable("ZeroRedundancyOptimizer::step");
    drop_consolidated();
    local_->step();
    sync_parameters();
  }

  /// Gathers the whole optimizer state on rank `to` (a collective): afterwards, and until the
  /// next step(), state() there is the plain optimizer's state (for io::save).
  void consolidate_state_dict(int to = 0) override {
    detail::zero_check_consolidate(group_, to);
    drop_consolidated();
    auto full = detail::zero_gather_state(group_, *local_, params_, owner_, local_index_);
    if (group_.rank() == to) {
      state_ = std::move(full);
      consolidated_ = true;
    }
  }

  /// The whole state: only on the rank of the last consolidate_state_dict, before the next step.
  const std::vector<State>& state() const override {
    detail::zero_check_consolidated(consolidated_, group_.rank());
    return state_;
  }

  /// Writes this rank's state into `dir` and rank 0 the index (a collective; Note [ZeRO-1 over the
  /// process group]): a checkpoint that resumes on any number of ranks through load_sharded,
  /// without gathering the state anywhere. `metadata`: the caller's (step, data position).
  void save_sharded(const std::string& dir, const io::TrainingState& with = {},
                    const io::Metadata& metadata = {}) const {
    detail::zero_save_sharded(group_, *this, local_->state(), local_index_, owner_, dir, with, metadata);
  }
  /// Reads a directory save_sharded wrote on any number of ranks (every rank calls it; no
  /// collective): this rank's parameters' state, the groups' lrs and what `with` names. Returns
  /// the metadata saved with it. Nothing changes when the directory does not match.
  io::Metadata load_sharded(const std::string& dir, const io::TrainingState& with = {}) {
    return detail::zero_load_sharded(group_, *this, owner_, dir, with);
  }

  /// Takes the whole state (as io::load reads it on every rank) and keeps this rank's shard.
  void load_state(std::vector<State> state) override {
    validate_states(state);
    std::vector<State> mine;
    for (auto i : local_index_) mine.push_back(std::move(state[i]));
    if (local_index_.empty()) mine.emplace_back();  // the placeholder's
    local_->load_state(std::move(mine));
    drop_consolidated();
  }

  /// torch.nn.utils.clip_grad_norm_ over every rank's gradients (a collective: every rank calls
  /// it): each rank's own parameters' gradients, whole or sharded (ZeRO-2), clipped by the norm
  /// of all of them. Returns that norm.
  double clip_grad_norm_(double max_norm, double norm_type = 2.0) {
    group_.check_usable("ZeroRedundancyOptimizer::clip_grad_norm_");
    return detail::zero_clip_grad_norm(group_, params_, local_index_, device_, max_norm, norm_type);
  }
  /// GradScaler's check over every rank (a collective).
  bool found_inf_anywhere(bool found_here) const override { return detail::zero_any_rank(group_, found_here, device_); }

  /// The rank that owns (keeps the state of, and steps) parameter i.
  int owner(std::size_t i) const { return owner_.at(i); }
  /// The process group the parameters are sharded over.
  ProcessGroup& process_group() const { return group_; }
  /// The optimizer over this rank's shard.
  ///@{
  O& local_optimizer() { return *local_; }
  const O& local_optimizer() const { return *local_; }
  ///@}

  double lr(std::size_t group) const override { return local_->lr(group); }
  /// Sets the learning rate of group `group` in this rank's shard's optimizer (every rank calls it).
  void set_lr(std::size_t group, double lr) override { local_->set_lr(group, lr); }
  bool has_momentum() const override { return local_->has_momentum(); }
  /// The momentum of group `group`; throws where O has none.
  double momentum(std::size_t group) const override { return local_->momentum(group); }
  /// Sets the momentum of group `group` in this rank's shard's optimizer; throws where O has none.
  void set_momentum(std::size_t group, double m) override { local_->set_momentum(group, m); }
  std::vector<std::string> state_keys() const override { return local_->state_keys(); }
  /// The plain optimizer's name: a consolidated checkpoint is the plain optimizer's file.
  std::string name() const override { return local_->name(); }

 private:
  void partition() { detail::zero_partition(*this, group_.world_size(), owner_); }

  void drop_consolidated() {
    if (!consolidated_) return;
    consolidated_ = false;
    state_.assign(params_.size(), State{});
  }

  /// One broadcast per (owner, dtype) of the owner's parameters packed in index order.
  void sync_parameters() { detail::zero_sync_parameters(group_, params_, owner_, device_); }

  ProcessGroup& group_;
  Device device_;
  std::vector<int> owner_;                  // owner_[i]: the rank that steps parameter i
  std::vector<std::size_t> local_index_;    // local parameter j is parameter local_index_[j]
  std::optional<O> local_;
  bool consolidated_ = false;               // state_ holds the whole state (this rank was `to`)
};

}  // namespace CHORUS_DIST_NS
}  // namespace dist

namespace optim {
using dist::ZeroRedundancyOptimizer;
}

CHORUS_NAMESPACE_END

// The definitions: compiled into chorus::compiled and the MPI library, or here in the
// header-only form (Note [compiled chorus] in compiled.hpp).
#if !CHORUS_COMPILED
#include "zero_redundancy_optimizer_impl.hpp"
#endif
