#pragma once
// The files of the checkpoints that reshard (Note [resharding checkpoints] in fsdp_checkpoint.hpp):
// their names and the caller's metadata in their index, shared by FullyShardedDataParallel's and
// ZeroRedundancyOptimizer's save_sharded / load_sharded.
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

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

/// Writes `index` as dir/index.json, last: its presence says every rank's files are whole.
inline void write_index(const std::string& dir, const nlohmann::json& index) {
  const std::string text = index.dump(1);
  io::detail::write_atomically((std::filesystem::path(dir) / "index.json").string(),
                               std::vector<std::uint8_t>(text.begin(), text.end()));
}

/// dir/index.json, refused (naming `who`, the caller) unless it is an object of `format` holding
/// "world" and `entries`; `kind` names such an index in the message.
inline nlohmann::json read_index(const std::string& dir, const char* format, const char* entries, const char* who,
                                 const char* kind) {
  const auto path = (std::filesystem::path(dir) / "index.json").string();
  std::ifstream in(path);
  CHORUS_CHECK(in.good(), who, ": '", path, "' cannot be read: not a sharded checkpoint, or one whose "
                          "writing did not finish (index.json is written last)");
  nlohmann::json index = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  CHORUS_CHECK(!index.is_discarded() && index.is_object() && index.value("format", "") == format &&
                   index.contains("world") && index.contains(entries),
               who, ": '", path, "' is not ", kind);
  return index;
}

}  // namespace detail
}  // namespace CHORUS_DIST_NS
}  // namespace dist
CHORUS_NAMESPACE_END
