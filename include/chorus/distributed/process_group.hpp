#pragma once
// The process group: one process per device, many processes, many machines.
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
//
// Note [communication thread]
// MPI's non-blocking collectives progress only while some thread calls into MPI. Every
// collective on CPU tensors is therefore queued to one communication thread, which starts the
// MPI_I* calls in queue order (the order every rank issued them in, which MPI requires) and
// then tests the requests in flight until they complete. The caller gets a Work to wait on;
// several collectives (gradient buckets) are in flight at once while the caller goes on.
//
// Note [watchdog]
// Work::wait() gives up after the group's timeout (Options::timeout, default 10 minutes like
// PyTorch's NCCL watchdog; CHORUS_DIST_TIMEOUT_S overrides it) with a chorus::Error naming the
// collective, and marks the group broken: a collective that never completes cannot be
// cancelled, so every later collective fails at once, and shutdown() skips MPI_Finalize (the
// launcher then ends the job with a non-zero status instead of hanging in its final fence).
// At exit, shutdown() first meets the other ranks in a barrier on a second private
// communicator; a rank that gets no answer within the timeout (the others are stuck in a
// collective that this rank left, say after an exception) also exits without MPI_Finalize.
#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "../core/any_tensor.hpp"
#include "../ops/ops.hpp"
#include "../core/runtime.hpp"
#include "../core/stream.hpp"
#include "../core/tensor.hpp"

#if defined(CHORUS_WITH_MPI) && CHORUS_WITH_MPI
// chorus uses MPI's C interface only (the deprecated C++ bindings need another library).
#ifndef OMPI_SKIP_MPICXX
#define OMPI_SKIP_MPICXX 1
#endif
#ifndef MPICH_SKIP_MPICXX
#define MPICH_SKIP_MPICXX 1
#endif
#include <mpi.h>
#define CHORUS_DIST_MPI 1
#else
#define CHORUS_DIST_MPI 0
#endif
#if CHORUS_CUDA
#include "../backend/cuda/nccl.cuh"
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

enum class ReduceOp { Sum, Avg };

inline const char* op_name(ReduceOp op) { return op == ReduceOp::Sum ? "sum" : "avg"; }

struct Options {
  /// How long a collective may take before it is declared stalled (Note [watchdog]).
  std::chrono::milliseconds timeout{std::chrono::minutes(10)};
};

/// How the job was launched.
enum class Launcher { None, Mpi, Torchrun };

class ProcessGroup;

/// A collective in flight. wait() returns once it completed (the result is then in the
/// tensors: CPU, or ordered before later work on the current stream for CUDA) or throws.
class Work {
 public:
  explicit Work(std::string what) : what_(std::move(what)), start_(std::chrono::steady_clock::now()) {}
  const std::string& what() const { return what_; }

  void wait(std::chrono::milliseconds timeout);
  bool completed() const {
    std::lock_guard<std::mutex> lk(m_);
    return done_;
  }

  // Called by the communication thread.
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
  ProcessGroup* group = nullptr;

 private:
  std::string what_;
  std::chrono::steady_clock::time_point start_;
  mutable std::mutex m_;
  std::condition_variable cv_;
  bool done_ = false;
  std::string error_;
};

