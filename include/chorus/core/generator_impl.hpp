#pragma once
// The definitions of core/generator.hpp (the host engine and its fills, seeding, state,
// replica bookkeeping, Philox layouts): compiled into chorus::compiled (src/core/runtime.cpp),
// included by generator.hpp itself only in the header-only form (Note [compiled chorus]).
#include <random>
#include <sstream>

#include "generator.hpp"
#include "host_engine_impl.hpp"

CHORUS_NAMESPACE_BEGIN

// ---- Generator ----

template <class T>
  requires is_supported_scalar_v<T>
void Generator::uniform(T* out, std::int64_t n, double lo, double hi) {
  detail::refuse_host_draw_in_checkpoint("rand");
  std::lock_guard<std::mutex> lk(m_);
  for (std::int64_t i = 0; i < n; ++i) out[i] = static_cast<T>(lo + (hi - lo) * next_unit());
}

template <class T>
  requires is_supported_scalar_v<T>
void Generator::normal(T* out, std::int64_t n, double mean, double stddev) {
  detail::refuse_host_draw_in_checkpoint("randn");
  std::lock_guard<std::mutex> lk(m_);
  constexpr double kTwoPi = 6.283185307179586476925286766559;
  for (std::int64_t i = 0; i < n; i += 2) {
    double u1 = 1.0 - next_unit();  // (0, 1]
    double u2 = next_unit();
    double r = std::sqrt(-2.0 * std::log(u1));
    out[i] = static_cast<T>(mean + stddev * r * std::cos(kTwoPi * u2));
    if (i + 1 < n) out[i + 1] = static_cast<T>(mean + stddev * r * std::sin(kTwoPi * u2));
  }
}

template <class T>
  requires is_supported_scalar_v<T>
void Generator::bernoulli(T* out, std::int64_t n, double p) {
  detail::refuse_host_draw_in_checkpoint("bernoulli");
  std::lock_guard<std::mutex> lk(m_);
  for (std::int64_t i = 0; i < n; ++i) out[i] = next_unit() < p ? T(1) : T(0);
}

CHORUS_INLINE std::uint64_t Generator::below(std::uint64_t n) {
  detail::refuse_host_draw_in_checkpoint("randperm/randint");
  std::lock_guard<std::mutex> lk(m_);
  return eng_.below(n);
}

CHORUS_INLINE void Generator::manual_seed(std::uint64_t seed) {
  std::lock_guard<std::mutex> lk(m_);
  eng_.seed(seed);
  seed_ = seed;
  offset_ = 0;
}

CHORUS_INLINE void Generator::set_offset(std::uint64_t offset) {
  CHORUS_CHECK(offset % 4 == 0, "Generator::set_offset: the Philox offset must be a multiple of 4, got ", offset);
  std::lock_guard<std::mutex> lk(m_);
  offset_ = offset;
}

CHORUS_INLINE std::vector<std::uint64_t> Generator::get_state() const {
  std::lock_guard<std::mutex> lk(m_);
  std::ostringstream os;
  os << detail::HostEngineAccess::of(eng_);
  std::vector<std::uint64_t> out{seed_, offset_};
  std::istringstream is(os.str());
  for (std::uint64_t w; is >> w;) out.push_back(w);
  return out;
}

CHORUS_INLINE void Generator::set_state(const std::vector<std::uint64_t>& state) {
  const std::size_t words = get_state().size();
  CHORUS_CHECK(state.size() == words, "Generator::set_state: a state of ", state.size(), " words, expected ", words);
  CHORUS_CHECK(state[1] % 4 == 0, "Generator::set_state: the Philox offset must be a multiple of 4, got ", state[1],
               " (a state get_state() did not write)");
  std::ostringstream os;
  for (std::size_t i = 2; i < state.size(); ++i) os << state[i] << ' ';
  std::mt19937_64 eng;
  std::istringstream is(os.str());
  is >> eng;
  CHORUS_CHECK(!is.fail(), "Generator::set_state: the engine words are not a valid state");
  std::lock_guard<std::mutex> lk(m_);
  seed_ = state[0];
  offset_ = state[1];
  detail::HostEngineAccess::of(eng_) = eng;
}

// ---- ReplicaRandomGroup ----

CHORUS_INLINE void ReplicaRandomGroup::commit() {
  std::lock_guard<std::mutex> lk(m_);
  for (auto& e : entries_) e.gen->philox_close_window(e.start, e.used);
  entries_.clear();
}

CHORUS_INLINE ReplicaRandomGroup::Entry& ReplicaRandomGroup::entry(Generator& gen) {
  for (auto& e : entries_)
    if (e.gen == &gen) return e;
  entries_.push_back({&gen, gen.philox_open_window(), 0});
  return entries_.back();
}

// ---- ReplicaRandomScope ----

