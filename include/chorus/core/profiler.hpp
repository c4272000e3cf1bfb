#pragma once
// The profiler's recorder: spans and counters from the layers that know a step's phases.
//
// Note [profiler recorder]
// The layers mark their phases with a Scope (DataParallel's scatter, replicate, each replica's
// forward and gather; each autograd node's backward, named by the layer whose forward made it;
// gradient reductions and collectives with their bytes; the optimizer step; the DataLoader's
// waits; host<->device copies). While no profiler records, a Scope costs one relaxed atomic load
// and a branch, and its name is never built (it takes a callable for names that need building).
// While one records, each thread appends to its own buffer (its mutex is only contended by
// stop()); a thread's track is named once, when it first records: a stream worker as its
// device and stream ("cpu:1 stream 0"), the thread that called start() "main", others by
// set_thread_name() (DDP's communication thread, the DataLoader's workers). The step number on
// every span is the profiler's (step()). io/profile.hpp turns the records into a Profile (Chrome
// trace, summary).
//
// Note [GPU spans]
// On a CUDA device a span's host time is when its work was queued. A span given a CUDA device
// (Scope::set_device) also records a timing CUDA event on that device's current stream of the
// calling thread when it begins and when it ends: nothing waits for them during the steps. stop()
// waits for each device, records one more event on the idle device and reads the host clock at
// once, and places every span's GPU begin and end by their distance to that event, as a copy of
// the span on the track "<device> stream <slot> (GPU)".
#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <type_traits>
#include <unordered_set>
#include <utility>
#include <vector>

#include "../error.hpp"
#include "device.hpp"
#include "runtime.hpp"
#include "stream.hpp"

CHORUS_NAMESPACE_BEGIN
namespace profiler {

/// What a span's time was spent on (its colour in a trace, its column in a summary).
enum class Category : std::uint8_t {
  forward,        ///< a replica's or a layer's forward
  backward,       ///< autograd nodes of the backward pass, grouped per layer
  communication,  ///< gradient reductions, all-reduces, broadcasts, gathers between devices or ranks
  copy,           ///< scatter, gather, replication and host<->device copies
  optimizer,      ///< the optimizer's step
  data,           ///< waiting for the DataLoader's next batch
  other,          ///< anything else a user marks
};

/// The name of `c` as it appears in traces ("forward", "communication", …).
inline const char* category_name(Category c) {
  switch (c) {
    case Category::forward: return "forward";
    case Category::backward: return "backward";
    case Category::communication: return "communication";
    case Category::copy: return "copy";
    case Category::optimizer: return "optimizer";
    case Category::data: return "data";
    case Category::other: return "other";
  }
  return "other";
}

/// One recorded interval of one thread.
struct Span {
  std::string name;                ///< what ran: a phase ("forward replica 1") or a layer's dotted name
  Category category = Category::other;  ///< what kind of work it was
  std::int64_t start_ns = 0;       ///< start, in nanoseconds since the profiler started
  std::int64_t end_ns = 0;         ///< end, in nanoseconds since the profiler started
  std::int64_t step = 0;           ///< the profiler's step number when the span began
  int track = 0;                   ///< the thread (device stream, communication thread, …) it ran on
  std::string device;              ///< the device it worked for ("cpu:1", "cuda:0"), empty if none
  std::int64_t bytes = -1;         ///< bytes moved or reduced (communication, copies), -1 if none
  std::string detail;              ///< more about it: the autograd nodes of a layer's backward, …
};

/// One sample of a counter (each device's allocated memory).
struct CounterSample {
  std::string name;        ///< the counter ("allocated cpu:0")
  std::int64_t t_ns = 0;   ///< when, in nanoseconds since the profiler started
  double value = 0;        ///< its value (bytes for memory)
  std::int64_t step = 0;   ///< the profiler's step number at the sample
};

/// A thread that recorded: its name and the device it serves ("" for none).
struct Track {
  std::string name;    ///< "main", "cpu:1 stream 0", "comm rank 0", "loader worker 2", …
  std::string device;  ///< the device of a stream's worker, empty for other threads
};

/// What a profiler records.
struct Options {
  bool memory = true;  ///< sample each device's allocated memory at the ends of phases
  bool layers = true;  ///< a span per layer call in forward and per layer in backward
};

/// Everything recorded between start and stop.
struct Records {
  std::vector<Track> tracks;           ///< indexed by Span::track
  std::vector<Span> spans;             ///< in each thread's order, threads one after another
  std::vector<CounterSample> counters; ///< every counter's samples
  int rank = -1;                       ///< the process's rank (-1 outside a process group)
  std::int64_t steps = 0;              ///< the step number when recording stopped
  std::int64_t origin_unix_ns = 0;     ///< the start of the recording, in ns since the Unix epoch (aligns ranks' files)
};

namespace detail {

/// True while a profiler records (one relaxed load: Note [profiler recorder]).
inline std::atomic<bool>& active_flag() {
  static std::atomic<bool> flag{false};
  return flag;
}

#if CHORUS_CUDA
/// A span's CUDA events on the stream it worked on (Note [GPU spans]).
struct GpuRecord {
  Span span;
  int device = 0, slot = 0;
  cudaEvent_t begin = nullptr, end = nullptr;
};
#endif

/// One thread's records of one recording.
struct ThreadBuffer {
  std::mutex m;
  std::uint64_t generation = 0;
  int track = 0;
  std::vector<Span> spans;
  std::vector<CounterSample> counters;
#if CHORUS_CUDA
  std::vector<GpuRecord> gpu;
#endif
};

/// The process's recorder: the recording's generation, start time, threads and step.
struct Recorder {
  std::mutex m;
  std::atomic<std::uint64_t> generation{0};  // the recording's number (written under m)
  std::chrono::steady_clock::time_point origin{};
  std::int64_t origin_unix_ns = 0;
  std::thread::id main_thread{};
  Options options{};
  std::vector<std::shared_ptr<ThreadBuffer>> buffers;
  std::map<std::string, std::shared_ptr<ThreadBuffer>> named;  // record_on_track's tracks
  std::vector<Track> tracks;
  std::atomic<std::int64_t> step{0};
  std::atomic<int> rank{-1};
  std::unordered_set<std::string> names;  // interned layer names (NodeBase keeps a pointer)
};

/// The process's one recorder.
inline Recorder& recorder() {
  static Recorder r;
  return r;
}

/// The name a thread's own set_thread_name() gave it ("" for none).
inline std::string& thread_name() {
  thread_local std::string name;
  return name;
}

/// Nanoseconds since the recording started.
inline std::int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() -
                                                              recorder().origin)
      .count();
}

