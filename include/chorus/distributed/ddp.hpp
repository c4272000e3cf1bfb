#pragma once
// DistributedDataParallel: one process per device, gradients averaged over the process group
// (the buckets and graph nodes behind it: reducer.hpp, Notes [DDP buckets], [DDP graph nodes]).
#include <algorithm>
#include <array>
#include <cstddef>
#include <exception>
#include <functional>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <type_traits>
#include <unordered_set>
#include <vector>

#include "../compiled.hpp"
#include "../nn/module.hpp"
#include "../parallel/data_parallel.hpp"
#include "process_group.hpp"
#include "reducer.hpp"
#include "stats_reducer.hpp"
#include "zero_redundancy_optimizer.hpp"

CHORUS_NAMESPACE_BEGIN

namespace dist::detail {
// What DistributedDataParallel<M> does that does not depend on M (ddp_impl.hpp).

/// The constructor's work on the wrapped module `root` (bucket sizes already checked): checks
/// its devices (`device` gets the one), that every rank holds the same model, copies rank 0's
/// parameters and buffers to every rank; returns the Reducer over the trained parameters.
CHORUS_INLINE std::shared_ptr<Reducer> setup_ddp(nn::Module& root, const DistributedDataParallelOptions& options,
                                                 ProcessGroup& group, Device& device);
/// Checks that all ranks hold the same parameter and buffer names, dtypes and shapes.
CHORUS_INLINE void verify_same_model(ProcessGroup& group, const std::vector<nn::Module::NamedTensor>& params,
                                     const std::vector<nn::Module::NamedTensor>& buffers);
/// Copies rank `root`'s parameters (unless buffers_only) and buffers to every rank.
CHORUS_INLINE void sync_from(ProcessGroup& group, int root, const std::vector<nn::Module::NamedTensor>& params,
                             const std::vector<nn::Module::NamedTensor>& buffers, bool buffers_only);
/// One round of flags (Note [DDP join]); true while some rank still trains, whose highest rank
/// then goes to `last_joiner`.
CHORUS_INLINE bool join_round(ProcessGroup& group, bool training, int& last_joiner);
/// One Finalize node per dtype of the parameters (Note [DDP graph nodes]), by DType.
using FinalizeSlots = std::array<std::shared_ptr<void>, 5>;
/// Sets each trained parameter's grad_fn to a ParamReady node whose edge leads to the Finalize
/// node of its dtype (made once per forward in its slot of `finalize`); `ready_nodes` gets the
/// nodes, in parameter order.
CHORUS_INLINE void wire_params(const std::shared_ptr<Reducer>& reducer, Device device, FinalizeSlots& finalize,
                               std::vector<const void*>& ready_nodes);
/// Makes the trained parameters plain leaves again and drops the Finalize nodes.
CHORUS_INLINE void unwire_params(const Reducer& reducer, FinalizeSlots& finalize);
/// The current buckets, as lists of parameter names (first reduced first).
CHORUS_INLINE std::vector<std::vector<std::string>> bucket_names(const Reducer& reducer);
/// For shard_gradients: the owner of each of the reducer's parameters, from the optimizer's
/// parameters and their owners.
CHORUS_INLINE std::vector<int> gradient_owners(const Reducer& reducer, const std::vector<AnyTensor>& opt_params,
                                               const std::vector<int>& opt_owner);
}  // namespace dist::detail

/// PyTorch's DistributedDataParallel for one device per process: construction checks that every
/// rank holds the same parameters and copies rank 0's parameters and buffers everywhere;
/// backward averages the gradients over the ranks bucket by bucket, overlapped with the
/// backward pass (Notes [DDP buckets], [DDP graph nodes]).
template <class M>
class DistributedDataParallel {
 public:
  using Options = DistributedDataParallelOptions;  ///< the constructor's options

  /// Wraps `module` (all of whose tensors live on one device) for the process group `group`
  /// (default: dist::init()).
  explicit DistributedDataParallel(M module, Options options = {}, dist::ProcessGroup* group = nullptr)
      : module_(std::move(module)), options_(options), group_(group ? *group : dist::init()) {
    CHORUS_CHECK(options_.bucket_cap_bytes > 0 && options_.first_bucket_bytes > 0,
                 "DistributedDataParallel: bucket sizes must be positive");
    reducer_ = dist::detail::setup_ddp(nn::module_of(module_), options_, group_, device_);
    registered_ = nn::detail::registered_keys(nn::module_of(module_));
  }

  DistributedDataParallel(const DistributedDataParallel&) = delete;
  DistributedDataParallel& operator=(const DistributedDataParallel&) = delete;

