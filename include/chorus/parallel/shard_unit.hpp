#pragma once
// The machinery behind both FullyShardedDataParallels (ZeRO-3): a unit's flat parameter sharded
// over the members of a ShardGroup (the ranks of a process group for dist::FullyShardedDataParallel,
// the devices of one process for parallel::FullyShardedDataParallel), gathered around the unit's
// forward and backward, and the graph node that runs the unit's backward between a gather and a
// reduce-scatter. Below, "rank" is a member of the group.
//
// Note [fully sharded parameters]
// ZeRO stage 3 (PyTorch's FSDP): every rank keeps 1/world of each unit's parameters, gradients
// and optimizer state.
// - A unit (a FullyShard module, or the root: the parameters no unit holds) lays its
//   parameters out in one flat buffer of one dtype, padded to a multiple of the world size;
//   rank r keeps elements [r·S, r·S + S) as its shard, a 1-D leaf that requires grad: the tensor
//   the optimizer steps (FullyShardedDataParallel::parameters()). Any optimizer whose update is
//   elementwise (SGD, Adam, AdamW, ...) then takes the same step on each element as over the
//   whole parameters; the padding stays zero.
// - Before the unit's forward the shards are all-gathered into a full flat buffer, and the
//   unit's parameters are made to view it (Note [unsharded parameter memory]); after forward the
//   buffer is freed. The unit's forward becomes one graph node (FullyShardBackward), which keeps
//   the unit's own graph and activations, as the plain graph would; in backward it gathers the
//   parameters again, runs the unit's graph (autograd::detail::grad_at, up to the unit's inputs,
//   its parameters and whatever else it read), reduce-scatters the parameters' gradients (the
//   mean over ranks, as DDP; the sum over one process's replicas, as DataParallel) into this
//   rank's shard of the flat gradient, and frees the buffer.
//   A unit's reduce-scatter runs while the next unit computes its backward and is waited for
//   (its full-size input freed) before that unit's starts; its result is added to the shard's
//   grad(), so repeated backward passes accumulate, as plain ones. The root's node, which runs
//   last, waits for the last one.
// - Prefetch: the order in which units ran forward is recorded; in forward a unit's gather
//   starts the next unit's, in backward it starts the previous unit's, so that communication
//   runs while the unit computes. At most two units are gathered at a time, besides the root,
//   which stays gathered from its forward to the end of its backward.
// - Every rank must run the units in the same order (the collectives are matched by order),
//   and a parameter must be used only by the unit that holds it: a weight tied between two
//   units, or between a unit and the root, is refused at construction.
//
// Note [sharded master weights]
// Mixed precision (PyTorch's MixedPrecision(param_dtype=bf16) over fp32 parameters): a module
// built in bfloat16 or half computes in it, while FullyShardedDataParallelOptions::shard_dtype
// (float32) keeps the shards, their gradients and so the optimizer state in float32. A gather
// rounds this rank's shard to the parameters' dtype and all-gathers that (half the bytes of
// float32); the gradients are reduce-scattered in the parameters' dtype (summed in float on each
// rank's side: Note [16-bit sums over MPI]) and widened into the float32 gradient of the shard. So
// updates smaller than a 16-bit step accumulate in the shards, as with amp's master weights; a
// rank holds 16/N bytes a parameter for the float32 shards, their gradients and Adam's moments,
// and 2 bytes a parameter of the units it has gathered.
//
// Note [unsharded parameter memory]
// A unit's parameters keep their identity (the module, the optimizer's view of the module, the
// nodes that saved them all hold the same TensorImpl) but their storage is a slice of the unit's
// flat buffer that is moved (StorageImpl::reseat_slice) onto each newly gathered buffer and off
// it when the buffer is freed (PyTorch resizes the storage to zero for the same purpose). A node
// of the unit's graph that saved a parameter, or a view of it, therefore reads the gathered
// values again in backward, and between the unit's forward and backward its memory is not held.
// Between uses a parameter views no memory: reading it outside its unit's forward and backward
// (rather than through FullyShardedDataParallel::full_state_dict) is an error of the program.
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "../autograd/checkpoint.hpp"
#include "../compiled.hpp"
#include "../nn/module.hpp"

