#pragma once
// DataParallel: one model, many devices. Each call splits the batch (Note [chunk plan]),
// refreshes the replicas from the primary (Note [flat replication]), runs the replicas'
// forward passes concurrently on their devices' streams, and gathers the outputs on the
// output device; backward runs each replica's half of the graph on its device and sums the
// gradients into the primary's parameters bucket by bucket (Note [gradient buckets]).
//
// Note [DataParallel threads]
// forward runs the replicas' forward passes concurrently, on the devices' worker threads
// (replica 0 on the calling thread). So:
//  - Anything a module's forward prints comes from several threads at once: a line built
//    with several `std::cout << a << b` can interleave with other replicas' lines. Print
//    whole lines with chorus::println(...) (core/println.hpp) or std::osyncstream.
//  - One DataParallel serves one thread at a time, for a whole step (forward, backward,
//    optimizer step): its replicas and their autograd wiring are shared state. A forward
//    entered while another thread is inside forward of the same DataParallel throws
//    chorus::Error instead of racing; for concurrent inference use one DataParallel per thread.
//  - A DataParallel cannot be called from inside a replica's forward (a device worker thread),
//    e.g. nested in a module that DataParallel replicates: the worker would wait for work
//    queued behind itself. That throws chorus::Error instead of deadlocking; call the inner
//    module directly there.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <concepts>
#include <initializer_list>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

#include "arguments.hpp"
#include "chunk_plan.hpp"
#include "comm.hpp"
#include "data_parallel_core.hpp"
#include "data_parallel_options.hpp"
#include "gather.hpp"
#include "parallel_apply.hpp"
#include "replicate.hpp"
#include "scatter.hpp"
#include "stats_reducer.hpp"

CHORUS_NAMESPACE_BEGIN

namespace parallel {
template <class O>
class ShardedOptimizer;
}

namespace parallel::detail {
template <class M, class... Args>
decltype(auto) call_forward(M& m, Args&&... args) {
  if constexpr (requires { m.forward(std::forward<Args>(args)...); }) {
    return m.forward(std::forward<Args>(args)...);
  } else {
    return m->forward(std::forward<Args>(args)...);
  }
}

/// A replica's module and a criterion as one forward (DataParallel::forward_loss).
template <class Module, class Criterion>
struct WithCriterion {
  Module& module;
  Criterion& criterion;
  template <class Input, class Target>
  decltype(auto) forward(Input&& input, Target&& target) {
    return criterion(call_forward(module, std::forward<Input>(input)), std::forward<Target>(target));
  }
};
}  // namespace parallel::detail

/// How DataParallel::forward_loss combines the replicas' losses: `{.reduction = Reduction::Sum}`.
struct ForwardLossOptions {
  Reduction reduction = Reduction::Mean;  ///< Mean: weighted by what each replica averaged over; Sum: added
  /// An integer target's value that the criterion skips (cross_entropy's and nll_loss's default):
  /// under Reduction::Mean each replica weighs by its count of the other targets.
  std::int64_t ignore_index = -100;
};

/// One module on several devices of one process, as PyTorch's nn.DataParallel: each call splits
/// the batch over the devices, runs the replicas concurrently and gathers the outputs; backward
/// sums the replicas' gradients into the module's parameters.
template <class M>
class DataParallel : public parallel::DataParallelCore {
  static_assert(std::is_base_of_v<nn::Module, M> || requires { typename M::ImplType; },
                "DataParallel wraps an nn::Module (or a module holder)");