  ~DistributedDataParallel() {
    // Destroyed by an exception in the middle of a reducing backward: the other ranks wait
    // for buckets this rank will never send; let the job end rather than hang (Note [watchdog]).
    if (reducer_ && reducer_->in_step() && std::uncaught_exceptions() > 0)
      group_.mark_broken("a rank left in the middle of a DistributedDataParallel backward pass");
  }

  /// Runs the module on this rank's batch (tensor arguments are moved to the module's device).
  template <class... Args>
  auto forward(Args&&... args) {
    group_.check_usable("DistributedDataParallel::forward");
    nn::detail::check_registry_unchanged(nn::module_of(module_), registered_, "DistributedDataParallel");
    if (joining_) {  // Note [DDP join]: this rank still trains
      CHORUS_CHECK(autograd::is_grad_enabled() && sync_ && nn::module_of(module_).is_training(),
                   "DistributedDataParallel::join: every forward inside join() must be a training step that "
                   "reduces gradients (not under no_sync(), NoGradGuard or eval()): the ranks that ran out of data "
                   "take part in one reducing step per forward of the others");
      join_round(true);
    }
    // A SyncBatchNorm normalises by the statistics of every rank's batch (Note [process
    // statistics reducer]).
    std::optional<StatsReducerScope> sync_bn;
    if (group_.world_size() > 1 && nn::module_of(module_).is_training() &&
        nn::module_of(module_).any_meets_other_replicas())
      sync_bn.emplace(std::make_shared<dist::detail::ProcessStatsReducer>(group_));
    if (options_.broadcast_buffers && group_.world_size() > 1) {
      auto& root = nn::module_of(module_);
      sync_from(joining_ ? last_joiner_ : 0, {}, root.named_buffers(), /*buffers_only=*/true);
    }
    const bool reduce = autograd::is_grad_enabled() && sync_ && !reducer_->params().empty();
    if (!reduce) {
      reducer_->disarm();
      return call(std::forward<Args>(args)...);
    }
    reducer_->prepare_step();
    Wiring wiring(*this);
    auto out = call(std::forward<Args>(args)...);
    int dtypes = 0;
    for (const auto& f : finalize_) dtypes += f != nullptr;
    wiring.restore();
    // The step ends with the last Finalize node backward runs: one per dtype it can reach
    // (Note [DDP graph nodes]); finding them walks the graph, needed only with several dtypes.
    if (options_.find_unused_parameters || dtypes > 1) dtypes = reachable_dtypes(out, options_.find_unused_parameters);
    reducer_->expect_finalizers(dtypes);
    return out;
  }
  /// Calls forward(args...).
  template <class... Args>
  auto operator()(Args&&... args) {
    return forward(std::forward<Args>(args)...);
  }

  /// While the returned guard lives, forward/backward accumulate gradients locally without
  /// reducing them; the first step after it reduces the accumulated sum (gradient accumulation).
  class NoSyncGuard {
   public:
    /// Turns off `d`'s gradient reduction until the guard is destroyed, which restores the previous setting.
    explicit NoSyncGuard(DistributedDataParallel& d) : d_(d), prev_(d.sync_) { d_.sync_ = false; }
    ~NoSyncGuard() { d_.sync_ = prev_; }
    NoSyncGuard(const NoSyncGuard&) = delete;
    NoSyncGuard& operator=(const NoSyncGuard&) = delete;

   private:
    DistributedDataParallel& d_;
    bool prev_;
  };
  /// PyTorch's no_sync(): a NoSyncGuard over this DistributedDataParallel.
  [[nodiscard]] NoSyncGuard no_sync() { return NoSyncGuard(*this); }

