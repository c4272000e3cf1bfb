#pragma once
// parallel::FullyShardedDataParallel: ZeRO stage 3 in one process over several devices, the
// DataParallel form of dist::FullyShardedDataParallel. Each device keeps 1/N of every unit's
// parameters, gradients and optimizer state; a unit's parameters are gathered on every device
// for its forward and its backward only.
//
//   struct Net : nn::Module {
//     std::vector<parallel::FullyShard<nn::TransformerEncoderLayer>> blocks;  // a unit each
//     nn::Linear head;                                                        // the root's
//     ...
//   };
//   parallel::FullyShardedDataParallel<Net> model(Net(...), {.devices = available_devices()});
//   optim::AdamW opt(model.parameters(), {.lr = 3e-4});  // every device's shards, each stepped there
//   auto loss = nn::functional::cross_entropy(model(x), y);
//   loss.backward();                                     // gradients summed into each device's shards
//   nn::utils::clip_grad_norm_(model.parameters(), 1.0);  // the norm over every device
//   opt.step();
//
// Note [fully sharded replicas]
// - Replica r (0: the wrapped module itself) is a copy of the module on devices[r] whose
//   parameters view no memory (Note [unsharded parameter memory]); its units (the FullyShard
//   modules inside and the root, Note [fully sharded parameters]) keep the shard of device r.
//   The replicas are the members of the units' ShardGroup: they meet at each collective through
//   the step's ReplicaStatsGroup (two barriers, as SyncBatchNorm's statistics), so a gather copies
//   every device's shard into each device's full buffer and a reduce-scatter sums, in replica
//   order, each replica's slice of the unit's gradient into the device that holds the shard. The
//   units are built the same way, every replica on its device's worker (replica 0's values
//   broadcast to the others); the module's own parameter memory is freed once all are built.
// - A forward splits the batch along dim into as many chunks as devices, as even as they come
//   (every device holds a shard and takes part in every collective, so every device gets rows:
//   a batch with fewer rows than devices is refused), runs the replicas at once (replica 0 on
//   the calling thread, the others on their devices' workers) and gathers the outputs on the
//   output device. Backward runs each replica's half of the graph on its device; the units
//   meet in the same order there, as in forward. Dropout draws as over the whole batch on one
//   device (Note [dropout random numbers]); buffers (BatchNorm's running statistics) are the
//   primary's, copied to the replicas before each forward, as DataParallel's.
// - parameters() are every device's shards, each a leaf on its device: a plain optimizer steps
//   each where it lies, and nn::utils::clip_grad_norm_ and GradScaler see every gradient of the
//   model (all are in this process). The destructor gives the module its whole parameters back.
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "../compiled.hpp"
#include "data_parallel.hpp"
#include "fully_shard.hpp"
#include "shard_checkpoint.hpp"

CHORUS_NAMESPACE_BEGIN
namespace parallel {

/// How a parallel::FullyShardedDataParallel splits and shards: `{.devices = ..., .shard_dtype = DType::Float32}`.
struct FullyShardedDataParallelOptions {
  std::vector<Device> devices = {};                    ///< default: all GPUs, else the virtual CPU devices
  std::optional<Device> output_device = std::nullopt;  ///< default: devices[0]
  std::int64_t dim = 0;                                ///< the dim inputs are split and outputs joined along
  /// The dtype of the shards, their gradients and so the optimizer state, where wider than the
  /// module's (Note [sharded master weights]).
  std::optional<DType> shard_dtype = std::nullopt;
};

namespace detail {
/// Replica `rank` of a one-process FullyShardedDataParallel as a member of its units' group
/// (Note [fully sharded replicas]); `step` is the rendezvous of the step under way.
class ReplicaShardGroup final : public ShardGroup {
 public:
  ReplicaShardGroup(int rank, int size) : rank_(rank), size_(size) {}
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  bool spans_processes() const override { return false; }
  CHORUS_INLINE void broadcast(const AnyTensor& t) override;
  CHORUS_INLINE Pending all_gather(const AnyTensor& full, const AnyTensor& part, const std::string& what) override;
  CHORUS_INLINE Pending reduce_scatter(const AnyTensor& part, const AnyTensor& full, const std::string& what) override;

  std::shared_ptr<ReplicaStatsGroup> step;

 private:
  int rank_, size_;
};

/// The CloneScope that makes a replica on `device`: the parameters (`params`, by impl key)
/// become tensors of their shape that view no memory (their unit gives them memory); anything
/// else is deep-copied to `device`.
class ShardReplicaScope final : public CloneScope {
 public:
  ShardReplicaScope(Device device, const std::unordered_set<const void*>& params) : device_(device), params_(params) {}

 protected:
  CHORUS_INLINE std::shared_ptr<void> copy_tensor(const void* impl, DType dtype) override;

