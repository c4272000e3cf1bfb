#pragma once
// ZeroRedundancyOptimizer: PyTorch's torch.distributed.optim.ZeroRedundancyOptimizer (ZeRO
// stage 1) over chorus's process group. Each rank keeps the optimizer state of its shard of
// the parameters only, steps that shard, and the updated parameters travel from their owners
// to every rank.
//
// Note [ZeRO-1 over the process group]
// - Partition (PyTorch's _partition_parameters): group by group, the parameters sorted by size
//   (largest first; ties in their order) each go to the rank holding the fewest elements so
//   far (ties: the lowest rank). Every rank computes the same partition from the shapes alone.
// - The wrapped optimizer (`local_optimizer()`) is an O over the rank's own parameters, with
//   the same groups and options, so its updates are the plain optimizer's, bit for bit, given
//   the same gradients. As in PyTorch, the gradients must already be the job's (averaged by
//   DistributedDataParallel, or reduced by the caller): this class does not reduce them.
// - step() then sends each owner's parameters to every rank: one broadcast per (owner, dtype),
//   of the owner's parameters packed in index order, all in flight at once.
// - Checkpoints: consolidate_state_dict(to) (a collective) gathers every parameter's state on
//   rank `to`, whose state() then equals the plain optimizer's, so io::save writes the same
//   file; state() elsewhere, or after a later step, is an error rather than a partial state.
//   load_state (what io::load calls on every rank) takes the whole state and keeps the shard.
// - A rank that owns no parameter (more ranks than parameters) still needs an O to answer
//   lr() and friends: it gets one over a single zero-element placeholder, which never has a
//   gradient and so never steps.
#include <algorithm>
#include <functional>
#include <memory>
#include <numeric>
#include <optional>
#include <utility>
#include <vector>

#include "../optim/optimizer.hpp"
#include "process_group.hpp"

