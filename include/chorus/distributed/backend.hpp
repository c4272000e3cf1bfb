#pragma once
// The interface between a process group and its transports: a collective in flight (Work), the
// state a group shares with its backends, and the backend interface itself.
//
// Note [process group backends]
// As PyTorch's ProcessGroupMPI / ProcessGroupNCCL behind c10d's Backend, each transport is one
// class in its own file behind detail::Backend: mpi_backend.hpp (CPU tensors, MPI non-blocking
// collectives on a communication thread) and nccl_backend.hpp (CUDA tensors, and every tensor
// under torchrun, which has no MPI). ProcessGroup (process_group.hpp) checks the arguments, does
// the world-of-one shortcut and picks the backend by the tensor's device and the launcher; the
// backend starts the collective and fills in the Work. Tensors cross the interface as AnyTensor:
// collectives are templates over the scalar type, a virtual function cannot be.
//
// Note [watchdog]
// Work::wait() gives up after the group's timeout (Note [timeout precedence]) with a
// chorus::Error naming the collective (NCCL: the watchdog does, Note [NCCL watchdog]), and marks the group broken: a collective that never completes cannot be
// cancelled, so every later collective fails at once, and shutdown() skips MPI_Finalize (the
// launcher then ends the job with a non-zero status instead of hanging in its final fence).
// At exit, shutdown() first meets the other ranks in a barrier on a second private
// communicator; a rank that gets no answer within the timeout (the others are stuck in a
// collective that this rank left, say after an exception) also exits without MPI_Finalize.
// An explicit dist::shutdown() that leaves this way throws a chorus::Error saying why.
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "../backend/backend.hpp"
#include "../compiled.hpp"
#include "../core/any_tensor.hpp"
#include "../core/profiler.hpp"
#include "../core/runtime.hpp"
#include "../core/tensor.hpp"

#if defined(CHORUS_WITH_MPI) && CHORUS_WITH_MPI
#define CHORUS_DIST_MPI 1
#else
#define CHORUS_DIST_MPI 0
#endif

// A program whose translation units disagree about MPI would break the ODR silently: make it a
// link error instead (see DESIGN.md, "Host and device compilation").
#if CHORUS_DIST_MPI
#define CHORUS_DIST_NS with_mpi
#else
#define CHORUS_DIST_NS without_mpi
#endif