 private:
  Device device_;
  const std::unordered_set<const void*>& params_;
};

/// save_sharded of a one-process FullyShardedDataParallel: a member per replica (units[r]).
CHORUS_INLINE void save_replica_shards(const std::vector<std::vector<std::shared_ptr<FsdpUnit>>>& units,
                                       const std::vector<nn::Module::NamedTensor>& buffers,
                                       const optim::Optimizer& opt, const std::string& dir,
                                       const io::TrainingState& with, const io::Metadata& metadata);
/// load_sharded of a one-process FullyShardedDataParallel; returns the saved metadata.
CHORUS_INLINE io::Metadata load_replica_shards(const std::vector<std::vector<std::shared_ptr<FsdpUnit>>>& units,
                                               const std::vector<nn::Module::NamedTensor>& buffers,
                                               optim::Optimizer& opt, const std::string& dir,
                                               const io::TrainingState& with);
/// Rows per device for a batch of `batch` over `devices`: as even as they come, every device some.
CHORUS_INLINE ChunkPlan even_chunks(std::int64_t batch, std::size_t devices);
/// The flat parameter of unit `u` (the units[r][u] of every replica) put together from every
/// replica's shard, in the unit's dtype, on `device`.
CHORUS_INLINE AnyTensor whole_flat(const std::vector<std::vector<std::shared_ptr<FsdpUnit>>>& units, std::size_t u,
                                   Device device);
}  // namespace detail

/// ZeRO-3 over one process's devices (Note [fully sharded replicas]): the module's FullyShard
/// submodules are units of their own and the rest of its parameters the root unit; device r
/// keeps shard r of each, and the optimizer steps those (parameters()).
template <class M>
class FullyShardedDataParallel : public DataParallelCore {
 public:
  using Options = FullyShardedDataParallelOptions;  ///< the constructor's options

  /// Shards `module` (on devices[0]) over `options.devices`.
  explicit FullyShardedDataParallel(M module, Options options = {})
      : DataParallelCore(DataParallelOptions{
            .devices = std::move(options.devices), .output_device = options.output_device, .dim = options.dim}),
        module_(std::move(module)) {
    nn::Module& root = nn::module_of(module_);
    CHORUS_CHECK(module_on(root, devices_[0]), "FullyShardedDataParallel: the module is not on the primary device ",
                 devices_[0], "; move it there first (module->to(", devices_[0], "))");
    install_links(link(devices_), /*has_buffers=*/false, /*meets_other_replicas=*/true);
    build(options.shard_dtype);
  }
  /// Gives the module its whole parameters back, so that it works on its own afterwards.
  ~FullyShardedDataParallel() {
    if (units_.empty() || units_[0].empty()) return;
    try {
      for (std::size_t u = 0; u < units_[0].size(); ++u)
        units_[0][u]->install(detail::whole_flat(units_, u, devices_[0]));
    } catch (...) {  // a destructor must not throw: the module then holds no parameters
    }
    for (std::size_t r = 0; r < units_.size(); ++r) detail::unlink_units(replica_root(r), units_[r]);
  }
  FullyShardedDataParallel(const FullyShardedDataParallel&) = delete;
  FullyShardedDataParallel& operator=(const FullyShardedDataParallel&) = delete;

  /// Splits the tensors of the arguments along dim (one chunk per device), runs the replicas and
  /// gathers their outputs on the output device, as DataParallel::forward.
  template <class... Args>
  auto forward(Args&&... args) {
    (detail::check_argument<Args>(), ...);
    check_not_nested();
    const InUse in_use(in_forward_);
    const auto split = split_size(args...);
    const std::size_t n = devices_.size();
    CHORUS_CHECK(split.batch >= static_cast<std::int64_t>(n), "FullyShardedDataParallel: ",
                 split.batch < 0 ? std::string("a forward without a tensor to split") :
                                   "a batch of " + std::to_string(split.batch) + " rows",
                 " over ", n, " devices; every device holds a shard and takes part in each step, so each needs at "
                 "least one row");
    random_dim_ = split.dim;
    const auto plan = detail::even_chunks(split.batch, n);
    using R = std::remove_cvref_t<decltype(call_replica(0, plan, args...))>;
    detail::check_output<R>();
    copy_buffers();
    fork_replica_streams();
    keep_workers_hot(n);
    auto random = std::make_shared<ReplicaRandomGroup>();  // Note [dropout random numbers]
    auto outs = run_replicas<R>([&](std::size_t r) {
      ReplicaRandomScope rs(random, static_cast<int>(r), random_dim_, plan.offsets[r], plan.sizes[r], split.batch);
      return call_replica(r, plan, args...);
    });
    return detail::gather_outputs(outs, gather_dims_, dim_, output_device_);
  }
  /// Calls forward(args...).
  template <class... Args>
  auto operator()(Args&&... args) {
    return forward(std::forward<Args>(args)...);
  }

