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
#include <optional>
#include <string>
#include <vector>

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
  explicit ProcessGroup(Options options = {}) {
    state_.timeout = resolve_timeout(options);
#if CHORUS_DIST_MPI
    if (!(detail::torchrun_present() && !detail::mpi_launcher_present())) {
      mpi_ = std::make_unique<detail::MpiBackend>(state_);
      state_.add_backend(mpi_.get());
      return;
    }
#endif
    if (detail::torchrun_present()) {
      init_torchrun();
      return;
    }
    // World of 1, nothing to talk to.
  }

  ~ProcessGroup() { (void)leave(); }  // at exit: a failed leave has already skipped MPI_Finalize
  ProcessGroup(const ProcessGroup&) = delete;
  ProcessGroup& operator=(const ProcessGroup&) = delete;

  int rank() const { return state_.rank; }
  int world_size() const { return state_.world; }
  int local_rank() const { return state_.local_rank; }
  int local_world_size() const { return state_.local_world; }
  Launcher launcher() const { return state_.launcher; }
  /// "mpi", "nccl" (torchrun) or "local" (a world of 1 without MPI).
  std::string backend() const {
    return state_.launcher == Launcher::Torchrun ? "nccl" : (has_mpi() ? "mpi" : "local");
  }
  std::chrono::milliseconds timeout() const { return state_.timeout; }
  void set_timeout(std::chrono::milliseconds t) {
    CHORUS_CHECK(t.count() > 0, "dist: timeout must be positive");
    state_.timeout = t;
  }

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
  template <class T>
  void all_reduce(const Tensor<T>& t, ReduceOp op = ReduceOp::Sum) {
    all_reduce_async(t, op)->wait(state_.timeout);
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
  template <class T>
  void broadcast(const Tensor<T>& t, int root = 0) {
    broadcast_async(t, root)->wait(state_.timeout);
  }
  void broadcast(const AnyTensor& t, int root = 0) {
    t.visit([&](const auto& x) { broadcast(x, root); });
  }

  /// [world_size, *t.shape()]: every rank's t, in rank order.
  template <class T>
  Tensor<T> all_gather(const Tensor<T>& t) {
    const std::string what = "all_gather";
    check_tensor(t, what);
    std::vector<std::int64_t> dims{state_.world};
    for (auto s : t.shape()) dims.push_back(s);
    auto out = Tensor<T>::empty(Shape(dims), t.device());
    auto work = make_work(what, t);
    work->keep.push_back(AnyTensor(out));
    if (local_only(t)) {
      backend::copy(out.view(t.shape()), t);
      return out;
    }
    backend_for(t.device(), what).all_gather(work, AnyTensor(t), AnyTensor(out));
    work->wait(state_.timeout);
    return out;
  }

  /// Returns once every rank has called barrier().
  void barrier() {
    if (state_.world == 1) return;
    auto work = std::make_shared<Work>("barrier");
    work->group = &state_;
    check_usable(work->what());
    // MPI where the group has it; under torchrun a one-element all-reduce over NCCL.
    backend_for(has_mpi() ? Device::cpu(0) : default_device(), "barrier").barrier(work);
    work->wait(state_.timeout);
  }

  // ---- failure handling (Note [watchdog]) ----

  /// Marks the group unusable: later collectives throw, shutdown skips MPI_Finalize.
  void mark_broken(const std::string& why) { state_.mark_broken(why); }
  bool broken() const { return state_.broken(); }

  /// Leaves the group: meets the other ranks (within the timeout), stops the communication
  /// thread, frees the communicators and finalises MPI if chorus initialised it (also done at
  /// exit). Throws a chorus::Error when the leave was not clean (the group broken, a collective
  /// still in flight, or another rank not reaching the exit barrier within the timeout): MPI is
  /// then left unfinalised, so that the launcher ends the job with a failure (Note [watchdog]).
  /// A second call does nothing.
  void shutdown() {
    const auto why = leave();
    CHORUS_CHECK(why.empty(), "dist: shutdown on rank ", state_.rank, " failed: ", why,
                 "; MPI was not finalised, so that the launcher ends the job");
  }

#if CHORUS_DIST_MPI
  /// The private communicator (a duplicate of MPI_COMM_WORLD; null without MPI).
  MPI_Comm mpi_comm() const { return mpi_ ? mpi_->comm() : MPI_COMM_NULL; }
#endif

#if CHORUS_CUDA
  /// The stream NCCL collectives run on (null before the first one): for ordering one's own work
  /// before or after the group's.
  cudaStream_t nccl_stream() const { return nccl_ ? nccl_->stream() : nullptr; }
#endif

  void check_usable(const std::string& what) const {
    const auto broken = state_.broken_reason();
    CHORUS_CHECK(broken.empty(), "dist: ", what, " on rank ", state_.rank, ": the process group is broken (", broken,
                 ")");
    CHORUS_CHECK(!shut_down_, "dist: ", what, " after the process group was shut down");
  }

 private:
  /// shutdown() without the exception: why the leave was not clean (empty when it was, or when
  /// the group was left before).
  std::string leave() noexcept {
    if (shut_down_) return {};
    shut_down_ = true;
#if CHORUS_DIST_MPI
    if (!mpi_) return {};
    std::string why;
    try {
      why = mpi_->leave();
    } catch (const std::exception& e) {
      why = e.what();
    }
#if CHORUS_CUDA
    nccl_.reset();
#endif
    mpi_->finalize(why.empty());
    return why;
#else
    return {};
#endif
  }

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
  static std::chrono::milliseconds resolve_timeout(const Options& o) {
    std::chrono::milliseconds t = std::chrono::minutes(10);
    if (o.timeout) {
      t = *o.timeout;
      CHORUS_CHECK(t.count() > 0, "dist::init: timeout must be positive, got ", t.count(), " ms");
    } else if (!detail::env("CHORUS_DIST_TIMEOUT_S").empty()) {
      const int s = detail::env_int("CHORUS_DIST_TIMEOUT_S", 0);
      CHORUS_CHECK(s > 0, "dist::init: CHORUS_DIST_TIMEOUT_S must be a positive number of seconds, got ", s);
      t = std::chrono::seconds(s);
    }
    return t;
  }
  bool has_mpi() const {
#if CHORUS_DIST_MPI
    return mpi_ != nullptr;
#else
    return false;
#endif
  }

  /// The backend for a tensor on `device` (Note [process group backends]).
  detail::Backend& backend_for([[maybe_unused]] Device device, [[maybe_unused]] const std::string& what) {
#if CHORUS_CUDA
    if (device.is_cuda() || state_.launcher == Launcher::Torchrun) {
      if (!nccl_) {
        detail::Backend* bootstrap = nullptr;
#if CHORUS_DIST_MPI
        bootstrap = mpi_.get();
#endif
        CHORUS_CHECK(bootstrap || state_.launcher == Launcher::Torchrun,
                     "dist: no way to share an NCCL unique id (no MPI, no torchrun)");
        nccl_ = std::make_unique<detail::NcclBackend>(state_, state_.launcher == Launcher::Torchrun ? nullptr : bootstrap);
        state_.add_backend(nccl_.get());
      }
      return *nccl_;
    }
#endif
#if CHORUS_DIST_MPI
    CHORUS_CHECK(mpi_, "dist: ", what, ": CPU tensors need MPI, which this process group does not use");
    return *mpi_;
#else
    CHORUS_FAIL("dist: ", what, " has no transport for ", device);
#endif
  }

  void init_torchrun() {
    state_.rank = detail::env_int("RANK", 0);
    state_.world = detail::env_int("WORLD_SIZE", 1);
    state_.local_rank = detail::env_int("LOCAL_RANK", 0);
    state_.local_world = detail::env_int("LOCAL_WORLD_SIZE", 1);
    CHORUS_CHECK(state_.world >= 1 && state_.rank >= 0 && state_.rank < state_.world, "dist::init: torchrun's RANK=",
                 state_.rank, " and WORLD_SIZE=", state_.world, " are inconsistent");
    state_.launcher = Launcher::Torchrun;
#if CHORUS_CUDA
    if (state_.world == 1) return;
    if (detail::env("NCCL_COMM_ID").empty()) {
      const auto addr = detail::env("MASTER_ADDR"), port = detail::env("MASTER_PORT");
      CHORUS_CHECK(!addr.empty() && !port.empty(), "dist::init: torchrun's environment lacks MASTER_ADDR or "
                                                   "MASTER_PORT, and NCCL_COMM_ID is not set");
      const std::string id = addr + ":" + std::to_string(detail::env_int("MASTER_PORT", 0) + 1);
      ::setenv("NCCL_COMM_ID", id.c_str(), 0);
    }
#else
    CHORUS_CHECK(state_.world == 1, "dist::init: launched by torchrun with WORLD_SIZE=", state_.world,
                 ", which needs NCCL: build with nvcc (chorus::cuda), or launch with mpirun/srun in a build with "
                 "chorus::distributed (MPI)");
#endif
  }

  // Declared before the backends, destroyed after them: they refer to it.
  detail::GroupState state_;
  bool shut_down_ = false;
#if CHORUS_DIST_MPI
  std::unique_ptr<detail::MpiBackend> mpi_;
#endif
#if CHORUS_CUDA
  std::unique_ptr<detail::NcclBackend> nccl_;
#endif
};

