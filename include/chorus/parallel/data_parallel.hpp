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
#include "data_parallel_options.hpp"
#include "gather.hpp"
#include "parallel_apply.hpp"
#include "replicate.hpp"
#include "scatter.hpp"
#include "stats_reducer.hpp"

CHORUS_NAMESPACE_BEGIN

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

/// The communicator for a device list: copies for CPU devices and repeated GPUs; the CUDA
/// backend overrides this for distinct GPUs (see backend/cuda/nccl.hpp).
inline std::shared_ptr<Communicator> make_communicator(const std::vector<Device>& devices,
                                                       const std::vector<Stream*>& streams);
}  // namespace parallel::detail

template <class M>
class DataParallel {
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
  DataParallel(M module, std::initializer_list<Device> devices, std::optional<Device> output_device = std::nullopt,
               std::int64_t dim = 0, std::optional<std::size_t> bucket_bytes = std::nullopt)
      : DataParallel(std::move(module), std::vector<Device>(devices), output_device, dim, bucket_bytes) {}
  /// The same from options, which also give per-argument and per-output dims (Note [scatter
  /// and gather dims]).
  explicit DataParallel(M module, DataParallelOptions options = {})
      : module_(std::move(module)),
        devices_(options.devices.empty() ? available_devices() : std::move(options.devices)),
        dim_(options.dim),
        scatter_dims_(std::move(options.scatter_dims)),
        gather_dims_(std::move(options.gather_dims)),
        bucket_bytes_(options.bucket_bytes) {
    CHORUS_CHECK(!devices_.empty(), "DataParallel: no devices");
    CHORUS_CHECK(dim_ >= 0, "DataParallel: dim must be non-negative, got ", dim_);
    for (const auto& d : devices_) {
      check_device(d);
      CHORUS_CHECK(d.kind == devices_[0].kind, "DataParallel: devices mix kinds (", devices_[0], " and ", d, ")");
    }
    output_device_ = options.output_device ? *options.output_device : devices_[0];
    check_device(output_device_);
    if (module_on(devices_[0])) install(build(devices_));  // else at to(devices[0]) or the first forward
  }