namespace detail {
inline std::string env(const char* name) {
  const char* v = std::getenv(name);
  return v ? std::string(v) : std::string();
}
inline int env_int(const char* name, int fallback) {
  const auto v = env(name);
  if (v.empty()) return fallback;
  try {
    return std::stoi(v);
  } catch (...) {
    CHORUS_FAIL("dist: environment variable ", name, "='", v, "' is not an integer");
  }
}
inline bool mpi_launcher_present() {
  for (const char* v : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMI_RANK", "PMIX_RANK", "MPI_LOCALNRANKS"})
    if (std::getenv(v)) return true;
  return false;
}
inline bool torchrun_present() { return std::getenv("RANK") && std::getenv("WORLD_SIZE"); }

template <class T>
void divide_in_place(const Tensor<T>& t, std::int64_t n) {
  T* p = t.data();
  for (std::int64_t i = 0, e = t.numel(); i < e; ++i) p[i] /= static_cast<T>(n);
}

#if CHORUS_DIST_MPI
inline std::string mpi_error_string(int code) {
  char buf[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(code, buf, &len) != MPI_SUCCESS) return "MPI error " + std::to_string(code);
  return std::string(buf, static_cast<std::size_t>(len));
}
#define CHORUS_MPI_CHECK(expr)                                                                         \
  do {                                                                                                 \
    const int chorus_mpi_rc_ = (expr);                                                                 \
    if (chorus_mpi_rc_ != MPI_SUCCESS) [[unlikely]]                                                    \
      ::chorus::detail::throw_error("MPI error: ", ::chorus::dist::detail::mpi_error_string(chorus_mpi_rc_), \
                                    " in ", #expr);                                                    \
  } while (0)

inline MPI_Datatype mpi_type(DType d) {
  switch (d) {
    case DType::Float32: return MPI_FLOAT;
    case DType::Float64: return MPI_DOUBLE;
    case DType::Int64: return MPI_INT64_T;
  }
  return MPI_BYTE;
}

/// The communication thread (Note [communication thread]).
class CommThread {
 public:
  /// Starts the MPI call for one collective (on the communication thread) and returns its request.
  using Start = std::function<int(MPI_Request*)>;

  CommThread() : thread_([this] { run(); }) {}
  ~CommThread() { stop(); }
  CommThread(const CommThread&) = delete;
  CommThread& operator=(const CommThread&) = delete;

  void submit(Start start, std::shared_ptr<Work> work) {
    {
      std::lock_guard<std::mutex> lk(m_);
      queue_.push_back({std::move(start), std::move(work), MPI_REQUEST_NULL});
      ++outstanding_;
    }
    cv_.notify_one();
  }
  /// Collectives queued or in flight.
  std::size_t pending() const {
    std::lock_guard<std::mutex> lk(m_);
    return outstanding_;
  }
  void stop() {
    {
      std::lock_guard<std::mutex> lk(m_);
      if (stopped_) return;
      stopped_ = true;
    }
    cv_.notify_one();
    thread_.join();
  }

 private:
  struct Op {
    Start start;
    std::shared_ptr<Work> work;
    MPI_Request request;
  };

  void run() {
    std::vector<Op> active;
    int idle_polls = 0;
    for (;;) {
      std::deque<Op> fresh;
      {
        std::unique_lock<std::mutex> lk(m_);
        if (active.empty()) cv_.wait(lk, [&] { return stopped_ || !queue_.empty(); });
        if (stopped_) return;  // requests still in flight are abandoned (Note [watchdog])
        fresh.swap(queue_);
      }
      for (auto& op : fresh) {
        const int rc = op.start(&op.request);
        if (rc != MPI_SUCCESS) {
          complete(op, "MPI error: " + mpi_error_string(rc));
          continue;
        }
        active.push_back(std::move(op));
      }
      bool progressed = false;
      for (std::size_t i = 0; i < active.size();) {
        int flag = 0;
        const int rc = MPI_Test(&active[i].request, &flag, MPI_STATUS_IGNORE);
        if (rc != MPI_SUCCESS || flag) {
          std::string err;
          if (rc != MPI_SUCCESS) err = "MPI error: " + mpi_error_string(rc);
          else if (active[i].work->on_done) active[i].work->on_done();
          complete(active[i], std::move(err));
          active.erase(active.begin() + static_cast<std::ptrdiff_t>(i));
          progressed = true;
        } else {
          ++i;
        }
      }
      // Poll quickly while things move, then back off (up to 200 us) so that a rank waiting
      // for a slow peer leaves the cores to the computation (Note [communication thread]).
      idle_polls = progressed ? 0 : idle_polls + 1;
      if (!active.empty()) {
        if (idle_polls < 16) std::this_thread::yield();
        else std::this_thread::sleep_for(std::chrono::microseconds(std::min(200, 5 * (idle_polls - 15))));
      }
    }
  }

  void complete(Op& op, std::string error) {
    {
      std::lock_guard<std::mutex> lk(m_);
      --outstanding_;
    }
    op.work->finish(std::move(error));
  }

  mutable std::mutex m_;
  std::condition_variable cv_;
  std::deque<Op> queue_;
  std::size_t outstanding_ = 0;  // submitted, not yet finished
  bool stopped_ = false;
  std::thread thread_;
};
#endif  // CHORUS_DIST_MPI

#if CHORUS_CUDA
/// One NCCL communicator over the whole group for this process's GPU, on a dedicated stream,
/// created non-blocking so that a stalled collective can be aborted (Note [watchdog]).
class NcclGroup {
 public:
  NcclGroup(const ncclUniqueId& id, int rank, int world, int device, std::chrono::milliseconds timeout)
      : device_(device) {
    ::chorus::cuda::DeviceGuard g(device_);
    CHORUS_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    const ncclResult_t rc = ncclCommInitRankConfig(&comm_, world, id, rank, &config);
    if (rc != ncclSuccess && rc != ncclInProgress) {
      (void)cudaStreamDestroy(stream_);
      CHORUS_FAIL("NCCL error: ", ncclGetErrorString(rc), " in ncclCommInitRankConfig (rank ", rank, " of ", world,
                  " on cuda:", device, ")");
    }
    settle("ncclCommInitRank", timeout);
  }
  ~NcclGroup() {
    if (comm_) (void)(aborted_ ? ncclSuccess : ncclCommFinalize(comm_)), (void)ncclCommDestroy(comm_);
    if (stream_) (void)cudaStreamDestroy(stream_);
  }
  NcclGroup(const NcclGroup&) = delete;
  NcclGroup& operator=(const NcclGroup&) = delete;

  int device() const { return device_; }
  cudaStream_t stream() const { return stream_; }
  ncclComm_t comm() const { return comm_; }

  /// Waits (host side) until the communicator has no operation in progress.
  void settle(const char* what, std::chrono::milliseconds timeout) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    for (;;) {
      ncclResult_t state = ncclSuccess;
      CHORUS_NCCL_CHECK(ncclCommGetAsyncError(comm_, &state));
      if (state == ncclSuccess) return;
      if (state != ncclInProgress) CHORUS_FAIL("NCCL error in ", what, ": ", ncclGetErrorString(state));
      if (std::chrono::steady_clock::now() > deadline) {
        abort();
        CHORUS_FAIL("dist: ", what, " did not complete within ", timeout.count(), " ms (NCCL communicator aborted)");
      }
      std::this_thread::yield();
    }
  }
  /// The communicator's asynchronous error, if any (ncclInProgress counts as none).
  std::string async_error() const {
    ncclResult_t state = ncclSuccess;
    if (ncclCommGetAsyncError(comm_, &state) != ncclSuccess) return "ncclCommGetAsyncError failed";
    return state == ncclSuccess || state == ncclInProgress ? std::string() : ncclGetErrorString(state);
  }
  void abort() {
    if (!aborted_ && comm_) (void)ncclCommAbort(comm_), comm_ = nullptr;
    aborted_ = true;
  }

 private:
  int device_;
  cudaStream_t stream_ = nullptr;
  ncclComm_t comm_ = nullptr;
  bool aborted_ = false;
};
#endif
}  // namespace detail

/// The group of all processes of the job (see Note [process group bootstrap]).
class ProcessGroup {
 public:
  explicit ProcessGroup(Options options = {}) : options_(options) {
    const int t = detail::env_int("CHORUS_DIST_TIMEOUT_S", -1);
    if (t > 0) options_.timeout = std::chrono::seconds(t);
    CHORUS_CHECK(options_.timeout.count() > 0, "dist::init: timeout must be positive, got ", options_.timeout.count(),
                 " ms");
#if CHORUS_DIST_MPI
    if (!(detail::torchrun_present() && !detail::mpi_launcher_present())) {
      init_mpi();
      return;
    }
#endif
    if (detail::torchrun_present()) {
      init_torchrun();
      return;
    }
    // World of 1, nothing to talk to.
  }