 public:
  /// Wraps `module` for `devices` (default: all GPUs, else the virtual CPU devices); outputs
  /// are gathered on `output_device` (default devices[0]) along `dim` (the dimension inputs are
  /// split along, default 0). Gradients are reduced in buckets of about `bucket_bytes` (default
  /// kDefaultBucketBytes on GPUs, kDefaultCpuBucketBytes on CPU devices; Note [gradient
  /// buckets]). The module should live on devices[0]; one that does not yet is moved there by
  /// to(devices[0]) (a forward before that throws), as PyTorch's nn.DataParallel(model).to(...).
  /// (A template, and an initializer_list overload, so that a braced options list `{.devices =
  /// ...}` picks the options constructor below instead of being ambiguous with this one.)
  template <class D>
    requires std::convertible_to<D, std::vector<Device>>
  DataParallel(M module, D&& devices, std::optional<Device> output_device = std::nullopt, std::int64_t dim = 0,
               std::optional<std::size_t> bucket_bytes = std::nullopt)
      : DataParallel(std::move(module), DataParallelOptions{.devices = std::vector<Device>(std::forward<D>(devices)),
                                                            .output_device = output_device,
                                                            .dim = dim,
                                                            .bucket_bytes = bucket_bytes}) {}
  /// The same, for a braced list of devices.
  DataParallel(M module, std::initializer_list<Device> devices, std::optional<Device> output_device = std::nullopt,
               std::int64_t dim = 0, std::optional<std::size_t> bucket_bytes = std::nullopt)
      : DataParallel(std::move(module), std::vector<Device>(devices), output_device, dim, bucket_bytes) {}
  /// The same from options, which also give per-argument and per-output dims (Note [scatter
  /// and gather dims]).
  explicit DataParallel(M module, DataParallelOptions options = {})
      : DataParallelCore(std::move(options)), module_(std::move(module)) {
    if (module_on(nn::module_of(module_), devices_[0]))
      install(build(devices_));  // else at to(devices[0]) or the first forward
  }

  /// Scatters the tensors of the arguments (also inside tuples, vectors, maps, optionals: Note
  /// [nested arguments]; along scatter_dims, Note [scatter and gather dims]), runs the replicas,
  /// gathers the outputs of the same forms. A forward without any tensor to split runs once, on
  /// the primary device. A replica's exception arrives as chorus::Error with the original nested
  /// (Note [replica errors]).
  template <class... Args>
  auto forward(Args&&... args) {
    (parallel::detail::check_argument<Args>(), ...);
    parallel::detail::check_dims_fit("DataParallel", "scatter_dims", scatter_dims_.size(), sizeof...(Args),
                                     "forward arguments");
    check_not_nested();
    const InUse in_use(in_forward_);  // Note [DataParallel threads]
    if (!replicator_) install(build(devices_));  // the module was elsewhere at construction
    if constexpr (sizeof...(Args) == 0) {
      return forward_on_primary(Gathered{});
    } else {
      return forward_split(Gathered{}, args...);
    }
  }

  /// Runs `criterion(forward(input), target)` on each replica's device and returns the whole
  /// batch's loss on the output device (the "DataParallelCriterion" PyTorch users write): the
  /// input and the target are split along their scatter dims (the target is argument 1), and only
  /// the per-replica losses, one value each, travel to the output device, where they combine
  /// (Reduction::Mean: weighted by each replica's share of what the criterion averaged over, its
  /// rows, or for an integer target its targets other than `ignore_index`, as the default
  /// mse_loss and cross_entropy average; Reduction::Sum: added). The outputs are never gathered,
  /// so the primary device holds its own chunk's only. The criterion is called on the replicas'
  /// threads at once: it must not write shared state.
  template <class Criterion, class Input, class Target>
  auto forward_loss(Criterion&& criterion, const Input& input, const Target& target, ForwardLossOptions options) {
    parallel::detail::check_argument<Input>();
    parallel::detail::check_argument<Target>();
    CHORUS_CHECK(options.reduction != Reduction::None, "DataParallel::forward_loss: the replicas' losses combine by "
                                                       "Reduction::Mean or Reduction::Sum, not None");
    parallel::detail::check_dims_fit("DataParallel::forward_loss", "scatter_dims", scatter_dims_.size(), 2,
                                     "arguments (input, target)");
    CHORUS_CHECK(scatter_dim(0) != kBroadcast && scatter_dim(1) != kBroadcast,
                 "DataParallel::forward_loss: the input and the target are split by rows (scatter_dims[",
                 scatter_dim(0) == kBroadcast ? 0 : 1, "] is kBroadcast); pass what every replica needs whole "
                 "through forward() instead");
    check_not_nested();
    const InUse in_use(in_forward_);  // Note [DataParallel threads]
    if (!replicator_) install(build(devices_));
    return forward_split(WithLoss<std::remove_reference_t<Criterion>, Target>{criterion, options, target}, input,
                         target);
  }
  /// The same with only the reduction given (default Reduction::Mean, `ignore_index` -100).
  template <class Criterion, class Input, class Target>
  auto forward_loss(Criterion&& criterion, const Input& input, const Target& target,
                    Reduction reduction = Reduction::Mean) {
    return forward_loss(std::forward<Criterion>(criterion), input, target, ForwardLossOptions{.reduction = reduction});
  }

