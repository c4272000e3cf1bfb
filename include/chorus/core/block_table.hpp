#pragma once
// The bookkeeping of a stream-ordered allocator, apart from any device API: which stream each
// live block was allocated on, and which other streams (and on which device each of them
// lives) used it since. Generic over the stream handle so that it is tested on the CPU.
//
// Note [cross-device stream uses]
// A block on device A can be read by a stream of device B (a peer copy is ordered on the
// destination's stream). Before the block is freed, an event must be recorded on each such
// stream, and an event can only be recorded on a stream of the device it was created on: the
// allocator must therefore know each using stream's device, not assume its own. Recording under
// the wrong device fails, and a failure ignored there lets the memory be reused while the peer
// copy still reads it.
#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <vector>

#include "../config.hpp"

CHORUS_NAMESPACE_BEGIN
namespace detail {

template <class Handle>
class BlockTable {
 public:
  struct Use {
    Handle stream{};
    int device = 0;  // the device `stream` belongs to
    bool operator==(const Use&) const = default;
  };
  struct Block {
    Handle stream{};  // allocated (and freed) on this stream, of the allocator's device
    std::size_t size = 0;
    std::vector<Use> used_on;  // other streams that used it, each with its device
  };

  void add(std::uintptr_t start, Handle stream, std::size_t size) { blocks_[start] = Block{stream, size, {}}; }

  /// Notes that `stream` (of device `device`) uses the block containing `address`, unless that
  /// is the block's own stream or already noted. Returns false when no live block contains it.
  bool record(std::uintptr_t address, Handle stream, int device) {
    auto it = blocks_.upper_bound(address);
    if (it == blocks_.begin()) return false;
    --it;
    if (address >= it->first + it->second.size) return false;
    if (it->second.stream == stream) return true;
    const Use u{stream, device};
    for (const auto& x : it->second.used_on)
      if (x == u) return true;
    it->second.used_on.push_back(u);
    return true;
  }

  /// Removes and returns the block that starts at `start` (nullopt when unknown).
  std::optional<Block> take(std::uintptr_t start) {
    auto it = blocks_.find(start);
    if (it == blocks_.end()) return std::nullopt;
    Block b = std::move(it->second);
    blocks_.erase(it);
    return b;
  }

  std::size_t size() const { return blocks_.size(); }

 private:
  std::map<std::uintptr_t, Block> blocks_;  // by start address
};

}  // namespace detail
CHORUS_NAMESPACE_END