  /// Uneven inputs, PyTorch's `with Join([ddp, ...]): ...` (Note [DDP join]): runs `loop` (this
  /// rank's training loop over its own batches; every forward in it a training step), then,
  /// until every rank's loop has ended, takes part in the other ranks' steps with zero
  /// gradients, so that nobody waits for a collective a finished rank never starts. The gradients
  /// are averaged over the whole world (a finished rank adds zeros: PyTorch's
  /// divide_by_initial_world_size). `shadow_step`, when given, runs after each of those
  /// reductions, with the averaged gradients in grad() that the other ranks step with: pass the
  /// step the loop takes after backward (`[&] { opt.step(); sched.step(); }`). It is required
  /// with a ZeroRedundancyOptimizer, whose step is a collective too (join refuses to start
  /// without it), and it keeps every rank's optimizer state the same as the last rank's (a
  /// checkpoint then resumes bitwise whichever rank saved it). At the end every rank holds the
  /// parameters and buffers of the last rank to finish.
  template <class F, class S = std::nullptr_t>
  void join(F&& loop, S&& shadow_step = nullptr) {
    constexpr bool has_shadow = !std::is_null_pointer_v<std::decay_t<S>>;
    CHORUS_CHECK(!joining_, "DistributedDataParallel::join: already inside join()");
    if (group_.world_size() == 1) {
      std::forward<F>(loop)();
      return;
    }
    CHORUS_CHECK(!nn::module_of(module_).any_meets_other_replicas(),
                 "DistributedDataParallel::join: the module holds a SyncBatchNorm, whose statistics reductions a "
                 "rank that ran out of data cannot take part in");
    if constexpr (!has_shadow)
      CHORUS_CHECK(!group_.has_collective_step(parameters()),
                   "DistributedDataParallel::join: a ZeroRedundancyOptimizer steps this module's parameters, and its "
                   "step is a collective the ranks that ran out of data must take part in: pass the step, "
                   "ddp.join(loop, [&] { opt.step(); })");
    joining_ = true;
    last_joiner_ = -1;
    struct Reset {
      bool& joining;
      ~Reset() { joining = false; }
    } reset{joining_};
    std::forward<F>(loop)();
    while (join_round(false)) {
      if (options_.broadcast_buffers) {
        auto& root = nn::module_of(module_);
        sync_from(last_joiner_, {}, root.named_buffers(), /*buffers_only=*/true);
      }
      reducer_->shadow_step();
      if constexpr (has_shadow) shadow_step();
    }
    joining_ = false;
    if (last_joiner_ >= 0) {
      auto& root = nn::module_of(module_);
      sync_from(last_joiner_, root.named_parameters(), root.named_buffers(), /*buffers_only=*/false);
    }
  }

  /// The wrapped module: save() of the wrapper or of module() writes the plain module's keys.
  ///@{
  M& module() { return module_; }
  const M& module() const { return module_; }
  ///@}
  /// The module's parameters.
  std::vector<AnyTensor> parameters() const { return nn::module_of(module_).parameters(); }
  /// The module's parameters with their dotted names (no prefix).
  std::vector<nn::Module::NamedTensor> named_parameters() const { return nn::module_of(module_).named_parameters(); }
  /// Sets the module's training mode.
  void train(bool on = true) { nn::module_of(module_).train(on); }
  /// train(false).
  void eval() { train(false); }
  /// Clears (set_to_none, the default) or zeroes the gradients of the module's parameters.
  void zero_grad(bool set_to_none = true) { nn::module_of(module_).zero_grad(set_to_none); }
  /// The device the module's tensors live on, where forward moves tensor arguments.
  Device device() const { return device_; }
  /// The process group the gradients are averaged over.
  dist::ProcessGroup& process_group() const { return group_; }

  /// PyTorch's register_comm_hook with one of its built-in hooks (Note [DDP communication
  /// hooks]): once, before the first forward that reduces gradients.
  void register_comm_hook(dist::CommHook hook) { reducer_->set_comm_hook(hook); }

  /// ZeRO-2 (Note [ZeRO-2 over the process group]): each gradient bucket is reduced to the rank
  /// that owns its parameters in `opt` (a ZeroRedundancyOptimizer over this module's parameters)
  /// and freed elsewhere, so after backward a rank keeps its own parameters' gradients only.
  /// Every rank calls it, before the first forward that reduces gradients. Clip with
  /// opt.clip_grad_norm_ (nn::utils::clip_grad_norm_ refuses: it would see this rank's shard
  /// only); GradScaler works as it is.
  template <class O>
  void shard_gradients(const dist::ZeroRedundancyOptimizer<O>& opt) {
    CHORUS_CHECK(&opt.process_group() == &group_, "DistributedDataParallel::shard_gradients: the optimizer works in "
                                                  "another process group than this DistributedDataParallel");
    std::vector<int> owner(opt.parameters().size());
    for (std::size_t j = 0; j < owner.size(); ++j) owner[j] = opt.owner(j);
    reducer_->shard(dist::detail::gradient_owners(*reducer_, opt.parameters(), owner));
  }

  /// The current buckets, as lists of parameter names (first reduced first).
  std::vector<std::vector<std::string>> bucket_names() const { return dist::detail::bucket_names(*reducer_); }
  /// True once the buckets were re-made from the observed gradient order.
  bool buckets_rebuilt() const { return reducer_->rebuilt(); }
  /// How many buckets of the last step started their all-reduce before backward had produced
  /// every gradient (overlapping it); all but the last, when the order is right.
  std::size_t buckets_started_early() const { return reducer_->early_launches(); }