  /// Every device's shards: for each unit with parameters (the root's first), its shard on
  /// devices[0], devices[1], ...; what the optimizer steps.
  std::vector<AnyTensor> parameters() const {
    std::vector<AnyTensor> out;
    for (const auto& n : named_parameters()) out.push_back(n.tensor);
    return out;
  }
  /// The shards, named by their unit and replica ("flat_param.0", "<unit>.flat_param.1", ...).
  std::vector<nn::Module::NamedTensor> named_parameters() const {
    std::vector<nn::Module::NamedTensor> out;
    for (std::size_t u = 0; u < units_[0].size(); ++u)
      for (std::size_t r = 0; r < units_.size(); ++r)
        if (!units_[r][u]->empty())
          out.push_back({units_[r][u]->shard_name() + "." + std::to_string(r), units_[r][u]->shard()});
    return out;
  }
  /// The whole parameters (copies, named as the module's, in its order, on devices[0]) and the
  /// module's buffers, put together one unit at a time.
  std::vector<nn::Module::NamedTensor> full_state_dict() const {
    NoGradGuard ng;
    std::unordered_map<const void*, AnyTensor> copies;
    for (std::size_t u = 0; u < units_[0].size(); ++u) {
      const auto& unit = *units_[0][u];
      if (unit.empty()) continue;
      const AnyTensor flat = detail::whole_flat(units_, u, devices_[0]);
      for (std::size_t i = 0; i < unit.params().size(); ++i)
        flat.visit([&](const auto& f) {
          const auto& p = unit.params()[i];
          copies.emplace(p.impl_key(), AnyTensor(detail::flat_part(f, unit.offsets()[i], p.numel(), p.shape()).clone()));
        });
    }
    std::vector<nn::Module::NamedTensor> out;
    for (const auto& [name, t] : nn::module_of(module_).named_parameters()) out.push_back({name, copies.at(t.impl_key())});
    for (const auto& b : nn::module_of(module_).named_buffers())
      b.tensor.visit([&](const auto& x) { out.push_back({b.name, AnyTensor(x.detach().clone())}); });
    return out;
  }

  /// Writes a checkpoint of every device's shards, `opt` (which steps parameters()) and what
  /// `with` names into directory `dir`: a model and an optimizer file per device and an index
  /// with `metadata`, never the whole model at once, in the files of
  /// dist::FullyShardedDataParallel::save_sharded with a device for a rank (Note [resharding
  /// checkpoints]).
  void save_sharded(const optim::Optimizer& opt, const std::string& dir, const io::TrainingState& with = {},
                    const io::Metadata& metadata = {}) const {
    detail::save_replica_shards(units_, nn::module_of(module_).named_buffers(), opt, dir, with, metadata);
  }
  /// Reads a checkpoint that save_sharded wrote over any number of devices into the shards, `opt`
  /// and what `with` names; returns the metadata saved with it. Nothing changes on a mismatch.
  io::Metadata load_sharded(optim::Optimizer& opt, const std::string& dir, const io::TrainingState& with = {}) {
    return detail::load_replica_shards(units_, nn::module_of(module_).named_buffers(), opt, dir, with);
  }

  /// The wrapped module (replica 0). Its parameters view no memory outside their unit's forward
  /// and backward; full_state_dict() has their values.
  ///@{
  M& module() { return module_; }
  const M& module() const { return module_; }
  ///@}
  /// Sets training mode in the module and every replica.
  void train(bool on = true) {
    for (std::size_t r = 0; r < units_.size(); ++r) replica_root(r).train(on);
  }
  /// train(false).
  void eval() { train(false); }
  /// Whether the module is in training mode.
  bool is_training() const { return nn::module_of(module_).is_training(); }
  /// Clears (set_to_none, the default) or zeroes the gradients of every device's shards (parameters()).
  void zero_grad(bool set_to_none = true) { parallel::detail::zero_shard_grads(parameters(), set_to_none); }
  /// The units' names, the root ("") first, and how many parameter elements each holds.
  std::vector<std::pair<std::string, std::int64_t>> units() const {
    std::vector<std::pair<std::string, std::int64_t>> out;
    for (const auto& u : units_[0]) out.emplace_back(u->name(), u->numel());
    return out;
  }

 private:
  nn::Module& replica_root(std::size_t r) const {
    return r == 0 ? nn::module_of(const_cast<M&>(module_)) : nn::module_of(*replicas_[r - 1]);
  }
  M& replica(std::size_t r) { return r == 0 ? module_ : *replicas_[r - 1]; }

