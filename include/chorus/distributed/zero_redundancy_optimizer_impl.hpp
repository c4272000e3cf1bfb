#pragma once
// The definitions of distributed/zero_redundancy_optimizer.hpp that do not depend on the
// optimizer type (the partition, the state gathering, the parameter broadcasts): compiled into
// chorus::compiled and the MPI library (src/distributed/local.cpp, mpi.cpp), included by
// zero_redundancy_optimizer.hpp itself in the header-only form (Note [compiled chorus]).
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>

#include "../io/sharded_files.hpp"
#include "zero_redundancy_optimizer.hpp"

CHORUS_NAMESPACE_BEGIN
namespace dist {
inline namespace CHORUS_DIST_NS {
namespace detail {

CHORUS_INLINE Device zero_device(const std::vector<AnyTensor>& params) {
  const Device device = params[0].device();
  for (std::size_t i = 0; i < params.size(); ++i)
    CHORUS_CHECK(params[i].device() == device, "ZeroRedundancyOptimizer: parameter ", i, " is on ",
                 params[i].device(), ", parameter 0 on ", device, "; one device per process");
  return device;
}

CHORUS_INLINE void zero_check_consolidate(ProcessGroup& group, int to) {
  CHORUS_CHECK(to >= 0 && to < group.world_size(), "ZeroRedundancyOptimizer::consolidate_state_dict: rank ", to,
               " is not a rank of a world of ", group.world_size());
  group.check_usable("ZeroRedundancyOptimizer::consolidate_state_dict");
}

CHORUS_INLINE std::vector<optim::Optimizer::State> zero_gather_state(ProcessGroup& group, const optim::Optimizer& local,
                                                                     const std::vector<AnyTensor>& params,
                                                                     const std::vector<int>& owner,
                                                                     const std::vector<std::size_t>& local_index) {
  using State = optim::Optimizer::State;
  const auto keys = local.state_keys();
  const std::size_t K = keys.size(), P = params.size();
  // Which entries exist (a parameter never stepped has none; amsgrad adds one): known to
  // their owner only, so every rank learns them first.
  auto present = zeros<std::int64_t>(Shape{static_cast<std::int64_t>(P * K)});
  {
    auto* flags = present.data();
    const auto& mine = local.state();
    for (std::size_t j = 0; j < local_index.size(); ++j)
      for (std::size_t k = 0; k < K; ++k) flags[local_index[j] * K + k] = mine[j].count(keys[k]) ? 1 : 0;
  }
  group.all_reduce(present);
  const auto* flags = present.data();
  std::vector<State> full(P);
  std::vector<std::shared_ptr<Work>> pending;
  std::vector<std::size_t> slot(P, 0);
  for (std::size_t j = 0; j < local_index.size(); ++j) slot[local_index[j]] = j;
  for (std::size_t i = 0; i < P; ++i)
    for (std::size_t k = 0; k < K; ++k) {
      if (!flags[i * K + k]) continue;
      AnyTensor t;
      if (owner[i] == group.rank()) {
        t = local.state()[slot[i]].at(keys[k]);
      } else if (keys[k] == "step") {
        t = AnyTensor(scalar_tensor<double>(0.0));
      } else {
        t = params[i].visit([&](const auto& p) {
          using T = typename std::decay_t<decltype(p)>::value_type;
          return AnyTensor(Tensor<T>::empty(p.shape(), p.device()));
        });
      }
      t.visit([&](const auto& x) {
        pending.push_back(group.broadcast_async(x, owner[i], "ZeroRedundancyOptimizer state of parameter " +
                                                             std::to_string(i) + " (" + keys[k] + ")"));
      });
      full[i][keys[k]] = std::move(t);
    }
  for (auto& w : pending) w->wait(group.timeout());
  return full;
}

CHORUS_INLINE void zero_check_consolidated(bool consolidated, int rank) {
  CHORUS_CHECK(consolidated, "ZeroRedundancyOptimizer: the optimizer state is sharded over the ranks and has not "
                             "been consolidated on rank ",
               rank, " since the last step; call consolidate_state_dict(", rank, ") on every rank first");
}

CHORUS_INLINE void zero_partition(const optim::Optimizer& opt, int w, std::vector<int>& owner) {
  const std::vector<AnyTensor>& params = opt.parameters();
  std::vector<std::int64_t> load(static_cast<std::size_t>(w), 0);
  owner.assign(params.size(), 0);
  for (std::size_t g = 0; g < opt.num_groups(); ++g) {
    std::vector<std::size_t> members;
    for (std::size_t i = 0; i < params.size(); ++i)
      if (opt.group_of(i) == g) members.push_back(i);
    std::stable_sort(members.begin(), members.end(),
                     [&](std::size_t a, std::size_t b) { return params[a].numel() > params[b].numel(); });
    for (auto i : members) {
      const int r = static_cast<int>(std::min_element(load.begin(), load.end()) - load.begin());
      owner[i] = r;
      load[static_cast<std::size_t>(r)] += params[i].numel();
    }
  }
}

struct ZeroPendingSync {
  std::shared_ptr<Work> work;
  std::function<void()> unpack;  // empty on the owner
};

template <class T, class F>
void for_each_slice(const std::vector<AnyTensor>& params, const Tensor<T>& flat, const std::vector<std::size_t>& members,
                    F&& f) {
  std::int64_t off = 0;
  for (auto i : members) {
    const auto& p = params[i].template as<T>();
    f(flat.narrow(0, off, p.numel()).view(p.shape()), p);
    off += p.numel();
  }
}

template <class T>
ZeroPendingSync broadcast_packed(ProcessGroup& group, const std::vector<AnyTensor>& params, Device device, int root,
                                 std::vector<std::size_t> members) {
  NoGradGuard ng;
  std::int64_t n = 0;
  for (auto i : members) n += params[i].numel();
  auto flat = Tensor<T>::empty(Shape{n}, device);
  const bool mine = root == group.rank();
  if (mine) for_each_slice<T>(params, flat, members, [](const Tensor<T>& slice, const Tensor<T>& p) { backend::copy(slice, p); });
  auto work = group.broadcast_async(flat, root, "ZeroRedundancyOptimizer parameters of rank " + std::to_string(root));
  std::function<void()> unpack;
  if (!mine)
    unpack = [&params, flat, members = std::move(members)] {
      NoGradGuard g;
      for_each_slice<T>(params, flat, members, [](const Tensor<T>& slice, const Tensor<T>& p) {
        backend::copy(p, slice);
        p.bump_version();  // an in-place update (Note [version counter])
      });
    };
  return {std::move(work), std::move(unpack)};
}

CHORUS_INLINE double zero_clip_grad_norm(ProcessGroup& group, const std::vector<AnyTensor>& params,
                                         const std::vector<std::size_t>& local_index, Device device, double max_norm,
                                         double norm_type) {
  CHORUS_CHECK(max_norm >= 0, "clip_grad_norm_: max_norm must be non-negative, got ", max_norm);
  CHORUS_CHECK(norm_type > 0, "clip_grad_norm_: norm_type must be positive, got ", norm_type);
  std::vector<AnyTensor> mine;
  for (auto i : local_index) mine.push_back(params[i]);
  auto local = Tensor<double>::empty(Shape{1}, device);
  auto local_groups = nn::utils::detail::device_grads(mine);
  backend::fill(local, nn::utils::detail::total_norm(local_groups, norm_type, 0.0, nullptr).item());
  const auto norms = group.all_gather(local).to_vector();
  double total = 0;
  if (std::isinf(norm_type)) {
    for (double n : norms) total = std::max(total, n);
  } else {
    for (double n : norms) total += std::pow(n, norm_type);
    total = std::pow(total, 1.0 / norm_type);
  }
  auto coef = Tensor<double>::empty(Shape{1}, device);  // as nn::utils::clip_grad_norm_
  backend::fill(coef, std::min(1.0, max_norm / (total + 1e-6)));
  NoGradGuard no_grad;
  for (auto& g : nn::utils::detail::device_grads(mine)) {
    auto c = g.device == coef.device() ? coef : coef.to(g.device);
    if (!g.f32.ptrs.empty()) backend::foreach_scale(g.f32.ptrs, g.f32.numels, c.data(), g.device);
    if (!g.f64.ptrs.empty()) backend::foreach_scale(g.f64.ptrs, g.f64.numels, c.data(), g.device);
  }
  return total;
}

CHORUS_INLINE bool zero_any_rank(ProcessGroup& group, bool mine, Device device) {
  auto flag = Tensor<std::int64_t>::empty(Shape{1}, device);
  backend::fill(flag, std::int64_t{mine ? 1 : 0});
  for (auto f : group.all_gather(flag).to_vector())
    if (f != 0) return true;
  return false;
}

CHORUS_INLINE void zero_sync_parameters(ProcessGroup& group, const std::vector<AnyTensor>& params,
                                        const std::vector<int>& owner, Device device) {
  if (group.world_size() == 1) return;
  std::vector<ZeroPendingSync> pending;
  for (int r = 0; r < group.world_size(); ++r)
    for (DType d : {DType::Float32, DType::Float64, DType::BFloat16, DType::Float16}) {
      std::vector<std::size_t> members;
      for (std::size_t i = 0; i < params.size(); ++i)
        if (owner[i] == r && params[i].dtype() == d) members.push_back(i);
      if (members.empty()) continue;
      params[members[0]].visit([&](const auto& first) {
        using T = typename std::decay_t<decltype(first)>::value_type;
        pending.push_back(broadcast_packed<T>(group, params, device, r, std::move(members)));
      });
    }
  for (auto& p : pending) {
    p.work->wait(group.timeout());
    if (p.unpack) p.unpack();
  }
}

CHORUS_INLINE void zero_save_sharded(ProcessGroup& group, const optim::Optimizer& opt,
                                     const std::vector<optim::Optimizer::State>& local_state,
                                     const std::vector<std::size_t>& local_index, const std::vector<int>& owner,
                                     const std::string& dir, const io::TrainingState& with,
                                     const io::Metadata& metadata) {
  group.check_usable("ZeroRedundancyOptimizer::save_sharded");
  const int rank = group.rank(), world = group.world_size();
  std::vector<std::pair<std::size_t, const optim::Optimizer::State*>> states;
  for (std::size_t j = 0; j < local_index.size(); ++j) states.emplace_back(local_index[j], &local_state[j]);
  io::TrainingState mine = with;
  if (rank != 0) mine.master = nullptr;  // the float32 masters are whole on every rank: rank 0 writes them
  std::filesystem::create_directories(dir);
  io::detail::write_atomically(io::detail::shard_file(dir, "optim", rank, world), io::detail::optimizer_image(opt, states, mine));
  group.barrier();  // every rank's file is whole before the index says so
  if (rank == 0) {
    nlohmann::json index{{"format", "chorus.zero"}, {"world", world}, {"optimizer", opt.name()}, {"metadata", metadata}};
    index["params"] = nlohmann::json::array();
    for (std::size_t i = 0; i < opt.parameters().size(); ++i)
      index["params"].push_back({{"shape", opt.parameters()[i].shape().vec()},
                                 {"dtype", dtype_name(opt.parameters()[i].dtype())},
                                 {"owner", owner[i]}});
    io::detail::write_index(dir, index);
  }
  group.barrier();  // the checkpoint is complete when save_sharded returns on any rank
}

CHORUS_INLINE io::Metadata zero_load_sharded(ProcessGroup& group, optim::Optimizer& opt, const std::vector<int>& owner,
                                             const std::string& dir, const io::TrainingState& with) {
  group.check_usable("ZeroRedundancyOptimizer::load_sharded");
  const auto index = io::detail::read_index(dir, "chorus.zero", "params", "ZeroRedundancyOptimizer::load_sharded",
                                "a ZeroRedundancyOptimizer index");
  CHORUS_CHECK(index["params"].is_array(), "ZeroRedundancyOptimizer::load_sharded: '", dir,
               "/index.json' is not a ZeroRedundancyOptimizer index");
  const int old_world = index["world"].get<int>();
  const auto& saved = index["params"];
  CHORUS_CHECK(index.value("optimizer", "") == opt.name() && saved.size() == opt.parameters().size(),
               "ZeroRedundancyOptimizer::load_sharded: '", dir, "' holds ", index.value("optimizer", "?"), " state of ",
               saved.size(), " parameters; this optimizer is ", opt.name(), " over ", opt.parameters().size());
  for (std::size_t i = 0; i < saved.size(); ++i) {
    const auto& p = opt.parameters()[i];
    const Shape shape(saved[i]["shape"].get<std::vector<std::int64_t>>());
    const int q = saved[i].value("owner", -1);
    CHORUS_CHECK(shape == p.shape() && saved[i].value("dtype", "") == std::string(dtype_name(p.dtype())) && q >= 0 &&
                     q < old_world,
                 "ZeroRedundancyOptimizer::load_sharded: '", dir, "': parameter ", i, " is ", saved[i].value("dtype", "?"),
                 " ", shape, " (owner ", q, " of ", old_world, "); this optimizer's is ", dtype_name(p.dtype()), " ",
                 p.shape());
  }
  std::map<int, io::File> files;  // the old ranks' files, opened as they are needed
  auto file = [&](int q) -> const io::File& {
    auto it = files.find(q);
    if (it == files.end()) it = files.emplace(q, io::read(io::detail::shard_file(dir, "optim", q, old_world))).first;
    return it->second;
  };
  std::vector<nn::Module::NamedTensor> tensors;
  auto take = [&](const io::File& f, const std::string& prefix) {
    for (const auto& entry : f.tensors) {
      const std::string& name = entry.first;
      const io::TensorRecord& rec = entry.second;
      if (name.rfind(prefix, 0) != 0) continue;
      visit_dtype(rec.dtype, [&](auto tag) {
        using T = decltype(tag);
        tensors.push_back({name, AnyTensor(io::detail::host_tensor<T>(f, rec))});
      });
    }
  };
  for (std::size_t i = 0; i < saved.size(); ++i)
    if (owner[i] == group.rank()) take(file(saved[i]["owner"].get<int>()), std::to_string(i) + ".");
  const io::File& first = file(0);
  if (with.master) take(first, "master.");
  // The optimizer's file as if consolidated, with this rank's parameters' state only: io::load
  // checks it all before anything changes, and load_state keeps this rank's shard.
  load(opt, io::parse(io::detail::serialise(tensors, first.metadata)), with);
  return io::detail::index_metadata(index);
}

}  // namespace detail
}  // namespace CHORUS_DIST_NS
}  // namespace dist
CHORUS_NAMESPACE_END
