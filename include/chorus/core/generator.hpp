#pragma once
// Random numbers: a seedable generator (one process-wide default), producing the same
// sequence whatever device the numbers end up on. Two engines live in one Generator: a
// host Mersenne Twister for the factories that fill on the host (rand, randn, init), and a
// counter-based Philox4x32-10 stream (seed + offset) that kernels evaluate where the numbers
// are used, on any device (dropout; Note [dropout random numbers]).
#include <cmath>
#include <cstdint>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "../compiled.hpp"
#include "../error.hpp"
#include "dtype.hpp"
#include "host_engine.hpp"
#include "shape.hpp"

CHORUS_NAMESPACE_BEGIN

// ---- Philox4x32-10 (Salmon, Moraes, Dror, Shaw: "Parallel random numbers: as easy as 1, 2, 3", SC'11) ----

/// One Philox4x32-10 block: `out` = the 10-round bijection of counter `ctr` under `key`.
CHORUS_HOST_DEVICE inline void philox4x32_10(const std::uint32_t ctr[4], const std::uint32_t key[2],
                                             std::uint32_t out[4]) {
  constexpr std::uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u;  // round multipliers
  constexpr std::uint32_t kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;  // key schedule (Weyl) increments
  std::uint32_t c0 = ctr[0], c1 = ctr[1], c2 = ctr[2], c3 = ctr[3];
  std::uint32_t k0 = key[0], k1 = key[1];
  for (int round = 0; round < 10; ++round) {
    if (round > 0) {
      k0 += kW0;
      k1 += kW1;
    }
    const std::uint64_t p0 = std::uint64_t{kM0} * c0, p1 = std::uint64_t{kM1} * c2;
    const std::uint32_t hi0 = static_cast<std::uint32_t>(p0 >> 32), lo0 = static_cast<std::uint32_t>(p0);
    const std::uint32_t hi1 = static_cast<std::uint32_t>(p1 >> 32), lo1 = static_cast<std::uint32_t>(p1);
    c0 = hi1 ^ c1 ^ k0;
    c1 = lo1;
    c2 = hi0 ^ c3 ^ k1;
    c3 = lo0;
  }
  out[0] = c0;
  out[1] = c1;
  out[2] = c2;
  out[3] = c3;
}

/// The four numbers at `offset` (a multiple of 4) of subsequence `subsequence` of the stream
/// `seed`, laid out as cuRAND's Philox and PyTorch's at::Philox4_32 lay them out:
/// key = (seed low, seed high), counter = (offset/4 low, high, subsequence low, high); i.e.
/// what curand4 returns right after curand_init(seed, subsequence, offset).
CHORUS_HOST_DEVICE inline void philox_block(std::uint64_t seed, std::uint64_t subsequence, std::uint64_t offset,
                                            std::uint32_t out[4]) {
  const std::uint64_t block = offset / 4;
  const std::uint32_t ctr[4] = {static_cast<std::uint32_t>(block), static_cast<std::uint32_t>(block >> 32),
                                static_cast<std::uint32_t>(subsequence), static_cast<std::uint32_t>(subsequence >> 32)};
  const std::uint32_t key[2] = {static_cast<std::uint32_t>(seed), static_cast<std::uint32_t>(seed >> 32)};
  philox4x32_10(ctr, key, out);
}

/// What a Philox consumer takes from a generator: the seed and the offset its numbers start at
/// (PyTorch's philox_engine_inputs).
struct PhiloxState {
  std::uint64_t seed = 0;    ///< the generator's seed (the Philox key)
  std::uint64_t offset = 0;  ///< the offset, in numbers per subsequence, the consumer's draws start at
};