  ~ProcessGroup() { shutdown(); }
  ProcessGroup(const ProcessGroup&) = delete;
  ProcessGroup& operator=(const ProcessGroup&) = delete;

  int rank() const { return rank_; }
  int world_size() const { return world_; }
  int local_rank() const { return local_rank_; }
  int local_world_size() const { return local_world_; }
  Launcher launcher() const { return launcher_; }
  /// "mpi", "nccl" (torchrun) or "local" (a world of 1 without MPI).
  std::string backend() const {
    return launcher_ == Launcher::Torchrun ? "nccl" : (mpi_ ? "mpi" : "local");
  }
  std::chrono::milliseconds timeout() const { return options_.timeout; }
  void set_timeout(std::chrono::milliseconds t) {
    CHORUS_CHECK(t.count() > 0, "dist: timeout must be positive");
    options_.timeout = t;
  }

  /// The device this process should use: cuda:local_rank when there are GPUs, else cpu:0.
  Device default_device() const {
    const auto devs = available_devices();
    if (!devs.empty() && devs[0].is_cuda()) {
      const int n = static_cast<int>(devs.size());
      return Device::cuda(local_rank_ % n);
    }
    return Device::cpu(0);
  }

  // ---- collectives (every rank calls them in the same order) ----

  /// t = the sum (or mean) of t over all ranks, in place. t must be contiguous.
  template <class T>
  std::shared_ptr<Work> all_reduce_async(const Tensor<T>& t, ReduceOp op = ReduceOp::Sum, std::string what = {}) {
    if (what.empty()) what = std::string("all_reduce(") + op_name(op) + ")";
    check_tensor(t, what);
    auto work = make_work(what, t);
    if (local_only(t)) return done(work);
#if CHORUS_CUDA
    if (t.device().is_cuda() || launcher_ == Launcher::Torchrun) {
      return nccl_collective(work, t, [&](const Tensor<T>& d, detail::NcclGroup& g) {
        return ncclAllReduce(d.data(), d.data(), static_cast<std::size_t>(d.numel()),
                             backend::cuda::nccl_type(dtype_of<T>()), op == ReduceOp::Sum ? ncclSum : ncclAvg,
                             g.comm(), g.stream());
      });
    }
#endif
#if CHORUS_DIST_MPI
    const int world = world_;
    if (op == ReduceOp::Avg) work->on_done = [t, world] { detail::divide_in_place(t, world); };
    return mpi_collective(work, [t, comm = comm_](MPI_Request* r) {
      return MPI_Iallreduce(MPI_IN_PLACE, t.data(), static_cast<int>(t.numel()), detail::mpi_type(dtype_of<T>()),
                            MPI_SUM, comm, r);
    });
#endif
    CHORUS_FAIL("dist: ", what, " has no transport for ", t.device());
  }
  template <class T>
  void all_reduce(const Tensor<T>& t, ReduceOp op = ReduceOp::Sum) {
    all_reduce_async(t, op)->wait(options_.timeout);
  }

