#pragma once
// ShardedOptimizer: a DataParallel's optimizer step sharded over its devices (ZeRO stage 1 in one
// process): each device keeps the optimizer state of its shard of the parameters and steps that
// shard on its own worker, at the same time as the others.
//
// Note [sharded optimizer step]
// - Shards: the parameters in the optimizer's order (a DataParallel's: its flat buffers' order),
//   cut at parameter boundaries into `devices.size()` contiguous runs of about equal element
//   counts (a parameter goes to the run its middle element falls in), each non-empty while
//   there are parameters enough. Shard r belongs to devices[r].
// - The gradients are the primary's, summed there by DataParallel's backward; clip_grad_norm_
//   over dp.parameters() before step() therefore clips by the global norm, as unsharded.
// - Shard r's optimizer (an O over the shard, with every group's options) steps handles on
//   devices[r], so its state (momentum, Adam's moments) is made and kept on devices[r]
//   (Note [optimizer state follows the parameters]). On CPU devices a handle is a host alias of
//   the primary's parameter and its gradient (Note [host aliases]): the update writes the
//   primary's memory in place and nothing is copied; so is a handle on the parameter's own
//   device (shard 0, or a GPU the list repeats): a view of it. Elsewhere on GPUs a handle is a
//   copy on devices[r]:
//   the shard's gradients and parameters are copied there on its stream (after the primary's
//   work so far), stepped, and the parameters copied back (ordered before the caller's later
//   work: parallel_apply joins the streams); the replicas get them at the next forward's
//   broadcast, as after an unsharded step.
// - The same elementwise updates on the same numbers: results are the unsharded optimizer's,
//   bit for bit. Every gradient is checked before any shard steps (no half steps).
// - state() collects the shards' entries (the shards' own tensors, on their devices) in the
//   plain optimizer's layout, so io::save writes the plain optimizer's file; load_state (io::load)
//   hands each shard its entries.
//
// Note [sharded gradients in one process]
// DataParallel::shard_gradients(opt) is ZeRO stage 2 in one process: the gradient of a parameter
// whose shard is on another device than the primary is kept there (TensorImpl::grad_keeper: the
// shard's handle of the parameter holds it). Backward still sums the replicas' gradients on the
// primary, bucket by bucket (Note [gradient buckets]); the parameter's AccumulateGrad then adds
// the sum into the keeper's gradient on the shard's device, so the primary holds a gradient only
// between its arrival and that copy, and after backward only shard 0's. The bytes that cross are
// the ones ZeRO-1 in one process copies to the shards before stepping on GPUs; here they cross
// during backward. On CPU devices nothing needs to cross: where the replica on the shard's device
// computed a term, the sum is made in that memory (NodeBase::gradient_memory) and handed over as
// it is (Note [host aliases]); otherwise it is copied into the shard device's memory. Everything
// that reads or writes a gradient goes through grad() / set_grad(), which follow the keeper:
// zero_grad (the module's or the optimizer's), nn::utils::clip_grad_norm_ over dp.parameters()
// (the norm over every device's gradients), GradScaler, io::save. A plain optimizer stepping such
// a parameter refuses its gradient (on another device); destroying the ShardedOptimizer hands the
// gradients back to the parameters.
#include <memory>
#include <string>
#include <vector>

#include "../compiled.hpp"
#include "../optim/optimizer.hpp"
#include "comm.hpp"
#include "data_parallel.hpp"
#include "parallel_apply.hpp"

CHORUS_NAMESPACE_BEGIN
namespace parallel {

namespace detail {
// What ShardedOptimizer<O> does that does not depend on O (Note [sharded optimizer step]).

/// Cuts `params` into k shards: members[r] gets shard r's parameter indices, shard_of[i] the
/// shard of parameter i.
CHORUS_INLINE void partition_shards(const std::vector<AnyTensor>& params, std::size_t k,
                                    std::vector<std::vector<std::size_t>>& members, std::vector<std::size_t>& shard_of);
/// A shard's handle of parameter p on `device`: a host alias on CPU devices, a copy on another GPU
/// (on p's own device, bring_to_shard makes it a view of p).
CHORUS_INLINE AnyTensor shard_handle(const AnyTensor& p, Device device);
/// Before a shard on `device` steps: the handles of its `members` see the primary's current
/// parameters and gradients.
CHORUS_INLINE void bring_to_shard(const std::vector<std::size_t>& members, const std::vector<AnyTensor>& params,
                                  const std::vector<AnyTensor>& handles, Device device);
/// Gives parameter i the handle handles[i] as its gradient's keeper where away[i], moving a
/// gradient it has there (Note [sharded gradients in one process]).
CHORUS_INLINE void keep_grads_on_shards(const std::vector<AnyTensor>& params, const std::vector<AnyTensor>& handles,
                                        const std::vector<bool>& away);
/// The optimizer's destructor: each kept gradient goes back to its parameter.
CHORUS_INLINE void return_kept_grads(const std::vector<AnyTensor>& params, const std::vector<AnyTensor>& handles) noexcept;
/// Every gradient can be stepped with (on the device that keeps it), before any shard steps.
CHORUS_INLINE void check_shard_grads(const std::vector<AnyTensor>& params);
/// After a shard on `device` stepped: the primary's parameters (on `primary`) hold the update.
CHORUS_INLINE void return_from_shard(const std::vector<std::size_t>& members, const std::vector<AnyTensor>& params,
                                     const std::vector<AnyTensor>& handles, Device device, Device primary);
}  // namespace detail

/// The optimizer O with its step sharded over a DataParallel's devices (Note [sharded optimizer
/// step]): `parallel::ShardedOptimizer<optim::Adam> opt(dp, {.lr = 1e-3})`, then zero_grad,
/// backward and step as with the plain optimizer. Schedulers, clip_grad_norm_ and io::save /
/// io::load work on it as on O.
template <class O>
class ShardedOptimizer final : public optim::Optimizer {
 public:
  using Options = typename O::options_type;  ///< O's options (optim::AdamOptions for optim::Adam)

