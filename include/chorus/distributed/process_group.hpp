#pragma once
// The process group: one process per device, many processes, many machines. The transports are
// in mpi_backend.hpp and nccl_backend.hpp (Note [process group backends]).
//
// Note [process group bootstrap]
// dist::init() finds out how the job was launched:
//  - by an MPI launcher (mpirun/mpiexec, `srun --mpi=pmix`) — or by nothing at all — in a build
//    with MPI (CHORUS_WITH_MPI, set by the chorus::distributed CMake target): MPI is initialised
//    with MPI_THREAD_MULTIPLE unless the program did so already, and chorus works on a private
//    MPI_Comm_dup with MPI_ERRORS_RETURN, so the user's own MPI traffic and error handler are
//    never touched. A program started without a launcher is an MPI singleton: a world of 1.
//  - by torchrun (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT, and
//    no MPI launcher variables), in a CUDA build: NCCL bootstraps itself from NCCL_COMM_ID
//    (default MASTER_ADDR:MASTER_PORT+1, since torchrun's own store listens on MASTER_PORT);
//    CPU tensors then travel through the GPU.
//  - otherwise (no MPI in the build, no torchrun): a world of 1 that needs nothing installed.
#include <algorithm>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_set>
#include <vector>

#include "../compiled.hpp"
#include "../ops/ops.hpp"
#include "backend.hpp"
#include "mpi_backend.hpp"
#include "nccl_backend.hpp"