// Note [dropout random numbers]
// Dropout draws one 32-bit Philox number per element, evaluated where the element is (a CUDA
// kernel, or the CPU loop: the same host/device function), from the generator's seed and
// offset; nothing is built on the host or copied. Which number an element gets is a function
// of its *stream index* only:
//   stream index s  ->  word s % 4 of philox_block(seed, subsequence s / 4, offset),
// and a call reserves 4 numbers of every subsequence (the offset advances by 4 per call, like
// PyTorch's philox offset, whatever the tensor's size). So a seed gives the same mask on the
// CPU and on a GPU: one process-wide generator serves every device (PyTorch keeps one per
// device, so its CPU and CUDA masks differ; ours agree).
// The stream index of an element is its row-major index in the *whole batch*, so that the
// numbers do not depend on how many devices share the batch: DataParallel tells each replica
// (ReplicaRandomScope, installed around the replica's forward) the rows [offset, offset + size)
// of `total` along `dim` that it got, and a tensor whose size along `dim` is the replica's
// `size` maps local element (o, i, j) (outer, dim, inner) to (o, offset + i, j) of the whole
// batch. The replicas of one forward all start from the generator's offset at the start of the
// forward, and the generator advances once, when the forward ends, by what a replica used
// (ReplicaRandomGroup, Note [replica windows]) — exactly as one device would have advanced
// it, and independent of the order in which the replicas' threads ran. Element i of a batch thus gets the same number on
// 1 or k devices (tests/test_random.cpp). A tensor inside a replica whose size along `dim` is
// not the replica's share (a reshaped or non-batch tensor) cannot be mapped; it gets stream
// indices of its own, distinct per replica (bits 56 and up hold the replica + 1), so replicas
// never share numbers, but such masks depend on the device count.
// The keep decision is an integer comparison, number < round(keep · 2^32): no floating point
// is involved, so every device decides alike. Backward recomputes the mask from the same
// inputs instead of saving it.

/// Where the numbers of one Philox call over a contiguous tensor of n elements come from:
/// local element i has stream index base + (i / run) * stride + i % run (Note [dropout random
/// numbers]).
struct PhiloxLayout {
  /// The call's generator inputs (PhiloxState).
  ///@{
  std::uint64_t seed = 0, offset = 0;
  ///@}
  std::int64_t run = 1;                ///< local elements per run of consecutive stream indices (> 0)
  std::uint64_t base = 0;              ///< stream index of local element 0
  std::uint64_t stride = 0;            ///< stream distance between consecutive runs
};

/// The stream index of local element `i`: base + (i / run) * stride + i % run.
CHORUS_HOST_DEVICE inline std::uint64_t stream_index(const PhiloxLayout& l, std::int64_t i) {
  const std::int64_t r = i / l.run;
  return l.base + static_cast<std::uint64_t>(r) * l.stride + static_cast<std::uint64_t>(i - r * l.run);
}

/// The 32-bit Philox number of stream index s (one block per call: the kernels amortise it over
/// four elements; this is the reference the tests check them against).
CHORUS_HOST_DEVICE inline std::uint32_t philox_number(const PhiloxLayout& l, std::uint64_t s) {
  std::uint32_t r[4];
  philox_block(l.seed, s / 4, l.offset, r);
  return r[s % 4];
}

/// Numbers below this keep an element with probability `keep` in [0, 1]: round(keep · 2^32).
inline std::uint64_t keep_threshold(double keep) {
  CHORUS_CHECK(keep >= 0.0 && keep <= 1.0, "keep probability must be in [0, 1], got ", keep);
  return static_cast<std::uint64_t>(std::llround(keep * 4294967296.0));
}

/// Stream indices from here up belong to tensors a replica could not map (Note [dropout random numbers]).
inline constexpr int kUnmappedStreamShift = 56;

/// A seedable source of random numbers: a host Mersenne Twister and a Philox seed and offset
/// (torch.Generator); thread-safe.
class Generator {
 public:
  /// A generator seeded with `seed`, its Philox offset at 0.
  explicit Generator(std::uint64_t seed = 5489u) : eng_(seed), seed_(seed) {}
  Generator(const Generator&) = delete;
  Generator& operator=(const Generator&) = delete;

  /// Seeds both engines; the Philox offset restarts at 0 (as PyTorch's manual_seed).
  void manual_seed(std::uint64_t seed);
  /// The seed last set (torch.Generator.initial_seed).
  std::uint64_t initial_seed() const {
    std::lock_guard<std::mutex> lk(m_);
    return seed_;
  }

  /// The Philox offset the next consumer starts at.
  std::uint64_t get_offset() const {
    std::lock_guard<std::mutex> lk(m_);
    return offset_;
  }
  /// Sets the Philox offset (a multiple of 4), as PyTorch's Generator::set_offset.
  void set_offset(std::uint64_t offset);

