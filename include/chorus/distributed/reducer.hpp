#pragma once
// The state behind DistributedDataParallel: gradient buckets, their all-reduces, and the graph
// nodes through which backward reports ready gradients (ddp.hpp is the user-facing wrapper).
//
// Note [DDP buckets]
// Like PyTorch's reducer, gradients are reduced in buckets (default 25 MB; the first 1 MB, so
// that the first all-reduce starts early), filled in reverse parameter order (about the order
// backward produces them) and, after the first step, re-made from the order in which the
// gradients actually became ready — rank 0's order, broadcast, so that every rank launches the
// same buckets in the same order, as collectives require. A bucket's all-reduce starts as soon
// as all its gradients exist and every earlier bucket has started, so the reduction of the late
// layers runs (on the communication thread, or NCCL's stream) while backward computes the
// early ones.
//
// Note [DDP graph nodes]
// chorus has no gradient hooks; as DataParallel does (Note [gradient buckets]), DDP puts graph
// nodes in the way instead. For the duration of forward, each trained parameter's grad_fn is a
// ParamReady node, so the operations that use it record an edge to that node; afterwards the
// parameter is a plain leaf again (the optimizer sees nothing). When backward reaches a
// ParamReady node, it accumulates the gradient into grad() (what AccumulateGrad would have
// done), copies grad() into its bucket and, when the bucket is complete, starts its all-reduce.
// Every ParamReady node has one edge to a Finalize node of its dtype (a node's inputs have one
// dtype), which the engine therefore runs after the last of them; forward counts the Finalize
// nodes backward can reach (one per dtype of the parameters, the graph walked only when there
// are several), and the last to run starts what is left and waits for all buckets, whose
// averages are then the grad()s. Reducing the accumulated grad() (not just this backward's
// gradient) gives no_sync()'s semantics: steps under no_sync accumulate locally, the next step
// reduces the sum.
//
// Note [ZeRO-2 over the process group]
// DistributedDataParallel::shard_gradients(opt) gives each parameter the rank that owns it in
// the ZeroRedundancyOptimizer `opt` (Note [ZeRO-1 over the process group]). Buckets are then made
// per (dtype, owner), and a complete bucket is reduced to its owner (MPI_Ireduce, ncclReduce)
// instead of all-reduced: the same bytes leave each rank as for an all-reduce's reduce-scatter
// half, and the optimizer's broadcast of the updated parameters is the all-gather half, so a
// step moves what DDP with ZeRO-1 moves (ZeRO paper §7: 2Ψ). After backward each rank keeps the
// buckets it owns (its parameters' averaged gradients) and frees the others, whose parameters
// are left without a gradient: between steps a rank holds 1/N of the gradients. A bucket it does
// not own is allocated again at the next reducing forward, so backward still fills every bucket
// while it runs. The sums are the all-reduce's up to the order MPI adds the ranks' terms in
// (within a few ulps). What reads every gradient must then ask the owners: the optimizer's
// clip_grad_norm_ and GradScaler (Optimizer::found_inf_anywhere) do, and nn::utils'
// clip_grad_norm_ refuses a parameter marked grad_on_other_rank. Under no_sync the gradients
// accumulate whole on every rank, as without sharding, and the next reducing step reduces them.
#include <algorithm>
#include <exception>
#include <memory>
#include <mutex>
#include <numeric>
#include <sstream>
#include <string>
#include <unordered_set>
#include <vector>

#include "../autograd/engine.hpp"
#include "../compiled.hpp"
#include "process_group.hpp"

CHORUS_NAMESPACE_BEGIN

namespace dist {
// Note [DDP communication hooks]
// PyTorch's built-in hooks (torch.distributed.algorithms.ddp_comm_hooks.default_hooks), chosen
// by DistributedDataParallel::register_comm_hook: `allreduce` averages each bucket as it is
// (the default); `fp16_compress` and `bf16_compress` convert a wider bucket to 16 bits, divide
// it by the world size in 16 bits, sum it across the ranks in 16 bits and convert the result
// back into the bucket: half the bytes on the wire, at 16-bit precision of the average.
/// A built-in communication hook of DistributedDataParallel::register_comm_hook (Note [DDP communication hooks]).
enum class CommHook { allreduce, fp16_compress, bf16_compress };
}  // namespace dist

