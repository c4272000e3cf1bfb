#pragma once
// DistributedDataParallel: one process per device, gradients averaged over the process group.
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
#include <functional>
#include <memory>
#include <mutex>
#include <numeric>
#include <optional>
#include <sstream>
#include <string>
#include <unordered_set>
#include <vector>

#include "../autograd/engine.hpp"
#include "../nn/module.hpp"
#include "../parallel/data_parallel.hpp"
#include "process_group.hpp"

CHORUS_NAMESPACE_BEGIN

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
  };

  Reducer(ProcessGroup& group, std::vector<Param> params, DistributedDataParallelOptions options, Device device)
      : group_(group), params_(std::move(params)), options_(options), device_(device) {
    std::vector<std::size_t> order(params_.size());
    std::iota(order.begin(), order.end(), std::size_t{0});
    std::reverse(order.begin(), order.end());
    build_buckets(order);
  }

  const std::vector<Bucket>& buckets() const { return buckets_; }
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

  void accumulate_into_bucket(Bucket& b, std::size_t i, const AnyTensor& grad) {
    const std::size_t k = position(b, i);
    NoGradGuard ng;
    params_[i].tensor.visit([&](auto& p) {
      using T = typename std::decay_t<decltype(p)>::value_type;
      if constexpr (is_floating_v<T>) {
        const auto& g = grad.template as<T>();
        CHORUS_CHECK(g.shape() == p.shape(), "DistributedDataParallel: gradient of shape ", g.shape(),
                     " for parameter '", params_[i].name, "' of shape ", p.shape());
        auto slot = slot_of(b, k, p);
        auto old = p.grad();
        if (is_slot(old, slot)) {
          backend::binary_same(slot, g.is_contiguous() ? g : g.contiguous(), slot, backend::fn::Add{});
        } else {
          backend::copy(slot, g);
          if (old.defined()) backend::binary_same(slot, old.is_contiguous() ? old : old.contiguous(), slot,
                                                  backend::fn::Add{});
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
      b.flat.visit([&](const auto& f) { b.work = group_.all_reduce_async(f, ReduceOp::Avg, what); });
      ++next_bucket_;
    }
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
      Bucket bucket{closed_dtypes[b], closed[b], {}, {}, 0, nullptr};
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
template <class T>
void reachable(const std::vector<std::shared_ptr<autograd::Node<T>>>& roots, std::unordered_set<const void*>& seen) {
  std::vector<autograd::Node<T>*> stack;
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

/// PyTorch's DistributedDataParallel for one device per process: construction checks that every
/// rank holds the same parameters and copies rank 0's parameters and buffers everywhere;
/// backward averages the gradients over the ranks bucket by bucket, overlapped with the
/// backward pass (Notes [DDP buckets], [DDP graph nodes]).
template <class M>
class DistributedDataParallel {
 public:
  using Options = DistributedDataParallelOptions;

  /// Wraps `module` (all of whose tensors live on one device) for the process group `group`
  /// (default: dist::init()).
  explicit DistributedDataParallel(M module, Options options = {}, dist::ProcessGroup* group = nullptr)
      : module_(std::move(module)), options_(options), group_(group ? *group : dist::init()) {
    CHORUS_CHECK(options_.bucket_cap_bytes > 0 && options_.first_bucket_bytes > 0,
                 "DistributedDataParallel: bucket sizes must be positive");
    auto& root = nn::module_of(module_);
    auto named = root.named_parameters();
    auto buffers = root.named_buffers();
    CHORUS_CHECK(!named.empty() || !buffers.empty(), "DistributedDataParallel: the module has no parameters");
    device_ = !named.empty() ? named[0].tensor.device() : buffers[0].tensor.device();
    for (const auto* list : {&named, &buffers})
      for (const auto& p : *list)
        CHORUS_CHECK(p.tensor.device() == device_, "DistributedDataParallel: '", p.name, "' is on ", p.tensor.device(),
                     " but '", (named.empty() ? buffers : named)[0].name, "' is on ", device_,
                     "; one device per process (move the module there first)");
    verify_same_model(named, buffers);
    sync_from_rank0(named, buffers, /*buffers_only=*/false);
    std::vector<dist::detail::Reducer::Param> trained;
    std::unordered_set<const void*> seen;  // a tensor registered under two names is reduced once
    for (auto& p : named)
      if (p.tensor.requires_grad() && p.tensor.dtype() != DType::Int64 && seen.insert(p.tensor.impl_key()).second)
        trained.push_back({p.name, p.tensor});
    reducer_ = std::make_shared<dist::detail::Reducer>(group_, std::move(trained), options_, device_);
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
    // SyncBatchNorm's statistics are reduced across DataParallel replicas through a StatsReducer
    // (Note [statistics reducer]); no process-group reducer exists yet, and without one each
    // rank would silently normalise by its own batch only. Refuse rather than train wrongly.
    CHORUS_CHECK(group_.world_size() == 1 || !nn::module_of(module_).is_training() ||
                     !nn::module_of(module_).any_meets_other_replicas(),
                 "DistributedDataParallel: the module holds a SyncBatchNorm, whose statistics are not yet reduced "
                 "across processes (each of the ", group_.world_size(),
                 " ranks would normalise by its own batch only); use BatchNorm, or DataParallel within one process");
    if (options_.broadcast_buffers && group_.world_size() > 1) {
      auto& root = nn::module_of(module_);
      sync_from_rank0({}, root.named_buffers(), /*buffers_only=*/true);
    }
    const bool reduce = autograd::is_grad_enabled() && sync_ && !reducer_->params().empty();
    if (!reduce) {
      reducer_->disarm();
      return call(std::forward<Args>(args)...);
    }
    reducer_->prepare_step();
    Wiring wiring(*this);
    auto out = call(std::forward<Args>(args)...);
    wiring.restore();
    if (options_.find_unused_parameters) mark_unused(out);
    return out;
  }
  template <class... Args>
  auto operator()(Args&&... args) {
    return forward(std::forward<Args>(args)...);
  }

  /// While the returned guard lives, forward/backward accumulate gradients locally without
  /// reducing them; the first step after it reduces the accumulated sum (gradient accumulation).
  class NoSyncGuard {
   public:
    explicit NoSyncGuard(DistributedDataParallel& d) : d_(d), prev_(d.sync_) { d_.sync_ = false; }
    ~NoSyncGuard() { d_.sync_ = prev_; }
    NoSyncGuard(const NoSyncGuard&) = delete;
    NoSyncGuard& operator=(const NoSyncGuard&) = delete;

   private:
    DistributedDataParallel& d_;
    bool prev_;
  };
  [[nodiscard]] NoSyncGuard no_sync() { return NoSyncGuard(*this); }

  /// The wrapped module: save() of the wrapper or of module() writes the plain module's keys.
  M& module() { return module_; }
  const M& module() const { return module_; }
  std::vector<AnyTensor> parameters() const { return nn::module_of(module_).parameters(); }
  std::vector<nn::Module::NamedTensor> named_parameters() const { return nn::module_of(module_).named_parameters(); }
  void train(bool on = true) { nn::module_of(module_).train(on); }
  void eval() { train(false); }
  void zero_grad(bool set_to_none = true) { nn::module_of(module_).zero_grad(set_to_none); }
  Device device() const { return device_; }
  dist::ProcessGroup& process_group() const { return group_; }

  /// The current buckets, as lists of parameter names (first reduced first).
  std::vector<std::vector<std::string>> bucket_names() const {
    std::vector<std::vector<std::string>> out;
    for (const auto& b : reducer_->buckets()) {
      out.emplace_back();
      for (auto i : b.members) out.back().push_back(reducer_->params()[i].name);
    }
    return out;
  }
  /// True once the buckets were re-made from the observed gradient order.
  bool buckets_rebuilt() const { return reducer_->rebuilt(); }
  /// How many buckets of the last step started their all-reduce before backward had produced
  /// every gradient (overlapping it); all but the last, when the order is right.
  std::size_t buckets_started_early() const { return reducer_->early_launches(); }

 private:
  template <class... Args>
  auto call(Args&&... args) {
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
      const auto& params = d_.reducer_->params();
      d_.ready_nodes_.clear();
      for (std::size_t i = 0; i < params.size(); ++i) {
        params[i].tensor.visit([&](const auto& p) {
          using T = typename std::decay_t<decltype(p)>::value_type;
          if constexpr (is_floating_v<T>) {
            auto finalize = d_.template finalize_node<T>();
            auto node = std::make_shared<dist::detail::ParamReady<T>>(d_.reducer_, i);
            node->set_stream(&current_stream(p.device()));
            node->add_next_edge({finalize, 0});
            auto& impl = *p.impl();
            impl.output_nr = node->add_input(impl.shape, p.device());
            impl.grad_fn = node;
            d_.ready_nodes_.push_back(node.get());
          }
        });
      }
    }
    void restore() {
      if (restored_) return;
      restored_ = true;
      for (auto& p : d_.reducer_->params())
        p.tensor.visit([](const auto& t) {
          t.impl()->grad_fn = nullptr;
          t.impl()->output_nr = 0;
        });
      d_.finalize_f_.reset();
      d_.finalize_d_.reset();
    }
    ~Wiring() { restore(); }
    DistributedDataParallel& d_;
    bool restored_ = false;
  };

  template <class T>
  std::shared_ptr<autograd::Node<T>> finalize_node() {
    auto& slot = [&]() -> std::shared_ptr<void>& {
      if constexpr (std::is_same_v<T, float>) return finalize_f_;
      else return finalize_d_;
    }();
    if (!slot) {
      auto node = std::make_shared<dist::detail::Finalize<T>>(reducer_);
      node->set_stream(&current_stream(device_));
      slot = node;
    }
    return std::static_pointer_cast<autograd::Node<T>>(std::static_pointer_cast<dist::detail::Finalize<T>>(slot));
  }

  /// find_unused_parameters: parameters whose ParamReady node the outputs cannot reach.
  template <class R>
  void mark_unused(const R& out) {
    std::unordered_set<const void*> seen;
    auto visit_tensor = [&](const auto& t) {
      using T = typename std::decay_t<decltype(t)>::value_type;
      if constexpr (is_floating_v<T>)
        if (t.defined() && t.grad_fn()) dist::detail::reachable<T>({t.grad_fn()}, seen);
    };
    if constexpr (parallel::detail::is_tensor_v<R>) visit_tensor(out);
    else std::apply([&](const auto&... t) { (visit_tensor(t), ...); }, out);
    for (std::size_t i = 0; i < ready_nodes_.size(); ++i)
      if (!seen.count(ready_nodes_[i])) reducer_->set_unused(i);
  }

  /// Checks that all ranks hold the same parameter and buffer names, dtypes and shapes.
  void verify_same_model(const std::vector<nn::Module::NamedTensor>& params,
                         const std::vector<nn::Module::NamedTensor>& buffers) {
    std::vector<std::string> mine;
    for (const auto& p : params)
      mine.push_back("parameter '" + p.name + "' " + std::string(dtype_name(p.tensor.dtype())) + " " + shape_str(p.tensor.shape()));
    for (const auto& b : buffers)
      mine.push_back("buffer '" + b.name + "' " + std::string(dtype_name(b.tensor.dtype())) + " " + shape_str(b.tensor.shape()));
    const int world = group_.world_size();
    if (world == 1) return;
    std::string joined;
    for (const auto& s : mine) joined += s + '\n';
    auto len = Tensor<std::int64_t>::empty(Shape{1}, Device::cpu(0));
    len.data()[0] = static_cast<std::int64_t>(joined.size());
    auto lens = group_.all_gather(len);
    std::int64_t longest = 0;
    for (int r = 0; r < world; ++r) longest = std::max(longest, lens.data()[r]);
    auto bytes = Tensor<std::int64_t>::empty(Shape{longest}, Device::cpu(0));
    for (std::int64_t k = 0; k < longest; ++k)
      bytes.data()[k] = k < static_cast<std::int64_t>(joined.size()) ? static_cast<unsigned char>(joined[k]) : 0;
    auto all = group_.all_gather(bytes);
    auto lines_of = [&](int r) {
      std::vector<std::string> lines;
      std::string cur;
      for (std::int64_t k = 0; k < lens.data()[r]; ++k) {
        const char c = static_cast<char>(all.data()[r * longest + k]);
        if (c == '\n') {
          lines.push_back(cur);
          cur.clear();
        } else {
          cur += c;
        }
      }
      return lines;
    };
    const auto ref = lines_of(0);
    for (int r = 1; r < world; ++r) {
      const auto other = lines_of(r);
      for (std::size_t k = 0; k < std::max(ref.size(), other.size()); ++k) {
        if (k < ref.size() && k < other.size() && ref[k] == other[k]) continue;
        CHORUS_FAIL("DistributedDataParallel: the ranks hold different models: entry ", k, " is ",
                    k < ref.size() ? ref[k] : std::string("missing"), " on rank 0 but ",
                    k < other.size() ? other[k] : std::string("missing"), " on rank ", r);
      }
    }
  }
  static std::string shape_str(const Shape& s) {
    std::ostringstream os;
    os << s;
    return os.str();
  }

  /// Copies rank 0's parameters (unless buffers_only) and buffers to every rank.
  void sync_from_rank0(const std::vector<nn::Module::NamedTensor>& params,
                       const std::vector<nn::Module::NamedTensor>& buffers, bool buffers_only) {
    if (group_.world_size() == 1) return;
    NoGradGuard ng;
    std::vector<std::function<void()>> waits;
    auto start = [&](const nn::Module::NamedTensor& nt) {
      nt.tensor.visit([&](const auto& t) {
        auto c = t.is_contiguous() ? t : t.contiguous();
        auto work = group_.broadcast_async(c, 0, "broadcast of '" + nt.name + "' from rank 0");
        waits.push_back([this, t, c, work] {
          work->wait(group_.timeout());
          if (!is_same(c, t)) backend::copy(t, c);
        });
      });
    };
    if (!buffers_only)
      for (const auto& p : params) start(p);
    for (const auto& b : buffers) start(b);
    for (auto& w : waits) w();
  }

  M module_;
  Options options_;
  dist::ProcessGroup& group_;
  Device device_;
  std::shared_ptr<dist::detail::Reducer> reducer_;
  std::vector<const void*> ready_nodes_;
  std::shared_ptr<void> finalize_f_, finalize_d_;
  bool sync_ = true;
};

CHORUS_NAMESPACE_END