namespace detail {
inline std::unique_ptr<ProcessGroup>& global_group() {
  static std::unique_ptr<ProcessGroup> g;  // destroyed at exit: shutdown() (Note [watchdog])
  return g;
}
}  // namespace detail

// Note [one process group]
// dist::init() makes the job's one group; later calls return it (DistributedDataParallel calls
// init() for a program that did not). A later init(options) whose options contradict the
// group's as in effect is an error naming both, not a silent no-op: the program would otherwise
// run with a timeout it did not ask for. Unset fields contradict nothing.

/// Joins the job's process group (Note [process group bootstrap], [one process group]). Every
/// rank calls it.
inline ProcessGroup& init(Options options = {}) {
  auto& g = detail::global_group();
  if (!g) {
    g = std::make_unique<ProcessGroup>(options);
    return *g;
  }
  if (options.timeout && *options.timeout != g->timeout())
    CHORUS_FAIL("dist::init: the process group already exists, with a timeout of ", g->timeout().count(),
                " ms; a second init() asks for ", options.timeout->count(),
                " ms. Call init() once with the options you want (or change it with group().set_timeout())");
  return *g;
}
inline bool is_initialized() { return detail::global_group() != nullptr; }
/// The group made by init().
inline ProcessGroup& group() {
  CHORUS_CHECK(is_initialized(), "dist: the process group is not initialised (call chorus::dist::init() first)");
  return *detail::global_group();
}
inline int rank() { return group().rank(); }
inline int world_size() { return group().world_size(); }
inline int local_rank() { return group().local_rank(); }
inline void barrier() { group().barrier(); }
template <class T>
void all_reduce(const Tensor<T>& t, ReduceOp op = ReduceOp::Sum) {
  group().all_reduce(t, op);
}
template <class T>
void broadcast(const Tensor<T>& t, int root = 0) {
  group().broadcast(t, root);
}
template <class T>
Tensor<T> all_gather(const Tensor<T>& t) {
  return group().all_gather(t);
}
/// Leaves the group (also done at exit). Call it before your own MPI_Finalize.
inline void shutdown() {
  if (auto& g = detail::global_group()) g->shutdown();
}

}  // namespace CHORUS_DIST_NS
}  // namespace dist
CHORUS_NAMESPACE_END