CHORUS_NAMESPACE_BEGIN
namespace parallel::detail {

class FsdpUnit;

/// Waits for a collective a ShardGroup started (empty: nothing to wait for).
using Pending = std::function<void()>;

/// The members a unit's shards are spread over, and the collectives a unit needs from them
/// (Note [fully sharded parameters]): the ranks of a process group (dist::FullyShardedDataParallel)
/// or the replicas of one process, one per device (parallel::FullyShardedDataParallel). Every
/// member calls the collectives in the same order.
class ShardGroup {
 public:
  virtual ~ShardGroup() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  /// The members are processes: a shard's gradient is then this process's part of the model's
  /// only (norms and inf checks need the group), as TensorImpl::grad_is_shard says.
  virtual bool spans_processes() const = 0;
  /// t = member 0's t, in place (a unit's first values).
  virtual void broadcast(const AnyTensor& t) = 0;
  /// Starts full = every member's `part`, in member order (full has size() · part's elements).
  virtual Pending all_gather(const AnyTensor& full, const AnyTensor& part, const std::string& what) = 0;
  /// Starts part = this member's slice of the members' `full`s combined: the mean over ranks
  /// (DDP's gradient), the sum over one process's replicas (DataParallel's).
  virtual Pending reduce_scatter(const AnyTensor& part, const AnyTensor& full, const std::string& what) = 0;
};

/// The contiguous elements [start, start + n) of a flat tensor, shaped `shape`.
template <class T>
Tensor<T> flat_part(const Tensor<T>& flat, std::int64_t start, std::int64_t n, const Shape& shape) {
  return flat.narrow(0, start, n).view(shape);
}

/// What the units of one FullyShardedDataParallel (one replica's, in one process) share: the
/// group, the forward order and the reduce-scatters in flight (Note [fully sharded parameters]).
struct FsdpShared {
  ShardGroup* group = nullptr;
  bool prefetch = true;
  std::optional<DType> shard_dtype;  // the shards' dtype, where not the parameters'
  std::vector<FsdpUnit*> order;      // the units in the order the last forward ran them
  std::vector<FsdpUnit*> recording;  // this forward's
  std::vector<FsdpUnit*> reducing;   // reduce-scatters in flight, in the order they started
  std::unordered_map<const void*, FsdpUnit*> holder;  // a sharded parameter's unit, by impl key
  std::vector<FsdpUnit*> units;                       // all of them, the root first
  bool summoned = false;  // summon_full_params: every unit stays gathered
};

/// One unit: its parameters, their flat shard on this rank, and the full buffer while gathered.
class FsdpUnit {
 public:
  /// Lays out `params` (named, one floating dtype, contiguous, on one device), copies rank 0's
  /// values to every rank, keeps this rank's shard and frees the rest.
  CHORUS_INLINE FsdpUnit(std::string name, const std::vector<nn::Module::NamedTensor>& params, FsdpShared& shared,
                         bool root);
  FsdpUnit(const FsdpUnit&) = delete;
  FsdpUnit& operator=(const FsdpUnit&) = delete;

  const std::string& name() const { return name_; }
  bool is_root() const { return root_; }
  /// Its shard's name: "flat_param" for the root's, "<unit>.flat_param" (parameters(), files).
  std::string shard_name() const { return root_ ? "flat_param" : name_ + ".flat_param"; }
  bool empty() const { return params_.empty(); }
  /// Its parameters train (and so its shard): a frozen unit reduces no gradients.
  bool trains() const { return !empty() && shard_.visit([](const auto& s) { return s.requires_grad(); }); }
  /// Its FullyShardedDataParallel is gone: a graph recorded before cannot run backward.
  bool released() const { return released_; }
  void release() { released_ = true; }
  /// This rank's part of the flat parameter (undefined for a unit without parameters).
  const AnyTensor& shard() const { return shard_; }
  const std::vector<AnyTensor>& params() const { return params_; }
  const std::vector<std::string>& param_names() const { return names_; }
  /// Where each parameter starts in the flat buffer, in elements.
  const std::vector<std::int64_t>& offsets() const { return offsets_; }
  DType dtype() const { return dtype_; }
  DType shard_dtype() const { return shard_dtype_; }
  FsdpShared& shared() const { return shared_; }
  bool gathered() const { return block_ != nullptr; }
  /// Elements of the flat parameter (unpadded), and of one rank's shard.
  std::int64_t numel() const { return numel_; }
  std::int64_t shard_numel() const { return shard_numel_; }

  /// Starts gathering the full parameters (a prefetch); nothing when gathered or gathering.
  CHORUS_INLINE void start_unshard();
  /// The full parameters are in place once this returns (waits for the gather in flight).
  CHORUS_INLINE void unshard();
  /// Frees the full parameters (waits for a gather in flight first); not while summoned.
  CHORUS_INLINE void reshard();
  /// Puts `full` (the whole flat parameter: the unit's dtype, on its device, size() shards long)
  /// in place as the gathered parameters until the next reshard: unshard()'s second half, and
  /// how a one-process FullyShardedDataParallel hands the module its parameters back.
  CHORUS_INLINE void install(AnyTensor full);
  /// Starts the reduce-scatter of the unit's gradients (grads[i] for params()[i]; undefined: zero).
  CHORUS_INLINE void reduce_gradients(std::vector<AnyTensor> grads);
  /// Waits for the reduce-scatter in flight and adds this rank's part to shard().grad().
  CHORUS_INLINE void finish_gradients();