CHORUS_NAMESPACE_BEGIN
namespace dist {
inline namespace CHORUS_DIST_NS {

/// The group of all processes of the job (see Note [process group bootstrap]).
class ProcessGroup {
 public:
  /// Joins the job's processes as it was launched (Note [process group bootstrap]); a program
  /// calls dist::init(), which makes the job's one group.
  explicit ProcessGroup(Options options = {});

  ~ProcessGroup();  // at exit: a failed leave has already skipped MPI_Finalize
  ProcessGroup(const ProcessGroup&) = delete;
  ProcessGroup& operator=(const ProcessGroup&) = delete;

  /// This process's rank, 0 … world_size()-1.
  int rank() const { return state_.rank; }
  /// The number of processes in the job.
  int world_size() const { return state_.world; }
  /// This process's rank among the processes on its machine (torchrun's LOCAL_RANK).
  int local_rank() const { return state_.local_rank; }
  /// The number of processes on this machine (torchrun's LOCAL_WORLD_SIZE).
  int local_world_size() const { return state_.local_world; }
  /// How the job was launched.
  Launcher launcher() const { return state_.launcher; }
  /// "mpi", "nccl" (torchrun) or "local" (a world of 1 without MPI).
  std::string backend() const;
  /// How long a collective may take before its wait throws and the group breaks (Note [watchdog]).
  std::chrono::milliseconds timeout() const { return state_.timeout; }
  /// Sets timeout() (positive) for the waits to come.
  void set_timeout(std::chrono::milliseconds t);

  /// The device this process should use: cuda:local_rank when there are GPUs, else cpu:0.
  Device default_device() const { return state_.default_device(); }

  // ---- collectives (every rank calls them in the same order) ----

  /// t = the sum (or mean) of t over all ranks, in place. t must be contiguous.
  template <class T>
  std::shared_ptr<Work> all_reduce_async(const Tensor<T>& t, ReduceOp op = ReduceOp::Sum, std::string what = {}) {
    if (what.empty()) what = std::string("all_reduce(") + op_name(op) + ")";
    check_tensor(t, what);
    auto work = make_work(what, t);
    if (local_only(t)) return done(work);
    backend_for(t.device(), what).all_reduce(work, AnyTensor(t), op);
    return work;
  }
  /// all_reduce_async(t, op), waited for within timeout() (PyTorch's dist.all_reduce).
  template <class T>
  void all_reduce(const Tensor<T>& t, ReduceOp op = ReduceOp::Sum) {
    all_reduce_async(t, op)->wait(state_.timeout);
  }

  /// Rank root's t = the sum (or mean) of t over all ranks, in place; the other ranks' t is
  /// unchanged. t must be contiguous.
  template <class T>
  std::shared_ptr<Work> reduce_async(const Tensor<T>& t, ReduceOp op, int root, std::string what = {}) {
    if (what.empty()) what = std::string("reduce(") + op_name(op) + ", root " + std::to_string(root) + ")";
    CHORUS_CHECK(root >= 0 && root < state_.world, "dist: ", what, ": root ", root, " is not a rank of a world of ",
                 state_.world);
    check_tensor(t, what);
    auto work = make_work(what, t);
    if (local_only(t)) return done(work);
    backend_for(t.device(), what).reduce(work, AnyTensor(t), op, root);
    return work;
  }

  /// t = rank root's t, in place.
  template <class T>
  std::shared_ptr<Work> broadcast_async(const Tensor<T>& t, int root = 0, std::string what = {}) {
    if (what.empty()) what = "broadcast(root " + std::to_string(root) + ")";
    CHORUS_CHECK(root >= 0 && root < state_.world, "dist: ", what, ": root ", root, " is not a rank of a world of ",
                 state_.world);
    check_tensor(t, what);
    auto work = make_work(what, t);
    if (local_only(t)) return done(work);
    backend_for(t.device(), what).broadcast(work, AnyTensor(t), root);
    return work;
  }
  /// broadcast_async(t, root), waited for within timeout() (PyTorch's dist.broadcast).
  template <class T>
  void broadcast(const Tensor<T>& t, int root = 0) {
    broadcast_async(t, root)->wait(state_.timeout);
  }
  /// broadcast(t, root) for a tensor of any dtype.
  void broadcast(const AnyTensor& t, int root = 0);

  /// [world_size, *t.shape()]: every rank's t, in rank order.
  template <class T>
  Tensor<T> all_gather(const Tensor<T>& t) {
    check_tensor(t, "all_gather");
    std::vector<std::int64_t> dims{state_.world};
    for (auto s : t.shape()) dims.push_back(s);
    auto out = Tensor<T>::empty(Shape(dims), t.device());
    all_gather_into_async(out, t)->wait(state_.timeout);
    return out;
  }

  /// out = every rank's `in`, in rank order (out has world_size × in.numel() elements), once the
  /// returned work is waited for.
  template <class T>
  std::shared_ptr<Work> all_gather_into_async(const Tensor<T>& out, const Tensor<T>& in, std::string what = {}) {
    if (what.empty()) what = "all_gather";
    check_tensor(in, what);
    check_tensor(out, what);
    CHORUS_CHECK(out.numel() == in.numel() * state_.world && out.device() == in.device(), "dist: ", what,
                 ": the output has ", out.numel(), " elements on ", out.device(), "; it takes ", state_.world,
                 " ranks' ", in.numel(), " on ", in.device());
    auto work = make_work(what, in);
    work->keep.push_back(AnyTensor(out));
    if (local_only(in)) {
      backend::copy(out.view(in.shape()), in);
      return done(work);
    }
    backend_for(in.device(), what).all_gather(work, AnyTensor(in), AnyTensor(out));
    return work;
  }

  /// out = this rank's part of the sum (or mean) of every rank's `in`: `in` has world_size ×
  /// out.numel() elements, and rank r gets elements [r·n, r·n + n).
  template <class T>
  std::shared_ptr<Work> reduce_scatter_async(const Tensor<T>& out, const Tensor<T>& in, ReduceOp op = ReduceOp::Sum,
                                             std::string what = {}) {
    if (what.empty()) what = std::string("reduce_scatter(") + op_name(op) + ")";
    check_tensor(in, what);
    check_tensor(out, what);
    CHORUS_CHECK(in.numel() == out.numel() * state_.world && out.device() == in.device(), "dist: ", what,
                 ": the input has ", in.numel(), " elements on ", in.device(), "; it takes ", state_.world,
                 " ranks' parts of ", out.numel(), " on ", out.device());
    auto work = make_work(what, in);
    work->keep.push_back(AnyTensor(out));
    if (local_only(in)) {
      backend::copy(out, in.view(out.shape()));
      return done(work);
    }
    backend_for(in.device(), what).reduce_scatter(work, AnyTensor(in), AnyTensor(out), op);
    return work;
  }

  /// Returns once every rank has called barrier().
  void barrier();

  // ---- failure handling (Note [watchdog]) ----

  /// Marks the group unusable: later collectives throw, shutdown skips MPI_Finalize.
  void mark_broken(const std::string& why) { state_.mark_broken(why); }
  /// Whether the group was marked broken (Note [watchdog]).
  bool broken() const { return state_.broken(); }

  /// Leaves the group: meets the other ranks (within the timeout), stops the communication
  /// thread, frees the communicators and finalises MPI if chorus initialised it (also done at
  /// exit). Throws a chorus::Error when the leave was not clean (the group broken, a collective
  /// still in flight, or another rank not reaching the exit barrier within the timeout): MPI is
  /// then left unfinalised, so that the launcher ends the job with a failure (Note [watchdog]).
  /// A second call does nothing.
  void shutdown();

#if CHORUS_DIST_MPI
  /// The private communicator (a duplicate of MPI_COMM_WORLD; null without MPI).
  MPI_Comm mpi_comm() const { return mpi_ ? mpi_->comm() : MPI_COMM_NULL; }
#endif

#if CHORUS_CUDA
  /// The stream NCCL collectives run on (null before the first one): for ordering one's own work
  /// before or after the group's.
  cudaStream_t nccl_stream() const { return nccl_ ? nccl_->stream() : nullptr; }
#endif

  /// Throws chorus::Error naming `what` if the group is broken or shut down.
  void check_usable(const std::string& what) const;

  // ---- optimizers whose step is a collective (Note [DDP join]) ----

  /// A ZeroRedundancyOptimizer notes its parameters here while it lives: a rank that ran out of
  /// data must still take part in its steps, so DistributedDataParallel::join refuses to run
  /// without them (instead of the other ranks waiting in the step's broadcasts until the timeout).
  void add_collective_step(const std::vector<AnyTensor>& params);
  /// Undoes one add_collective_step(params) (the optimizer's destructor).
  void remove_collective_step(const std::vector<AnyTensor>& params) noexcept;
  /// Whether an optimizer with a collective step steps any of `params`.
  bool has_collective_step(const std::vector<AnyTensor>& params) const;

 private:
  /// shutdown() without the exception: why the leave was not clean (empty when it was, or when
  /// the group was left before).
  std::string leave() noexcept;

  template <class T>
  void check_tensor(const Tensor<T>& t, const std::string& what) const {
    check_usable(what);
    CHORUS_CHECK(t.defined(), "dist: ", what, " of an undefined tensor");
    CHORUS_CHECK(t.is_contiguous(), "dist: ", what, " needs a contiguous tensor, got shape ", t.shape(),
                 " with strides ", Shape(std::vector<std::int64_t>(t.strides().begin(), t.strides().end())));
    // Size limits are the backends' (MPI counts are int: Note [MPI counts]; NCCL's are size_t).
  }
  template <class T>
  std::shared_ptr<Work> make_work(const std::string& what, const Tensor<T>& t) {
    auto w = std::make_shared<Work>(what + " of " + std::to_string(t.numel() * sizeof(T)) + " bytes" + state_.where());
    w->group = &state_;
    w->keep.push_back(AnyTensor(t));
    return w;
  }
  /// A world of 1 needs no communication; but CUDA tensors under a launcher still go through
  /// NCCL (a one-rank communicator), so that a one-GPU job runs the same path as a large one.
  template <class T>
  bool local_only(const Tensor<T>& t) const {
    return state_.world == 1 && !(t.device().is_cuda() && state_.launcher != Launcher::None);
  }
  static std::shared_ptr<Work> done(std::shared_ptr<Work> w) {
    w->finish();
    return w;
  }
  // Note [timeout precedence].
  static std::chrono::milliseconds resolve_timeout(const Options& o);
  bool has_mpi() const {
#if CHORUS_DIST_MPI
    return mpi_ != nullptr;
#else
    return false;
#endif
  }

  /// The backend for a tensor on `device` (Note [process group backends]).
  detail::Backend& backend_for(Device device, const std::string& what);

  void init_torchrun();

  // Declared before the backends, destroyed after them: they refer to it.
  detail::GroupState state_;
  bool shut_down_ = false;
  mutable std::mutex collective_m_;
  std::unordered_multiset<const void*> collective_;  // parameters' impl keys
#if CHORUS_DIST_MPI
  std::unique_ptr<detail::MpiBackend> mpi_;
#endif
#if CHORUS_CUDA
  std::unique_ptr<detail::NcclBackend> nccl_;
#endif
};

namespace detail {
CHORUS_INLINE std::unique_ptr<ProcessGroup>& global_group();
}  // namespace detail

// Note [one process group]
// dist::init() makes the job's one group; later calls return it (DistributedDataParallel calls
// init() for a program that did not). A later init(options) whose options contradict the
// group's as in effect is an error naming both, not a silent no-op: the program would otherwise
// run with a timeout it did not ask for. Unset fields contradict nothing.

/// Joins the job's process group (Note [process group bootstrap], [one process group]). Every
/// rank calls it.
CHORUS_INLINE ProcessGroup& init(Options options = {});
/// Whether init() has made the group.
inline bool is_initialized() { return detail::global_group() != nullptr; }
/// The group made by init().
CHORUS_INLINE ProcessGroup& group();
/// group().rank().
inline int rank() { return group().rank(); }
/// group().world_size().
inline int world_size() { return group().world_size(); }
/// group().local_rank().
inline int local_rank() { return group().local_rank(); }
/// group().barrier().
inline void barrier() { group().barrier(); }
/// group().all_reduce(t, op).
template <class T>
void all_reduce(const Tensor<T>& t, ReduceOp op = ReduceOp::Sum) {
  group().all_reduce(t, op);
}
/// group().broadcast(t, root).
template <class T>
void broadcast(const Tensor<T>& t, int root = 0) {
  group().broadcast(t, root);
}
/// group().all_gather(t).
template <class T>
Tensor<T> all_gather(const Tensor<T>& t) {
  return group().all_gather(t);
}
/// Leaves the group (also done at exit). Call it before your own MPI_Finalize.
CHORUS_INLINE void shutdown();

}  // namespace CHORUS_DIST_NS
}  // namespace dist
CHORUS_NAMESPACE_END

// The definitions: compiled into chorus::compiled and the MPI library, or here in the
// header-only form (Note [compiled chorus] in compiled.hpp).
#if !CHORUS_COMPILED
#include "process_group_impl.hpp"
#endif