CHORUS_NAMESPACE_BEGIN
namespace dist {
inline namespace CHORUS_DIST_NS {

/// How a collective combines the ranks' tensors: their sum or their mean.
enum class ReduceOp { Sum, Avg };

/// "sum" or "avg", for messages.
inline const char* op_name(ReduceOp op) { return op == ReduceOp::Sum ? "sum" : "avg"; }

// Note [timeout precedence]
// A timeout set in code wins. CHORUS_DIST_TIMEOUT_S (seconds) is used only where the code leaves
// Options::timeout unset, and 10 minutes (PyTorch's default) where neither says: an operator can
// tune the watchdog of a program that does not choose, but never silently overrides one that
// does. A field left unset also means "no preference" to a second dist::init(options), which
// refuses only options that contradict the group's (Note [one process group]).
/// The options of dist::init() and ProcessGroup: `dist::init({.timeout = std::chrono::minutes(30)})`.
struct Options {
  /// How long a collective may take before it is declared stalled (Note [watchdog]); unset:
  /// CHORUS_DIST_TIMEOUT_S, else 10 minutes (Note [timeout precedence]).
  std::optional<std::chrono::milliseconds> timeout;
  /// Equal when every field is.
  bool operator==(const Options&) const = default;
};

/// How the job was launched.
enum class Launcher { None, Mpi, Torchrun };

namespace detail {
class GroupState;

/// How many threads of this process wait in Work::wait now (Note [polling collectives]).
inline std::atomic<int>& collective_waiters() {
  static std::atomic<int> n{0};
  return n;
}
}  // namespace detail

/// A collective in flight. wait() returns once the result is in the tensors (CPU tensors,
/// and barrier) or ordered before later work on the calling thread's current stream (CUDA
/// tensors: Note [NCCL work]), or throws (Note [watchdog]).
class Work {
 public:
  /// A collective described by `what` (for messages), started now: wait()'s timeout counts from here.
  explicit Work(std::string what) : what_(std::move(what)), start_(std::chrono::steady_clock::now()) {}
  /// The collective as messages name it, such as "all_reduce(sum) of 4096 bytes on rank 1 of 4".
  const std::string& what() const { return what_; }

  /// Blocks until the collective completes; throws chorus::Error, and marks the group broken,
  /// when it failed or did not complete within `timeout` of its start.
  void wait(std::chrono::milliseconds timeout);
  /// Whether the backend has finished the work (a CUDA collective may still run on its stream).
  bool completed() const {
    std::lock_guard<std::mutex> lk(m_);
    return done_;
  }

  /// Marks the work complete, failed with `error` unless it is empty; called by the backend
  /// (the communication thread).
  void finish(std::string error = {}) {
    std::lock_guard<std::mutex> lk(m_);
    done_ = true;
    error_ = std::move(error);
    cv_.notify_all();
  }
  std::function<void()> on_done;  ///< run by the communication thread before finish() (avg)
  /// Run by the waiter after completion, with the deadline (CUDA: watches the GPU side).
  std::function<void(std::chrono::steady_clock::time_point)> on_wait;
  std::vector<AnyTensor> keep;    ///< tensors the collective reads or writes, alive until done
  detail::GroupState* group = nullptr;  ///< the group wait() marks broken on a failure (null: none)

 private:
  std::string what_;
  std::chrono::steady_clock::time_point start_;
  mutable std::mutex m_;
  std::condition_variable cv_;
  bool done_ = false;
  std::string error_;
};

namespace detail {
CHORUS_INLINE std::string env(const char* name);
CHORUS_INLINE int env_int(const char* name, int fallback);
CHORUS_INLINE bool mpi_launcher_present();
inline bool torchrun_present() { return std::getenv("RANK") && std::getenv("WORLD_SIZE"); }

// Note [MPI counts]
// MPI takes element counts as int: a tensor of 2^31 or more elements would wrap in the cast.
// MPI collectives refuse it (NCCL's counts are size_t and take it).
CHORUS_INLINE int checked_int_count(std::int64_t n, const std::string& what);

/// t /= n (a contiguous t), on t's device: a GPU bucket is device memory (the compression hooks
/// divide it before the all-reduce). A 16-bit t divides in float and rounds once.
template <class T>
void divide_in_place(const Tensor<T>& t, std::int64_t n) {
  backend::unary(t, t, backend::fn::DivScalar{static_cast<double>(n)});
}

/// One transport of a process group (Note [process group backends]). The group has checked the
/// tensors (defined, contiguous, within the size limit) and made `work`; a backend starts the
/// collective and either finishes `work` or leaves it to its own thread / Work::on_wait.
class Backend {
 public:
  virtual ~Backend() = default;
  /// t = the sum (or mean) of t over all ranks, in place.
  virtual void all_reduce(const std::shared_ptr<Work>& work, const AnyTensor& t, ReduceOp op) = 0;
  /// Rank root's t = the sum (or mean) of t over all ranks, in place; the others' t unchanged.
  virtual void reduce(const std::shared_ptr<Work>& work, const AnyTensor& t, ReduceOp op, int root) = 0;
  /// t = rank root's t, in place.
  virtual void broadcast(const std::shared_ptr<Work>& work, const AnyTensor& t, int root) = 0;
  /// out ([world, *in.shape()]) = every rank's `in`, in rank order, once `work` is waited for.
  virtual void all_gather(const std::shared_ptr<Work>& work, const AnyTensor& in, const AnyTensor& out) = 0;
  /// out (n elements) = rank's part [rank·n, rank·n + n) of the sum (or mean) over all ranks of
  /// `in` (world·n elements).
  virtual void reduce_scatter(const std::shared_ptr<Work>& work, const AnyTensor& in, const AnyTensor& out,
                              ReduceOp op) = 0;
  /// Completes once every rank has called it.
  virtual void barrier(const std::shared_ptr<Work>& work) = 0;
  /// The group was marked broken (Note [watchdog]): cancel what can be cancelled. Called with
  /// the group's lock held; must not call back into the group.
  virtual void abort() noexcept {}
};

/// What a process group shares with its backends: who this process is, the timeout, and whether
/// the group is broken (Note [watchdog]).
class GroupState {
 public:
  int rank = 0, world = 1, local_rank = 0, local_world = 1;
  Launcher launcher = Launcher::None;
  std::chrono::milliseconds timeout{std::chrono::minutes(10)};

  /// Marks the group unusable: later collectives throw, shutdown skips MPI_Finalize, and every
  /// backend aborts what it can.
  void mark_broken(const std::string& why);
  bool broken() const {
    std::lock_guard<std::mutex> lk(m_);
    return !broken_.empty();
  }
  std::string broken_reason() const {
    std::lock_guard<std::mutex> lk(m_);
    return broken_;
  }
  /// Backends to abort when the group breaks (they outlive their registration).
  void add_backend(Backend* b);

  /// The device this process should use: cuda:local_rank when there are GPUs, else cpu:0.
  Device default_device() const;
  /// "... on rank r of w", for messages.
  std::string where() const;

 private:
  mutable std::mutex m_;
  std::string broken_;
  std::vector<Backend*> backends_;
};
}  // namespace detail

}  // namespace CHORUS_DIST_NS
}  // namespace dist
CHORUS_NAMESPACE_END

// The definitions: compiled into chorus::compiled and the MPI library, or here in the
// header-only form (Note [compiled chorus] in compiled.hpp).
#if !CHORUS_COMPILED
#include "backend_impl.hpp"
#endif
