#pragma once
// The definitions of io/profile.hpp: compiled into chorus::compiled (src/io/profile.cpp),
// included by profile.hpp itself in the header-only form (Note [compiled chorus]).
#include <algorithm>
#include <cstdio>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <ostream>
#include <set>
#include <sstream>
#include <utility>

#include "profile.hpp"

CHORUS_NAMESPACE_BEGIN
namespace profiler {
namespace detail {

/// Sorted, disjoint intervals [begin, end) of nanoseconds.
using Intervals = std::vector<std::pair<std::int64_t, std::int64_t>>;

CHORUS_INLINE Intervals merged(Intervals v) {
  std::sort(v.begin(), v.end());
  Intervals out;
  for (const auto& iv : v) {
    if (iv.second <= iv.first) continue;
    if (!out.empty() && iv.first <= out.back().second)
      out.back().second = std::max(out.back().second, iv.second);
    else
      out.push_back(iv);
  }
  return out;
}

CHORUS_INLINE std::int64_t length(const Intervals& v) {
  std::int64_t n = 0;
  for (const auto& iv : v) n += iv.second - iv.first;
  return n;
}

CHORUS_INLINE Intervals intersect(const Intervals& a, const Intervals& b) {
  Intervals out;
  for (std::size_t i = 0, j = 0; i < a.size() && j < b.size();) {
    const std::int64_t lo = std::max(a[i].first, b[j].first), hi = std::min(a[i].second, b[j].second);
    if (lo < hi) out.emplace_back(lo, hi);
    (a[i].second < b[j].second) ? ++i : ++j;
  }
  return out;
}

CHORUS_INLINE Intervals subtract(const Intervals& a, const Intervals& b) {
  Intervals out;
  std::size_t j = 0;
  for (auto [lo, hi] : a) {
    while (j < b.size() && b[j].second <= lo) ++j;
    for (std::size_t k = j; k < b.size() && b[k].first < hi; ++k) {
      if (b[k].first > lo) out.emplace_back(lo, b[k].first);
      lo = std::max(lo, b[k].second);
    }
    if (lo < hi) out.emplace_back(lo, hi);
  }
  return out;
}

CHORUS_INLINE Intervals unite(Intervals a, const Intervals& b) {
  a.insert(a.end(), b.begin(), b.end());
  return merged(std::move(a));
}

CHORUS_INLINE double ms(std::int64_t ns) { return static_cast<double>(ns) / 1e6; }

CHORUS_INLINE StepSummary summarize_step(std::int64_t step, const std::vector<const Span*>& spans,
                                         std::size_t tracks) {
  StepSummary s;
  s.step = step;
  std::int64_t first = INT64_MAX, last = INT64_MIN;
  std::vector<Intervals> compute(tracks), comm(tracks);
  std::map<std::string, std::vector<std::pair<int, std::pair<std::int64_t, std::int64_t>>>> by_device;
  Intervals optimizer, data, copy;
  for (const Span* p : spans) {
    first = std::min(first, p->start_ns);
    last = std::max(last, p->end_ns);
    const auto iv = std::make_pair(p->start_ns, p->end_ns);
    switch (p->category) {
      case Category::forward:
      case Category::backward:
        compute[p->track].push_back(iv);
        if (!p->device.empty()) by_device[p->device].push_back({p->track, iv});
        break;
      case Category::communication:
        comm[p->track].push_back(iv);
        if (p->bytes > 0) s.communication_bytes += p->bytes;
        break;
      case Category::optimizer: optimizer.push_back(iv); break;
      case Category::data: data.push_back(iv); break;
      case Category::copy: copy.push_back(iv); break;
      case Category::other: break;
    }
  }
  Intervals all_compute, all_comm;
  for (std::size_t t = 0; t < tracks; ++t) {
    comm[t] = merged(std::move(comm[t]));
    all_comm = unite(std::move(all_comm), comm[t]);
    all_compute = unite(std::move(all_compute), subtract(merged(std::move(compute[t])), comm[t]));
  }
  s.wall_ms = spans.empty() ? 0 : ms(last - first);
  s.compute_ms = ms(length(all_compute));
  s.communication_ms = ms(length(all_comm));
  s.hidden_ms = ms(length(intersect(all_comm, all_compute)));
  s.hidden_percent = s.communication_ms > 0 ? 100.0 * s.hidden_ms / s.communication_ms : 0.0;
  s.optimizer_ms = ms(length(merged(std::move(optimizer))));
  s.data_wait_ms = ms(length(merged(std::move(data))));
  s.copy_ms = ms(length(merged(std::move(copy))));
  double most = 0, sum = 0;
  for (auto& [device, ivs] : by_device) {
    Intervals busy;
    for (const auto& [track, iv] : ivs) busy = unite(std::move(busy), subtract({iv}, comm[track]));
    const double b = ms(length(busy));
    if (b <= 0) continue;
    most = std::max(most, b);
    sum += b;
    ++s.devices;
  }
  s.imbalance = s.devices > 0 ? most / (sum / s.devices) : 1.0;
  return s;
}

}  // namespace detail

CHORUS_INLINE Profile::Profile(Records records) : records_(std::move(records)) {
  auto& spans = records_.spans;
  std::stable_sort(spans.begin(), spans.end(), [](const Span& a, const Span& b) {
    if (a.track != b.track) return a.track < b.track;
    if (a.start_ns != b.start_ns) return a.start_ns < b.start_ns;
    return a.end_ns > b.end_ns;  // the enclosing span first
  });
  // Each track's consecutive backward spans of one layer in one step become one span.
  std::vector<Span> grouped;
  grouped.reserve(spans.size());
  std::vector<std::string> nodes;
  auto flush_nodes = [&] {
    if (grouped.empty() || nodes.empty()) return;
    std::string detail;
    for (const auto& n : nodes) detail += (detail.empty() ? "" : ", ") + n;
    grouped.back().detail = std::move(detail);
    nodes.clear();
  };
  for (auto& s : spans) {
    Span* prev = grouped.empty() ? nullptr : &grouped.back();
    if (prev && s.category == Category::backward && prev->category == Category::backward &&
        prev->track == s.track && prev->name == s.name && prev->step == s.step && prev->device == s.device &&
        s.start_ns >= prev->end_ns) {
      prev->end_ns = std::max(prev->end_ns, s.end_ns);
      if (std::find(nodes.begin(), nodes.end(), s.detail) == nodes.end()) nodes.push_back(s.detail);
      continue;
    }
    flush_nodes();
    grouped.push_back(std::move(s));
    if (grouped.back().category == Category::backward) nodes = {grouped.back().detail};
  }
  flush_nodes();
  spans = std::move(grouped);
  std::stable_sort(records_.counters.begin(), records_.counters.end(),
                   [](const CounterSample& a, const CounterSample& b) { return a.t_ns < b.t_ns; });
}

CHORUS_INLINE std::string Profile::chrome_trace() const {
  using nlohmann::json;
  const int pid = records_.rank >= 0 ? records_.rank : 0;
  json events = json::array();
  const std::string process = records_.rank >= 0 ? "chorus rank " + std::to_string(records_.rank) : "chorus";
  events.push_back({{"ph", "M"}, {"name", "process_name"}, {"pid", pid}, {"args", {{"name", process}}}});
  events.push_back({{"ph", "M"}, {"name", "process_sort_index"}, {"pid", pid}, {"args", {{"sort_index", pid}}}});
  // Tracks in order: the main thread, then device streams by name, then the others.
  std::vector<int> order(records_.tracks.size());
  for (std::size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int>(i);
  auto rank_of = [&](int t) {
    const Track& tr = records_.tracks[t];
    return tr.name == "main" ? 0 : !tr.device.empty() ? 1 : 2;
  };
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
    if (rank_of(a) != rank_of(b)) return rank_of(a) < rank_of(b);
    return records_.tracks[a].name < records_.tracks[b].name;
  });
  for (std::size_t i = 0; i < order.size(); ++i) {
    const int t = order[i];
    events.push_back({{"ph", "M"}, {"name", "thread_name"}, {"pid", pid}, {"tid", t},
                      {"args", {{"name", records_.tracks[t].name}}}});
    events.push_back({{"ph", "M"}, {"name", "thread_sort_index"}, {"pid", pid}, {"tid", t},
                      {"args", {{"sort_index", static_cast<int>(i)}}}});
  }
  for (const Span& s : records_.spans) {
    json args = {{"step", s.step}};
    if (!s.device.empty()) args["device"] = s.device;
    if (s.bytes >= 0) args["bytes"] = s.bytes;
    if (!s.detail.empty()) args["detail"] = s.detail;
    events.push_back({{"ph", "X"}, {"name", s.name}, {"cat", category_name(s.category)}, {"pid", pid},
                      {"tid", s.track}, {"ts", static_cast<double>(s.start_ns) / 1e3},
                      {"dur", static_cast<double>(s.end_ns - s.start_ns) / 1e3}, {"args", std::move(args)}});
  }
  for (const CounterSample& c : records_.counters)
    events.push_back({{"ph", "C"}, {"name", c.name}, {"pid", pid}, {"ts", static_cast<double>(c.t_ns) / 1e3},
                      {"args", {{"bytes", c.value}}}});
  json trace = {{"traceEvents", std::move(events)}, {"displayTimeUnit", "ms"},
                {"otherData", {{"library", "chorus"}, {"version", CHORUS_VERSION_STRING}, {"rank", records_.rank},
                               {"steps", records_.steps}, {"origin_unix_ns", records_.origin_unix_ns}}}};
  return trace.dump();
}

