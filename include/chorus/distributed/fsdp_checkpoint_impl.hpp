#pragma once
// The definitions of distributed/fsdp_checkpoint.hpp: compiled into chorus::compiled and the MPI
// library, or included by fsdp_checkpoint.hpp in the header-only form (Note [compiled chorus]).
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>

#include "fsdp_checkpoint.hpp"

CHORUS_NAMESPACE_BEGIN
namespace dist {
inline namespace CHORUS_DIST_NS {
namespace detail {

CHORUS_INLINE void save_fsdp_sharded(nn::Module& root, const std::vector<std::shared_ptr<FsdpUnit>>& units,
                                     ProcessGroup& group, const optim::Optimizer& opt, const std::string& dir,
                                     const io::TrainingState& with, const io::Metadata& metadata) {
  group.check_usable("FullyShardedDataParallel::save_sharded");
  CHORUS_CHECK(with.master == nullptr, "save_sharded: a FullyShardedDataParallel keeps float32 master shards "
                                      "itself (shard_dtype); there are no amp::MasterWeights to save");
  parallel::detail::UnitList mine;
  for (const auto& u : units)
    if (!u->empty()) mine.push_back(u.get());
  CHORUS_CHECK(opt.parameters().size() == mine.size(), "save_sharded: the optimizer steps ",
               opt.parameters().size(), " tensors; it must step the wrapper's parameters() (", mine.size(),
               " shards)");
  for (std::size_t i = 0; i < mine.size(); ++i)
    CHORUS_CHECK(opt.parameters()[i].impl_key() == mine[i]->shard().impl_key(), "save_sharded: the optimizer's "
                 "parameter ", i, " is not the wrapper's shard '", mine[i]->shard_name(), "'; build it over parameters()");
  const int rank = group.rank(), world = group.world_size();
  parallel::detail::write_shard_file(dir, mine, rank, world,
                                     rank == 0 ? root.named_buffers() : std::vector<nn::Module::NamedTensor>{});
  save(opt, io::detail::shard_file(dir, "optim", rank, world), with);
  group.barrier();  // every rank's files are whole before the index says so
  if (rank == 0) io::detail::write_index(dir, parallel::detail::shard_index(mine, world, metadata));
  group.barrier();  // the checkpoint is complete when save_sharded returns on any rank
}

CHORUS_INLINE io::Metadata load_fsdp_sharded(nn::Module& root, const std::vector<std::shared_ptr<FsdpUnit>>& units,
                                             ProcessGroup& group, optim::Optimizer& opt, const std::string& dir,
                                             const io::TrainingState& with) {
  group.check_usable("FullyShardedDataParallel::load_sharded");
  parallel::detail::UnitList mine;
  for (const auto& u : units)
    if (!u->empty()) mine.push_back(u.get());
  parallel::detail::ShardReader reader(dir, mine, "load_sharded");
  std::vector<nn::Module::NamedTensor> state;
  const auto shards = reader.read(mine, group.rank(), [](std::size_t k) { return k; }, state);
  // The optimizer's file as this rank would have written it: the state above, the groups, the
  // scheduler and the scaler of rank 0's (the same on every rank).
  io::Metadata meta = reader.first_optim().metadata;
  meta["parameters"] = std::to_string(opt.parameters().size());
  load(opt, io::parse(io::detail::serialise(state, meta)), with);  // refuses (changing nothing) on any mismatch
  parallel::detail::set_shards(mine, shards);
  reader.read_buffers(root.named_buffers());
  return io::detail::index_metadata(reader.index());
}

}  // namespace detail

CHORUS_INLINE void consolidate_sharded(const std::string& dir, const std::string& path) {
  const auto index =
      io::detail::read_index(dir, "chorus.fsdp", "units", "consolidate_sharded", "a FullyShardedDataParallel index");
  const int world = index["world"].get<int>();
  std::vector<io::File> models;
  for (int q = 0; q < world; ++q) models.push_back(io::read(io::detail::shard_file(dir, "model", q, world)));
  std::vector<nn::Module::NamedTensor> tensors;
  for (const auto& u : index["units"]) {
    const auto key = u["key"].get<std::string>();
    const auto s = u["shard_numel"].get<std::int64_t>(), numel = u["numel"].get<std::int64_t>();
    const auto& first = models[0].tensors;
    CHORUS_CHECK(first.count(key), "consolidate_sharded: ", models[0].source, " holds no '", key, "'");
    visit_dtype(first.at(key).dtype, [&](auto tag) {
      using T = decltype(tag);
      if constexpr (is_floating_v<T>) {
        auto flat = io::detail::reshard<T>(
            [&](int q) {
              const auto it = models[static_cast<std::size_t>(q)].tensors.find(key);
              CHORUS_CHECK(it != models[static_cast<std::size_t>(q)].tensors.end(), "consolidate_sharded: ",
                           models[static_cast<std::size_t>(q)].source, " holds no '", key, "'");
              return std::pair{&models[static_cast<std::size_t>(q)], &it->second};
            },
            numel, s, numel, 0, Device::cpu());
        for (const auto& p : u["params"]) {
          const Shape shape(p["shape"].get<std::vector<std::int64_t>>());
          const auto offset = p["offset"].get<std::int64_t>();
          tensors.push_back({p["name"].get<std::string>(),
                             AnyTensor(flat.narrow(0, offset, numel_of(shape)).view(shape).clone())});
        }
      }
    });
  }
  for (const auto& entry : models[0].tensors) {
    const std::string& name = entry.first;
    const io::TensorRecord& rec = entry.second;
    if (name.rfind("buffer.", 0) != 0) continue;
    visit_dtype(rec.dtype, [&](auto tag) {
      using T = decltype(tag);
      tensors.push_back({name.substr(7), AnyTensor(io::detail::host_tensor<T>(models[0], rec))});
    });
  }
  io::detail::write_atomically(path, io::detail::serialise(tensors, io::detail::index_metadata(index)));
}

}  // namespace CHORUS_DIST_NS
}  // namespace dist
CHORUS_NAMESPACE_END