  /// Calls forward(args...).
  template <class... Args>
  auto operator()(Args&&... args) {
    return forward(std::forward<Args>(args)...);
  }

 private:
  // What a forward makes of the replicas' results: forward() gathers their outputs;
  // forward_loss() runs the criterion in each replica and combines the losses.
  struct Gathered {
    template <class Module>
    Module& wrap(Module& m) const {
      return m;
    }
    template <class R>
    R finish(const DataParallel& dp, std::vector<R>& outs, const parallel::ChunkPlan&) const {
      return dp.gather_outputs(outs);
    }
    template <class R>
    R primary(R out) const {  // one replica: its result as it is
      return out;
    }
  };
  template <class Criterion, class Target>
  struct WithLoss {
    Criterion& criterion;
    ForwardLossOptions options;
    const Target& target;
    template <class Module>
    parallel::detail::WithCriterion<Module, Criterion> wrap(Module& m) const {
      return {m, criterion};
    }
    template <class R>
    R finish(const DataParallel& dp, std::vector<R>& losses, const parallel::ChunkPlan& plan) const {
      static_assert(parallel::detail::is_tensor_v<R>, "DataParallel::forward_loss: the criterion must return a tensor");
      std::vector<std::int64_t> counts(plan.sizes.begin(), plan.sizes.begin() + static_cast<std::ptrdiff_t>(losses.size()));
      if constexpr (std::is_same_v<Target, Tensor<std::int64_t>>) {
        if (options.reduction == Reduction::Mean) {  // each replica's targets that count (on the host)
          const auto t = target.to(Device::cpu());
          const std::int64_t dim = wrap_dim(dp.scatter_dim(1), t.dim());
          for (std::size_t r = 0; r < losses.size(); ++r) {
            const auto chunk = t.narrow(dim, plan.offsets[r], plan.sizes[r]).contiguous().to_vector();
            counts[r] = std::count_if(chunk.begin(), chunk.end(), [&](std::int64_t v) { return v != options.ignore_index; });
          }
        }
      }
      return parallel::detail::combine_losses(losses, counts, options.reduction, dp.output_device_);
    }
    template <class R>
    R primary(R loss) const {  // one replica: its loss is the batch's, if it is one value
      CHORUS_CHECK(loss.defined() && loss.numel() == 1, "DataParallel::forward_loss: the criterion returned ",
                   loss.defined() ? "a tensor of shape " + loss.shape().str() : std::string("an undefined tensor"),
                   " in replica 0; it must return one value (a reduced loss)");
      return loss.dim() == 0 ? loss : loss.reshape(Shape{});
    }
  };
  template <class How, class... Args>
  auto forward_on_primary(const How& how, const Args&... args) {
    auto&& m = how.wrap(module_);
    using R = decltype(parallel::detail::call_forward(m, parallel::detail::move_part(args, devices_[0])...));
    check_output<R>();
    replicator_->prepare(1);
    return how.primary(to_output(
        on_primary([&] { return parallel::detail::call_forward(m, parallel::detail::move_part(args, devices_[0])...); })));
  }

  template <class How, class... Args>
  auto forward_split(const How& how, const Args&... args) {
    const auto split = split_size(args...);
    const std::int64_t batch = split.batch;
    // Passthrough (one device) and a call without tensors to split (PyTorch's zero inputs): once, on the primary.
    if (devices_.size() == 1 || batch < 0) return forward_on_primary(how, args...);
    using W = std::remove_reference_t<decltype(how.wrap(module_))>;  // M, or M with the criterion
    using R = std::remove_cvref_t<decltype(call_replica(std::declval<W&>(), std::declval<const parallel::ChunkPlan&>(), 0,
                                                        args...))>;
    check_output<R>();
    random_dim_ = split.dim;
    const auto plan = parallel::plan_chunks(batch, devices_.size());
    if (runs_on_caller(plan, batch, args...)) return forward_on_caller<R>(how, plan, args...);
    fork_replica_streams();  // after the work issued so far (inputs, optimizer step)
    keep_workers_hot(plan.used());
    auto modules = [&] {
      const profiler::Scope span(profiler::Category::copy, "replicate");
      auto made = replicator_->prepare(plan.used());
      if (has_buffers_) wait_for_broadcasts();
      return made;
    }();
    std::vector<Stream*> streams(streams_.begin(), streams_.begin() + static_cast<std::ptrdiff_t>(plan.used()));
    streams[0] = &current_stream(devices_[0]);
    // SyncBatchNorm layers sum their statistics over the replicas of this call (Note [statistics reducer]).
    auto stats = std::make_shared<parallel::ReplicaStatsGroup>(static_cast<int>(plan.used()));
    const auto versions = replicator_->aliased_versions();
    auto random = std::make_shared<ReplicaRandomGroup>();  // Note [dropout random numbers]
    auto outs = parallel::parallel_apply(streams, [&](std::size_t r) -> R {
      StatsReducerScope sync(stats->member(static_cast<int>(r)));
      ReplicaRandomScope rs(random, static_cast<int>(r), random_dim_, plan.offsets[r], plan.sizes[r], batch);
      try {
        const parallel::detail::ReplicaSpan span(*modules[r], r, devices_[r]);
        auto&& m = how.wrap(*modules[r]);
        return call_replica(m, plan, r, args...);
      } catch (...) {
        stats->cancel(static_cast<int>(r));  // the others stop waiting for it (Note [cancelled reductions])
        throw;
      }
    });
    replicator_->check_parameters_unwritten(versions);
    return how.finish(*this, outs, plan);
  }

