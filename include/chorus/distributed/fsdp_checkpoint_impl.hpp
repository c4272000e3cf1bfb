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
#include "sharded_files.hpp"

CHORUS_NAMESPACE_BEGIN
namespace dist {
inline namespace CHORUS_DIST_NS {
namespace detail {

/// The elements [begin, end) of the 1-D tensor `rec` of file `f`, read alone, as T on `device`.
template <class T>
Tensor<T> read_range(const io::File& f, const io::TensorRecord& rec, std::int64_t begin, std::int64_t end,
                     Device device) {
  io::TensorRecord part = rec;
  part.shape = Shape{end - begin};
  part.begin = rec.begin + static_cast<std::size_t>(begin) * sizeof(T);
  part.end = rec.begin + static_cast<std::size_t>(end) * sizeof(T);
  return io::detail::host_tensor<T>(f, part).to(device);
}

/// Rank `rank`'s part [rank·s_new, rank·s_new + s_new) of a flat sequence of `numel` elements
/// that the old files hold cut into parts of `s_old`: `tensor_of(q)` names old rank q's record.
template <class T, class Tensors>
Tensor<T> reshard(Tensors&& tensor_of, std::int64_t numel, std::int64_t s_old, std::int64_t s_new, int rank,
                  Device device) {
  auto out = Tensor<T>::empty(Shape{s_new}, device);
  backend::fill(out, T(0));  // the padding
  const std::int64_t begin = rank * s_new, end = std::min(numel, begin + s_new);
  for (std::int64_t at = begin; at < end;) {
    const auto q = static_cast<int>(at / s_old);
    const std::int64_t upto = std::min(end, (q + 1) * s_old);
    const auto [file, rec] = tensor_of(q);
    CHORUS_CHECK(rec->dtype == dtype_of<T>() && rec->shape == Shape{s_old}, "load_sharded: ", file->source,
                 " holds a ", dtype_name(rec->dtype), " ", rec->shape, " part; expected ", dtype_name(dtype_of<T>()),
                 " [", s_old, "]");
    backend::copy(out.narrow(0, at - begin, upto - at), read_range<T>(*file, *rec, at - q * s_old, upto - q * s_old, device));
    at = upto;
  }
  return out;
}

CHORUS_INLINE void save_fsdp_sharded(nn::Module& root, const std::vector<std::shared_ptr<FsdpUnit>>& units,
                                     ProcessGroup& group, const optim::Optimizer& opt, const std::string& dir,
                                     const io::TrainingState& with, const io::Metadata& metadata) {
  group.check_usable("FullyShardedDataParallel::save_sharded");
  CHORUS_CHECK(with.master == nullptr, "save_sharded: a FullyShardedDataParallel keeps float32 master shards "
                                      "itself (shard_dtype); there are no amp::MasterWeights to save");
  std::vector<nn::Module::NamedTensor> tensors;
  for (const auto& u : units)
    if (!u->empty()) tensors.push_back({u->shard_name(), u->shard()});
  CHORUS_CHECK(opt.parameters().size() == tensors.size(), "save_sharded: the optimizer steps ",
               opt.parameters().size(), " tensors; it must step the wrapper's parameters() (", tensors.size(),
               " shards)");
  for (std::size_t i = 0; i < tensors.size(); ++i)
    CHORUS_CHECK(opt.parameters()[i].impl_key() == tensors[i].tensor.impl_key(), "save_sharded: the optimizer's "
                 "parameter ", i, " is not the wrapper's shard '", tensors[i].name, "'; build it over parameters()");
  const int rank = group.rank(), world = group.world_size();
  if (rank == 0)
    for (const auto& [name, b] : root.named_buffers()) tensors.push_back({"buffer." + name, b});
  std::filesystem::create_directories(dir);
  io::detail::write_atomically(shard_file(dir, "model", rank, world),
                               io::detail::serialise(tensors, {{"format", "chorus.fsdp.shard"},
                                                               {"rank", std::to_string(rank)},
                                                               {"world", std::to_string(world)}}));
  save(opt, shard_file(dir, "optim", rank, world), with);
  group.barrier();  // every rank's files are whole before the index says so
  if (rank == 0) {
    nlohmann::json index{{"format", "chorus.fsdp"}, {"world", world}, {"metadata", metadata}};
    index["units"] = nlohmann::json::array();
    for (const auto& u : units) {
      if (u->empty()) continue;
      nlohmann::json params = nlohmann::json::array();
      for (std::size_t i = 0; i < u->params().size(); ++i)
        params.push_back({{"name", u->param_names()[i]},
                          {"shape", u->params()[i].shape().vec()},
                          {"offset", u->offsets()[i]}});
      index["units"].push_back({{"name", u->name()},
                                {"key", u->shard_name()},
                                {"numel", u->numel()},
                                {"shard_numel", u->shard_numel()},
                                {"dtype", dtype_name(u->dtype())},
                                {"shard_dtype", dtype_name(u->shard_dtype())},
                                {"params", params}});
    }
    write_index(dir, index);
  }
  group.barrier();  // the checkpoint is complete when save_sharded returns on any rank
}

CHORUS_INLINE io::Metadata load_fsdp_sharded(nn::Module& root, const std::vector<std::shared_ptr<FsdpUnit>>& units,
                                             ProcessGroup& group, optim::Optimizer& opt, const std::string& dir,
                                             const io::TrainingState& with) {
  group.check_usable("FullyShardedDataParallel::load_sharded");
  const auto index = read_index(dir, "chorus.fsdp", "units", "load_sharded", "a FullyShardedDataParallel index");
  const int old_world = index["world"].get<int>(), rank = group.rank();
  CHORUS_CHECK(old_world > 0, "load_sharded: '", dir, "': a world of ", old_world);
  std::vector<const FsdpUnit*> mine;
  for (const auto& u : units)
    if (!u->empty()) mine.push_back(u.get());
  const auto& saved = index["units"];
  CHORUS_CHECK(saved.size() == mine.size(), "load_sharded: '", dir, "' holds ", saved.size(), " units; the model has ",
               mine.size());
  for (std::size_t k = 0; k < mine.size(); ++k) {
    const auto& s = saved[k];
    const FsdpUnit& u = *mine[k];
    const std::string who = u.is_root() ? std::string("the root unit") : "unit '" + u.name() + "'";
    CHORUS_CHECK(s.value("name", "?") == u.name() && s.value("numel", std::int64_t{-1}) == u.numel() &&
                     s.value("dtype", "") == std::string(dtype_name(u.dtype())) &&
                     s.value("shard_dtype", "") == std::string(dtype_name(u.shard_dtype())) &&
                     s["params"].size() == u.params().size(),
                 "load_sharded: '", dir, "' holds ",
                 s.value("name", "?").empty() ? std::string("the root unit") : "unit '" + s.value("name", "?") + "'",
                 " of ", s.value("numel", -1),
                 " elements (", s.value("dtype", "?"), ", shards ", s.value("shard_dtype", "?"), "); the model's ",
                 who, " has ", u.numel(), " (", dtype_name(u.dtype()), ", shards ", dtype_name(u.shard_dtype()), ")");
    for (std::size_t i = 0; i < u.params().size(); ++i) {
      const auto& p = s["params"][i];
      CHORUS_CHECK(p.value("name", "") == u.param_names()[i] && p.value("offset", std::int64_t{-1}) == u.offsets()[i] &&
                       Shape(p["shape"].get<std::vector<std::int64_t>>()) == u.params()[i].shape(),
                   "load_sharded: '", dir, "': parameter ", i, " of ", who, " is '", p.value("name", "?"), "' ",
                   Shape(p["shape"].get<std::vector<std::int64_t>>()), "; the model's is '", u.param_names()[i], "' ",
                   u.params()[i].shape());
    }
  }
  // The old ranks' files, opened as they are needed.
  std::map<int, io::File> model_files, optim_files;
  auto file = [&](std::map<int, io::File>& files, const char* kind, int q) -> const io::File& {
    auto it = files.find(q);
    if (it == files.end()) it = files.emplace(q, io::read(shard_file(dir, kind, q, old_world))).first;
    return it->second;
  };
  auto record = [&](const io::File& f, const std::string& name) {
    const auto it = f.tensors.find(name);
    CHORUS_CHECK(it != f.tensors.end(), "load_sharded: ", f.source, " holds no '", name, "'");
    return &it->second;
  };
  // The new shards and the optimizer's state for them, in this rank's cut.
  std::vector<AnyTensor> shards;
  std::vector<nn::Module::NamedTensor> state;
  const io::File& first_optim = file(optim_files, "optim", 0);
  for (std::size_t k = 0; k < mine.size(); ++k) {
    const FsdpUnit& u = *mine[k];
    const auto s_old = saved[k]["shard_numel"].get<std::int64_t>();
    visit_dtype(u.shard_dtype(), [&](auto tag) {
      using T = decltype(tag);
      if constexpr (is_floating_v<T>) {
        const auto key = saved[k]["key"].get<std::string>();
        shards.emplace_back(reshard<T>(
            [&](int q) { const auto& f = file(model_files, "model", q); return std::pair{&f, record(f, key)}; },
            u.numel(), s_old, u.shard_numel(), rank, u.shard().device()));
      }
    });
    const std::string prefix = std::to_string(k) + ".";
    for (const auto& entry : first_optim.tensors) {
      const std::string& name = entry.first;  // (a lambda below uses it: no structured binding)
      const io::TensorRecord& rec = entry.second;
      if (name.rfind(prefix, 0) != 0) continue;
      if (rec.shape == Shape{s_old}) {  // one value an element: cut as the parameters
        visit_dtype(rec.dtype, [&](auto tag) {
          using T = decltype(tag);
          state.push_back({name, AnyTensor(reshard<T>(
                                     [&](int q) {
                                       const auto& f = file(optim_files, "optim", q);
                                       return std::pair{&f, record(f, name)};
                                     },
                                     u.numel(), s_old, u.shard_numel(), rank, Device::cpu()))});
        });
      } else {  // a scalar (a step count): the same on every rank
        visit_dtype(rec.dtype, [&](auto tag) {
          using T = decltype(tag);
          state.push_back({name, AnyTensor(io::detail::host_tensor<T>(first_optim, rec))});
        });
      }
    }
  }
  // The optimizer's file as this rank would have written it: the state above, the groups, the
  // scheduler and the scaler of rank 0's (the same on every rank).
  io::Metadata meta = first_optim.metadata;
  auto image = io::detail::serialise(state, meta);
  load(opt, io::parse(image), with);  // refuses (changing nothing) on any mismatch
  NoGradGuard ng;
  for (std::size_t k = 0; k < mine.size(); ++k)
    mine[k]->shard().visit([&](const auto& s) {
      using T = typename std::decay_t<decltype(s)>::value_type;
      backend::copy(s, shards[k].template as<T>());
      s.bump_version();
    });
  const io::File& first_model = file(model_files, "model", 0);
  for (const auto& buffer : root.named_buffers())
    buffer.tensor.visit([&](const auto& t) {
      const std::string& name = buffer.name;
      using T = typename std::decay_t<decltype(t)>::value_type;
      const auto* rec = record(first_model, "buffer." + name);
      CHORUS_CHECK(rec->dtype == t.dtype() && rec->shape == t.shape(), "load_sharded: buffer '", name, "' is ",
                   dtype_name(rec->dtype), " ", rec->shape, " in ", first_model.source, "; the model's is ",
                   dtype_name(t.dtype()), " ", t.shape());
      backend::copy(t, io::detail::host_tensor<T>(first_model, *rec).to(t.device()));
      t.bump_version();
    });
  return index_metadata(index);
}

}  // namespace detail

CHORUS_INLINE void consolidate_sharded(const std::string& dir, const std::string& path) {
  const auto index =
      detail::read_index(dir, "chorus.fsdp", "units", "consolidate_sharded", "a FullyShardedDataParallel index");
  const int world = index["world"].get<int>();
  std::vector<io::File> models;
  for (int q = 0; q < world; ++q) models.push_back(io::read(detail::shard_file(dir, "model", q, world)));
  std::vector<nn::Module::NamedTensor> tensors;
  for (const auto& u : index["units"]) {
    const auto key = u["key"].get<std::string>();
    const auto s = u["shard_numel"].get<std::int64_t>(), numel = u["numel"].get<std::int64_t>();
    const auto& first = models[0].tensors;
    CHORUS_CHECK(first.count(key), "consolidate_sharded: ", models[0].source, " holds no '", key, "'");
    visit_dtype(first.at(key).dtype, [&](auto tag) {
      using T = decltype(tag);
      if constexpr (is_floating_v<T>) {
        auto flat = detail::reshard<T>(
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
  io::detail::write_atomically(path, io::detail::serialise(tensors, detail::index_metadata(index)));
}

}  // namespace CHORUS_DIST_NS
}  // namespace dist
CHORUS_NAMESPACE_END