/// DistributedDataParallel's options, with designated initializers:
/// `{.bucket_cap_bytes = 50 << 20, .find_unused_parameters = true}`.
struct DistributedDataParallelOptions {
  /// The size at which a gradient bucket closes: PyTorch's bucket_cap_mb, in bytes (default 25 MiB;
  /// Note [DDP buckets]).
  std::size_t bucket_cap_bytes = std::size_t{25} << 20;
  /// The same for the first bucket of each dtype, small so that the first all-reduce starts early
  /// (default 1 MiB, as PyTorch's).
  std::size_t first_bucket_bytes = std::size_t{1} << 20;
  /// Off: a trained parameter that gets no gradient in a backward pass is an error naming it.
  /// On: such parameters are found after forward and count as zeros in the average.
  bool find_unused_parameters = false;
  /// Copy rank 0's buffers to every rank at each forward (as PyTorch does).
  bool broadcast_buffers = true;
};

/// \cond
namespace dist::detail {

/// The per-model state behind DistributedDataParallel (shared with its graph nodes).
class Reducer : public std::enable_shared_from_this<Reducer> {
 public:
  struct Param {
    std::string name;
    AnyTensor tensor;
  };
  struct Bucket {
    DType dtype;
    std::vector<std::size_t> members;  // parameter indices, in bucket order
    std::vector<std::int64_t> offsets;
    std::int64_t numel = 0;
    int owner = -1;  // the rank it is reduced to (Note [ZeRO-2 over the process group]); -1: every rank
    AnyTensor flat;  // undefined between steps on a rank that does not own it
    std::size_t pending = 0;
    std::shared_ptr<Work> work;
    AnyTensor wire;  // the 16-bit copy a compression hook reduces (undefined otherwise)
  };

  Reducer(ProcessGroup& group, std::vector<Param> params, DistributedDataParallelOptions options, Device device);

  const std::vector<Bucket>& buckets() const { return buckets_; }

  /// Note [DDP communication hooks]: once, before the first reducing step.
  void set_comm_hook(dist::CommHook hook);
  /// Note [ZeRO-2 over the process group]: owner[i] keeps parameter i's gradient; once, before
  /// the first reducing step.
  void shard(std::vector<int> owner);
  bool sharded() const { return !owner_.empty(); }
  const std::vector<Param>& params() const { return params_; }
  bool rebuilt() const { return rebuilt_; }

  /// Before a forward whose backward reduces: rebuilds the buckets once (after the first
  /// reduced step) and resets the per-step state. `used[i]` is false for parameters that
  /// find_unused_parameters found unreachable.
  void prepare_step();
  /// Marks parameter i as used or not (find_unused_parameters; before backward).
  void set_unused(std::size_t i);

  /// A ParamReady node: `grad` is parameter i's gradient from this backward pass; it is added
  /// to grad() in the bucket, where grad() lives from now on (Note [DDP gradient views]).
  void mark_ready(std::size_t i, const AnyTensor& grad);

  /// The Finalize node: starts what is left, waits for every bucket, writes the averages back.
  void finalize();
  /// This step's Finalize nodes: one per dtype of the parameters backward reaches (Note [DDP
  /// graph nodes]); finalizer_ran() finalizes once the last of them has run.
  void expect_finalizers(int n);
  void finalizer_ran();

  /// One reducing step of the other ranks while this rank has run out of data (Note [DDP
  /// join]): the collectives of a step in the same order — the bucket rebuild, every bucket's
  /// all-reduce (as the communication hook sends it), the used-parameter map — with zeros.
  void shadow_step();

  /// Buckets of the last step whose all-reduce started while gradients were still missing.
  std::size_t early_launches() const {
    std::lock_guard<std::mutex> lk(m_);
    return early_launches_;
  }
  /// True between a reducing forward and the end of its backward.
  bool in_step() const {
    std::lock_guard<std::mutex> lk(m_);
    return armed_;
  }
  void disarm() {
    std::lock_guard<std::mutex> lk(m_);
    armed_ = false;
  }

 private:
  void check_previous_step();

  // Note [DDP gradient views]
  // As PyTorch's gradient_as_bucket_view: a parameter's grad() is a view of its slot in the
  // bucket, so the all-reduce (in place) leaves the averages where the optimizer reads them,
  // and each gradient is copied once (into the slot), not twice. The gradient accumulated so
  // far (no_sync steps, or zero_grad(false)) is what gets added to, as with AccumulateGrad.
  template <class T>
  static Tensor<T> slot_of(const Bucket& b, std::size_t k, const Tensor<T>& p) {
    return b.flat.template as<T>().narrow(0, b.offsets[k], p.numel()).view(p.shape());
  }
  template <class T>
  static bool is_slot(const Tensor<T>& g, const Tensor<T>& slot) {
    return g.defined() && g.same_storage(slot) && g.storage_offset() == slot.storage_offset() && g.is_contiguous();
  }
  std::size_t position(const Bucket& b, std::size_t i) const;

