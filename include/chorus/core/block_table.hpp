#pragma once
// The bookkeeping of the allocators of device-visible memory, apart from any device API: which
// stream each live block was allocated on, and which other streams (and on which device each
// of them lives) used it since; the host-side cache of freed device blocks; the pinned host
// blocks that wait for their copies before reuse. Generic over the stream and event handles
// so that it is tested on the CPU.
//
// Note [cross-device stream uses]
// A block on device A can be read by a stream of device B (a peer copy is ordered on the
// destination's stream). Before the block is freed, an event must be recorded on each such
// stream, and an event can only be recorded on a stream of the device it was created on: the
// allocator must therefore know each using stream's device, not assume its own. Recording under
// the wrong device fails, and a failure ignored there lets the memory be reused while the peer
// copy still reads it.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <unordered_map>
#include <utility>
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

// Note [CUDA block cache]
// A driver call per allocation (cudaMallocAsync, cudaFreeAsync: each takes the pool's lock)
// costs about a microsecond of host time, and a small training step allocates hundreds of
// tensors. So freed device blocks stay on the host side, by (stream, size), and a later
// allocation of that size on that stream takes one back without calling the driver. That
// reuse is safe by stream order: the block was freed on its own stream after every recorded
// use of another stream had been made to precede it there (Note [CUDA allocator]). Sizes are
// rounded up to 512 bytes, so slightly different sizes share blocks. The cache gives its
// blocks back to the driver's pool (which any stream and size may then reuse) when an
// allocation fails for lack of memory and when it holds more than its limit.
template <class Handle>
class BlockCache {
 public:
  static constexpr std::size_t kRound = 512;
  static constexpr std::size_t round(std::size_t n) { return (n + kRound - 1) / kRound * kRound; }

  /// Keeps block `p` of (rounded) `size`, freed on `stream`.
  void put(Handle stream, std::size_t size, void* p) {
    free_[Key{stream, size}].push_back(p);
    bytes_ += size;
  }
  /// A cached block of `size` freed on `stream`, or nullptr.
  void* take(Handle stream, std::size_t size) {
    auto it = free_.find(Key{stream, size});
    if (it == free_.end() || it->second.empty()) return nullptr;
    void* p = it->second.back();  // the most recently freed block: likely still in cache
    it->second.pop_back();
    bytes_ -= size;
    return p;
  }
  /// Hands blocks to `give_back(stream, size, p)`, the largest first, until at most `keep`
  /// bytes stay cached (0, the default: all of them). A cache past its limit gives back only
  /// down to `keep`: the small blocks a training step reuses stay, so the next step's
  /// allocations do not all miss at once.
  template <class F>
  void drain(F&& give_back, std::size_t keep = 0) {
    if (keep == 0) {
      auto all = std::exchange(free_, {});
      bytes_ = 0;
      for (auto& [key, blocks] : all)
        for (void* p : blocks) give_back(key.stream, key.size, p);
      return;
    }
    std::vector<Key> keys;
    for (const auto& [key, blocks] : free_)
      if (!blocks.empty()) keys.push_back(key);
    std::sort(keys.begin(), keys.end(), [](const Key& a, const Key& b) { return a.size > b.size; });
    for (const Key& key : keys) {
      auto& blocks = free_[key];
      while (bytes_ > keep && !blocks.empty()) {
        void* p = blocks.front();  // the least recently freed of its size
        blocks.erase(blocks.begin());
        bytes_ -= key.size;
        give_back(key.stream, key.size, p);
      }
      if (blocks.empty()) free_.erase(key);
      if (bytes_ <= keep) break;
    }
  }
  std::size_t bytes() const { return bytes_; }

 private:
  struct Key {
    Handle stream{};
    std::size_t size = 0;
    bool operator==(const Key&) const = default;
  };
  struct KeyHash {
    std::size_t operator()(const Key& k) const {
      return std::hash<Handle>{}(k.stream) ^ (std::hash<std::size_t>{}(k.size) * 0x9e3779b97f4a7c15ULL);
    }
  };
  std::unordered_map<Key, std::vector<void*>, KeyHash> free_;
  std::size_t bytes_ = 0;
};

