#pragma once
// The files of the checkpoints that reshard (Note [resharding checkpoints] in
// parallel/shard_checkpoint.hpp): their names, the caller's metadata in their index, and a flat
// sequence read back in another cut; shared by both FullyShardedDataParallels' and
// ZeroRedundancyOptimizer's save_sharded / load_sharded.
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "safetensors.hpp"

CHORUS_NAMESPACE_BEGIN
namespace io::detail {

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

/// The elements [begin, end) of the 1-D tensor `rec` of file `f`, read alone, as T on `device`.
template <class T>
Tensor<T> read_range(const io::File& f, const io::TensorRecord& rec, std::int64_t begin, std::int64_t end,
                     Device device) {
  io::TensorRecord part = rec;
  part.shape = Shape{end - begin};
  part.begin = rec.begin + static_cast<std::size_t>(begin) * sizeof(T);
  part.end = rec.begin + static_cast<std::size_t>(end) * sizeof(T);
  return host_tensor<T>(f, part).to(device);
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

}  // namespace io::detail
CHORUS_NAMESPACE_END