  /// t = rank root's t, in place.
  template <class T>
  std::shared_ptr<Work> broadcast_async(const Tensor<T>& t, int root = 0, std::string what = {}) {
    if (what.empty()) what = "broadcast(root " + std::to_string(root) + ")";
    CHORUS_CHECK(root >= 0 && root < world_, "dist: ", what, ": root ", root, " is not a rank of a world of ", world_);
    check_tensor(t, what);
    auto work = make_work(what, t);
    if (local_only(t)) return done(work);
#if CHORUS_CUDA
    if (t.device().is_cuda() || launcher_ == Launcher::Torchrun) {
      return nccl_collective(work, t, [&](const Tensor<T>& d, detail::NcclGroup& g) {
        return ncclBroadcast(d.data(), d.data(), static_cast<std::size_t>(d.numel()),
                             backend::cuda::nccl_type(dtype_of<T>()), root, g.comm(), g.stream());
      });
    }
#endif
#if CHORUS_DIST_MPI
    return mpi_collective(work, [t, root, comm = comm_](MPI_Request* r) {
      return MPI_Ibcast(t.data(), static_cast<int>(t.numel()), detail::mpi_type(dtype_of<T>()), root, comm, r);
    });
#endif
    CHORUS_FAIL("dist: ", what, " has no transport for ", t.device());
  }
  template <class T>
  void broadcast(const Tensor<T>& t, int root = 0) {
    broadcast_async(t, root)->wait(options_.timeout);
  }
  void broadcast(const AnyTensor& t, int root = 0) {
    t.visit([&](const auto& x) { broadcast(x, root); });
  }

