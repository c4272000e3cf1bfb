#pragma once
// The files of the checkpoints that reshard (Note [resharding checkpoints] in fsdp_checkpoint.hpp):
// their names and the caller's metadata in their index, shared by FullyShardedDataParallel's and
// ZeroRedundancyOptimizer's save_sharded / load_sharded.
#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>

#include "../io/safetensors.hpp"
#include "backend.hpp"

CHORUS_NAMESPACE_BEGIN
namespace dist {
inline namespace CHORUS_DIST_NS {
namespace detail {

/// "model-00002-of-00004.safetensors" (kind "model" or "optim").
inline std::string shard_file(const std::string& dir, const char* kind, int rank, int world) {
  char name[64];
  std::snprintf(name, sizeof name, "%s-%05d-of-%05d.safetensors", kind, rank, world);
  return (std::filesystem::path(dir) / name).string();
}

/// The caller's metadata an index holds.
inline io::Metadata index_metadata(const nlohmann::json& index) {
  io::Metadata out;
  if (index.contains("metadata") && index["metadata"].is_object())
    for (const auto& [k, v] : index["metadata"].items())
      if (v.is_string()) out[k] = v.get<std::string>();
  return out;
}

}  // namespace detail
}  // namespace CHORUS_DIST_NS
}  // namespace dist
CHORUS_NAMESPACE_END