  /// Over a DataParallel's parameters and devices.
  template <class M>
  ShardedOptimizer(const DataParallel<M>& dp, Options options)
      : ShardedOptimizer(dp.parameters(), options, dp.devices()) {}
  /// Over parameters (or parameter groups) that live on devices[0], sharded over `devices`
  /// (a DataParallel's: `ShardedOptimizer<optim::AdamW> opt(groups, dp.devices())`).
  ShardedOptimizer(std::vector<AnyTensor> params, Options options, std::vector<Device> devices)
      : ShardedOptimizer(std::vector<optim::ParamGroup<Options>>{{std::move(params), options}}, std::move(devices)) {}
  /// Over parameter groups, each with its own options, that live on devices[0], sharded over `devices`.
  ShardedOptimizer(std::vector<optim::ParamGroup<Options>> groups, std::vector<Device> devices)
      : Optimizer(optim::detail::params_of(groups)), devices_(std::move(devices)) {
    CHORUS_CHECK(!devices_.empty(), "ShardedOptimizer: no devices");
    for (auto d : devices_) check_device(d);
    for (std::size_t i = 0; i < params_.size(); ++i)
      CHORUS_CHECK(params_[i].device() == devices_[0], "ShardedOptimizer: parameter ", i, " is on ",
                   params_[i].device(), ", not on the primary device ", devices_[0]);
    partition();
    for (std::size_t r = 1; r < devices_.size(); ++r) {
      int slot = 0;  // DataParallel's streams (and workers) for the same device list
      for (std::size_t q = 0; q < r; ++q) slot += devices_[q] == devices_[r];
      streams_.push_back(&get_stream(devices_[r], slot));
    }
    handles_.resize(params_.size());
    shards_.resize(devices_.size());
    for (std::size_t r = 0; r < devices_.size(); ++r) {
      if (members_[r].empty()) continue;
      std::vector<optim::ParamGroup<Options>> mine;
      for (const auto& g : groups) mine.push_back({{}, g.options});
      for (auto i : members_[r]) {
        handles_[i] = r == 0 ? params_[i] : make_handle(params_[i], devices_[r]);
        mine[group_of(i)].params.push_back(handles_[i]);
      }
      shards_[r] = std::make_unique<O>(std::move(mine));
    }
  }

  ShardedOptimizer(const ShardedOptimizer&) = delete;
  ShardedOptimizer& operator=(const ShardedOptimizer&) = delete;
  /// Hands kept gradients back to the parameters (Note [sharded gradients in one process]).
  ~ShardedOptimizer() override { detail::return_kept_grads(params_, handles_); }

  /// Steps every shard on its device's worker, at once (shard 0 on the calling thread).
  void step() override {
    NoGradGuard g;
    detail::check_shard_grads(params_);  // all of them, before any shard moves
    gathered_.clear();
    for (std::size_t i = 0; i < params_.size(); ++i)
      CHORUS_CHECK(params_[i].device() == devices_[0], "ShardedOptimizer: parameter ", i, " is now on ",
                   params_[i].device(), ", not on the primary device ", devices_[0],
                   "; build the optimizer again for the new devices");
    std::vector<Stream*> streams{&current_stream(devices_[0])};
    streams.insert(streams.end(), streams_.begin(), streams_.end());
    std::optional<Event> fork;  // GPU shards start after the primary's work so far (the gradients)
    if (devices_[0].is_cuda()) {
      fork.emplace();
      fork->record(*streams[0]);
    }
    parallel_apply(streams, [&](std::size_t r) {
      if (!shards_[r]) return 0;
      NoGradGuard ng;
      if (r > 0 && fork && devices_[r].is_cuda()) fork->block(*streams[r]);
      if (r > 0) bring_to_shard(r);
      shards_[r]->step();
      if (r > 0) return_from_shard(r);
      return 0;
    });
  }

