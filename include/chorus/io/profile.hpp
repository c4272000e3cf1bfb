#pragma once
// The profiler's front: start a recording, stop it, and what it recorded as a Chrome trace and a
// per-step summary (core/profiler.hpp records; Note [profiler recorder]).
//
//   auto prof = chorus::profiler::start();
//   for (...) { ...; prof.step(); }
//   prof.stop().save("trace.json");   // Perfetto, chrome://tracing
//   std::cout << prof.summary();       // compute, communication, hidden %, optimizer, data, imbalance
//
// Note [profile summary]
// Each step's figures are wall times over the union of the step's spans of a kind, across every
// track: compute = forward and backward spans, less the communication nested in them on the same
// track (a bucket reduced inside a backward node hides nothing); communication = reductions and
// collectives; hidden = the part of communication during which some track computes; optimizer,
// data (waits for batches) and copy likewise. Imbalance = the busiest device's forward and
// backward time over the mean of the devices that computed (1 for one device).
#include <cstdint>
#include <iosfwd>
#include <string>
#include <vector>

#include "../compiled.hpp"
#include "../core/profiler.hpp"
#include "../version.hpp"

CHORUS_NAMESPACE_BEGIN
namespace profiler {

/// One step's figures (Note [profile summary]); times in milliseconds.
struct StepSummary {
  std::int64_t step = 0;            ///< the step number
  double wall_ms = 0;               ///< from the step's first span's start to its last span's end
  double compute_ms = 0;            ///< forward and backward on any device
  double communication_ms = 0;      ///< reductions and collectives
  double hidden_ms = 0;             ///< communication while some device computed
  double hidden_percent = 0;        ///< hidden_ms over communication_ms, in percent (0 without communication)
  double optimizer_ms = 0;          ///< the optimizer's step
  double data_wait_ms = 0;          ///< waiting for the DataLoader
  double copy_ms = 0;               ///< scatter, gather, replication and host<->device copies
  double imbalance = 1;             ///< the busiest device's compute over the devices' mean
  int devices = 0;                  ///< devices that computed in the step
  std::int64_t communication_bytes = 0;  ///< bytes reduced or exchanged
};

/// A profile's figures per step (Profile::summary()).
struct Summary {
  std::vector<StepSummary> steps;  ///< one row per step that recorded a span

  /// The figures as a text table, a row per step and a median row.
  CHORUS_INLINE std::string table() const;
  /// The figures as JSON: {"steps": [{"step": …, "wall_ms": …, …}, …]}.
  CHORUS_INLINE std::string json() const;
};

/// Writes summary.table() to `os`.
CHORUS_INLINE std::ostream& operator<<(std::ostream& os, const Summary& summary);

/// What a recording recorded, with backward's nodes grouped per layer.
class Profile {
 public:
  Profile() = default;
  /// The profile of `records`: each track's consecutive backward spans of one layer in one step
  /// are grouped into one span naming the nodes.
  CHORUS_INLINE explicit Profile(Records records);

  /// The tracks (threads), indexed by Span::track.
  const std::vector<Track>& tracks() const { return records_.tracks; }
  /// Every span, by track then start time.
  const std::vector<Span>& spans() const { return records_.spans; }
  /// Every counter sample, by time.
  const std::vector<CounterSample>& counters() const { return records_.counters; }
  /// The recording process's rank (-1 outside a process group).
  int rank() const { return records_.rank; }

  /// The profile in Chrome's trace event format (Perfetto and chrome://tracing open it): a
  /// process per rank ("chorus rank 0"), a thread per track, complete events with the step,
  /// device and bytes in their arguments, counters for each device's allocated memory.
  CHORUS_INLINE std::string chrome_trace() const;
  /// Writes chrome_trace() to `path` (an Error naming the path if it cannot).
  CHORUS_INLINE const Profile& save(const std::string& path) const;
  /// The figures per step (Note [profile summary]).
  CHORUS_INLINE Summary summary() const;

 private:
  Records records_;
};

/// A recording in progress (profiler::start); stopping it keeps its Profile.
class Profiler {
 public:
  /// Starts recording with `options` (an Error while another Profiler records).
  CHORUS_INLINE explicit Profiler(const Options& options = {});
  /// Stops recording if still recording.
  CHORUS_INLINE ~Profiler();
  Profiler(const Profiler&) = delete;
  Profiler& operator=(const Profiler&) = delete;
  /// A running recording moves with its owner.
  CHORUS_INLINE Profiler(Profiler&& other) noexcept;
  /// Not assignable: one recording per owner.
  Profiler& operator=(Profiler&&) = delete;

  /// Ends the current step (as torch.profiler's prof.step()).
  void step() { profiler::step(); }
  /// Stops recording and returns what was recorded (an Error if already stopped).
  CHORUS_INLINE const Profile& stop();
  /// True until stop().
  bool recording() const { return recording_; }
  /// The recorded profile (an Error before stop()).
  CHORUS_INLINE const Profile& profile() const;
  /// The stopped profile's figures per step (an Error before stop()).
  Summary summary() const { return profile().summary(); }

 private:
  bool recording_ = false;
  bool stopped_ = false;
  Profile profile_;
};

/// Starts recording spans and memory on every device and thread of this process.
inline Profiler start(const Options& options = {}) { return Profiler(options); }

}  // namespace profiler
CHORUS_NAMESPACE_END

// The definitions: compiled into chorus::compiled, or here in the header-only form (Note
// [compiled chorus] in compiled.hpp).
#if !CHORUS_COMPILED
#include "profile_impl.hpp"
#endif