/// The calling thread's buffer for the current recording (registered, and its track named, on
/// the thread's first record of the recording).
inline ThreadBuffer& this_thread_buffer() {
  thread_local std::shared_ptr<ThreadBuffer> buffer;
  Recorder& r = recorder();
  if (buffer && buffer->generation == r.generation.load(std::memory_order_acquire)) return *buffer;
  std::lock_guard<std::mutex> lk(r.m);
  if (buffer && buffer->generation == r.generation.load()) return *buffer;
  buffer = std::make_shared<ThreadBuffer>();
  buffer->generation = r.generation.load();
  Track t;
  if (const Stream* s = chorus::detail::worker_stream_of_thread()) {
    t.device = s->device().str();
    t.name = t.device + " stream " + std::to_string(s->slot());
  } else if (!thread_name().empty()) {
    t.name = thread_name();
  } else if (std::this_thread::get_id() == r.main_thread) {
    t.name = "main";
  } else {
    t.name = "thread " + std::to_string(r.tracks.size());
  }
  buffer->track = static_cast<int>(r.tracks.size());
  r.tracks.push_back(std::move(t));
  r.buffers.push_back(buffer);
  return *buffer;
}

/// The layer whose forward the calling thread runs (an interned dotted name; null for none).
inline const std::string*& current_layer() {
  thread_local const std::string* layer = nullptr;
  return layer;
}

/// `name`, interned for the process's lifetime (pointers to it stay valid).
inline const std::string* intern(std::string name) {
  Recorder& r = recorder();
  std::lock_guard<std::mutex> lk(r.m);
  return &*r.names.insert(std::move(name)).first;
}