  /// [world_size, *t.shape()]: every rank's t, in rank order.
  template <class T>
  Tensor<T> all_gather(const Tensor<T>& t) {
    const std::string what = "all_gather";
    check_tensor(t, what);
    std::vector<std::int64_t> dims{world_};
    for (auto s : t.shape()) dims.push_back(s);
    auto out = Tensor<T>::empty(Shape(dims), t.device());
    auto work = make_work(what, t);
    work->keep.push_back(AnyTensor(out));
    if (local_only(t)) {
      backend::copy(out.view(t.shape()), t);
      return out;
    }
#if CHORUS_CUDA
    if (t.device().is_cuda() || launcher_ == Launcher::Torchrun) {
      auto gathered = nccl_collective_out(work, t, out, [&](const Tensor<T>& in, const Tensor<T>& o,
                                                             detail::NcclGroup& g) {
        return ncclAllGather(in.data(), o.data(), static_cast<std::size_t>(in.numel()),
                             backend::cuda::nccl_type(dtype_of<T>()), g.comm(), g.stream());
      });
      work->wait(options_.timeout);
      return gathered;
    }
#endif
#if CHORUS_DIST_MPI
    const int n = static_cast<int>(t.numel());
    mpi_collective(work, [t, out, n, comm = comm_](MPI_Request* r) {
      return MPI_Iallgather(t.data(), n, detail::mpi_type(dtype_of<T>()), out.data(), n,
                            detail::mpi_type(dtype_of<T>()), comm, r);
    })->wait(options_.timeout);
    return out;
#endif
    CHORUS_FAIL("dist: ", what, " has no transport for ", t.device());
  }

  /// Returns once every rank has called barrier().
  void barrier() {
    if (world_ == 1) return;
    auto work = std::make_shared<Work>("barrier");
    work->group = this;
    check_usable(work->what());
#if CHORUS_DIST_MPI
    if (mpi_) {
      mpi_collective(work, [comm = comm_](MPI_Request* r) { return MPI_Ibarrier(comm, r); })->wait(options_.timeout);
      return;
    }
#endif
    // torchrun: a one-element all-reduce is a barrier.
    auto one = Tensor<float>::empty(Shape{1}, default_device());
    backend::fill(one, 1.0f);
    all_reduce_async(one, ReduceOp::Sum, "barrier")->wait(options_.timeout);
  }

  // ---- failure handling (Note [watchdog]) ----

  /// Marks the group unusable: later collectives throw, shutdown skips MPI_Finalize.
  void mark_broken(const std::string& why) {
    std::lock_guard<std::mutex> lk(m_);
    if (broken_.empty()) broken_ = why;
#if CHORUS_CUDA
    if (nccl_) nccl_->abort();
#endif
  }
  bool broken() const {
    std::lock_guard<std::mutex> lk(m_);
    return !broken_.empty();
  }

  /// Leaves the group: meets the other ranks (within the timeout), stops the communication
  /// thread, frees the communicators and finalises MPI if chorus initialised it. Called at exit.
  void shutdown() {
    if (shut_down_) return;
    shut_down_ = true;
#if CHORUS_DIST_MPI
    if (!mpi_) return;
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (finalized) {  // the program finalised MPI itself (it should have called dist::shutdown() first)
      comm_thread_->stop();
      return;
    }
    bool clean = !broken() && comm_thread_->pending() == 0;
    if (clean && world_ > 1) {
      // Note [watchdog]: a barrier on a communicator nothing else uses, so that it cannot be
      // confused with a collective some other rank is still stuck in.
      auto work = std::make_shared<Work>("shutdown barrier");
      work->group = this;
      comm_thread_->submit([comm = exit_comm_](MPI_Request* r) { return MPI_Ibarrier(comm, r); }, work);
      try {
        work->wait(options_.timeout);
      } catch (const Error&) {
        clean = false;
      }
    }
    comm_thread_->stop();
#if CHORUS_CUDA
    nccl_.reset();
#endif
    if (!clean) return;  // no MPI_Finalize: the launcher ends the job (Note [watchdog])
    (void)MPI_Comm_free(&comm_);
    (void)MPI_Comm_free(&exit_comm_);
    if (owns_mpi_) MPI_Finalize();
#endif
  }

#if CHORUS_DIST_MPI
  /// The private communicator (a duplicate of MPI_COMM_WORLD; null without MPI).
  MPI_Comm mpi_comm() const { return comm_; }
#endif

  void check_usable(const std::string& what) const {
    std::lock_guard<std::mutex> lk(m_);
    CHORUS_CHECK(broken_.empty(), "dist: ", what, " on rank ", rank_, ": the process group is broken (", broken_,
                 ")");
    CHORUS_CHECK(!shut_down_, "dist: ", what, " after the process group was shut down");
  }