CHORUS_INLINE const Profile& Profile::save(const std::string& path) const {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  CHORUS_CHECK(out.good(), "profiler: cannot open '", path, "' to write the trace");
  out << chrome_trace();
  out.close();
  CHORUS_CHECK(!out.fail(), "profiler: writing the trace to '", path, "' failed");
  return *this;
}

CHORUS_INLINE Summary Profile::summary() const {
  std::map<std::int64_t, std::vector<const Span*>> by_step;
  for (const Span& s : records_.spans) by_step[s.step].push_back(&s);
  Summary out;
  for (const auto& [step, spans] : by_step)
    out.steps.push_back(detail::summarize_step(step, spans, records_.tracks.size()));
  return out;
}

CHORUS_INLINE std::string Summary::table() const {
  std::ostringstream os;
  char line[256];
  std::snprintf(line, sizeof line, "%6s %10s %10s %10s %8s %10s %10s %10s %10s %6s\n", "step", "wall ms", "compute",
                "comm", "hidden%", "optimizer", "data wait", "copy", "imbalance", "dev");
  os << line;
  auto row = [&](const char* label, const StepSummary& s) {
    std::snprintf(line, sizeof line, "%6s %10.3f %10.3f %10.3f %8.1f %10.3f %10.3f %10.3f %10.3f %6d\n", label,
                  s.wall_ms, s.compute_ms, s.communication_ms, s.hidden_percent, s.optimizer_ms, s.data_wait_ms,
                  s.copy_ms, s.imbalance, s.devices);
    os << line;
  };
  for (const auto& s : steps) row(std::to_string(s.step).c_str(), s);
  if (steps.size() > 1) {
    auto median = [&](auto field) {
      std::vector<double> v;
      for (const auto& s : steps) v.push_back(static_cast<double>(s.*field));
      std::sort(v.begin(), v.end());
      return v.size() % 2 ? v[v.size() / 2] : (v[v.size() / 2 - 1] + v[v.size() / 2]) / 2;
    };
    StepSummary m;
    m.wall_ms = median(&StepSummary::wall_ms);
    m.compute_ms = median(&StepSummary::compute_ms);
    m.communication_ms = median(&StepSummary::communication_ms);
    m.hidden_percent = median(&StepSummary::hidden_percent);
    m.optimizer_ms = median(&StepSummary::optimizer_ms);
    m.data_wait_ms = median(&StepSummary::data_wait_ms);
    m.copy_ms = median(&StepSummary::copy_ms);
    m.imbalance = median(&StepSummary::imbalance);
    m.devices = static_cast<int>(median(&StepSummary::devices));
    row("median", m);
  }
  return os.str();
}