/// Appends `s` to the calling thread's buffer (its track and step filled in).
inline void append(Span s) {
  ThreadBuffer& b = this_thread_buffer();
  s.track = b.track;
  std::lock_guard<std::mutex> lk(b.m);
  b.spans.push_back(std::move(s));
}

}  // namespace detail

// CHORUS_PROFILER=0 compiles the instrumentation out (enabled() is constantly false): the
// baseline benchmarks/profiler_cost_bench compares the library with, where it is compiled in and
// off. A program must be compiled one way throughout (the header-only form).
#ifndef CHORUS_PROFILER
#define CHORUS_PROFILER 1
#endif

/// True while a profiler records. Instrumentation checks it before building anything.
inline bool enabled() noexcept {
#if CHORUS_PROFILER
  return detail::active_flag().load(std::memory_order_relaxed);
#else
  return false;
#endif
}

/// The options of the recording in progress.
inline const Options& options() { return detail::recorder().options; }

/// The profiler's step number (0 from start; step() advances it).
inline std::int64_t current_step() noexcept { return detail::recorder().step.load(std::memory_order_relaxed); }

/// Names the calling thread's track in traces (before it first records).
inline void set_thread_name(std::string name) { detail::thread_name() = std::move(name); }

/// Sets the process's rank for traces' process names (distributed's init calls it).
inline void set_process_rank(int rank) { detail::recorder().rank.store(rank); }

/// Samples the allocated memory of `device` as the counter "allocated <device>".
inline void sample_memory(Device device) {
  if (!enabled() || !detail::recorder().options.memory) return;
  CounterSample c{"allocated " + device.str(), detail::now_ns(),
                  static_cast<double>(memory_stats(device).allocated), current_step()};
  detail::ThreadBuffer& b = detail::this_thread_buffer();
  std::lock_guard<std::mutex> lk(b.m);
  b.counters.push_back(std::move(c));
}

/// Records `span` (its times from detail::now_ns(), set by the caller) on the track named
/// `track`, made on first use: for work a thread keeps several of in flight at once (the
/// communication thread's collectives, a track per one in flight), whose spans would overlap on
/// the thread's own track.
inline void record_on_track(const std::string& track, Span span) {
  if (!enabled()) return;
  detail::Recorder& r = detail::recorder();
  std::shared_ptr<detail::ThreadBuffer> buffer;
  {
    std::lock_guard<std::mutex> lk(r.m);
    auto& b = r.named[track];
    if (!b || b->generation != r.generation.load()) {
      b = std::make_shared<detail::ThreadBuffer>();
      b->generation = r.generation.load();
      b->track = static_cast<int>(r.tracks.size());
      r.tracks.push_back({track, ""});
      r.buffers.push_back(b);
    }
    buffer = b;
  }
  span.track = buffer->track;
  std::lock_guard<std::mutex> lk(buffer->m);
  buffer->spans.push_back(std::move(span));
}

/// Records a span from construction to destruction on the calling thread's track, if a profiler
/// records when it is made; otherwise it does nothing (Note [profiler recorder]).
class Scope {
 public:
  /// A span named `name` (a literal or a string that already exists).
  Scope(Category category, const char* name) {
    if (enabled()) begin(category, name);
  }
  /// A span whose name `make_name()` builds, called only while a profiler records.
  template <class F>
    requires std::is_invocable_r_v<std::string, F&>
  Scope(Category category, F&& make_name) {
    if (enabled()) begin(category, make_name());
  }
  ~Scope() {
    if (!span_) return;
    // A span of a recording that has stopped since it began belongs to none.
    if (generation_ != detail::recorder().generation.load(std::memory_order_acquire)) {
#if CHORUS_CUDA
      if (gpu_) (void)cuda::tolerate(cudaEventDestroy(gpu_->begin));
#endif
      return;
    }
    span_->end_ns = detail::now_ns();
    if (sample_device_) sample_memory(*sample_device_);
#if CHORUS_CUDA
    end_gpu();
#endif
    detail::append(std::move(*span_));
  }
  Scope(const Scope&) = delete;
  Scope& operator=(const Scope&) = delete;

