#pragma once
// The definitions of distributed/reducer.hpp (the Reducer behind DistributedDataParallel):
// compiled into chorus::compiled and the MPI library (src/distributed/local.cpp, mpi.cpp),
// included by reducer.hpp itself in the header-only form (Note [compiled chorus]).
#include "reducer.hpp"

CHORUS_NAMESPACE_BEGIN
namespace dist::detail {

CHORUS_INLINE Reducer::Reducer(ProcessGroup& group, std::vector<Param> params, DistributedDataParallelOptions options,
                               Device device)
    : group_(group), params_(std::move(params)), options_(options), device_(device) {
  build_buckets_in_reverse();
}

CHORUS_INLINE void Reducer::set_comm_hook(dist::CommHook hook) {
  std::lock_guard<std::mutex> lk(m_);
  CHORUS_CHECK(!hook_set_, "DistributedDataParallel::register_comm_hook can only be called once");
  CHORUS_CHECK(steps_ == 0 && !armed_, "DistributedDataParallel::register_comm_hook must be called before the first "
                                       "forward that reduces gradients");
  hook_ = hook;
  hook_set_ = true;
}

CHORUS_INLINE void Reducer::shard(std::vector<int> owner) {
  std::lock_guard<std::mutex> lk(m_);
  CHORUS_CHECK(steps_ == 0 && !armed_, "DistributedDataParallel::shard_gradients must be called before the first "
                                       "forward that reduces gradients");
  CHORUS_CHECK(owner.size() == params_.size(), "DistributedDataParallel::shard_gradients: ", owner.size(),
               " owners for ", params_.size(), " parameters");
  owner_ = std::move(owner);
  build_buckets_in_reverse();
}

CHORUS_INLINE void Reducer::build_buckets_in_reverse() {
  std::vector<std::size_t> order(params_.size());
  std::iota(order.begin(), order.end(), std::size_t{0});
  std::reverse(order.begin(), order.end());
  build_buckets(order);
}

CHORUS_INLINE void Reducer::prepare_step() {
  std::lock_guard<std::mutex> lk(m_);
  check_previous_step();
  if (!rebuilt_ && steps_ > 0) rebuild();
  for (auto& b : buckets_) {
    b.pending = b.members.size();
    b.work.reset();
    if (!b.flat.defined()) b.flat = empty_any(b.dtype, Shape{b.numel}, device_);  // another rank's bucket
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

CHORUS_INLINE void Reducer::set_unused(std::size_t i) {
  std::lock_guard<std::mutex> lk(m_);
  if (!used_[i]) return;
  used_[i] = false;
  ready_[i] = true;
  ++ready_count_;
  --buckets_[bucket_of_[i]].pending;
}

CHORUS_INLINE void Reducer::mark_ready(std::size_t i, const AnyTensor& grad) {
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

CHORUS_INLINE void Reducer::finalize() {
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
  NoGradGuard ng;
  for (auto& b : buckets_) {
    if (owns(b)) {
      if (b.wire.defined()) decompress(b);
      continue;
    }
    // Another rank's bucket (Note [ZeRO-2 over the process group]): its gradients leave here.
    for (auto i : b.members)
      params_[i].tensor.visit([](auto& p) {
        using T = typename std::decay_t<decltype(p)>::value_type;
        if constexpr (is_floating_v<T>) {
          p.set_grad(Tensor<T>());
          p.impl()->grad_on_other_rank = true;
        }
      });
    b.flat = AnyTensor();
    b.wire = AnyTensor();
    b.work.reset();  // it keeps the bucket alive
  }
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
  for (auto& b : buckets_) {
    if (!owns(b)) continue;
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

CHORUS_INLINE void Reducer::expect_finalizers(int n) {
  std::lock_guard<std::mutex> lk(m_);
  finalizers_pending_ = n;
}

CHORUS_INLINE void Reducer::finalizer_ran() {
  {
    std::lock_guard<std::mutex> lk(m_);
    if (--finalizers_pending_ > 0) return;  // another dtype's Finalize node is still to run
  }
  finalize();
}

CHORUS_INLINE void Reducer::shadow_step() {
  prepare_step();
  {
    std::lock_guard<std::mutex> lk(m_);
    // This rank used nothing: finalize() points every parameter some rank used at its averaged
    // gradient, as a real step leaves it (Note [DDP join]: a shadow optimizer step reads it).
    used_.assign(params_.size(), false);
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

CHORUS_INLINE void Reducer::check_previous_step() {
  if (started_ && !finalized_) {
    group_.mark_broken("a DistributedDataParallel backward pass was interrupted");
    CHORUS_FAIL("DistributedDataParallel on rank ", group_.rank(),
                ": the previous backward pass started reducing gradients but did not finish (it threw?); "
                "the ranks are out of step and the process group is now broken");
  }
}

CHORUS_INLINE std::size_t Reducer::position(const Bucket& b, std::size_t i) const {
  return static_cast<std::size_t>(std::find(b.members.begin(), b.members.end(), i) - b.members.begin());
}

CHORUS_INLINE bool Reducer::prescaled(const Bucket& b) const {
  return device_.is_cpu() && group_.world_size() > 1 && wire_of(b) == b.dtype;
}

CHORUS_INLINE DType Reducer::wire_of(const Bucket& b) const {
  const DType wire = hook_ == dist::CommHook::fp16_compress   ? DType::Float16
                     : hook_ == dist::CommHook::bf16_compress ? DType::BFloat16
                                                              : b.dtype;
  return b.dtype == DType::Float32 || b.dtype == DType::Float64 ? wire : b.dtype;
}

CHORUS_INLINE void Reducer::accumulate_into_bucket(Bucket& b, std::size_t i, const AnyTensor& grad) {
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

CHORUS_INLINE void Reducer::launch_ready() {
  while (next_bucket_ < buckets_.size() && buckets_[next_bucket_].pending == 0) {
    auto& b = buckets_[next_bucket_];
    // Unused members (find_unused_parameters) count as zeros.
    for (std::size_t k = 0; k < b.members.size(); ++k)
      if (!used_[b.members[k]]) zero_slot(b, k);
    if (ready_count_ < params_.size()) ++early_launches_;  // overlaps the rest of backward
    const std::string what = (b.owner < 0 ? std::string("all_reduce") : "reduce to rank " + std::to_string(b.owner)) +
                             " of gradient bucket " + std::to_string(next_bucket_);
    // Every rank, or the owner (Note [ZeRO-2 over the process group]).
    const auto start = [&](const auto& t, ReduceOp op, const std::string& w) {
      return b.owner < 0 ? group_.all_reduce_async(t, op, w) : group_.reduce_async(t, op, b.owner, w);
    };
    const DType wire = wire_of(b);
    if (wire != b.dtype) {
      b.wire = compress(b.flat, wire);
      const std::string compressed = what + " (" + std::string(dtype_name(wire)) + "-compressed)";
      b.wire.visit([&](const auto& c) { b.work = start(c, ReduceOp::Sum, compressed); });
    } else {
      const ReduceOp op = prescaled(b) ? ReduceOp::Sum : ReduceOp::Avg;  // Note [DDP pre-division]
      b.flat.visit([&](const auto& f) { b.work = start(f, op, what); });
    }
    ++next_bucket_;
  }
}

CHORUS_INLINE AnyTensor Reducer::compress(const AnyTensor& flat, DType wire) const {
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

CHORUS_INLINE void Reducer::decompress(Bucket& b) {
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

CHORUS_INLINE void Reducer::zero_slot(Bucket& b, std::size_t k) {
  params_[b.members[k]].tensor.visit([&](auto& p) {
    using T = typename std::decay_t<decltype(p)>::value_type;
    if constexpr (is_floating_v<T>) {
      auto slot = slot_of(b, k, p);
      if (is_slot(p.grad(), slot)) p.set_grad(slot.clone());
      backend::fill(slot, T(0));
    }
  });
}

CHORUS_INLINE void Reducer::rebuild() {
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

CHORUS_INLINE void Reducer::build_buckets(const std::vector<std::size_t>& order) {
  buckets_.clear();
  bucket_of_.assign(params_.size(), 0);
  // One open bucket per dtype (and owner: Note [ZeRO-2 over the process group]); a bucket
  // closes when it reaches its size limit (the first bucket of each: first_bucket_bytes).
  struct Open {
    DType dtype;
    int owner;
    std::vector<std::size_t> members;
    std::size_t bytes = 0;
    bool first = true;
  };
  std::vector<Open> open;
  struct Closed {
    DType dtype;
    int owner;
    std::vector<std::size_t> members;
  };
  std::vector<Closed> closed;
  for (auto i : order) {
    const auto& t = params_[i].tensor;
    const int owner = owner_.empty() ? -1 : owner_[i];
    auto it = std::find_if(open.begin(), open.end(),
                           [&](const Open& o) { return o.dtype == t.dtype() && o.owner == owner; });
    if (it == open.end()) {
      open.push_back({t.dtype(), owner, {}, 0, true});
      it = open.end() - 1;
    }
    it->members.push_back(i);
    it->bytes += t.nbytes();
    const std::size_t limit = it->first ? options_.first_bucket_bytes : options_.bucket_cap_bytes;
    if (it->bytes >= limit) {
      closed.push_back({it->dtype, it->owner, std::move(it->members)});
      it->members.clear();
      it->bytes = 0;
      it->first = false;
    }
  }
  for (auto& o : open)
    if (!o.members.empty()) closed.push_back({o.dtype, o.owner, std::move(o.members)});
  for (std::size_t b = 0; b < closed.size(); ++b) {
    Bucket bucket;
    bucket.dtype = closed[b].dtype;
    bucket.owner = closed[b].owner;
    bucket.members = std::move(closed[b].members);
    for (auto i : bucket.members) {
      bucket.offsets.push_back(bucket.numel);
      bucket.numel += params_[i].tensor.numel();
      bucket_of_[i] = b;
    }
    if (owns(bucket)) bucket.flat = empty_any(bucket.dtype, Shape{bucket.numel}, device_);
    buckets_.push_back(std::move(bucket));
  }
}

CHORUS_INLINE void reachable(const std::vector<std::shared_ptr<autograd::NodeBase>>& roots,
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