 private:
  template <class T>
  void check_tensor(const Tensor<T>& t, const std::string& what) const {
    check_usable(what);
    CHORUS_CHECK(t.defined(), "dist: ", what, " of an undefined tensor");
    CHORUS_CHECK(t.is_contiguous(), "dist: ", what, " needs a contiguous tensor, got shape ", t.shape(),
                 " with strides ", Shape(std::vector<std::int64_t>(t.strides().begin(), t.strides().end())));
    CHORUS_CHECK(t.numel() <= std::int64_t{1} << 31, "dist: ", what, " of ", t.numel(),
                 " elements: more than 2^31 per call is not supported");
  }
  template <class T>
  std::shared_ptr<Work> make_work(const std::string& what, const Tensor<T>& t) {
    auto w = std::make_shared<Work>(what + " of " + std::to_string(t.numel() * sizeof(T)) + " bytes on rank " +
                                    std::to_string(rank_) + " of " + std::to_string(world_));
    w->group = this;
    w->keep.push_back(AnyTensor(t));
    return w;
  }
  /// A world of 1 needs no communication; but CUDA tensors under a launcher still go through
  /// NCCL (a one-rank communicator), so that a one-GPU job runs the same path as a large one.
  template <class T>
  bool local_only(const Tensor<T>& t) const {
    return world_ == 1 && !(t.device().is_cuda() && launcher_ != Launcher::None);
  }
  static std::shared_ptr<Work> done(std::shared_ptr<Work> w) {
    w->finish();
    return w;
  }

#if CHORUS_DIST_MPI
  void init_mpi() {
    int initialized = 0;
    CHORUS_MPI_CHECK(MPI_Initialized(&initialized));
    int provided = 0;
    if (!initialized) {
      CHORUS_MPI_CHECK(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided));
      owns_mpi_ = true;
    } else {
      CHORUS_MPI_CHECK(MPI_Query_thread(&provided));
    }
    // The communication thread calls MPI while the user's threads may too.
    CHORUS_CHECK(provided >= MPI_THREAD_MULTIPLE, "dist::init: MPI provides thread level ", provided,
                 " but chorus needs MPI_THREAD_MULTIPLE (", MPI_THREAD_MULTIPLE,
                 "); initialise MPI with MPI_Init_thread(..., MPI_THREAD_MULTIPLE, ...)");
    CHORUS_MPI_CHECK(MPI_Comm_dup(MPI_COMM_WORLD, &comm_));
    CHORUS_MPI_CHECK(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN));
    CHORUS_MPI_CHECK(MPI_Comm_dup(comm_, &exit_comm_));
    CHORUS_MPI_CHECK(MPI_Comm_rank(comm_, &rank_));
    CHORUS_MPI_CHECK(MPI_Comm_size(comm_, &world_));
    MPI_Comm local;
    CHORUS_MPI_CHECK(MPI_Comm_split_type(comm_, MPI_COMM_TYPE_SHARED, rank_, MPI_INFO_NULL, &local));
    CHORUS_MPI_CHECK(MPI_Comm_rank(local, &local_rank_));
    CHORUS_MPI_CHECK(MPI_Comm_size(local, &local_world_));
    CHORUS_MPI_CHECK(MPI_Comm_free(&local));
    mpi_ = true;
    launcher_ = world_ > 1 || detail::mpi_launcher_present() ? Launcher::Mpi : Launcher::None;
    comm_thread_ = std::make_unique<detail::CommThread>();
  }

  std::shared_ptr<Work> mpi_collective(std::shared_ptr<Work> work, detail::CommThread::Start start) {
    CHORUS_CHECK(mpi_, "dist: ", work->what(), ": CPU tensors need MPI, which this process group does not use");
    // The tensor's pending work (a CPU device's worker) finishes before MPI reads it.
    for (auto& k : work->keep) {
      Event e;
      e.record(current_stream(k.device()));
      e.synchronize();
    }
    comm_thread_->submit(std::move(start), work);
    return work;
  }