 public:
  /// The wrapped (primary) module, as PyTorch's `model.module`: the nn::Module itself (for a
  /// holder such as nn::Sequential, the module it holds), so that `dp.module().named_buffers()`,
  /// `dp.module().fc1` and `dp.module().forward(x)` work whatever M is.
  ///@{
  auto& module() { return unwrap(module_); }
  const auto& module() const { return unwrap(module_); }
  ///@}

  // The registry, as on the module, with names prefixed by name_prefix().
  /// The module's parameters (of its submodules too unless `recurse` is false).
  std::vector<AnyTensor> parameters(bool recurse = true) const { return nn::module_of(module_).parameters(recurse); }
  /// The module's parameters with their names, each prefixed by name_prefix().
  std::vector<nn::Module::NamedTensor> named_parameters(bool recurse = true) const {
    return prefixed(nn::module_of(module_).named_parameters(recurse));
  }
  /// The module's buffers (of its submodules too unless `recurse` is false).
  std::vector<AnyTensor> buffers(bool recurse = true) const { return nn::module_of(module_).buffers(recurse); }
  /// The module's buffers with their names, each prefixed by name_prefix().
  std::vector<nn::Module::NamedTensor> named_buffers(bool recurse = true) const {
    return prefixed(nn::module_of(module_).named_buffers(recurse));
  }
  /// Parameters then buffers (what a checkpoint holds; save(dp, path) writes these names).
  std::vector<nn::Module::NamedTensor> named_tensors() const { return prefixed(nn::module_of(module_).named_tensors()); }

  /// The prefix of the names above: "" (default, the module's own names) or, with
  /// set_name_prefix("module."), the names of PyTorch's nn.DataParallel state_dict, so that a
  /// checkpoint saved from one matches the other (load(dp, path) strips it again).
  DataParallel& set_name_prefix(std::string prefix) {
    set_name_prefix_core(std::move(prefix));
    return *this;
  }

  /// ZeRO stage 2 in one process (Note [sharded gradients in one process]): from now on each
  /// parameter's gradient is kept on the device whose shard of `opt` steps it, arriving there
  /// during backward, so after backward each device holds its shard's gradients only.
  /// `opt` is a ShardedOptimizer over this DataParallel's parameters and devices.
  template <class O>
  DataParallel& shard_gradients(parallel::ShardedOptimizer<O>& opt) {
    auto names = [](const std::vector<Device>& ds) {
      std::string out;
      for (const auto& d : ds) out += (out.empty() ? "" : ", ") + d.str();
      return out;
    };
    CHORUS_CHECK(opt.devices() == devices_, "DataParallel::shard_gradients: the optimizer's shards are on ",
                 names(opt.devices()), ", this DataParallel's devices are ", names(devices_));
    std::vector<const void*> mine, theirs;
    for (const auto& p : parameters()) mine.push_back(p.impl_key());
    for (const auto& p : opt.parameters()) theirs.push_back(p.impl_key());
    std::sort(mine.begin(), mine.end());
    std::sort(theirs.begin(), theirs.end());
    CHORUS_CHECK(mine == theirs, "DataParallel::shard_gradients: the optimizer steps other parameters than this "
                                 "DataParallel's parameters() (", theirs.size(), " against ", mine.size(),
                 "); build the ShardedOptimizer from the DataParallel, or from parameter groups of dp.parameters()");
    opt.shard_gradients();
    return *this;
  }

