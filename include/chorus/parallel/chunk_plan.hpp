#pragma once
// The chunk plan: how a batch is split across devices.
//
// Note [chunk plan]
// torch.chunk semantics: chunk size ceil(B / k), number of chunks ceil(B / chunk), which may
// be fewer than k (only the first that many devices are used). A batch of 30 on 8 devices
// is 4 ×7 and 2; a batch of 10 on 8 devices is 2 ×5 (three devices idle). An empty batch is
// one empty chunk, run on the primary device.
#include <cstdint>
#include <vector>

#include "../error.hpp"

CHORUS_NAMESPACE_BEGIN
namespace parallel {

/// How a batch splits over devices: chunk r, of sizes[r] rows from row offsets[r], goes to device r.
struct ChunkPlan {
  std::vector<std::int64_t> sizes;    ///< rows per used device (sizes.size() devices are used)
  std::vector<std::int64_t> offsets;  ///< first row of each chunk
  /// The number of devices used (chunks), at most the number of devices planned for.
  std::size_t used() const { return sizes.size(); }
};

/// torch.chunk's split of `batch` rows over `devices` devices (Note [chunk plan]).
inline ChunkPlan plan_chunks(std::int64_t batch, std::size_t devices) {
  CHORUS_CHECK(devices > 0, "chunk plan: no devices");
  CHORUS_CHECK(batch >= 0, "chunk plan: negative batch size ", batch);
  ChunkPlan plan;
  if (batch == 0) {
    plan.sizes = {0};
    plan.offsets = {0};
    return plan;
  }
  const auto k = static_cast<std::int64_t>(devices);
  const std::int64_t chunk = batch / k + (batch % k != 0);  // ceil, without batch + k - 1 (overflows)
  for (std::int64_t off = 0; off < batch; off += std::min(chunk, batch - off)) {
    plan.offsets.push_back(off);
    plan.sizes.push_back(std::min(chunk, batch - off));
  }
  return plan;
}

}  // namespace parallel
CHORUS_NAMESPACE_END