 private:
  template <class... Args>
  auto call(Args&&... args) {
    const profiler::Scope span(profiler::Category::forward, "forward");
    const nn::detail::RootFrame root(nn::module_of(module_));  // its layers by their names (Note [layer spans])
    return parallel::detail::call_forward(module_, to_device(std::forward<Args>(args))...);
  }
  template <class A>
  decltype(auto) to_device(A&& a) const {
    if constexpr (parallel::detail::is_tensor_v<A>) return a.to(device_);
    else return std::forward<A>(a);
  }

  /// Sets each trained parameter's grad_fn to a ParamReady node for the length of forward.
  struct Wiring {
    explicit Wiring(DistributedDataParallel& d) : d_(d) {
      dist::detail::wire_params(d_.reducer_, d_.device_, d_.finalize_, d_.ready_nodes_);
    }
    void restore() {
      if (restored_) return;
      restored_ = true;
      dist::detail::unwire_params(*d_.reducer_, d_.finalize_);
    }
    ~Wiring() { restore(); }
    DistributedDataParallel& d_;
    bool restored_ = false;
  };

  /// How many dtypes of parameters the outputs' graph reaches; with `mark`
  /// (find_unused_parameters) the parameters it cannot reach are marked unused.
  template <class R>
  int reachable_dtypes(const R& out, bool mark) {
    std::unordered_set<const void*> seen;
    auto visit_tensor = [&](const auto& t) {
      using T = typename std::decay_t<decltype(t)>::value_type;
      if constexpr (is_floating_v<T>)
        if (t.defined() && t.grad_fn())
          dist::detail::reachable(std::vector<std::shared_ptr<autograd::NodeBase>>{t.grad_fn()}, seen);
    };
    if constexpr (parallel::detail::is_tensor_v<R>) visit_tensor(out);
    else std::apply([&](const auto&... t) { (visit_tensor(t), ...); }, out);
    std::array<bool, 5> reached{};
    for (std::size_t i = 0; i < ready_nodes_.size(); ++i) {
      if (seen.count(ready_nodes_[i])) reached[static_cast<std::size_t>(reducer_->params()[i].tensor.dtype())] = true;
      else if (mark) reducer_->set_unused(i);
    }
    return static_cast<int>(std::count(reached.begin(), reached.end(), true));
  }

  // Note [DDP join]
  // PyTorch's Join for DDP. Inside join(), every forward of a rank that still has data starts
  // with an all-gather of one flag per rank (1: still training); a rank whose loop has ended
  // answers each such round with 0 and then runs the step's collectives with zero gradients
  // (Reducer::shadow_step, which leaves the averaged gradients in grad() as a real step does),
  // then the caller's shadow step (its optimizer's), until a round finds every flag 0. The
  // flags also name the last rank to finish (the highest rank still training): buffers come
  // from it while the others join, and its parameters and buffers go to every rank at the end
  // (without a shadow step the finished ranks skipped the optimizer steps of the rounds they
  // shadowed). An optimizer whose step is a collective (ZeroRedundancyOptimizer) notes its
  // parameters in the process group, so a join that could not take part in it refuses to
  // start. One all-gather of a flag per step is the cost.
  /// One round of flags; true while some rank still trains.
  bool join_round(bool training) { return dist::detail::join_round(group_, training, last_joiner_); }

  /// Copies rank `root`'s parameters (unless buffers_only) and buffers to every rank.
  void sync_from(int root, const std::vector<nn::Module::NamedTensor>& params,
                 const std::vector<nn::Module::NamedTensor>& buffers, bool buffers_only) {
    dist::detail::sync_from(group_, root, params, buffers, buffers_only);
  }

  M module_;
  Options options_;
  dist::ProcessGroup& group_;
  Device device_;
  std::shared_ptr<dist::detail::Reducer> reducer_;
  std::vector<const void*> registered_;  // the module's tensors when built (Note [tied parameters])
  std::vector<const void*> ready_nodes_;
  dist::detail::FinalizeSlots finalize_;
  bool sync_ = true;
  bool joining_ = false;  // inside join() (Note [DDP join])
  int last_joiner_ = -1;  // the highest rank still training in the latest round
};

CHORUS_NAMESPACE_END

// The definitions: compiled into chorus::compiled and the MPI library, or here in the
// header-only form (Note [compiled chorus] in compiled.hpp).
#if !CHORUS_COMPILED
#include "ddp_impl.hpp"
#endif
