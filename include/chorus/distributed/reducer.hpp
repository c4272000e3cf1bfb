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
// Every ParamReady node has one edge to a Finalize node, which the engine therefore runs after
// the last of them: it starts what is left and waits for all buckets, whose averages are then
// the grad()s. Reducing the accumulated grad() (not just this backward's gradient) gives
// no_sync()'s semantics: steps under no_sync accumulate locally, the next step reduces the sum.
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
#include "process_group.hpp"

CHORUS_NAMESPACE_BEGIN

namespace dist {
// Note [DDP communication hooks]
// PyTorch's built-in hooks (torch.distributed.algorithms.ddp_comm_hooks.default_hooks), chosen
// by DistributedDataParallel::register_comm_hook: `allreduce` averages each bucket as it is
// (the default); `fp16_compress` and `bf16_compress` convert a wider bucket to 16 bits, divide
// it by the world size in 16 bits, sum it across the ranks in 16 bits and convert the result
// back into the bucket: half the bytes on the wire, at 16-bit precision of the average.
enum class CommHook { allreduce, fp16_compress, bf16_compress };
}  // namespace dist

struct DistributedDataParallelOptions {
  std::size_t bucket_cap_bytes = std::size_t{25} << 20;  ///< Note [DDP buckets]
  std::size_t first_bucket_bytes = std::size_t{1} << 20;
  /// Off: a trained parameter that gets no gradient in a backward pass is an error naming it.
  /// On: such parameters are found after forward and count as zeros in the average.
  bool find_unused_parameters = false;
  /// Copy rank 0's buffers to every rank at each forward (as PyTorch does).
  bool broadcast_buffers = true;
};

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
    AnyTensor flat;
    std::size_t pending = 0;
    std::shared_ptr<Work> work;
    AnyTensor wire;  // the 16-bit copy a compression hook reduces (undefined otherwise)
  };

  Reducer(ProcessGroup& group, std::vector<Param> params, DistributedDataParallelOptions options, Device device)
      : group_(group), params_(std::move(params)), options_(options), device_(device) {
    std::vector<std::size_t> order(params_.size());
    std::iota(order.begin(), order.end(), std::size_t{0});
    std::reverse(order.begin(), order.end());
    build_buckets(order);
  }

  const std::vector<Bucket>& buckets() const { return buckets_; }

  /// Note [DDP communication hooks]: once, before the first reducing step.
  void set_comm_hook(dist::CommHook hook) {
    std::lock_guard<std::mutex> lk(m_);
    CHORUS_CHECK(!hook_set_, "DistributedDataParallel::register_comm_hook can only be called once");
    CHORUS_CHECK(steps_ == 0 && !armed_, "DistributedDataParallel::register_comm_hook must be called before the first "
                                         "forward that reduces gradients");
    hook_ = hook;
    hook_set_ = true;
  }
  const std::vector<Param>& params() const { return params_; }
  bool rebuilt() const { return rebuilt_; }

  /// Before a forward whose backward reduces: rebuilds the buckets once (after the first
  /// reduced step) and resets the per-step state. `used[i]` is false for parameters that
  /// find_unused_parameters found unreachable.
  void prepare_step() {
    std::lock_guard<std::mutex> lk(m_);
    check_previous_step();
    if (!rebuilt_ && steps_ > 0) rebuild();
    for (auto& b : buckets_) {
      b.pending = b.members.size();
      b.work.reset();
    }
    ready_.assign(params_.size(), false);
    used_.assign(params_.size(), true);
    ready_count_ = 0;
    early_launches_ = 0;
    next_bucket_ = 0;
    started_ = false;
    finalized_ = false;
    armed_ = true;
  }
  /// Marks parameter i as used or not (find_unused_parameters; before backward).
  void set_unused(std::size_t i) {
    std::lock_guard<std::mutex> lk(m_);
    if (!used_[i]) return;
    used_[i] = false;
    ready_[i] = true;
    ++ready_count_;
    --buckets_[bucket_of_[i]].pending;
  }

  /// A ParamReady node: `grad` is parameter i's gradient from this backward pass; it is added
  /// to grad() in the bucket, where grad() lives from now on (Note [DDP gradient views]).
  void mark_ready(std::size_t i, const AnyTensor& grad) {
    std::lock_guard<std::mutex> lk(m_);
    CHORUS_CHECK(armed_, "DistributedDataParallel: a gradient arrived for '", params_[i].name,
                 "' outside a reducing step (backward through the graph of an earlier forward twice?)");
    CHORUS_CHECK(!ready_[i], "DistributedDataParallel: parameter '", params_[i].name,
                 "' received a gradient twice in one backward pass (is the module's output used in two "
                 "backward passes, or the parameter shared with another DistributedDataParallel?)");
    started_ = true;
    ready_[i] = true;
    ++ready_count_;
    if (!rebuilt_) ready_order_.push_back(i);
    auto& b = buckets_[bucket_of_[i]];
    accumulate_into_bucket(b, i, grad);
    --b.pending;
    launch_ready();
  }

  /// The Finalize node: starts what is left, waits for every bucket, writes the averages back.
  void finalize() {
    std::unique_lock<std::mutex> lk(m_);
    launch_ready();
    std::vector<std::string> missing;
    for (std::size_t i = 0; i < params_.size(); ++i)
      if (!ready_[i]) missing.push_back(params_[i].name);
    // Whatever was started must finish on every rank before anything is reported.
    std::exception_ptr failure;
    for (auto& b : buckets_) {
      if (!b.work) continue;
      try {
        b.work->wait(group_.timeout());
      } catch (...) {
        if (!failure) failure = std::current_exception();
      }
    }
    finalized_ = true;
    armed_ = false;
    if (failure) std::rethrow_exception(failure);
    for (auto& b : buckets_)
      if (b.wire.defined()) decompress(b);
    if (!missing.empty()) {
      std::ostringstream os;
      for (std::size_t k = 0; k < missing.size(); ++k) os << (k ? ", '" : "'") << missing[k] << "'";
      CHORUS_FAIL("DistributedDataParallel on rank ", group_.rank(), ": parameter", missing.size() > 1 ? "s " : " ",
                  os.str(), missing.size() > 1 ? " were" : " was",
                  " not used in producing the loss, so no gradient arrived for it and its bucket was never "
                  "reduced; pass find_unused_parameters = true, or take the parameter out of the module");
    }
    // With unused parameters (find_unused_parameters), a parameter keeps grad() untouched only
    // when no rank used it, as in PyTorch.
    std::vector<bool> globally_used(params_.size(), true);
    if (options_.find_unused_parameters) {
      auto used = Tensor<std::int64_t>::empty(Shape{static_cast<std::int64_t>(params_.size())}, Device::cpu(0));
      for (std::size_t i = 0; i < params_.size(); ++i) used.data()[i] = used_[i] ? 1 : 0;
      group_.all_reduce_async(used, ReduceOp::Sum, "all_reduce of the used-parameter map")->wait(group_.timeout());
      for (std::size_t i = 0; i < params_.size(); ++i) globally_used[i] = used.data()[i] > 0;
    }
    // The averages are in the buckets, where the used parameters' grad() already points; a
    // parameter only another rank used gets its view now.
    NoGradGuard ng;
    for (auto& b : buckets_) {
      for (std::size_t k = 0; k < b.members.size(); ++k) {
        const std::size_t i = b.members[k];
        if (!globally_used[i] || used_[i]) continue;
        params_[i].tensor.visit([&](auto& p) {
          using T = typename std::decay_t<decltype(p)>::value_type;
          if constexpr (is_floating_v<T>) p.set_grad(slot_of(b, k, p));
        });
      }
    }
    ++steps_;
  }

  /// One reducing step of the other ranks while this rank has run out of data (Note [DDP
  /// join]): the collectives of a step in the same order — the bucket rebuild, every bucket's
  /// all-reduce (as the communication hook sends it), the used-parameter map — with zeros.
  void shadow_step() {
    prepare_step();
    {
      std::lock_guard<std::mutex> lk(m_);
      NoGradGuard ng;
      for (auto& b : buckets_) {
        b.flat.visit([](const auto& f) {
          using T = typename std::decay_t<decltype(f)>::value_type;
          backend::fill(f, T(0));
        });
        b.pending = 0;
      }
      ready_.assign(params_.size(), true);
      ready_count_ = params_.size();
      started_ = true;
    }
    finalize();
  }

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
  void check_previous_step() {
    if (started_ && !finalized_) {
      group_.mark_broken("a DistributedDataParallel backward pass was interrupted");
      CHORUS_FAIL("DistributedDataParallel on rank ", group_.rank(),
                  ": the previous backward pass started reducing gradients but did not finish (it threw?); "
                  "the ranks are out of step and the process group is now broken");
    }
  }

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
  std::size_t position(const Bucket& b, std::size_t i) const {
    return static_cast<std::size_t>(std::find(b.members.begin(), b.members.end(), i) - b.members.begin());
  }

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
  bool prescaled(const Bucket& b) const {
    return device_.is_cpu() && group_.world_size() > 1 && wire_of(b) == b.dtype;
  }
  /// The dtype bucket b's all-reduce sends: its own, or 16 bits under a compression hook.
  DType wire_of(const Bucket& b) const {
    const DType wire = hook_ == dist::CommHook::fp16_compress   ? DType::Float16
                       : hook_ == dist::CommHook::bf16_compress ? DType::BFloat16
                                                                : b.dtype;
    return b.dtype == DType::Float32 || b.dtype == DType::Float64 ? wire : b.dtype;
  }

  void accumulate_into_bucket(Bucket& b, std::size_t i, const AnyTensor& grad) {
    const std::size_t k = position(b, i);
    const double scale = prescaled(b) ? 1.0 / group_.world_size() : 1.0;  // Note [DDP pre-division]
    NoGradGuard ng;
    params_[i].tensor.visit([&](auto& p) {
      using T = typename std::decay_t<decltype(p)>::value_type;
      if constexpr (is_floating_v<T>) {
        const auto& g = grad.template as<T>();
        CHORUS_CHECK(g.shape() == p.shape(), "DistributedDataParallel: gradient of shape ", g.shape(),
                     " for parameter '", params_[i].name, "' of shape ", p.shape());
        auto slot = slot_of(b, k, p);
        auto old = p.grad();
        const auto dense = [](const Tensor<T>& t) { return t.is_contiguous() ? t : t.contiguous(); };
        if (old.defined()) {  // slot = (accumulated + g) / world
          const Tensor<T> acc = is_slot(old, slot) ? slot : dense(old);
          if (scale == 1.0) backend::binary_same(acc, dense(g), slot, backend::fn::Add{});
          else backend::binary_same(acc, dense(g), slot, backend::fn::AddThenScale{scale});
        } else if (scale == 1.0) {
          backend::copy(slot, g);
        } else {  // slot = g / world
          backend::unary(dense(g), slot, backend::fn::Scale{scale});
        }
        p.set_grad(slot);
      }
    });
  }

  // Starts the buckets that are complete, in bucket order (Note [DDP buckets]); m_ held.
  void launch_ready() {
    while (next_bucket_ < buckets_.size() && buckets_[next_bucket_].pending == 0) {
      auto& b = buckets_[next_bucket_];
      // Unused members (find_unused_parameters) count as zeros.
      for (std::size_t k = 0; k < b.members.size(); ++k)
        if (!used_[b.members[k]]) zero_slot(b, k);
      if (ready_count_ < params_.size()) ++early_launches_;  // overlaps the rest of backward
      const std::string what = "all_reduce of gradient bucket " + std::to_string(next_bucket_);
      const DType wire = wire_of(b);
      if (wire != b.dtype) {
        b.wire = compress(b.flat, wire);
        const std::string compressed = what + " (" + std::string(dtype_name(wire)) + "-compressed)";
        b.wire.visit([&](const auto& c) { b.work = group_.all_reduce_async(c, ReduceOp::Sum, compressed); });
      } else {
        const ReduceOp op = prescaled(b) ? ReduceOp::Sum : ReduceOp::Avg;  // Note [DDP pre-division]
        b.flat.visit([&](const auto& f) { b.work = group_.all_reduce_async(f, op, what); });
      }
      ++next_bucket_;
    }
  }
  // The bucket in 16 bits, divided by the world size there (PyTorch's order: convert, then
  // divide, so that the sum across ranks cannot overflow float16's range).
  AnyTensor compress(const AnyTensor& flat, DType wire) const {
    NoGradGuard ng;
    AnyTensor out = empty_any(wire, flat.shape(), device_);
    const auto world = static_cast<std::int64_t>(group_.world_size());
    out.visit([&](const auto& c) {
      using W = typename std::decay_t<decltype(c)>::value_type;
      if constexpr (is_reduced_floating_v<W>) {
        flat.visit([&](const auto& f) {
          using T = typename std::decay_t<decltype(f)>::value_type;
          if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double>) backend::convert(c, f);
        });
        divide_in_place(c, world);
      }
    });
    return out;
  }
  // The reduced 16-bit bucket back into the bucket's dtype.
  static void decompress(Bucket& b) {
    NoGradGuard ng;
    b.flat.visit([&](const auto& f) {
      b.wire.visit([&](const auto& c) {
        using T = typename std::decay_t<decltype(f)>::value_type;
        using W = typename std::decay_t<decltype(c)>::value_type;
        if constexpr ((std::is_same_v<T, float> || std::is_same_v<T, double>) && is_reduced_floating_v<W>)
          backend::convert(f, c);
      });
    });
    b.wire = AnyTensor();
  }

  // An unused parameter counts as zeros; its grad() (if it is the slot) keeps its values.
  void zero_slot(Bucket& b, std::size_t k) {
    params_[b.members[k]].tensor.visit([&](auto& p) {
      using T = typename std::decay_t<decltype(p)>::value_type;
      if constexpr (is_floating_v<T>) {
        auto slot = slot_of(b, k, p);
        if (is_slot(p.grad(), slot)) p.set_grad(slot.clone());
        backend::fill(slot, T(0));
      }
    });
  }

  /// Rank 0's ready order for every rank; unused parameters last, in reverse order.
  void rebuild() {
    std::vector<std::size_t> order = ready_order_;
    std::vector<bool> seen(params_.size(), false);
    for (auto i : order) seen[i] = true;
    for (std::size_t i = params_.size(); i-- > 0;)
      if (!seen[i]) order.push_back(i);
    auto t = Tensor<std::int64_t>::empty(Shape{static_cast<std::int64_t>(order.size())}, Device::cpu(0));
    for (std::size_t k = 0; k < order.size(); ++k) t.data()[k] = static_cast<std::int64_t>(order[k]);
    group_.broadcast_async(t, 0, "broadcast of the gradient-ready order")->wait(group_.timeout());
    for (std::size_t k = 0; k < order.size(); ++k) order[k] = static_cast<std::size_t>(t.data()[k]);
    build_buckets(order);
    rebuilt_ = true;
    ready_order_.clear();
  }

  void build_buckets(const std::vector<std::size_t>& order) {
    buckets_.clear();
    bucket_of_.assign(params_.size(), 0);
    // One open bucket per dtype; a bucket closes when it reaches its size limit (the first
    // bucket of each dtype: first_bucket_bytes).
    struct Open {
      DType dtype;
      std::vector<std::size_t> members;
      std::size_t bytes = 0;
      bool first = true;
    };
    std::vector<Open> open;
    std::vector<std::vector<std::size_t>> closed;
    std::vector<DType> closed_dtypes;
    for (auto i : order) {
      const auto& t = params_[i].tensor;
      auto it = std::find_if(open.begin(), open.end(), [&](const Open& o) { return o.dtype == t.dtype(); });
      if (it == open.end()) {
        open.push_back({t.dtype(), {}, 0, true});
        it = open.end() - 1;
      }
      it->members.push_back(i);
      it->bytes += t.nbytes();
      const std::size_t limit = it->first ? options_.first_bucket_bytes : options_.bucket_cap_bytes;
      if (it->bytes >= limit) {
        closed.push_back(std::move(it->members));
        closed_dtypes.push_back(it->dtype);
        it->members.clear();
        it->bytes = 0;
        it->first = false;
      }
    }
    for (auto& o : open)
      if (!o.members.empty()) {
        closed.push_back(std::move(o.members));
        closed_dtypes.push_back(o.dtype);
      }
    for (std::size_t b = 0; b < closed.size(); ++b) {
      Bucket bucket{closed_dtypes[b], closed[b], {}, {}, 0, nullptr, {}};
      std::int64_t n = 0;
      for (auto i : bucket.members) {
        bucket.offsets.push_back(n);
        n += params_[i].tensor.numel();
        bucket_of_[i] = b;
      }
      bucket.flat = empty_any(bucket.dtype, Shape{n}, device_);
      buckets_.push_back(std::move(bucket));
    }
  }

  ProcessGroup& group_;
  std::vector<Param> params_;
  DistributedDataParallelOptions options_;
  Device device_;
  mutable std::mutex m_;
  std::vector<Bucket> buckets_;
  std::vector<std::size_t> bucket_of_;
  std::vector<bool> ready_, used_;
  std::vector<std::size_t> ready_order_;
  std::size_t next_bucket_ = 0, ready_count_ = 0, early_launches_ = 0;
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
    reducer_->finalize();
    return {};
  }

 private:
  std::shared_ptr<Reducer> reducer_;
};

/// Collects the nodes reachable from `roots` (find_unused_parameters).
inline void reachable(const std::vector<std::shared_ptr<autograd::NodeBase>>& roots,
                      std::unordered_set<const void*>& seen) {
  std::vector<autograd::NodeBase*> stack;
  for (auto& r : roots)
    if (r && seen.insert(r.get()).second) stack.push_back(r.get());
  while (!stack.empty()) {
    auto* n = stack.back();
    stack.pop_back();
    for (const auto& e : n->next_edges())
      if (e.valid() && seen.insert(e.fn.get()).second) stack.push_back(e.fn.get());
  }
}

}  // namespace dist::detail

CHORUS_NAMESPACE_END