#endif

  void init_torchrun() {
    rank_ = detail::env_int("RANK", 0);
    world_ = detail::env_int("WORLD_SIZE", 1);
    local_rank_ = detail::env_int("LOCAL_RANK", 0);
    local_world_ = detail::env_int("LOCAL_WORLD_SIZE", 1);
    CHORUS_CHECK(world_ >= 1 && rank_ >= 0 && rank_ < world_, "dist::init: torchrun's RANK=", rank_,
                 " and WORLD_SIZE=", world_, " are inconsistent");
    launcher_ = Launcher::Torchrun;
#if CHORUS_CUDA
    if (world_ == 1) return;
    if (detail::env("NCCL_COMM_ID").empty()) {
      const auto addr = detail::env("MASTER_ADDR"), port = detail::env("MASTER_PORT");
      CHORUS_CHECK(!addr.empty() && !port.empty(), "dist::init: torchrun's environment lacks MASTER_ADDR or "
                                                   "MASTER_PORT, and NCCL_COMM_ID is not set");
      const std::string id = addr + ":" + std::to_string(detail::env_int("MASTER_PORT", 0) + 1);
      ::setenv("NCCL_COMM_ID", id.c_str(), 0);
    }
#else
    CHORUS_CHECK(world_ == 1, "dist::init: launched by torchrun with WORLD_SIZE=", world_,
                 ", which needs NCCL: build with nvcc (chorus::cuda), or launch with mpirun/srun in a build with "
                 "chorus::distributed (MPI)");
#endif
  }

#if CHORUS_CUDA
  /// The NCCL communicator for `device` (made by the first CUDA collective, on every rank).
  detail::NcclGroup& nccl(Device device) {
    CHORUS_CHECK(device.is_cuda(), "dist: NCCL needs a CUDA device, got ", device);
    if (nccl_) {
      CHORUS_CHECK(nccl_->device() == device.index, "dist: this process already talks to the group from cuda:",
                   nccl_->device(), "; one device per process (got a tensor on ", device, ")");
      return *nccl_;
    }
    ncclUniqueId id;
    if (launcher_ == Launcher::Torchrun) {
      // With NCCL_COMM_ID set, every rank gets the same id: the root's address.
      CHORUS_NCCL_CHECK(ncclGetUniqueId(&id));
    } else {
#if CHORUS_DIST_MPI
      if (rank_ == 0) CHORUS_NCCL_CHECK(ncclGetUniqueId(&id));
      auto bytes = Tensor<std::int64_t>::empty(Shape{(sizeof(id) + 7) / 8}, Device::cpu(0));
      std::memcpy(bytes.data(), &id, sizeof(id));
      broadcast_async(bytes, 0, "broadcast of the NCCL unique id")->wait(options_.timeout);
      std::memcpy(&id, bytes.data(), sizeof(id));
#else
      CHORUS_FAIL("dist: no way to share an NCCL unique id (no MPI, no torchrun)");
#endif
    }
    nccl_ = std::make_unique<detail::NcclGroup>(id, rank_, world_, device.index, options_.timeout);
    return *nccl_;
  }

  template <class T, class Issue>
  std::shared_ptr<Work> nccl_collective(std::shared_ptr<Work> work, const Tensor<T>& t, Issue&& issue) {
    nccl_collective_out(work, t, t, [&](const Tensor<T>& in, const Tensor<T>&, detail::NcclGroup& g) {
      return issue(in, g);
    });
    return work;
  }

  /// Runs an NCCL collective on the group's stream after the tensors' current streams, staging
  /// CPU tensors through the GPU (torchrun); returns `out` (for CPU tensors, filled by
  /// Work::wait). Work::wait watches the collective's completion event against the timeout
  /// (Note [watchdog]) and orders the current stream after it.
  template <class T, class Issue>
  Tensor<T> nccl_collective_out(std::shared_ptr<Work> work, const Tensor<T>& in, const Tensor<T>& out,
                                Issue&& issue) {
    const bool staged = !in.device().is_cuda();
    const Device dev = staged ? default_device() : in.device();
    auto& g = nccl(dev);
    Tensor<T> din = staged ? in.to(dev) : in;
    Tensor<T> dout = staged ? (is_same(in, out) ? din : Tensor<T>::empty(out.shape(), dev)) : out;
    ::chorus::cuda::DeviceGuard guard(g.device());
    Stream* cur = &current_stream(dev);
    cudaEvent_t ready = nullptr, finished = nullptr;
    CHORUS_CUDA_CHECK(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming));
    CHORUS_CUDA_CHECK(cudaEventCreateWithFlags(&finished, cudaEventDisableTiming));
    CHORUS_CUDA_CHECK(cudaEventRecord(ready, cur->handle()));
    CHORUS_CUDA_CHECK(cudaStreamWaitEvent(g.stream(), ready, 0));
    (void)cudaEventDestroy(ready);
    const ncclResult_t rc = issue(din, dout, g);
    if (rc != ncclSuccess && rc != ncclInProgress) {
      (void)cudaEventDestroy(finished);
      mark_broken(work->what() + ": " + ncclGetErrorString(rc));
      CHORUS_FAIL("NCCL error in ", work->what(), ": ", ncclGetErrorString(rc));
    }
    g.settle(work->what().c_str(), options_.timeout);  // non-blocking communicator: enqueued
    CHORUS_CUDA_CHECK(cudaEventRecord(finished, g.stream()));
    record_stream(din.data(), dev, *cur);
    if (!is_same(din, dout)) record_stream(dout.data(), dev, *cur);
    work->keep.push_back(AnyTensor(din));
    work->keep.push_back(AnyTensor(dout));
    const std::string what = work->what();
    work->on_wait = [this, finished, cur, dout, out, staged, what](std::chrono::steady_clock::time_point deadline) {
      for (;;) {
        const cudaError_t q = cudaEventQuery(finished);
        if (q == cudaSuccess) break;
        if (q != cudaErrorNotReady) CHORUS_CUDA_CHECK(q);
        const auto err = nccl_ ? nccl_->async_error() : std::string();
        if (!err.empty() || std::chrono::steady_clock::now() > deadline) {
          mark_broken(what + (err.empty() ? " timed out" : ": " + err));
          CHORUS_FAIL("dist: ", what, err.empty() ? " did not complete within the timeout" : " failed: " + err,
                      " (NCCL communicator aborted; the process group is now broken)");
        }
        std::this_thread::yield();
      }
      CHORUS_CUDA_CHECK(cudaStreamWaitEvent(cur->handle(), finished, 0));
      (void)cudaEventDestroy(finished);
      if (staged) backend::copy(out, dout.to(out.device()));
    };
    work->finish();
    return out;
  }