  /// Forward bookkeeping (Note [fully sharded parameters]): notes the unit in the forward order
  /// and starts the next unit's gather.
  CHORUS_INLINE void entered_forward();
  /// After the unit's forward: the root's ends the step's forward order.
  CHORUS_INLINE void left_forward();
  /// Backward: starts the gather of the unit that ran forward before this one.
  CHORUS_INLINE void prefetch_previous();

 private:
  std::string name_;
  FsdpShared& shared_;
  bool root_;
  bool released_ = false;
  std::vector<AnyTensor> params_;
  std::vector<std::string> names_;
  std::vector<std::int64_t> offsets_;  // in the flat buffer, in elements
  DType dtype_ = DType::Float32;        // the parameters': what forward and backward compute in
  DType shard_dtype_ = DType::Float32;  // the shards' (and the optimizer's): Note [sharded master weights]
  Device device_;
  std::int64_t numel_ = 0, shard_numel_ = 0;
  AnyTensor shard_;
  std::shared_ptr<StorageImpl> block_;  // the gathered flat parameter (null: resharded)
  AnyTensor full_;                      // over block_
  Pending gathering_;
  Pending reducing_;
  AnyTensor grad_part_;                 // this rank's part of the reduced gradient, in flight
};

/// `t` in dtype `to` (itself when it is of it already; a rounded or widened copy otherwise).
CHORUS_INLINE AnyTensor convert_any(const AnyTensor& t, DType to);

/// Waits for every reduce-scatter in flight and adds the results to the shards' gradients.
CHORUS_INLINE void finish_all_gradients(FsdpShared& shared);

/// zero_grad of a FullyShardedDataParallel: each shard's gradient dropped (set_to_none) or zeroed.
CHORUS_INLINE void zero_shard_grads(const std::vector<AnyTensor>& shards, bool set_to_none);

/// The node of a unit's forward (Note [fully sharded parameters]): next edges are the unit's
/// tensor inputs, then the edges out of it other than to its own parameters.
template <class T>
class FullyShardBackward final : public autograd::NodeBase {
 public:
  explicit FullyShardBackward(std::shared_ptr<FsdpUnit> unit) : unit_(std::move(unit)) {}
  std::string name() const override { return "FullyShardBackward"; }
  DType dtype() const override { return dtype_of<T>(); }
  void release_saved() override {
    leaves_.clear();
    roots_.clear();
    param_edges_.clear();
    out_edges_.clear();
  }

  std::vector<AnyTensor> apply_any(std::vector<std::vector<AnyTensor>>&& arrived) override {
    CHORUS_CHECK(!roots_.empty(), "FullyShardedDataParallel: the graph of unit '", unit_->name(),
                 "' was already used by a backward pass (retain_graph is not supported under FSDP)");
    CHORUS_CHECK(!unit_->released(), "FullyShardedDataParallel: the wrapper was destroyed before this backward "
                                     "pass, which needs it to gather the parameters; keep it alive until then");
    auto grads = autograd::detail::gradients_in<T>(*this, std::move(arrived));
    Stream& home = stream() ? *stream() : current_stream(device());
    StreamGuard on_home(home);
    unit_->unshard();
    unit_->prefetch_previous();
    // Stops: the inputs' accumulators, the unit's parameters, then the other edges out.
    std::vector<autograd::Edge> stops;
    for (const auto& leaf : leaves_)
      leaf.visit([&](const auto& l) {
        if constexpr (is_floating_v<typename std::decay_t<decltype(l)>::value_type>)
          stops.push_back({autograd::grad_accumulator(l), 0});
      });
    const std::size_t first_param = stops.size();
    for (const auto& e : param_edges_) stops.push_back(e.edge);
    const std::size_t first_out = stops.size();
    for (const auto& e : out_edges_) stops.push_back(e);
    std::vector<autograd::Edge> live;
    std::vector<AnyTensor> seeds;
    for (std::size_t i = 0; i < roots_.size(); ++i) {
      if (!roots_[i].valid()) continue;
      live.push_back(roots_[i]);
      seeds.emplace_back(std::move(grads[i]));
    }
    auto got = autograd::detail::grad_at(live, std::move(seeds), stops, &home);
    std::vector<AnyTensor> param_grads(unit_->params().size());
    for (std::size_t k = 0; k < param_edges_.size(); ++k)
      param_grads[param_edges_[k].param] =
          autograd::detail::add_gradients(std::move(param_grads[param_edges_[k].param]), std::move(got[first_param + k]));
    if (unit_->trains()) unit_->reduce_gradients(std::move(param_grads));
    if (unit_->is_root()) finish_all_gradients(unit_->shared());
    unit_->reshard();
    std::vector<AnyTensor> result(next_edges().size());
    std::size_t n = 0;
    for (std::size_t k = 0; k < first_param; ++k) result[n++] = std::move(got[k]);
    for (std::size_t k = first_out; k < stops.size(); ++k) result[n++] = std::move(got[k]);
    return result;
  }

