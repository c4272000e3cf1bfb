#pragma once
// FullyShardedDataParallel: ZeRO stage 3 over the process group, PyTorch's FSDP (fully_shard).
// Each rank keeps 1/world of every parameter, gradient and optimizer state; a unit's parameters
// are gathered for its forward and its backward only (Note [fully sharded parameters] in
// parallel/shard_unit.hpp). parallel::FullyShardedDataParallel is the same over one process's devices.
//
//   struct Net : nn::Module {
//     std::vector<dist::FullyShard<nn::TransformerEncoderLayer>> blocks;  // a unit each
//     nn::Linear head;                                                    // the root's
//     ...
//   };
//   dist::FullyShardedDataParallel fsdp(Net(...));
//   optim::AdamW opt(fsdp.parameters(), {.lr = 3e-4});      // this rank's shards
//   auto loss = nn::functional::cross_entropy(fsdp(x), y);
//   loss.backward();                                        // gradients reduce-scattered into the shards
//   fsdp.clip_grad_norm_(1.0);                              // the norm over every rank
//   opt.step();
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

#include "../compiled.hpp"
#include "../nn/checkpoint.hpp"
#include "../nn/module.hpp"
#include "../parallel/data_parallel.hpp"
#include "../parallel/fully_shard.hpp"
#include "fsdp_checkpoint.hpp"
#include "process_group.hpp"
#include "zero_redundancy_optimizer.hpp"