  /// True when this scope records.
  bool active() const noexcept { return span_ != nullptr; }
  /// The device the span works for (on a CUDA device, also timed by CUDA events: Note [GPU spans]).
  void set_device(Device d) {
    if (!span_) return;
    span_->device = d.str();
#if CHORUS_CUDA
    begin_gpu(d);
#endif
  }
  /// The bytes the span moves or reduces.
  void set_bytes(std::int64_t bytes) {
    if (span_) span_->bytes = bytes;
  }
  /// More about the span (shown in its arguments).
  void set_detail(std::string detail) {
    if (span_) span_->detail = std::move(detail);
  }
  /// Samples `d`'s allocated memory when the span ends.
  void sample_memory_at_end(Device d) {
    if (span_) sample_device_ = std::make_unique<Device>(d);
  }

 private:
  void begin(Category category, std::string name) {
    generation_ = detail::recorder().generation.load(std::memory_order_acquire);
    span_ = std::make_unique<Span>();
    span_->name = std::move(name);
    span_->category = category;
    span_->step = current_step();
    span_->start_ns = detail::now_ns();
  }

#if CHORUS_CUDA
  // Note [GPU spans]: a timing event on the device's current stream (a failure only loses the span).
  void begin_gpu(Device d) {
    if (!d.is_cuda() || gpu_) return;
    Stream& s = current_stream(d);
    cuda::DeviceGuard g(d.index);
    cudaEvent_t e = nullptr;
    if (cuda::tolerate(cudaEventCreate(&e)) != cudaSuccess) return;
    if (cuda::tolerate(cudaEventRecord(e, s.handle())) != cudaSuccess) {
      (void)cuda::tolerate(cudaEventDestroy(e));
      return;
    }
    gpu_ = std::make_unique<detail::GpuRecord>();
    gpu_->begin = e;
    gpu_->device = d.index;
    gpu_->slot = s.slot();
    gpu_stream_ = &s;
  }
  void end_gpu() {
    if (!gpu_) return;
    cuda::DeviceGuard g(gpu_->device);
    cudaEvent_t e = nullptr;
    if (cuda::tolerate(cudaEventCreate(&e)) != cudaSuccess ||
        cuda::tolerate(cudaEventRecord(e, gpu_stream_->handle())) != cudaSuccess) {
      if (e) (void)cuda::tolerate(cudaEventDestroy(e));
      (void)cuda::tolerate(cudaEventDestroy(gpu_->begin));
      return;
    }
    gpu_->end = e;
    gpu_->span = *span_;
    detail::ThreadBuffer& b = detail::this_thread_buffer();
    std::lock_guard<std::mutex> lk(b.m);
    b.gpu.push_back(std::move(*gpu_));
  }
  std::unique_ptr<detail::GpuRecord> gpu_;
  Stream* gpu_stream_ = nullptr;
#endif
  std::unique_ptr<Span> span_;
  std::unique_ptr<Device> sample_device_;
  std::uint64_t generation_ = 0;
};

/// Makes the calling thread's forward belong to layer `name` while alive: the autograd nodes it
/// creates carry the name, and their backward is grouped under it.
class LayerScope {
 public:
  /// Enters layer `name` (an interned name, detail::intern); null leaves the layer as it is.
  explicit LayerScope(const std::string* name)
      : prev_(detail::current_layer()), set_(name != nullptr) {
    if (set_) detail::current_layer() = name;
  }
  ~LayerScope() {
    if (set_) detail::current_layer() = prev_;
  }
  LayerScope(const LayerScope&) = delete;
  LayerScope& operator=(const LayerScope&) = delete;

 private:
  const std::string* prev_;
  bool set_;
};

namespace detail {

/// Starts a recording (refused while one records).
inline void start_recording(const Options& options) {
  Recorder& r = recorder();
  std::lock_guard<std::mutex> lk(r.m);
  CHORUS_CHECK(CHORUS_PROFILER, "profiler::start: this program was compiled with CHORUS_PROFILER=0 (no instrumentation)");
  CHORUS_CHECK(!active_flag().load(), "profiler::start: a profiler already records in this process (stop it first)");
  r.generation.fetch_add(1);
  r.buffers.clear();
  r.named.clear();
  r.tracks.clear();
  r.options = options;
  r.step.store(0);
  r.main_thread = std::this_thread::get_id();
  r.origin_unix_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
                         std::chrono::system_clock::now().time_since_epoch())
                         .count();
  r.origin = std::chrono::steady_clock::now();
  active_flag().store(true);
}