CHORUS_INLINE ReplicaRandomScope::ReplicaRandomScope(std::shared_ptr<ReplicaRandomGroup> group, int replica,
                                                     std::int64_t dim, std::int64_t offset, std::int64_t size,
                                                     std::int64_t total)
    : previous_(detail::current_replica_random()) {
  CHORUS_CHECK(group && replica >= 0 && dim >= 0 && offset >= 0 && size >= 0 && offset + size <= total,
               "ReplicaRandomScope: bad share: replica ", replica, ", dim ", dim, ", rows [", offset, ", ",
               offset + size, ") of ", total);
  mine_.group = std::move(group);
  mine_.replica = replica;
  mine_.dim = static_cast<int>(dim);
  mine_.offset = offset;
  mine_.size = size;
  mine_.total = total;
  detail::current_replica_random() = &mine_;
}

// ---- philox_layout ----

CHORUS_INLINE void detail::refuse_host_draw_in_checkpoint(const char* what) {
  CHORUS_CHECK(current_philox_tape() == nullptr, what,
               " inside a checkpointed function: its host random numbers cannot be drawn again alike when backward "
               "recomputes the function (Note [checkpoint random numbers]); draw them outside and pass them in, or use "
               "dropout, whose numbers are replayed");
}

namespace detail {
CHORUS_INLINE PhiloxLayout fresh_philox_layout(Generator& gen, const Shape& shape);
}

CHORUS_INLINE PhiloxLayout philox_layout(Generator& gen, const Shape& shape) {
  auto* tape = detail::current_philox_tape();
  if (!tape) return detail::fresh_philox_layout(gen, shape);
  detail::PhiloxTape* source = tape;  // Note [checkpoint random numbers]
  while (source && !source->replaying) source = source->parent;
  const std::int64_t n = numel_of(shape);
  PhiloxLayout l;
  if (source) {
    CHORUS_CHECK(source->next < source->draws.size(),
                 "checkpoint: recomputing the checkpointed function drew random numbers more often than its forward "
                 "did (",
                 source->draws.size(), " draws); it must run the same operations each time");
    const auto& d = source->draws[source->next++];
    CHORUS_CHECK(d.gen == &gen && d.numel == n, "checkpoint: draw ", source->next,
                 " of the recomputed function is of ", n, " elements", d.gen == &gen ? "" : " from another generator",
                 "; its forward drew ", d.numel, ": it must run the same operations each time");
    l = d.layout;
  } else {
    l = detail::fresh_philox_layout(gen, shape);
  }
  for (auto* t = tape; t != source; t = t->parent) t->draws.push_back({&gen, n, l});
  return l;
}

CHORUS_INLINE PhiloxLayout detail::fresh_philox_layout(Generator& gen, const Shape& shape) {
  const std::int64_t n = numel_of(shape);
  PhiloxLayout l;
  l.run = n > 0 ? n : 1;
  detail::ReplicaRandom* rr = detail::current_replica_random();
  if (!rr) {
    const PhiloxState s = gen.philox_engine_inputs(4);
    l.seed = s.seed;
    l.offset = s.offset;
    return l;
  }
  std::uint64_t* used = nullptr;
  for (auto& [g, u] : rr->used)
    if (g == &gen) used = &u;
  if (!used) used = &rr->used.emplace_back(&gen, 0).second;
  const PhiloxState start = rr->group->start(gen);
  CHORUS_CHECK(*used < Generator::kWindow, "random numbers: a DataParallel forward drew ", *used / 4,
               " times from one generator, more than its window holds (Note [replica windows])");
  l.seed = start.seed;
  l.offset = start.offset + *used;
  *used += 4;
  rr->group->note_used(gen, *used);
  constexpr std::uint64_t kLimit = std::uint64_t{1} << kUnmappedStreamShift;
  if (rr->dim < shape.size() && shape[rr->dim] == rr->size && rr->size > 0) {
    std::int64_t outer = 1, inner = 1;
    for (int i = 0; i < rr->dim; ++i) outer *= shape[i];
    for (int i = rr->dim + 1; i < shape.size(); ++i) inner *= shape[i];
    CHORUS_CHECK(static_cast<double>(outer) * static_cast<double>(rr->total) * static_cast<double>(inner) <
                     static_cast<double>(kLimit),
                 "random numbers: a batch of ", outer * rr->total * inner, " elements exceeds the stream (2^",
                 kUnmappedStreamShift, ")");
    l.run = rr->size * inner;
    l.base = static_cast<std::uint64_t>(rr->offset * inner);
    l.stride = static_cast<std::uint64_t>(rr->total * inner);
    return l;
  }
  CHORUS_CHECK(static_cast<std::uint64_t>(n) < kLimit && rr->replica < 255, "random numbers: ", n,
               " elements in replica ", rr->replica, " exceed the stream");
  l.base = static_cast<std::uint64_t>(rr->replica + 1) << kUnmappedStreamShift;
  return l;
}

CHORUS_NAMESPACE_END