CHORUS_NAMESPACE_BEGIN
namespace dist {
inline namespace CHORUS_DIST_NS {

/// How a FullyShardedDataParallel gathers: `{.prefetch = false}`.
struct FullyShardedDataParallelOptions {
  /// Start gathering the next unit's parameters while one computes (in forward the one after,
  /// in backward the one before), as PyTorch's forward_prefetch and BACKWARD_PRE: at most two
  /// units gathered at a time, and the gathers overlap compute.
  bool prefetch = true;
  /// The dtype of the shards, their gradients and so the optimizer state, where wider than the
  /// module's (Note [sharded master weights]): a bfloat16 module with {.shard_dtype =
  /// DType::Float32} computes in bfloat16 and steps float32 master shards.
  std::optional<DType> shard_dtype;
};

namespace detail {
using parallel::detail::finish_all_gradients;
using parallel::detail::FsdpShared;
using parallel::detail::FsdpUnit;
using parallel::detail::run_unit;

/// The ranks of a process group as the members a unit's shards are spread over.
class ProcessShardGroup final : public parallel::detail::ShardGroup {
 public:
  explicit ProcessShardGroup(ProcessGroup& group) : group_(group) {}
  int rank() const override { return group_.rank(); }
  int size() const override { return group_.world_size(); }
  bool spans_processes() const override { return true; }
  CHORUS_INLINE void broadcast(const AnyTensor& t) override;
  CHORUS_INLINE parallel::detail::Pending all_gather(const AnyTensor& full, const AnyTensor& part,
                                                     const std::string& what) override;
  CHORUS_INLINE parallel::detail::Pending reduce_scatter(const AnyTensor& part, const AnyTensor& full,
                                                         const std::string& what) override;

 private:
  ProcessGroup& group_;
};

/// Builds the units of `root` over `group` (checking every rank holds the same model, and
/// starting every rank from rank 0's buffers).
CHORUS_INLINE std::vector<std::shared_ptr<FsdpUnit>> setup_fsdp(nn::Module& root, FsdpShared& shared,
                                                                ProcessGroup& group);
/// Every unit gathered once more, its parameters copied out (names as the module's), in the
/// module's parameter order; then the module's buffers.
CHORUS_INLINE std::vector<nn::Module::NamedTensor> fsdp_full_state_dict(
    nn::Module& root, const std::vector<std::shared_ptr<FsdpUnit>>& units);
/// Hands the units' full parameters back to the module for good (a collective), and unlinks
/// the FullyShard modules.
CHORUS_INLINE void release_fsdp(nn::Module& root, const std::vector<std::shared_ptr<FsdpUnit>>& units, bool gather);
}  // namespace detail

using parallel::FullyShard;
using parallel::FullyShardImpl;

/// ZeRO-3 (Note [fully sharded parameters]): the module's FullyShard submodules are units of
/// their own and the rest of its parameters the root unit; every rank keeps its shard of each,
/// and its optimizer steps those (parameters()). Every rank starts from rank 0's parameters and
/// buffers, and every rank must run the same units in the same order.
template <class M>
class FullyShardedDataParallel {
 public:
  using Options = FullyShardedDataParallelOptions;  ///< the constructor's options

  /// Shards `module` (all of whose tensors live on one device) over `group` (default:
  /// dist::init()). A collective: every rank constructs it.
  explicit FullyShardedDataParallel(M module, Options options = {}, ProcessGroup* group = nullptr)
      : module_(std::move(module)), group_(group ? *group : dist::init()), members_(group_) {
    shared_.group = &members_;
    shared_.prefetch = options.prefetch;
    shared_.shard_dtype = options.shard_dtype;
    units_ = detail::setup_fsdp(nn::module_of(module_), shared_, group_);
    const auto shards = parameters();
    device_ = shards.empty() ? Device::cpu(0) : shards[0].device();
  }
  /// Gives the module its full parameters back (a collective, as construction), so that it works
  /// on its own afterwards; skipped while an exception unwinds (the module then holds none).
  ~FullyShardedDataParallel() {
    detail::release_fsdp(nn::module_of(module_), units_,
                         std::uncaught_exceptions() == 0 && !group_.broken());
  }
  FullyShardedDataParallel(const FullyShardedDataParallel&) = delete;
  FullyShardedDataParallel& operator=(const FullyShardedDataParallel&) = delete;

  /// Runs the module on this rank's batch (tensor arguments are moved to the module's device),
  /// the root unit gathered around it.
  template <class... Args>
  auto forward(Args&&... args) {
    group_.check_usable("FullyShardedDataParallel::forward");
    return call(to_device(std::forward<Args>(args))...);
  }
  /// Calls forward(args...).
  template <class... Args>
  auto operator()(Args&&... args) {
    return forward(std::forward<Args>(args)...);
  }

  /// This rank's shards, one per unit with parameters (the root's first): what the optimizer
  /// steps. Their gradients are this rank's part of the mean over the ranks.
  std::vector<AnyTensor> parameters() const {
    std::vector<AnyTensor> out;
    for (const auto& u : units_)
      if (!u->empty()) out.push_back(u->shard());
    return out;
  }
  /// The shards, named by their unit ("flat_param" for the root's, "<unit>.flat_param").
  std::vector<nn::Module::NamedTensor> named_parameters() const {
    std::vector<nn::Module::NamedTensor> out;
    for (const auto& u : units_)
      if (!u->empty()) out.push_back({u->shard_name(), u->shard()});
    return out;
  }
  /// torch.nn.utils.clip_grad_norm_ over every rank's shards (a collective); returns the norm.
  double clip_grad_norm_(double max_norm, double norm_type = 2.0) {
    group_.check_usable("FullyShardedDataParallel::clip_grad_norm_");
    const auto shards = parameters();
    std::vector<std::size_t> all(shards.size());
    for (std::size_t i = 0; i < all.size(); ++i) all[i] = i;
    return detail::zero_clip_grad_norm(group_, shards, all, device(), max_norm, norm_type);
  }
  /// The full parameters (copies, named as the module's, in its order) and buffers, gathered one
  /// unit at a time: a collective, and every rank gets them.
  std::vector<nn::Module::NamedTensor> full_state_dict() {
    return detail::fsdp_full_state_dict(nn::module_of(module_), units_);
  }

  /// While the returned guard lives, every unit's full parameters are in place, so the module
  /// can be used on its own (sampling, saving on one rank): PyTorch's summon_full_params, without
  /// writing back (changes to the parameters are not kept). Made by every rank (it gathers); the
  /// guard's end frees them. The whole model is then on every rank: for a state dict of a model
  /// too large for that, full_state_dict() gathers one unit at a time.
  class FullParams {
   public:
    FullParams(const FullParams&) = delete;
    FullParams& operator=(const FullParams&) = delete;
    ~FullParams() {
      shared_.summoned = false;
      for (auto* u : shared_.units) u->reshard();
    }

   private:
    friend class FullyShardedDataParallel;
    explicit FullParams(detail::FsdpShared& shared) : shared_(shared) {
      detail::finish_all_gradients(shared_);
      for (auto* u : shared_.units) u->unshard();
      shared_.summoned = true;
    }
    detail::FsdpShared& shared_;
  };
  /// PyTorch's summon_full_params(): a FullParams guard (a collective); throws while another one lives.
  [[nodiscard]] FullParams summon_full_params() {
    group_.check_usable("FullyShardedDataParallel::summon_full_params");
    CHORUS_CHECK(!shared_.summoned, "FullyShardedDataParallel::summon_full_params: already summoned");
    return FullParams(shared_);
  }

  /// Writes a checkpoint of the shards, `opt` (which steps parameters()) and what `with` names
  /// into directory `dir`, each rank its own files and rank 0 an index with `metadata` (the step,
  /// the data position in global samples, generator offsets): a collective that never gathers the
  /// model (Note [resharding checkpoints]).
  void save_sharded(const optim::Optimizer& opt, const std::string& dir, const io::TrainingState& with = {},
                    const io::Metadata& metadata = {}) {
    detail::save_fsdp_sharded(nn::module_of(module_), units_, group_, opt, dir, with, metadata);
  }
  /// Reads a checkpoint that save_sharded wrote, on this world or any other size, into the
  /// shards, `opt` and what `with` names; returns the metadata saved with it. Every rank calls it.
  io::Metadata load_sharded(optim::Optimizer& opt, const std::string& dir, const io::TrainingState& with = {}) {
    detail::finish_all_gradients(shared_);
    return detail::load_fsdp_sharded(nn::module_of(module_), units_, group_, opt, dir, with);
  }

  /// The wrapped module. Its parameters view no memory outside their unit's forward and backward
  /// (Note [unsharded parameter memory]); use it alone inside summon_full_params().
  ///@{
  M& module() { return module_; }
  const M& module() const { return module_; }
  ///@}
  /// Sets the module's training mode.
  void train(bool on = true) { nn::module_of(module_).train(on); }
  /// train(false).
  void eval() { train(false); }
  /// Clears (set_to_none, the default) or zeroes the gradients of this rank's shards (parameters()).
  void zero_grad(bool set_to_none = true) { parallel::detail::zero_shard_grads(parameters(), set_to_none); }
  /// The device of the module's parameters.
  Device device() const { return device_; }
  /// The process group the parameters are sharded over.
  ProcessGroup& process_group() const { return group_; }
  /// The units' names, the root ("") first, and how many parameter elements each holds.
  std::vector<std::pair<std::string, std::int64_t>> units() const {
    std::vector<std::pair<std::string, std::int64_t>> out;
    for (const auto& u : units_) out.emplace_back(u->name(), u->numel());
    return out;
  }

 private:
  template <class... Args>
  auto call(const Args&... args) {
    return nn::detail::call_as_graph_function(
        [this](const Args&... a) { return parallel::detail::call_forward(module_, a...); },
        [this](auto run, std::vector<AnyTensor> inputs, std::vector<AnyTensor>) {
          return detail::run_unit(units_.front(), std::move(run), std::move(inputs));
        },
        args...);
  }
  template <class A>
  decltype(auto) to_device(A&& a) const {
    if constexpr (parallel::detail::is_tensor_v<A>) return a.to(device());
    else return std::forward<A>(a);
  }

  M module_;
  ProcessGroup& group_;
  detail::ProcessShardGroup members_;  // the ranks of group_, for the units
  detail::FsdpShared shared_;
  std::vector<std::shared_ptr<detail::FsdpUnit>> units_;  // the root first
  Device device_;
};

}  // namespace CHORUS_DIST_NS
}  // namespace dist
CHORUS_NAMESPACE_END

#if !CHORUS_COMPILED
#include "fsdp_impl.hpp"
#endif