  /// Sets the module's training mode (the replicas follow at the next forward).
  void train(bool on = true) { nn::module_of(module_).train(on); }
  /// train(false).
  void eval() { train(false); }
  /// Whether the module is in training mode.
  bool is_training() const { return nn::module_of(module_).is_training(); }
  /// Clears (set_to_none, the default) or zeroes the gradients of the module's parameters.
  void zero_grad(bool set_to_none = true) { nn::module_of(module_).zero_grad(set_to_none); }

  /// Moves the primary module to `device` and rebuilds the replicas (PyTorch's
  /// `nn.DataParallel(model).to(device)`): `device` becomes the primary device; when it is one
  /// of devices(), it moves to the front (the others keep their order), else it replaces
  /// devices()[0]. An output device that was the primary follows it. Parameter handles held
  /// elsewhere (an optimizer's) stay valid: the tensors move in place, and an optimizer's state
  /// follows them at its next step (Note [optimizer state follows the parameters]).
  /// Strong guarantee: if moving or rebuilding throws, the DataParallel and its module are as
  /// they were (the new replicas are built before the old ones go, so for a moment both exist).
  DataParallel& to(Device device) {
    check_move(device);
    const InUse in_use(in_forward_);
    if (device == devices_[0]) {
      nn::module_of(module_).to(device);  // a module moved behind our back (or never there) comes home
      if (!replicator_) install(build(devices_));
      return *this;
    }
    auto moved = moved_to(device);
    const auto saved = save_tensors(nn::module_of(module_));
    try {
      nn::module_of(module_).to(device);
      auto built = build(moved.devices);
      set_devices(std::move(moved.devices), moved.output);
      install(std::move(built));
    } catch (...) {
      restore_tensors(saved);  // the old replicas read the module's old storage again
      throw;
    }
    return *this;
  }

  /// Steps whose work off the caller is at most `work` run on the calling thread (Note
  /// [inline small steps]); 0: never.
  DataParallel& set_inline_work(std::int64_t work) {
    set_inline_work_core(work);
    return *this;
  }
  /// The replica on devices()[r] (0 is the primary module itself), as module() is.
  const auto& replica(std::size_t r) const { return unwrap(built().replica(r)); }
  /// The communicator that refreshes the replicas and sums their gradients (Note [communicators]).
  const parallel::Communicator& communicator() const { return (built(), *comm_); }

 private:
  static constexpr bool kHolder = requires { typename M::ImplType; };
  const parallel::Replicator<M>& built() const {
    CHORUS_CHECK(replicator_, "DataParallel: no replicas yet: the module is not on the primary device ", devices_[0],
                 " (call to(", devices_[0], "))");
    return *replicator_;
  }
  template <class X>
  static auto& unwrap(X& m) {
    if constexpr (kHolder) return *m;  // the holder's module (a const holder still yields the module)
    else return m;
  }
  static const auto& unwrap(const M& m) {
    if constexpr (kHolder) return static_cast<const typename M::ImplType&>(*m);
    else return m;
  }

  struct Built {
    Links links;
    std::unique_ptr<parallel::Replicator<M>> replicator;
    bool has_buffers = false, meets_other_replicas = false;
  };
  /// Streams, communicator and replicas for `devices`; nothing of this DataParallel changes but
  /// the module's storage (flattened).
  Built build(const std::vector<Device>& devices) {
    Built b;
    b.links = link(devices);
    b.replicator = std::make_unique<parallel::Replicator<M>>(module_, devices, b.links.comm, bucket_bytes_for(devices));
    b.has_buffers = !nn::module_of(module_).named_buffers().empty();
    b.meets_other_replicas = nn::module_of(module_).any_meets_other_replicas();
    return b;
  }
  void install(Built&& b) noexcept {
    install_links(std::move(b.links), b.has_buffers, b.meets_other_replicas);
    replicator_ = std::move(b.replicator);  // the old replicas go
  }

  /// Runs replica 0's forward on the calling thread (one device, or nothing to split), with its
  /// errors reported as the threaded replicas' are (Note [replica errors]).
  template <class F>
  auto on_primary(F&& f) {
    autograd::ReplicaGuard rg(0);
    try {
      return f();
    } catch (...) {
      parallel::detail::rethrow_in_replica(std::current_exception(), 0, devices_[0]);
    }
  }