  DataParallel(const DataParallel&) = delete;
  DataParallel& operator=(const DataParallel&) = delete;

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
  /// (Reduction::Mean: weighted by each replica's share of the rows, for a criterion that
  /// averages over its rows as the default mse_loss and cross_entropy do; Reduction::Sum: added).
  /// The outputs are never gathered, so the primary device holds its own chunk's only. The
  /// criterion is called on the replicas' threads at once: it must not write shared state.
  template <class Criterion, class Input, class Target>
  auto forward_loss(Criterion&& criterion, const Input& input, const Target& target,
                    Reduction reduction = Reduction::Mean) {
    parallel::detail::check_argument<Input>();
    parallel::detail::check_argument<Target>();
    CHORUS_CHECK(reduction != Reduction::None, "DataParallel::forward_loss: the replicas' losses combine by "
                                               "Reduction::Mean or Reduction::Sum, not None");
    parallel::detail::check_dims_fit("DataParallel::forward_loss", "scatter_dims", scatter_dims_.size(), 2,
                                     "arguments (input, target)");
    check_not_nested();
    const InUse in_use(in_forward_);  // Note [DataParallel threads]
    if (!replicator_) install(build(devices_));
    return forward_split(WithLoss<std::remove_reference_t<Criterion>>{criterion, reduction}, input, target);
  }

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
  template <class Criterion>
  struct WithLoss {
    Criterion& criterion;
    Reduction reduction;
    template <class Module>
    parallel::detail::WithCriterion<Module, Criterion> wrap(Module& m) const {
      return {m, criterion};
    }
    template <class R>
    R finish(const DataParallel& dp, std::vector<R>& losses, const parallel::ChunkPlan& plan) const {
      static_assert(parallel::detail::is_tensor_v<R>, "DataParallel::forward_loss: the criterion must return a tensor");
      const std::int64_t batch = plan.offsets.back() + plan.sizes.back();
      return parallel::detail::combine_losses(losses, plan.sizes, batch, reduction, dp.output_device_);
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
    if (devices_[0].is_cuda()) {  // replica streams start after the work issued so far (inputs, optimizer step)
      Event fork;
      fork.record(current_stream(devices_[0]));
      for (std::size_t r = 1; r < devices_.size(); ++r) fork.block(*streams_[r]);
    }
    keep_workers_hot(plan.used());
    auto modules = replicator_->prepare(plan.used());
    if (has_buffers_) wait_for_broadcasts();
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
  auto& module() { return unwrap(module_); }
  const auto& module() const { return unwrap(module_); }

  // The registry, as on the module, with names prefixed by name_prefix().
  std::vector<AnyTensor> parameters(bool recurse = true) const { return nn::module_of(module_).parameters(recurse); }
  std::vector<nn::Module::NamedTensor> named_parameters(bool recurse = true) const {
    return prefixed(nn::module_of(module_).named_parameters(recurse));
  }
  std::vector<AnyTensor> buffers(bool recurse = true) const { return nn::module_of(module_).buffers(recurse); }
  std::vector<nn::Module::NamedTensor> named_buffers(bool recurse = true) const {
    return prefixed(nn::module_of(module_).named_buffers(recurse));
  }
  /// Parameters then buffers (what a checkpoint holds; save(dp, path) writes these names).
  std::vector<nn::Module::NamedTensor> named_tensors() const { return prefixed(nn::module_of(module_).named_tensors()); }

  /// The prefix of the names above: "" (default, the module's own names) or, with
  /// set_name_prefix("module."), the names of PyTorch's nn.DataParallel state_dict, so that a
  /// checkpoint saved from one matches the other (load(dp, path) strips it again).
  DataParallel& set_name_prefix(std::string prefix) {
    CHORUS_CHECK(prefix.empty() || (prefix.back() == '.' && prefix.front() != '.' && prefix.find("..") == std::string::npos),
                 "DataParallel::set_name_prefix: '", prefix, "' must be empty or dotted names ending in '.', such as "
                 "\"module.\"");
    name_prefix_ = std::move(prefix);
    return *this;
  }
  const std::string& name_prefix() const { return name_prefix_; }

  void train(bool on = true) { nn::module_of(module_).train(on); }
  void eval() { train(false); }
  bool is_training() const { return nn::module_of(module_).is_training(); }
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
    check_device(device);
    CHORUS_CHECK(device.kind == devices_[0].kind, "DataParallel::to(", device, "): the primary device is ", devices_[0],
                 "; a DataParallel cannot change device kind (build a new one for ", device, ")");
    const InUse in_use(in_forward_);
    if (device == devices_[0]) {
      nn::module_of(module_).to(device);  // a module moved behind our back (or never there) comes home
      if (!replicator_) install(build(devices_));
      return *this;
    }
    const auto moved = std::find(devices_.begin(), devices_.end(), device);
    const std::size_t dropped = moved == devices_.end() ? 0 : static_cast<std::size_t>(moved - devices_.begin());
    std::vector<Device> devices{device};
    for (std::size_t r = 0; r < devices_.size(); ++r)
      if (r != dropped) devices.push_back(devices_[r]);
    const Device output = output_device_ == devices_[0] ? device : output_device_;
    const auto saved = save_tensors();
    try {
      nn::module_of(module_).to(device);
      auto built = build(devices);
      devices_ = std::move(devices);
      output_device_ = output;
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
    CHORUS_CHECK(work >= 0, "DataParallel::set_inline_work: work must be >= 0, got ", work);
    inline_work_ = work;
    return *this;
  }
  std::int64_t inline_work() const { return inline_work_; }

  const std::vector<Device>& devices() const { return devices_; }
  Device output_device() const { return output_device_; }
  std::int64_t dim() const { return dim_; }
  const std::vector<std::int64_t>& scatter_dims() const { return scatter_dims_; }
  const std::vector<std::int64_t>& gather_dims() const { return gather_dims_; }
  /// The replica on devices()[r] (0 is the primary module itself), as module() is.
  const auto& replica(std::size_t r) const { return unwrap(built().replica(r)); }
  const parallel::Communicator& communicator() const { return (built(), *comm_); }

 private:
  static constexpr bool kHolder = requires { typename M::ImplType; };
  const parallel::Replicator<M>& built() const {
    CHORUS_CHECK(replicator_, "DataParallel: no replicas yet: the module is not on the primary device ", devices_[0],
                 " (call to(", devices_[0], "))");
    return *replicator_;
  }
  /// Every parameter and buffer of the module is on `device`.
  bool module_on(Device device) const {
    for (const auto& t : nn::module_of(module_).named_tensors())
      if (t.tensor.device() != device) return false;
    return true;
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

  std::vector<nn::Module::NamedTensor> prefixed(std::vector<nn::Module::NamedTensor> named) const {
    if (!name_prefix_.empty())
      for (auto& t : named) t.name = name_prefix_ + t.name;
    return named;
  }

  struct Built {
    std::vector<Stream*> streams;
    std::shared_ptr<parallel::Communicator> comm;
    std::unique_ptr<parallel::Replicator<M>> replicator;
    bool has_buffers = false, meets_other_replicas = false;
  };
  /// Streams (slot = how often the device came before), communicator and replicas for
  /// `devices`; nothing of this DataParallel changes but the module's storage (flattened).
  Built build(const std::vector<Device>& devices) {
    Built b;
    b.streams.push_back(&get_stream(devices[0], 0));
    for (std::size_t r = 1; r < devices.size(); ++r) {
      int slot = 0;
      for (std::size_t q = 0; q < r; ++q) slot += devices[q] == devices[r];
      b.streams.push_back(&get_stream(devices[r], slot));
    }
    b.comm = parallel::detail::make_communicator(devices, b.streams);
    const std::size_t bucket_bytes =
        bucket_bytes_.value_or(devices[0].is_cpu() ? kDefaultCpuBucketBytes : kDefaultBucketBytes);
    b.replicator = std::make_unique<parallel::Replicator<M>>(module_, devices, b.comm, bucket_bytes);
    b.has_buffers = !nn::module_of(module_).named_buffers().empty();
    b.meets_other_replicas = nn::module_of(module_).any_meets_other_replicas();
    return b;
  }
  void install(Built&& b) noexcept {
    streams_ = std::move(b.streams);
    comm_ = std::move(b.comm);
    replicator_ = std::move(b.replicator);  // the old replicas go
    has_buffers_ = b.has_buffers;
    meets_other_replicas_ = b.meets_other_replicas;
  }

  /// What DataParallel::to may change in the module's tensors, to put back when it fails.
  struct SavedTensor {
    std::function<void()> restore;
  };
  std::vector<SavedTensor> save_tensors() {
    std::vector<SavedTensor> saved;
    nn::module_of(module_).for_each_tensor([&](AnyTensor& t) {
      t.visit([&](auto& x) {
        saved.push_back({[impl = x.impl(), copy = *x.impl()] {
          impl->storage = copy.storage;
          impl->offset = copy.offset;
          impl->strides = copy.strides;
          impl->grad = copy.grad;
          impl->grad_accumulator = copy.grad_accumulator;
        }});
      });
    });
    return saved;
  }
  static void restore_tensors(const std::vector<SavedTensor>& saved) {
    for (const auto& s : saved) s.restore();
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

  /// Marks the DataParallel busy for a scope; a second thread entering meanwhile gets an error
  /// (Note [DataParallel threads]).
  class InUse {
   public:
    explicit InUse(std::atomic<bool>& flag) : flag_(flag) {
      bool expected = false;
      CHORUS_CHECK(flag_.compare_exchange_strong(expected, true, std::memory_order_acquire),
                   "DataParallel: forward (or to()) called while another thread is inside forward of the same "
                   "DataParallel; one DataParallel serves one thread at a time (replicas and their autograd "
                   "wiring are shared): use one DataParallel per thread, or a lock around the whole step");
    }
    ~InUse() { flag_.store(false, std::memory_order_release); }
    InUse(const InUse&) = delete;
    InUse& operator=(const InUse&) = delete;

   private:
    std::atomic<bool>& flag_;
  };

  /// A forward from a device worker thread (inside a replica's forward) would queue work
  /// behind itself, or behind workers that wait for it: refuse it (Note [DataParallel threads]).
  void check_not_nested() const {
    if (devices_.size() == 1) return;  // the passthrough posts nothing
    if (const Stream* w = ::chorus::detail::worker_stream_of_thread()) {
      std::string uses;
      for (std::size_t r = 1; r < streams_.size() && uses.empty(); ++r)
        if (streams_[r] == w) uses = " (this DataParallel runs replica " + std::to_string(r) + " on that very stream)";
      CHORUS_FAIL("DataParallel: forward called on the worker thread of ", w->str(),
                  ", i.e. inside a replica's forward (a DataParallel nested in a replicated module?)", uses,
                  "; nested DataParallel is not supported: it would wait for work queued behind itself. Call the "
                  "inner module directly inside the outer model");
    }
  }

  // Note [active window]
  // A training step posts work to the replicas' workers in bursts: the forward, then the
  // backward (after the loss), then nothing until the next forward (after the optimizer
  // step). A worker that fell asleep in a gap costs a wake-up at the next burst (up to
  // ~100 us on some VMs, per burst). So each forward keeps the used workers spinning for
  // twice the time since the previous forward (the step period), capped at kMaxActiveWindow:
  // short steps never sleep between bursts; a loop that pauses between steps (evaluation,
  // I/O) lets them sleep again after the cap. Spinning workers yield to runnable threads.
  // The same window, up to kMaxLendWindow, lends the idle workers to the primary's large
  // elementwise loops (Note [idle workers help]).
  static constexpr auto kMaxActiveWindow = std::chrono::milliseconds(10);
  static constexpr auto kMaxLendWindow = std::chrono::seconds(1);
  void keep_workers_hot(std::size_t used) {
    const auto now = std::chrono::steady_clock::now();
    const auto period = now - last_forward_;
    last_forward_ = now;
    if (period <= kMaxLendWindow && devices_[0].is_cpu())  // not after the first step
      for (std::size_t r = 1; r < used; ++r) streams_[r]->lend_until(now + 2 * period);
    if (period > kMaxActiveWindow) return;  // also the first step
    const auto until = now + std::min<std::chrono::steady_clock::duration>(2 * period, kMaxActiveWindow);
    for (std::size_t r = 1; r < used; ++r) streams_[r]->keep_hot_until(until);
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
        auto&& m = how.wrap(*modules[r]);
        outs.push_back(call_replica(m, plan, r, args...));
      } catch (...) {
        parallel::detail::rethrow_in_replica(std::current_exception(), r, devices_[r]);
      }
    }
    replicator_->check_parameters_unwritten(versions);
    return how.finish(*this, outs, plan);
  }

  // Note [buffers written in forward]
  // The broadcast that refreshes replica r runs on replica r's stream and reads the primary's
  // flat buffers, while replica 0 (the primary itself) starts its forward on the caller's
  // stream — and a forward may write its buffers in place (BatchNorm's running statistics).
  // When the module has buffers, replica 0 therefore starts after every broadcast has read
  // the primary: CPU streams are drained; CUDA streams are joined by events.
  // On CUDA the event is recorded by a marker task on the replica's worker, after the
  // broadcast's posted work (a repeated-GPU set copies from the worker: an event recorded from
  // the caller could precede a copy the worker has not launched yet; Note [idle replicas]).
  void wait_for_broadcasts() {
    for (std::size_t r = 1; r < devices_.size(); ++r) {
      if (devices_[r].is_cuda()) {
        auto done = streams_[r]->async([s = streams_[r]] {
          Event e;
          e.record(*s);
          return e;
        });
        done.get().block(current_stream(devices_[0]));
      } else {
        streams_[r]->synchronize();
      }
    }
  }

  // ---- scattering (Note [nested arguments], Note [scatter and gather dims]) ----
  std::int64_t scatter_dim(std::size_t i) const { return parallel::detail::dim_at(scatter_dims_, i, dim_); }

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
    return parallel::detail::gather_outputs(outs, gather_dims_, dim_, output_device_);
  }