  /// Reserves `increment` numbers (rounded up to a multiple of 4) of every Philox subsequence:
  /// returns the seed and the offset they start at, and advances the offset past them.
  PhiloxState philox_engine_inputs(std::uint64_t increment) {
    std::lock_guard<std::mutex> lk(m_);
    const PhiloxState s{seed_, offset_};
    offset_ += (increment + 3) / 4 * 4;
    return s;
  }

  /// Note [replica windows]: a DataParallel forward's replicas draw from a window that opens
  /// at the current offset; the generator moves past a whole window meanwhile (kWindow numbers
  /// of every subsequence), so that draws from elsewhere while the window is open (another
  /// thread, another DataParallel) never reuse its numbers. Closing it with nothing drawn in
  /// between sets the offset to just past what the replicas used — where one device would be.
  static constexpr std::uint64_t kWindow = std::uint64_t{1} << 40;
  /// Opens a window: the seed and the offset its draws start at.
  PhiloxState philox_open_window() {
    std::lock_guard<std::mutex> lk(m_);
    const PhiloxState s{seed_, offset_};
    offset_ += kWindow;
    return s;
  }
  /// Closes the window opened at `start` after `used` numbers of every subsequence.
  void philox_close_window(const PhiloxState& start, std::uint64_t used) noexcept {
    std::lock_guard<std::mutex> lk(m_);
    if (offset_ == start.offset + kWindow && seed_ == start.seed) offset_ = start.offset + used;
  }

  /// Fills out[0..n) with uniform numbers in [lo, hi).
  template <class T>
    requires is_supported_scalar_v<T>
  void uniform(T* out, std::int64_t n, double lo, double hi);

  /// Fills out[0..n) with normal numbers (Box–Muller on the generator's stream).
  template <class T>
    requires is_supported_scalar_v<T>
  void normal(T* out, std::int64_t n, double mean, double stddev);

  /// Fills out[0..n) with 1 with probability p, else 0.
  template <class T>
    requires is_supported_scalar_v<T>
  void bernoulli(T* out, std::int64_t n, double p);

  /// A uniformly random integer in [0, n).
  CHORUS_INLINE std::uint64_t below(std::uint64_t n);

  /// The whole state (PyTorch's Generator::get_state): seed, Philox offset and the host
  /// engine's words, to restore with set_state() for a bitwise resume (dist::Checkpointer).
  std::vector<std::uint64_t> get_state() const;
  /// Restores a state written by get_state() (PyTorch's Generator::set_state); throws when malformed.
  void set_state(const std::vector<std::uint64_t>& state);

 private:
  double next_unit() { return static_cast<double>(eng_() >> 11) * 0x1.0p-53; }  // [0, 1), under m_
  mutable std::mutex m_;
  HostEngine eng_;  // Note [host engine]
  std::uint64_t seed_;
  std::uint64_t offset_ = 0;
};

/// The process-wide default generator (used when none is passed), shared by every device.
inline Generator& default_generator() {
  static Generator g;
  return g;
}

/// Seeds the default generator.
inline void manual_seed(std::uint64_t seed) { default_generator().manual_seed(seed); }

/// The Philox draws of one DataParallel forward (Note [dropout random numbers]): every replica
/// starts from a generator's offset as it was when the forward began, and the generator
/// advances once, by the most any replica used, when the group ends (commit() or destruction;
/// Note [replica windows]).
class ReplicaRandomGroup {
 public:
  ReplicaRandomGroup() = default;
  ReplicaRandomGroup(const ReplicaRandomGroup&) = delete;
  ReplicaRandomGroup& operator=(const ReplicaRandomGroup&) = delete;
  ~ReplicaRandomGroup() { commit(); }

  /// The inputs this forward's draws from `gen` start at (the window opened at the first ask,
  /// the same for every replica).
  PhiloxState start(Generator& gen) {
    std::lock_guard<std::mutex> lk(m_);
    return entry(gen).start;
  }
  /// A replica has used `used` numbers of every subsequence of `gen` since the start.
  void note_used(Generator& gen, std::uint64_t used) {
    std::lock_guard<std::mutex> lk(m_);
    auto& e = entry(gen);
    if (used > e.used) e.used = used;
  }
  /// Advances every generator drawn from past what the replicas used (once; later calls do nothing).
  void commit();