 private:
  template <class U>
  friend std::vector<Tensor<U>> run_unit(const std::shared_ptr<FsdpUnit>& unit, autograd::CheckpointFn<U> fn,
                                         std::vector<AnyTensor> inputs);

  struct ParamEdge {
    autograd::Edge edge;
    std::size_t param;  // index into the unit's params()
  };
  std::shared_ptr<FsdpUnit> unit_;
  std::vector<AnyTensor> leaves_;             // the detached inputs the unit's graph starts from
  std::vector<autograd::Edge> roots_;         // the unit's outputs in its own graph
  std::vector<ParamEdge> param_edges_;        // the edges to the unit's parameters
  std::vector<autograd::Edge> out_edges_;     // the other edges out of the unit
};

/// Runs a unit's forward `fn` on `inputs` (its tensor arguments that require grad) between a
/// gather and a reshard; with grad mode on, its outputs' history is one FullyShardBackward node
/// (Note [fully sharded parameters]).
template <class T>
std::vector<Tensor<T>> run_unit(const std::shared_ptr<FsdpUnit>& unit, autograd::CheckpointFn<T> fn,
                                std::vector<AnyTensor> inputs) {
  unit->entered_forward();
  unit->unshard();
  if (!autograd::is_grad_enabled()) {
    auto outs = fn(inputs);
    unit->left_forward();
    unit->reshard();
    return outs;
  }
  auto node = std::make_shared<FullyShardBackward<T>>(unit);
  std::vector<Tensor<T>> outs;
  std::vector<autograd::detail::EdgeLog::Entry> out_edges;
  std::vector<autograd::Edge> roots;
  auto* outer = autograd::detail::current_edge_log();
  {
    autograd::detail::EdgeLog log;
    log.start = autograd::detail::next_sequence_nr();
    struct Restore {
      autograd::detail::EdgeLog* prev;
      ~Restore() { autograd::detail::current_edge_log() = prev; }
    } restore{outer};
    autograd::detail::current_edge_log() = &log;
    node->leaves_ = autograd::detail::checkpoint_leaves(inputs);
    outs = fn(node->leaves_);
    for (const auto& o : outs) roots.push_back(autograd::gradient_edge(o));  // an output from outside leaves the unit too
    out_edges = autograd::detail::edges_out(log, node->leaves_);
  }
  unit->left_forward();
  bool any = false;
  for (const auto& o : outs) any = any || (o.defined() && o.requires_grad());
  if (!any) {  // nothing will run backward through the unit
    unit->reshard();
    return outs;
  }
  for (const auto& in : inputs)
    in.visit([&](const auto& t) {
      using U = typename std::decay_t<decltype(t)>::value_type;
      if constexpr (is_floating_v<U>) node->add_next_edge(autograd::gradient_edge(t));
      else CHORUS_FAIL("FullyShardedDataParallel: an input of ", dtype_name(in.dtype()), " cannot require grad");
    });
  auto& shared = unit->shared();
  for (auto& e : out_edges) {
    const void* key = e.tensor.impl_key();
    const auto it = shared.holder.find(key);
    if (it != shared.holder.end()) {
      CHORUS_CHECK(it->second == unit.get(), "FullyShardedDataParallel: unit '", unit->name(),
                   "' used a parameter of unit '", it->second->name(),
                   "', which is gathered only inside that unit; a parameter (a tied weight) must be used by the "
                   "unit that holds it only: put the modules that share it into one unit");
      std::size_t index = 0;
      while (unit->params()[index].impl_key() != key) ++index;
      node->param_edges_.push_back({e.edge, index});
      continue;
    }
    if (outer) outer->note(e);
    node->add_next_edge(e.edge);
    node->out_edges_.push_back(e.edge);
  }
  std::vector<Tensor<T>> result(outs.size());
  for (std::size_t k = 0; k < outs.size(); ++k) {
    if (!outs[k].defined() || !outs[k].requires_grad()) {
      result[k] = outs[k];
      continue;
    }
    node->roots_.push_back(roots[k]);
    result[k] = outs[k].detach();
    autograd::set_history(result[k], node);
  }
  if (!unit->is_root()) unit->reshard();  // the root stays gathered until its backward ends
  return result;
}

}  // namespace parallel::detail
CHORUS_NAMESPACE_END

#if !CHORUS_COMPILED
#include "shard_unit_impl.hpp"
#endif