  M module_;
  std::vector<Device> devices_;
  Device output_device_;
  std::int64_t dim_;
  std::vector<std::int64_t> scatter_dims_, gather_dims_;  // Note [scatter and gather dims]
  int random_dim_ = 0;  // of this step's first split tensor (Note [dropout random numbers])
  std::optional<std::size_t> bucket_bytes_;  // nullopt: the default of the devices' kind
  std::string name_prefix_;                  // of named_parameters() etc. (set_name_prefix)
  std::atomic<bool> in_forward_{false};
  std::int64_t inline_work_ = parallel::inline_work_default();
  std::chrono::steady_clock::time_point last_forward_{};
  std::vector<Stream*> streams_;
  std::shared_ptr<parallel::Communicator> comm_;
  std::unique_ptr<parallel::Replicator<M>> replicator_;
  bool has_buffers_ = false;  // Note [buffers written in forward]
  bool meets_other_replicas_ = false;  // a SyncBatchNorm inside: never run replicas one after another
};

namespace parallel::detail {
inline std::shared_ptr<Communicator> make_communicator(const std::vector<Device>& devices,
                                                       const std::vector<Stream*>& streams) {
#if CHORUS_CUDA
  // Distinct GPUs: NCCL. A repeated GPU (NCCL refuses it) or CPU devices: copies.
  bool distinct = devices.size() > 1 && devices[0].is_cuda();
  for (std::size_t i = 0; i < devices.size() && distinct; ++i)
    for (std::size_t j = 0; j < i; ++j) distinct = distinct && devices[i] != devices[j];
  if (distinct) return std::make_shared<NcclCommunicator>(streams);
#else
  (void)devices;
#endif
  return std::make_shared<CopyCommunicator>(streams);
}
}  // namespace parallel::detail

CHORUS_NAMESPACE_END
