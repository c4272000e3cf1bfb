#pragma once
// DistributedDataParallel: one process per device, gradients averaged over the process group
// (the buckets and graph nodes behind it: reducer.hpp, Notes [DDP buckets], [DDP graph nodes]).
#include <algorithm>
#include <exception>
#include <functional>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <unordered_set>
#include <vector>

#include "../nn/module.hpp"
#include "../parallel/data_parallel.hpp"
#include "process_group.hpp"
#include "reducer.hpp"
#include "stats_reducer.hpp"

CHORUS_NAMESPACE_BEGIN

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
    sync_from(0, named, buffers, /*buffers_only=*/false);
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

  /// Uneven inputs, PyTorch's `with ddp.join(): ...` (Note [DDP join]): runs `loop` (this rank's
  /// training loop over its own batches; every forward in it a training step), then, until every
  /// rank's loop has ended, takes part in the other ranks' steps with zero gradients, so that
  /// nobody waits for a collective a finished rank never starts. The gradients are averaged over
  /// the whole world (a finished rank adds zeros: PyTorch's divide_by_initial_world_size). At the
  /// end every rank holds the parameters and buffers of the last rank to finish.
  template <class F>
  void join(F&& loop) {
    CHORUS_CHECK(!joining_, "DistributedDataParallel::join: already inside join()");
    if (group_.world_size() == 1) {
      std::forward<F>(loop)();
      return;
    }
    CHORUS_CHECK(!nn::module_of(module_).any_meets_other_replicas(),
                 "DistributedDataParallel::join: the module holds a SyncBatchNorm, whose statistics reductions a "
                 "rank that ran out of data cannot take part in");
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
    }
    joining_ = false;
    if (last_joiner_ >= 0) {
      auto& root = nn::module_of(module_);
      sync_from(last_joiner_, root.named_parameters(), root.named_buffers(), /*buffers_only=*/false);
    }
  }

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

  /// PyTorch's register_comm_hook with one of its built-in hooks (Note [DDP communication
  /// hooks]): once, before the first forward that reduces gradients.
  void register_comm_hook(dist::CommHook hook) { reducer_->set_comm_hook(hook); }

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
        if (t.defined() && t.grad_fn())
          dist::detail::reachable(std::vector<std::shared_ptr<autograd::NodeBase>>{t.grad_fn()}, seen);
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

  // Note [DDP join]
  // PyTorch's Join for DDP. Inside join(), every forward of a rank that still has data starts
  // with an all-gather of one flag per rank (1: still training); a rank whose loop has ended
  // answers each such round with 0 and then runs the step's collectives with zero gradients
  // (Reducer::shadow_step), until a round finds every flag 0. The flags also name the last rank
  // to finish (the highest rank still training): buffers come from it while the others join,
  // and its parameters and buffers go to every rank at the end (the finished ranks skipped the
  // optimizer steps of the rounds they shadowed). One all-gather of a flag per step is the cost.
  /// One round of flags; true while some rank still trains.
  bool join_round(bool training) {
    auto flag = Tensor<std::int64_t>::empty(Shape{1}, Device::cpu(0));
    flag.data()[0] = training ? 1 : 0;
    auto flags = group_.all_gather(flag);
    int last = -1;
    for (int r = 0; r < group_.world_size(); ++r)
      if (flags.data()[r]) last = r;
    if (last >= 0) last_joiner_ = last;
    return last >= 0;
  }

  /// Copies rank `root`'s parameters (unless buffers_only) and buffers to every rank.
  void sync_from(int root, const std::vector<nn::Module::NamedTensor>& params,
                 const std::vector<nn::Module::NamedTensor>& buffers, bool buffers_only) {
    if (group_.world_size() == 1) return;
    NoGradGuard ng;
    std::vector<std::function<void()>> waits;
    auto start = [&](const nn::Module::NamedTensor& nt) {
      nt.tensor.visit([&](const auto& t) {
        auto c = t.is_contiguous() ? t : t.contiguous();
        auto work = group_.broadcast_async(c, root, "broadcast of '" + nt.name + "' from rank " + std::to_string(root));
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
  bool joining_ = false;  // inside join() (Note [DDP join])
  int last_joiner_ = -1;  // the highest rank still training in the latest round
};

CHORUS_NAMESPACE_END
