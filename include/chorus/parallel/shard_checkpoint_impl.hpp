#pragma once
// The definitions of parallel/shard_checkpoint.hpp: compiled into chorus::compiled, or included by
// shard_checkpoint.hpp in the header-only form (Note [compiled chorus]).
#include <filesystem>

#include "shard_checkpoint.hpp"

CHORUS_NAMESPACE_BEGIN
namespace parallel::detail {

CHORUS_INLINE nlohmann::json shard_index(const UnitList& units, int world, const io::Metadata& metadata) {
  nlohmann::json index{{"format", "chorus.fsdp"}, {"world", world}, {"metadata", metadata}};
  index["units"] = nlohmann::json::array();
  for (const auto* u : units) {
    nlohmann::json params = nlohmann::json::array();
    for (std::size_t i = 0; i < u->params().size(); ++i)
      params.push_back(
          {{"name", u->param_names()[i]}, {"shape", u->params()[i].shape().vec()}, {"offset", u->offsets()[i]}});
    index["units"].push_back({{"name", u->name()},
                              {"key", u->shard_name()},
                              {"numel", u->numel()},
                              {"shard_numel", u->shard_numel()},
                              {"dtype", dtype_name(u->dtype())},
                              {"shard_dtype", dtype_name(u->shard_dtype())},
                              {"params", params}});
  }
  return index;
}

CHORUS_INLINE void write_shard_file(const std::string& dir, const UnitList& units, int rank, int world,
                                    const std::vector<nn::Module::NamedTensor>& buffers) {
  std::vector<nn::Module::NamedTensor> tensors;
  for (const auto* u : units) tensors.push_back({u->shard_name(), u->shard()});
  for (const auto& [name, b] : buffers) tensors.push_back({"buffer." + name, b});
  std::filesystem::create_directories(dir);
  io::detail::write_atomically(io::detail::shard_file(dir, "model", rank, world),
                               io::detail::serialise(tensors, {{"format", "chorus.fsdp.shard"},
                                                               {"rank", std::to_string(rank)},
                                                               {"world", std::to_string(world)}}));
}

CHORUS_INLINE ShardReader::ShardReader(std::string dir, const UnitList& units, const char* who)
    : dir_(std::move(dir)),
      index_(io::detail::read_index(dir_, "chorus.fsdp", "units", who, "a FullyShardedDataParallel index")) {
  world_ = index_["world"].get<int>();
  CHORUS_CHECK(world_ > 0, who, ": '", dir_, "': a world of ", world_);
  const auto& saved = index_["units"];
  CHORUS_CHECK(saved.size() == units.size(), who, ": '", dir_, "' holds ", saved.size(), " units; the model has ",
               units.size());
  for (std::size_t k = 0; k < units.size(); ++k) {
    const auto& s = saved[k];
    const FsdpUnit& u = *units[k];
    const std::string unit = u.is_root() ? std::string("the root unit") : "unit '" + u.name() + "'";
    CHORUS_CHECK(s.value("name", "?") == u.name() && s.value("numel", std::int64_t{-1}) == u.numel() &&
                     s.value("dtype", "") == std::string(dtype_name(u.dtype())) &&
                     s.value("shard_dtype", "") == std::string(dtype_name(u.shard_dtype())) &&
                     s["params"].size() == u.params().size(),
                 who, ": '", dir_, "' holds ",
                 s.value("name", "?").empty() ? std::string("the root unit") : "unit '" + s.value("name", "?") + "'",
                 " of ", s.value("numel", -1), " elements (", s.value("dtype", "?"), ", shards ",
                 s.value("shard_dtype", "?"), "); the model's ", unit, " has ", u.numel(), " (", dtype_name(u.dtype()),
                 ", shards ", dtype_name(u.shard_dtype()), ")");
    for (std::size_t i = 0; i < u.params().size(); ++i) {
      const auto& p = s["params"][i];
      CHORUS_CHECK(p.value("name", "") == u.param_names()[i] && p.value("offset", std::int64_t{-1}) == u.offsets()[i] &&
                       Shape(p["shape"].get<std::vector<std::int64_t>>()) == u.params()[i].shape(),
                   who, ": '", dir_, "': parameter ", i, " of ", unit, " is '", p.value("name", "?"), "' ",
                   Shape(p["shape"].get<std::vector<std::int64_t>>()), "; the model's is '", u.param_names()[i], "' ",
                   u.params()[i].shape());
    }
  }
}

CHORUS_INLINE const io::File& ShardReader::file(std::map<int, io::File>& files, const char* kind, int q) {
  auto it = files.find(q);
  if (it == files.end()) it = files.emplace(q, io::read(io::detail::shard_file(dir_, kind, q, world_))).first;
  return it->second;
}

CHORUS_INLINE const io::TensorRecord* ShardReader::record(const io::File& f, const std::string& name) const {
  const auto it = f.tensors.find(name);
  CHORUS_CHECK(it != f.tensors.end(), "load_sharded: ", f.source, " holds no '", name, "'");
  return &it->second;
}

CHORUS_INLINE std::vector<AnyTensor> ShardReader::read(const UnitList& units, int rank,
                                                       const std::function<std::size_t(std::size_t)>& index_of,
                                                       std::vector<nn::Module::NamedTensor>& state) {
  std::vector<AnyTensor> shards;
  const auto& saved = index_["units"];
  const io::File& first = first_optim();
  for (std::size_t k = 0; k < units.size(); ++k) {
    const FsdpUnit& u = *units[k];
    const auto s_old = saved[k]["shard_numel"].get<std::int64_t>();
    visit_dtype(u.shard_dtype(), [&](auto tag) {
      using T = decltype(tag);
      if constexpr (is_floating_v<T>) {
        const auto key = saved[k]["key"].get<std::string>();
        shards.emplace_back(io::detail::reshard<T>(
            [&](int q) {
              const auto& f = file(model_, "model", q);
              return std::pair{&f, record(f, key)};
            },
            u.numel(), s_old, u.shard_numel(), rank, u.shard().device()));
      }
    });
    const std::string prefix = std::to_string(k) + ".", renamed = std::to_string(index_of(k)) + ".";
    for (const auto& entry : first.tensors) {
      const std::string& name = entry.first;  // (a lambda below uses it: no structured binding)
      const io::TensorRecord& rec = entry.second;
      if (name.rfind(prefix, 0) != 0) continue;
      const std::string mine = renamed + name.substr(prefix.size());
      if (rec.shape == Shape{s_old}) {  // one value an element: cut as the parameters
        visit_dtype(rec.dtype, [&](auto tag) {
          using T = decltype(tag);
          state.push_back({mine, AnyTensor(io::detail::reshard<T>(
                                     [&](int q) {
                                       const auto& f = file(optim_, "optim", q);
                                       return std::pair{&f, record(f, name)};
                                     },
                                     u.numel(), s_old, u.shard_numel(), rank, Device::cpu()))});
        });
      } else {  // a scalar (a step count): the same on every member
        visit_dtype(rec.dtype, [&](auto tag) {
          using T = decltype(tag);
          state.push_back({mine, AnyTensor(io::detail::host_tensor<T>(first, rec))});
        });
      }
    }
  }
  return shards;
}

CHORUS_INLINE void ShardReader::read_buffers(const std::vector<nn::Module::NamedTensor>& buffers) {
  const io::File& first = file(model_, "model", 0);
  NoGradGuard ng;
  for (const auto& buffer : buffers)
    buffer.tensor.visit([&](const auto& t) {
      const std::string& name = buffer.name;
      using T = typename std::decay_t<decltype(t)>::value_type;
      const auto* rec = record(first, "buffer." + name);
      CHORUS_CHECK(rec->dtype == t.dtype() && rec->shape == t.shape(), "load_sharded: buffer '", name, "' is ",
                   dtype_name(rec->dtype), " ", rec->shape, " in ", first.source, "; the model's is ",
                   dtype_name(t.dtype()), " ", t.shape());
      backend::copy(t, io::detail::host_tensor<T>(first, *rec).to(t.device()));
      t.bump_version();
    });
}

CHORUS_INLINE void set_shards(const UnitList& units, const std::vector<AnyTensor>& shards) {
  NoGradGuard ng;
  for (std::size_t k = 0; k < units.size(); ++k)
    units[k]->shard().visit([&](const auto& s) {
      using T = typename std::decay_t<decltype(s)>::value_type;
      backend::copy(s, shards[k].template as<T>());
      s.bump_version();
    });
}

}  // namespace parallel::detail
CHORUS_NAMESPACE_END