  /// The plain optimizer's state: parameter i's entries, from the shard that keeps them.
  const std::vector<State>& state() const override {
    gathered_.assign(params_.size(), State{});
    for (std::size_t r = 0; r < shards_.size(); ++r)
      for (std::size_t j = 0; j < members_[r].size(); ++j) gathered_[members_[r][j]] = shards_[r]->state()[j];
    return gathered_;
  }

  /// Takes the whole state (io::load) and hands each shard its entries.
  void load_state(std::vector<State> state) override {
    validate_states(state);
    for (std::size_t r = 0; r < shards_.size(); ++r) {
      if (!shards_[r]) continue;
      std::vector<State> mine;
      for (auto i : members_[r]) mine.push_back(std::move(state[i]));
      shards_[r]->load_state(std::move(mine));
    }
    gathered_.clear();
  }

  /// The device whose shard holds parameter i (an index into the devices).
  std::size_t shard_of(std::size_t i) const { return shard_of_.at(i); }
  /// The devices, shard r's at [r] (devices[0] holds the parameters).
  const std::vector<Device>& devices() const { return devices_; }

  double lr(std::size_t group) const override { return first().lr(group); }
  /// Sets the learning rate of group `group` in every shard's optimizer.
  void set_lr(std::size_t group, double lr) override {
    for (auto& s : shards_)
      if (s) s->set_lr(group, lr);
  }
  bool has_momentum() const override { return first().has_momentum(); }
  /// The momentum of group `group` (the first shard's; every shard has the same); throws where O has none.
  double momentum(std::size_t group) const override { return first().momentum(group); }
  /// Sets the momentum of group `group` in every shard's optimizer; throws where O has none.
  void set_momentum(std::size_t group, double m) override {
    for (auto& s : shards_)
      if (s) s->set_momentum(group, m);
  }
  std::vector<std::string> state_keys() const override { return first().state_keys(); }
  /// The plain optimizer's name: the checkpoint is the plain optimizer's file.
  std::string name() const override { return first().name(); }

 private:
  template <class>
  friend class chorus::DataParallel;
  /// Keeps each parameter's gradient on its shard's device from now on (Note [sharded gradients
  /// in one process]); what DataParallel::shard_gradients does once it has checked the match.
  void shard_gradients() {
    if (gradients_kept_) return;
    std::vector<bool> away(params_.size(), false);
    for (std::size_t i = 0; i < params_.size(); ++i) away[i] = devices_[shard_of_[i]] != devices_[0];
    detail::keep_grads_on_shards(params_, handles_, away);
    gradients_kept_ = true;
  }

  void partition() { detail::partition_shards(params_, devices_.size(), members_, shard_of_); }

  const O& first() const {
    for (const auto& s : shards_)
      if (s) return *s;
    CHORUS_FAIL("ShardedOptimizer: no shard");  // unreachable: the parameter list is not empty
  }

  /// Shard r's handle of parameter p: a host alias on CPU devices, a copy on GPUs.
  static AnyTensor make_handle(const AnyTensor& p, Device device) { return detail::shard_handle(p, device); }

  /// Before shard r steps: its handles see the primary's current parameters and gradients.
  void bring_to_shard(std::size_t r) { detail::bring_to_shard(members_[r], params_, handles_, devices_[r]); }

  /// After shard r stepped: the primary's parameters hold the update (a copy back on GPUs).
  void return_from_shard(std::size_t r) {
    detail::return_from_shard(members_[r], params_, handles_, devices_[r], devices_[0]);
  }

  std::vector<Device> devices_;
  std::vector<Stream*> streams_;                   // devices_[1 ...]'s
  std::vector<std::size_t> shard_of_;              // shard_of_[i]: the shard of parameter i
  std::vector<std::vector<std::size_t>> members_;  // members_[r]: shard r's parameters, in order
  std::vector<AnyTensor> handles_;                 // what shard r's optimizer steps for parameter i
  std::vector<std::unique_ptr<O>> shards_;         // null for a shard without parameters
  bool gradients_kept_ = false;                    // Note [sharded gradients in one process]
  mutable std::vector<State> gathered_;            // state()'s result
};

}  // namespace parallel

namespace optim {
using parallel::ShardedOptimizer;
}

CHORUS_NAMESPACE_END

// The definitions: compiled into chorus::compiled, or here in the header-only form (Note
// [compiled chorus] in compiled.hpp).
#if !CHORUS_COMPILED
#include "sharded_optimizer_impl.hpp"
#endif