CHORUS_NAMESPACE_BEGIN
namespace dist {
inline namespace CHORUS_DIST_NS {

/// PyTorch's ZeroRedundancyOptimizer: `ZeroRedundancyOptimizer<optim::Adam> opt(ddp.parameters(),
/// {.lr = 1e-3})` (Note [ZeRO-1 over the process group]). Every rank constructs it with the same
/// parameters and calls step() together; learning-rate schedulers, clip_grad_norm_ and
/// io::save / io::load work on it as on the plain optimizer (save after consolidate_state_dict).
template <class O>
class ZeroRedundancyOptimizer final : public optim::Optimizer {
 public:
  using Options = typename O::options_type;

  ZeroRedundancyOptimizer(std::vector<AnyTensor> params, Options options, ProcessGroup* group = nullptr)
      : ZeroRedundancyOptimizer(std::vector<optim::ParamGroup<Options>>{{std::move(params), options}}, group) {}

  explicit ZeroRedundancyOptimizer(std::vector<optim::ParamGroup<Options>> groups, ProcessGroup* group = nullptr)
      : Optimizer(optim::detail::params_of(groups)), group_(group ? *group : dist::init()) {
    device_ = params_[0].device();
    for (std::size_t i = 0; i < params_.size(); ++i)
      CHORUS_CHECK(params_[i].device() == device_, "ZeroRedundancyOptimizer: parameter ", i, " is on ",
                   params_[i].device(), ", parameter 0 on ", device_, "; one device per process");
    partition();
    std::vector<optim::ParamGroup<Options>> mine;
    for (std::size_t g = 0; g < groups.size(); ++g) mine.push_back({{}, groups[g].options});
    for (std::size_t i = 0; i < params_.size(); ++i)
      if (owner_[i] == group_.rank()) {
        local_index_.push_back(i);
        mine[group_of(i)].params.push_back(params_[i]);
      }
    if (local_index_.empty()) mine[0].params.push_back(AnyTensor(Tensor<float>::empty(Shape{0}, device_)));
    local_.emplace(std::move(mine));
  }

  /// Steps this rank's shard, then brings every rank's updated parameters to every rank (a
  /// collective: every rank calls it).
  void step() override {
    group_.check_usable("ZeroRedundancyOptimizer::step");
    drop_consolidated();
    local_->step();
    sync_parameters();
  }

  /// Gathers the whole optimizer state on rank `to` (a collective): afterwards, and until the
  /// next step(), state() there is the plain optimizer's state (for io::save).
  void consolidate_state_dict(int to = 0) override {
    CHORUS_CHECK(to >= 0 && to < group_.world_size(), "ZeroRedundancyOptimizer::consolidate_state_dict: rank ", to,
                 " is not a rank of a world of ", group_.world_size());
    group_.check_usable("ZeroRedundancyOptimizer::consolidate_state_dict");
    drop_consolidated();
    const auto keys = state_keys();
    const std::size_t K = keys.size(), P = params_.size();
    // Which entries exist (a parameter never stepped has none; amsgrad adds one): known to
    // their owner only, so every rank learns them first.
    auto present = zeros<std::int64_t>(Shape{static_cast<std::int64_t>(P * K)});
    {
      auto* flags = present.data();
      const auto& mine = local_->state();
      for (std::size_t j = 0; j < local_index_.size(); ++j)
        for (std::size_t k = 0; k < K; ++k) flags[local_index_[j] * K + k] = mine[j].count(keys[k]) ? 1 : 0;
    }
    group_.all_reduce(present);
    const auto* flags = present.data();
    std::vector<State> full(P);
    std::vector<std::shared_ptr<Work>> pending;
    std::vector<std::size_t> slot(P, 0);
    for (std::size_t j = 0; j < local_index_.size(); ++j) slot[local_index_[j]] = j;
    for (std::size_t i = 0; i < P; ++i)
      for (std::size_t k = 0; k < K; ++k) {
        if (!flags[i * K + k]) continue;
        AnyTensor t;
        if (owner_[i] == group_.rank()) {
          t = local_->state()[slot[i]].at(keys[k]);
        } else if (keys[k] == "step") {
          t = AnyTensor(scalar_tensor<double>(0.0));
        } else {
          t = params_[i].visit([&](const auto& p) {
            using T = typename std::decay_t<decltype(p)>::value_type;
            return AnyTensor(Tensor<T>::empty(p.shape(), p.device()));
          });
        }
        t.visit([&](const auto& x) {
          pending.push_back(group_.broadcast_async(x, owner_[i], "ZeroRedundancyOptimizer state of parameter " +
                                                                     std::to_string(i) + " (" + keys[k] + ")"));
        });
        full[i][keys[k]] = std::move(t);
      }
    for (auto& w : pending) w->wait(group_.timeout());
    if (group_.rank() == to) {
      state_ = std::move(full);
      consolidated_ = true;
    }
  }

  /// The whole state: only on the rank of the last consolidate_state_dict, before the next step.
  const std::vector<State>& state() const override {
    CHORUS_CHECK(consolidated_, "ZeroRedundancyOptimizer: the optimizer state is sharded over the ranks and has not "
                                "been consolidated on rank ",
                 group_.rank(), " since the last step; call consolidate_state_dict(", group_.rank(),
                 ") on every rank first");
    return state_;
  }

  /// Takes the whole state (as io::load reads it on every rank) and keeps this rank's shard.
  void load_state(std::vector<State> state) override {
    validate_states(state);
    std::vector<State> mine;
    for (auto i : local_index_) mine.push_back(std::move(state[i]));
    if (local_index_.empty()) mine.emplace_back();  // the placeholder's
    local_->load_state(std::move(mine));
    drop_consolidated();
  }

  /// The rank that owns (keeps the state of, and steps) parameter i.
  int owner(std::size_t i) const { return owner_.at(i); }
  /// The optimizer over this rank's shard.
  O& local_optimizer() { return *local_; }
  const O& local_optimizer() const { return *local_; }

  double lr(std::size_t group) const override { return local_->lr(group); }
  void set_lr(std::size_t group, double lr) override { local_->set_lr(group, lr); }
  bool has_momentum() const override { return local_->has_momentum(); }
  double momentum(std::size_t group) const override { return local_->momentum(group); }
  void set_momentum(std::size_t group, double m) override { local_->set_momentum(group, m); }
  std::vector<std::string> state_keys() const override { return local_->state_keys(); }
  /// The plain optimizer's name: a consolidated checkpoint is the plain optimizer's file.
  std::string name() const override { return local_->name(); }

 private:
  void partition() {
    const int w = group_.world_size();
    std::vector<std::int64_t> load(static_cast<std::size_t>(w), 0);
    owner_.assign(params_.size(), 0);
    for (std::size_t g = 0; g < num_groups(); ++g) {
      std::vector<std::size_t> members;
      for (std::size_t i = 0; i < params_.size(); ++i)
        if (group_of(i) == g) members.push_back(i);
      std::stable_sort(members.begin(), members.end(),
                       [&](std::size_t a, std::size_t b) { return params_[a].numel() > params_[b].numel(); });
      for (auto i : members) {
        const int r = static_cast<int>(std::min_element(load.begin(), load.end()) - load.begin());
        owner_[i] = r;
        load[static_cast<std::size_t>(r)] += params_[i].numel();
      }
    }
  }

  void drop_consolidated() {
    if (!consolidated_) return;
    consolidated_ = false;
    state_.assign(params_.size(), State{});
  }

  struct PendingSync {
    std::shared_ptr<Work> work;
    std::function<void()> unpack;  // empty on the owner
  };

  /// One broadcast per (owner, dtype) of the owner's parameters packed in index order.
  void sync_parameters() {
    if (group_.world_size() == 1) return;
    std::vector<PendingSync> pending;
    for (int r = 0; r < group_.world_size(); ++r)
      for (DType d : {DType::Float32, DType::Float64, DType::BFloat16, DType::Float16}) {
        std::vector<std::size_t> members;
        for (std::size_t i = 0; i < params_.size(); ++i)
          if (owner_[i] == r && params_[i].dtype() == d) members.push_back(i);
        if (members.empty()) continue;
        params_[members[0]].visit([&](const auto& first) {
          using T = typename std::decay_t<decltype(first)>::value_type;
          pending.push_back(broadcast_packed<T>(r, std::move(members)));
        });
      }
    for (auto& p : pending) {
      p.work->wait(group_.timeout());
      if (p.unpack) p.unpack();
    }
  }

  template <class T>
  PendingSync broadcast_packed(int root, std::vector<std::size_t> members) {
    NoGradGuard ng;
    std::int64_t n = 0;
    for (auto i : members) n += params_[i].numel();
    auto flat = Tensor<T>::empty(Shape{n}, device_);
    const bool mine = root == group_.rank();
    if (mine) for_each_slice<T>(flat, members, [](const Tensor<T>& slice, const Tensor<T>& p) { backend::copy(slice, p); });
    auto work = group_.broadcast_async(flat, root, "ZeroRedundancyOptimizer parameters of rank " + std::to_string(root));
    std::function<void()> unpack;
    if (!mine)
      unpack = [this, flat, members = std::move(members)] {
        NoGradGuard g;
        for_each_slice<T>(flat, members, [](const Tensor<T>& slice, const Tensor<T>& p) {
          backend::copy(p, slice);
          p.bump_version();  // an in-place update (Note [version counter])
        });
      };
    return {std::move(work), std::move(unpack)};
  }

  template <class T, class F>
  void for_each_slice(const Tensor<T>& flat, const std::vector<std::size_t>& members, F&& f) {
    std::int64_t off = 0;
    for (auto i : members) {
      const auto& p = params_[i].template as<T>();
      f(flat.narrow(0, off, p.numel()).view(p.shape()), p);
      off += p.numel();
    }
  }

  ProcessGroup& group_;
  Device device_;
  std::vector<int> owner_;                  // owner_[i]: the rank that steps parameter i
  std::vector<std::size_t> local_index_;    // local parameter j is parameter local_index_[j]
  std::optional<O> local_;
  bool consolidated_ = false;               // state_ holds the whole state (this rank was `to`)
};

}  // namespace CHORUS_DIST_NS
}  // namespace dist

namespace optim {
using dist::ZeroRedundancyOptimizer;
}

CHORUS_NAMESPACE_END