  /// Makes the replicas and their units (Note [fully sharded replicas]). If anything fails, the
  /// module keeps its parameters.
  void build(std::optional<DType> shard_dtype) {
    const std::size_t n = devices_.size();
    std::unordered_set<const void*> params;
    for (const auto& p : nn::module_of(module_).parameters()) params.insert(p.impl_key());
    for (std::size_t r = 1; r < n; ++r)
      replicas_.push_back(std::make_unique<M>(nn::detail::copy_checked(
          module_, [&] { return std::make_unique<detail::ShardReplicaScope>(devices_[r], params); })));
    for (std::size_t r = 0; r < n; ++r) {
      members_.push_back(std::make_unique<detail::ReplicaShardGroup>(static_cast<int>(r), static_cast<int>(n)));
      shared_.push_back(std::make_unique<detail::FsdpShared>());
      shared_[r]->group = members_[r].get();
      shared_[r]->prefetch = false;  // the gathers are copies on the host's schedule: nothing to overlap
      shared_[r]->shard_dtype = shard_dtype;
    }
    const auto saved = save_tensors(nn::module_of(module_));
    units_.resize(n);
    try {
      run_replicas<int>([&](std::size_t r) {
        units_[r] = detail::make_units(replica_root(r), *shared_[r]);
        return 0;
      });
    } catch (...) {
      for (std::size_t r = 0; r < n; ++r) detail::unlink_units(replica_root(r), units_[r]);
      units_.clear();
      restore_tensors(saved);
      throw;
    }
  }

  /// fn(r) for every replica at once, under this step's rendezvous (Note [fully sharded
  /// replicas]), which also serves SyncBatchNorm layers; a failing replica releases the others.
  template <class R, class F>
  std::vector<R> run_replicas(F&& fn) {
    const std::size_t n = devices_.size();
    auto step = std::make_shared<ReplicaStatsGroup>(static_cast<int>(n));
    for (auto& m : members_) m->step = step;
    std::vector<Stream*> streams(streams_.begin(), streams_.end());
    streams[0] = &current_stream(devices_[0]);
    return parallel_apply(streams, [&](std::size_t r) -> R {
      StatsReducerScope sync(step->member(static_cast<int>(r)));
      try {
        return fn(r);
      } catch (...) {
        step->cancel(static_cast<int>(r));  // the others stop waiting for it (Note [cancelled reductions])
        throw;
      }
    });
  }

  template <class... Args>
  detail::SplitSize split_size(const Args&... args) const {
    detail::SplitMeasure measure("FullyShardedDataParallel", "argument", "scatter_dims", detail::SplitMeasure::Numbered);
    std::size_t i = 0;
    ((measure.add(args, i, scatter_dim(i), false), ++i), ...);
    return measure.size();
  }

  /// Replica r's forward on its rows of each argument, the root unit gathered around it.
  template <class... Args>
  auto call_replica(std::size_t r, const ChunkPlan& plan, const Args&... args) {
    return [&]<std::size_t... I>(std::index_sequence<I...>) {
      return run_root(r, detail::scatter_part(args, scatter_dim(I), plan.offsets[r], plan.sizes[r], devices_[r])...);
    }(std::index_sequence_for<Args...>{});
  }
  template <class... Parts>
  auto run_root(std::size_t r, const Parts&... parts) {
    M& m = replica(r);
    return nn::detail::call_as_graph_function(
        [&m](const Parts&... a) { return detail::call_forward(m, a...); },
        [this, r](auto run, std::vector<AnyTensor> inputs, std::vector<AnyTensor>) {
          return detail::run_unit(units_[r].front(), std::move(run), std::move(inputs));
        },
        parts...);
  }

  /// The primary's buffers into every replica's (Note [fully sharded replicas]).
  void copy_buffers() {
    const auto mine = nn::module_of(module_).buffers();
    if (mine.empty()) return;
    NoGradGuard ng;
    for (std::size_t r = 1; r < devices_.size(); ++r) {
      const auto theirs = replica_root(r).buffers();
      for (std::size_t k = 0; k < mine.size(); ++k)
        mine[k].visit([&](const auto& src) {
          using T = typename std::decay_t<decltype(src)>::value_type;
          const auto& dst = theirs[k].template as<T>();
          backend::copy(dst, src.to(dst.device()));
        });
    }
  }

  M module_;
  std::vector<std::unique_ptr<M>> replicas_;  // replica r at r - 1
  std::vector<std::unique_ptr<detail::ReplicaShardGroup>> members_;
  std::vector<std::unique_ptr<detail::FsdpShared>> shared_;
  std::vector<std::vector<std::shared_ptr<detail::FsdpUnit>>> units_;  // [replica][unit], the root first
};

}  // namespace parallel
CHORUS_NAMESPACE_END

#if !CHORUS_COMPILED
#include "fully_sharded_data_parallel_impl.hpp"
#endif