CHORUS_INLINE std::string Summary::json() const {
  nlohmann::json rows = nlohmann::json::array();
  for (const auto& s : steps)
    rows.push_back({{"step", s.step}, {"wall_ms", s.wall_ms}, {"compute_ms", s.compute_ms},
                    {"communication_ms", s.communication_ms}, {"hidden_ms", s.hidden_ms},
                    {"hidden_percent", s.hidden_percent}, {"optimizer_ms", s.optimizer_ms},
                    {"data_wait_ms", s.data_wait_ms}, {"copy_ms", s.copy_ms}, {"imbalance", s.imbalance},
                    {"devices", s.devices}, {"communication_bytes", s.communication_bytes}});
  return nlohmann::json{{"steps", std::move(rows)}}.dump(1);
}

CHORUS_INLINE std::ostream& operator<<(std::ostream& os, const Summary& summary) { return os << summary.table(); }

CHORUS_INLINE Profiler::Profiler(const Options& options) {
  detail::start_recording(options);
  recording_ = true;
}

CHORUS_INLINE Profiler::~Profiler() {
  if (!recording_) return;
  try {
    (void)detail::stop_recording();
  } catch (...) {  // a destructor does not throw; the recording ends either way
  }
}

CHORUS_INLINE Profiler::Profiler(Profiler&& other) noexcept
    : recording_(std::exchange(other.recording_, false)),
      stopped_(std::exchange(other.stopped_, false)),
      profile_(std::move(other.profile_)) {}

CHORUS_INLINE const Profile& Profiler::stop() {
  CHORUS_CHECK(recording_, "profiler: stop() on a profiler that is not recording");
  recording_ = false;
  profile_ = Profile(detail::stop_recording());
  stopped_ = true;
  return profile_;
}

CHORUS_INLINE const Profile& Profiler::profile() const {
  CHORUS_CHECK(stopped_, "profiler: the profile is there after stop()");
  return profile_;
}

}  // namespace profiler
CHORUS_NAMESPACE_END