 private:
  struct Entry {
    Generator* gen;
    PhiloxState start;
    std::uint64_t used;
  };
  Entry& entry(Generator& gen);
  std::mutex m_;
  std::vector<Entry> entries_;
};

namespace detail {
/// What the calling thread's replica knows about its share of the batch.
struct ReplicaRandom {
  std::shared_ptr<ReplicaRandomGroup> group;
  int replica = 0;
  int dim = 0;
  std::int64_t offset = 0, size = 0, total = 0;
  std::vector<std::pair<Generator*, std::uint64_t>> used;  // this replica's draws per generator
};
inline ReplicaRandom*& current_replica_random() {
  thread_local ReplicaRandom* r = nullptr;
  return r;
}
}  // namespace detail

/// Makes the calling thread replica `replica` of a DataParallel forward until the scope ends:
/// it got rows [offset, offset + size) along `dim` of a batch of `total` (Note [dropout random
/// numbers]).
class ReplicaRandomScope {
 public:
  /// Installs the share on the calling thread; throws when the rows are not within [0, `total`).
  ReplicaRandomScope(std::shared_ptr<ReplicaRandomGroup> group, int replica, std::int64_t dim, std::int64_t offset,
                     std::int64_t size, std::int64_t total);
  ~ReplicaRandomScope() { detail::current_replica_random() = previous_; }
  ReplicaRandomScope(const ReplicaRandomScope&) = delete;
  ReplicaRandomScope& operator=(const ReplicaRandomScope&) = delete;

 private:
  detail::ReplicaRandom mine_;
  detail::ReplicaRandom* previous_;
};

// Note [checkpoint random numbers]
// A checkpointed function (nn::utils::checkpoint) runs twice: in forward, and again in backward
// to recompute what it dropped. Its dropout masks must be the same both times, although other
// draws (later layers, other replicas, the next forward) moved the generator in between and a
// DataParallel replica's share of the batch is no longer installed. So the first run records the
// Philox layout each draw got on a tape, and the recomputation replays the tape in order (the
// same generator and element count at each draw, and every draw used, or it fails naming the
// difference): masks are equal bit for bit, and the generator does not move in backward. A
// checkpoint inside a checkpoint records into every tape up to the nearest one that replays.
// The host engine (rand, randn, bernoulli, randperm) has no such replay: a checkpointed
// function that draws from it is refused when it does.
namespace detail {
struct PhiloxTape {
  struct Draw {
    const Generator* gen;
    std::int64_t numel;
    PhiloxLayout layout;
  };
  std::vector<Draw> draws;
  std::size_t next = 0;    // the next draw to replay
  bool replaying = false;  // recomputation (else recording)
  PhiloxTape* parent = nullptr;
};
/// The tape of the checkpointed function the calling thread runs (null outside one).
inline PhiloxTape*& current_philox_tape() {
  thread_local PhiloxTape* t = nullptr;
  return t;
}
/// Throws when the calling thread runs a checkpointed function: `what` draws from the host engine.
CHORUS_INLINE void refuse_host_draw_in_checkpoint(const char* what);
}  // namespace detail

/// Reserves the numbers of one Philox call over a contiguous tensor of `shape` (4 of every
/// subsequence) and says which stream index each element takes (Note [dropout random numbers];
/// inside a checkpointed function, Note [checkpoint random numbers]).
CHORUS_INLINE PhiloxLayout philox_layout(Generator& gen, const Shape& shape);

CHORUS_NAMESPACE_END

// The host engine's fills take every dtype (all listed): defined in generator_impl.hpp.
#define CHORUS_CORE_GENERATOR_INSTANCES(X, T)                           \
  X(void Generator::uniform<T>(T*, std::int64_t, double, double)) \
  X(void Generator::normal<T>(T*, std::int64_t, double, double))  \
  X(void Generator::bernoulli<T>(T*, std::int64_t, double))
CHORUS_EXTERN_INSTANCES(CHORUS_CORE_GENERATOR_INSTANCES, CHORUS_ALL_DTYPES)

#if !CHORUS_COMPILED
#include "generator_impl.hpp"
#endif