#endif

  Options options_;
  int rank_ = 0, world_ = 1, local_rank_ = 0, local_world_ = 1;
  Launcher launcher_ = Launcher::None;
  bool mpi_ = false;
  bool owns_mpi_ = false;
  bool shut_down_ = false;
  mutable std::mutex m_;
  std::string broken_;
#if CHORUS_DIST_MPI
  MPI_Comm comm_ = MPI_COMM_NULL;
  MPI_Comm exit_comm_ = MPI_COMM_NULL;
  std::unique_ptr<detail::CommThread> comm_thread_;
#endif
#if CHORUS_CUDA
  std::unique_ptr<detail::NcclGroup> nccl_;
#endif
};

inline void Work::wait(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lk(m_);
  const auto deadline = start_ + timeout;
  if (!cv_.wait_until(lk, deadline, [this] { return done_; })) {
    lk.unlock();
    std::ostringstream msg;
    msg << "dist: " << what_ << " did not complete within " << std::chrono::duration<double>(timeout).count()
        << " s (a rank stopped participating?); the process group is now broken";
    if (group) group->mark_broken(what_ + " timed out");
    CHORUS_FAIL(msg.str());
  }
  if (!error_.empty()) {
    lk.unlock();
    if (group) group->mark_broken(what_ + ": " + error_);
    CHORUS_FAIL("dist: ", what_, " failed: ", error_);
  }
  auto f = std::move(on_wait);
  on_wait = nullptr;
  lk.unlock();
  if (f) f(deadline);
}

namespace detail {
inline std::unique_ptr<ProcessGroup>& global_group() {
  static std::unique_ptr<ProcessGroup> g;  // destroyed at exit: shutdown() (Note [watchdog])
  return g;
}
}  // namespace detail

/// Joins the job's process group (Note [process group bootstrap]); later calls return the same
/// group. Every rank calls it.
inline ProcessGroup& init(Options options = {}) {
  auto& g = detail::global_group();
  if (!g) g = std::make_unique<ProcessGroup>(options);
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