#if CHORUS_CUDA
/// Note [GPU spans]: each span's CUDA events placed on the host clock, on the tracks of the
/// streams they ran on; the events are destroyed.
inline void place_gpu_spans(std::vector<GpuRecord>& gpu, Records& out) {
  std::map<int, std::pair<cudaEvent_t, std::int64_t>> now;  // per device: an event and the host time it completed
  for (const auto& g : gpu) {
    if (now.count(g.device)) continue;
    cuda::DeviceGuard guard(g.device);
    cudaEvent_t e = nullptr;
    if (cuda::tolerate(cudaDeviceSynchronize()) == cudaSuccess && cuda::tolerate(cudaEventCreate(&e)) == cudaSuccess &&
        cuda::tolerate(cudaEventRecord(e, nullptr)) == cudaSuccess &&
        cuda::tolerate(cudaEventSynchronize(e)) == cudaSuccess)
      now[g.device] = {e, now_ns()};
    else if (e)
      (void)cuda::tolerate(cudaEventDestroy(e));
  }
  std::map<std::string, int> tracks;
  for (auto& g : gpu) {
    float to_begin = 0, to_end = 0;
    const auto it = now.find(g.device);
    if (it != now.end() && cuda::tolerate(cudaEventElapsedTime(&to_begin, g.begin, it->second.first)) == cudaSuccess &&
        cuda::tolerate(cudaEventElapsedTime(&to_end, g.end, it->second.first)) == cudaSuccess) {
      const std::string name = "cuda:" + std::to_string(g.device) + " stream " + std::to_string(g.slot) + " (GPU)";
      auto [t, fresh] = tracks.emplace(name, static_cast<int>(out.tracks.size()));
      if (fresh) out.tracks.push_back({name, "cuda:" + std::to_string(g.device)});
      Span s = std::move(g.span);
      s.track = t->second;
      s.start_ns = it->second.second - static_cast<std::int64_t>(static_cast<double>(to_begin) * 1e6);
      s.end_ns = it->second.second - static_cast<std::int64_t>(static_cast<double>(to_end) * 1e6);
      out.spans.push_back(std::move(s));
    }
    (void)cuda::tolerate(cudaEventDestroy(g.begin));
    (void)cuda::tolerate(cudaEventDestroy(g.end));
  }
  for (auto& [device, e] : now) (void)cuda::tolerate(cudaEventDestroy(e.first));
}
#endif

/// Stops the recording and hands over what it recorded. Spans still open on other threads when
/// it stops are left out.
inline Records stop_recording() {
  Recorder& r = recorder();
  Records out;
  std::vector<std::shared_ptr<ThreadBuffer>> buffers;
  {
    std::lock_guard<std::mutex> lk(r.m);
    CHORUS_CHECK(active_flag().load(), "profiler: stop() without a recording in progress");
    active_flag().store(false);
    r.generation.fetch_add(1);  // a Scope that ends later records nothing (~Scope)
    buffers = std::move(r.buffers);
    out.tracks = std::move(r.tracks);
    r.buffers.clear();
    r.named.clear();
    r.tracks.clear();
    out.rank = r.rank.load();
    out.origin_unix_ns = r.origin_unix_ns;
    out.steps = r.step.load();
  }
#if CHORUS_CUDA
  std::vector<GpuRecord> gpu;
#endif
  for (auto& b : buffers) {
    std::lock_guard<std::mutex> lk(b->m);
    for (auto& s : b->spans) out.spans.push_back(std::move(s));
    for (auto& c : b->counters) out.counters.push_back(std::move(c));
#if CHORUS_CUDA
    for (auto& g : b->gpu) gpu.push_back(std::move(g));
#endif
  }
#if CHORUS_CUDA
  place_gpu_spans(gpu, out);
#endif
  return out;
}

}  // namespace detail

/// Ends the profiler's current step (as torch.profiler's prof.step()): later spans carry the next
/// step number.
inline void step() {
  if (enabled()) detail::recorder().step.fetch_add(1, std::memory_order_relaxed);
}

}  // namespace profiler
CHORUS_NAMESPACE_END