  // Note [DDP pre-division]
  // The average of a bucket is the sum over the ranks of each rank's gradient divided by the
  // world size. Over MPI (CPU tensors) the division was a pass over the bucket of its own, after
  // the all-reduce: for the last bucket (mlp-medium's 12.6 MB), on the critical path at the end
  // of backward. So, as PyTorch's reducer does without a communication hook
  // (mark_variable_ready_dense: mul_out(bucket_view, grad, 1 / div_factor)), a CPU bucket is
  // divided while each gradient is copied (or added) into it, in the same pass, and all-reduced
  // by sum. NCCL averages inside its reduction kernel (ncclAvg), so GPU buckets still ask for
  // ReduceOp::Avg; so do the compression hooks, which divide in 16 bits (Note [DDP communication
  // hooks]). The results equal the divided sum for a world size that is a power of 2; otherwise
  // they differ from it by the rounding of the products, as PyTorch's do.
  bool prescaled(const Bucket& b) const;
  /// The dtype bucket b's all-reduce sends: its own, or 16 bits under a compression hook.
  DType wire_of(const Bucket& b) const;

  void accumulate_into_bucket(Bucket& b, std::size_t i, const AnyTensor& grad);

  // Starts the buckets that are complete, in bucket order (Note [DDP buckets]); m_ held.
  void launch_ready();
  // The bucket in 16 bits, divided by the world size there (PyTorch's order: convert, then
  // divide, so that the sum across ranks cannot overflow float16's range).
  AnyTensor compress(const AnyTensor& flat, DType wire) const;
  // The reduced 16-bit bucket back into the bucket's dtype.
  static void decompress(Bucket& b);

  // An unused parameter counts as zeros; its grad() (if it is the slot) keeps its values.
  void zero_slot(Bucket& b, std::size_t k);

  /// Rank 0's ready order for every rank; unused parameters last, in reverse order.
  void rebuild();

  void build_buckets(const std::vector<std::size_t>& order);
  /// The buckets before any step: the parameters in reverse order (Note [DDP buckets]).
  void build_buckets_in_reverse();
  /// Whether this rank keeps bucket b's reduced gradients (Note [ZeRO-2 over the process group]).
  bool owns(const Bucket& b) const { return b.owner < 0 || b.owner == group_.rank(); }

  ProcessGroup& group_;
  std::vector<Param> params_;
  DistributedDataParallelOptions options_;
  Device device_;
  mutable std::mutex m_;
  std::vector<Bucket> buckets_;
  std::vector<std::size_t> bucket_of_;
  std::vector<bool> ready_, used_;
  std::vector<int> owner_;  // shard(): the rank that keeps each parameter's gradient
  std::vector<std::size_t> ready_order_;
  std::size_t next_bucket_ = 0, ready_count_ = 0, early_launches_ = 0;
  int finalizers_pending_ = 0;  // this step's Finalize nodes still to run
  std::size_t steps_ = 0;
  bool rebuilt_ = false, started_ = false, finalized_ = false, armed_ = false;
  dist::CommHook hook_ = dist::CommHook::allreduce;
  bool hook_set_ = false;
};

/// The grad_fn of a trained parameter during forward (Note [DDP graph nodes]).
template <class T>
class ParamReady final : public autograd::Node<T> {
 public:
  ParamReady(std::shared_ptr<Reducer> reducer, std::size_t index) : reducer_(std::move(reducer)), index_(index) {}
  std::string name() const override { return "DistributedDataParallel::ParamReady"; }
  typename autograd::Node<T>::TensorList apply(typename autograd::Node<T>::TensorList&& grads) override {
    reducer_->mark_ready(index_, AnyTensor(std::move(grads[0])));
    return {};
  }

 private:
  std::shared_ptr<Reducer> reducer_;
  std::size_t index_;
};

/// Runs after every ParamReady node of one backward pass (Note [DDP graph nodes]).
template <class T>
class Finalize final : public autograd::Node<T> {
 public:
  explicit Finalize(std::shared_ptr<Reducer> reducer) : reducer_(std::move(reducer)) {}
  std::string name() const override { return "DistributedDataParallel::Finalize"; }
  typename autograd::Node<T>::TensorList apply(typename autograd::Node<T>::TensorList&&) override {
    reducer_->finalizer_ran();
    return {};
  }

 private:
  std::shared_ptr<Reducer> reducer_;
};

/// Collects the nodes reachable from `roots` (find_unused_parameters).
CHORUS_INLINE void reachable(const std::vector<std::shared_ptr<autograd::NodeBase>>& roots,
                             std::unordered_set<const void*>& seen);

}  // namespace dist::detail
/// \endcond

CHORUS_NAMESPACE_END

// The definitions: compiled into chorus::compiled and the MPI library, or here in the
// header-only form (Note [compiled chorus] in compiled.hpp).
#if !CHORUS_COMPILED
#include "reducer_impl.hpp"
#endif