// Note [deferred host frees]
// A copy from page-locked host memory to a device runs asynchronously (Note [async
// host-to-device copies] in storage.hpp): the host block may be dropped while the copy still
// reads it. So each such copy records an event into the block, a freed block waits in a
// pending list, and it is reused only once all of its events have completed (as PyTorch's
// CachingHostAllocator does). A later event on the same stream supersedes an earlier one (it
// completes only after it), so a block that stays alive and is copied from every step (a
// pinned staging buffer) keeps one event per stream instead of one per copy, which grew
// without bound. Generic over the event type so that it is tested on the CPU.
template <class Event>
class HostBlockPool {
 public:
  /// A new live block.
  void add(void* p, std::size_t size) { live_[addr(p)] = Live{size, {}}; }

  /// Notes that `e` marks the end of a use of the live block containing `p`; false (and `e`
  /// untouched) when no live block contains it. An event `old` of the block for which
  /// `supersedes(e, old)` holds (the same stream) is replaced by `e` and handed to `release(old)`.
  template <class Supersedes, class Release>
  bool record(const void* p, Event e, Supersedes&& supersedes, Release&& release) {
    auto it = find(p);
    if (it == live_.end()) return false;
    for (auto& old : it->second.events)
      if (supersedes(e, old)) {
        release(old);
        old = std::move(e);
        return true;
      }
    it->second.events.push_back(std::move(e));
    return true;
  }
  /// record() where no event supersedes another.
  bool record(const void* p, Event e) {
    return record(p, std::move(e), [](const Event&, const Event&) { return false; }, [](const Event&) {});
  }
  /// The events the live block containing `p` holds (0 when there is none).
  std::size_t events(const void* p) const {
    auto it = find(p);
    return it == live_.end() ? 0 : it->second.events.size();
  }
  bool contains(const void* p) const { return find(p) != live_.end(); }

  /// The block starting at `p` is freed: reusable at once when nothing used it, else once its
  /// events are done. Returns false for an unknown block.
  bool free(void* p) {
    auto it = live_.find(addr(p));
    if (it == live_.end()) return false;
    Live b = std::move(it->second);
    live_.erase(it);
    if (b.events.empty()) free_[b.size].push_back(p);
    else pending_.push_back(Pending{p, b.size, std::move(b.events)});
    return true;
  }

  /// A free block of exactly `size` (made live again), or nullptr. Pending blocks whose events
  /// are all done (`done(e)`) become free first; their events go to `release(e)`.
  template <class Done, class Release>
  void* take(std::size_t size, Done&& done, Release&& release) {
    for (std::size_t i = 0; i < pending_.size();) {
      auto& b = pending_[i];
      bool all = true;
      for (const auto& e : b.events) all = all && done(e);
      if (!all) {
        ++i;
        continue;
      }
      for (auto& e : b.events) release(e);
      free_[b.size].push_back(b.p);
      pending_[i] = std::move(pending_.back());
      pending_.pop_back();
    }
    auto it = free_.find(size);
    if (it == free_.end() || it->second.empty()) return nullptr;
    void* p = it->second.back();
    it->second.pop_back();
    add(p, size);
    return p;
  }

  std::size_t pending() const { return pending_.size(); }
  std::size_t live() const { return live_.size(); }

 private:
  struct Live {
    std::size_t size = 0;
    std::vector<Event> events;
  };
  struct Pending {
    void* p = nullptr;
    std::size_t size = 0;
    std::vector<Event> events;
  };
  static std::uintptr_t addr(const void* p) { return reinterpret_cast<std::uintptr_t>(p); }
  typename std::map<std::uintptr_t, Live>::iterator find(const void* p) {
    auto it = live_.upper_bound(addr(p));
    if (it == live_.begin()) return live_.end();
    --it;
    return addr(p) < it->first + it->second.size ? it : live_.end();
  }
  typename std::map<std::uintptr_t, Live>::const_iterator find(const void* p) const {
    auto it = live_.upper_bound(addr(p));
    if (it == live_.begin()) return live_.end();
    --it;
    return addr(p) < it->first + it->second.size ? it : live_.end();
  }
  std::map<std::uintptr_t, Live> live_;  // by start address (copies may read from inside a block)
  std::map<std::size_t, std::vector<void*>> free_;
  std::vector<Pending> pending_;
};

}  // namespace detail
CHORUS_NAMESPACE_END