  // ---- small steps (Note [inline small steps]) ----
  template <class... Args>
  bool runs_on_caller(const parallel::ChunkPlan& plan, std::int64_t batch, const Args&... args) const {
    if (inline_work_ <= 0 || !devices_[0].is_cpu() || batch <= 0) return false;
    if (meets_other_replicas_) return false;  // SyncBatchNorm: replicas wait for each other
    const std::int64_t rows = batch - plan.sizes[0];  // the rows that would leave the caller
    const std::int64_t params = replicator_->parameter_numel();
    if (params > inline_work_) return false;
    if (rows > inline_work_ / (2 * std::max<std::int64_t>(params, 1))) return false;  // no overflow below
    std::int64_t work = rows * 2 * params;
    auto add_input = [&](const auto& t, const parallel::detail::LeafPath&) {
      if (t.defined()) work += t.numel() / batch * rows;
    };
    (parallel::detail::for_each_tensor(args, parallel::detail::LeafPath{}, add_input), ...);
    return work <= inline_work_;
  }

  template <class R, class How, class... Args>
  R forward_on_caller(const How& how, const parallel::ChunkPlan& plan, const Args&... args) {
    auto modules = replicator_->prepare(plan.used(), /*on_caller=*/true);
    const auto versions = replicator_->aliased_versions();
    std::vector<R> outs;
    outs.reserve(plan.used());
    auto random = std::make_shared<ReplicaRandomGroup>();  // Note [dropout random numbers]
    const std::int64_t batch = plan.offsets.back() + plan.sizes.back();
    for (std::size_t r = 0; r < plan.used(); ++r) {
      ReplicaRandomScope rs(random, static_cast<int>(r), random_dim_, plan.offsets[r], plan.sizes[r], batch);
      std::optional<StreamGuard> on_stream;  // replica r's stream is current, as on its worker
      if (r > 0) on_stream.emplace(*streams_[r]);
      autograd::ReplicaGuard rg(static_cast<int>(r));  // its nodes name the replica in backward errors
      try {
        const parallel::detail::ReplicaSpan span(*modules[r], r, devices_[r]);
        auto&& m = how.wrap(*modules[r]);
        outs.push_back(call_replica(m, plan, r, args...));
      } catch (...) {
        parallel::detail::rethrow_in_replica(std::current_exception(), r, devices_[r]);
      }
    }
    replicator_->check_parameters_unwritten(versions);
    return how.finish(*this, outs, plan);
  }

  // ---- scattering (Note [nested arguments], Note [scatter and gather dims]) ----
  template <class... Args>
  parallel::detail::SplitSize split_size(const Args&... args) const {
    parallel::detail::SplitMeasure measure("DataParallel", "argument", "scatter_dims",
                                           parallel::detail::SplitMeasure::Numbered);
    std::size_t i = 0;
    ((measure.add(args, i, scatter_dim(i), i < scatter_dims_.size()), ++i), ...);
    return measure.size();
  }

  /// Replica r's forward on its arguments: its rows of each tensor, copied straight to its
  /// device (on its worker, so the copies to different devices run in parallel); other values
  /// as they are.
  template <class Module, class... Args>
  decltype(auto) call_replica(Module& m, const parallel::ChunkPlan& plan, std::size_t r, const Args&... args) const {
    return [&]<std::size_t... I>(std::index_sequence<I...>) -> decltype(auto) {
      return parallel::detail::call_forward(
          m, parallel::detail::scatter_part(args, scatter_dim(I), plan.offsets[r], plan.sizes[r], devices_[r])...);
    }(std::index_sequence_for<Args...>{});
  }

  // ---- gathering ----
  template <class R>
  void check_output() const {
    parallel::detail::check_output<R>();
    parallel::detail::check_dims_fit("DataParallel", "gather_dims", gather_dims_.size(),
                                     parallel::detail::top_level_size<R>(), "outputs of forward");
  }
  template <class R>
  R to_output(R out) const {
    auto move = [&](const auto& t) { return t.defined() ? t.to(output_device_) : t; };
    return parallel::detail::map_tensors(out, move);
  }
  template <class R>
  R gather_outputs(std::vector<R>& outs) const {
    profiler::Scope span(profiler::Category::copy, "gather");
    span.set_device(output_device_);
    return parallel::detail::gather_outputs(outs, gather_dims_, dim_, output_device_);
  }

  M module_;
  std::unique_ptr<parallel::Replicator<M>> replicator_;
};

CHORUS_NAMESPACE_END
