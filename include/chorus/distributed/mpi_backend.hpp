#pragma once
// The MPI backend of the process group (Note [process group backends]): CPU tensors, through
// MPI's non-blocking collectives on a private communicator. Empty without MPI.
//
// Note [communication thread]
// MPI's non-blocking collectives progress only while some thread calls into MPI. Every
// collective on CPU tensors is therefore queued to one communication thread, which starts the
// MPI_I* calls in queue order (the order every rank issued them in, which MPI requires) and
// then tests the requests in flight until they complete. The caller gets a Work to wait on;
// several collectives (gradient buckets) are in flight at once while the caller goes on.
//
// Note [leaving notice]
// A rank that leaves the group (dist::shutdown(), or the group's destructor at exit, also after
// an exception the program caught) first tells every other rank so, on the exit communicator: a
// point-to-point message carrying how many collectives it completed and whether it will meet the
// others at the exit barrier (a clean leave) or not (a broken group, collectives in flight).
// Each rank's communication thread keeps a receive posted for these notices and tests it with
// its requests. A collective numbered at or past a leaver's count can never complete: it fails
// at once, naming the rank that left, instead of waiting for the timeout (a rank that threw
// between two steps no longer holds the others for ten minutes), and a collective issued later
// fails without starting. A notice of a leave that skips the barrier also fails a rank waiting
// in the exit barrier. A clean shutdown of every rank sends and receives all the notices before
// the communicators are freed, and changes nothing else: every count is past every collective.
#include "../compiled.hpp"
#include "../core/profiler.hpp"
#include "backend.hpp"

#if CHORUS_DIST_MPI
#include <stdlib.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <optional>
#include <thread>

#include "../core/stream.hpp"

// chorus uses MPI's C interface only (the deprecated C++ bindings need another library).
#ifndef OMPI_SKIP_MPICXX
#define OMPI_SKIP_MPICXX 1
#endif
#ifndef MPICH_SKIP_MPICXX
#define MPICH_SKIP_MPICXX 1
#endif
#include <mpi.h>

CHORUS_NAMESPACE_BEGIN
namespace dist {
inline namespace CHORUS_DIST_NS {
namespace detail {

CHORUS_INLINE std::string mpi_error_string(int code);
#define CHORUS_MPI_CHECK(expr)                                                                         \
  do {                                                                                                 \
    const int chorus_mpi_rc_ = (expr);                                                                 \
    if (chorus_mpi_rc_ != MPI_SUCCESS) [[unlikely]]                                                    \
      ::chorus::detail::throw_error("MPI error: ", ::chorus::dist::detail::mpi_error_string(chorus_mpi_rc_), \
                                    " in ", #expr);                                                    \
  } while (0)

/// The MPI type of `d`'s elements: 16-bit floating elements move as uint16 (exact), and are
/// summed by the backend's own operations (Note [16-bit sums over MPI]).
CHORUS_INLINE MPI_Datatype mpi_type(DType d);

// Note [16-bit sums over MPI]
// MPI has no 16-bit floating types, and MPI_SUM over the raw uint16 bits would be wrong. The
// backend creates one user operation per 16-bit type: it adds each pair in float and rounds
// once, so a reduction over w ranks rounds w - 1 times, as NCCL's 16-bit sums do (to sum in
// float throughout, reduce a float32 copy). Commutative, so MPI may reduce in any order.
template <class T>
void sum_16bit(void* in, void* inout, int* len, MPI_Datatype*) {
  const T* a = static_cast<const T*>(in);
  T* b = static_cast<T*>(inout);
  for (int i = 0; i < *len; ++i) b[i] = T(static_cast<float>(a[i]) + static_cast<float>(b[i]));
}

// Note [ring all-reduce]
// Gradient buckets are all-reduced with MPI_Iallreduce in place. With Open MPI 4.1's default
// choice in its non-blocking collectives (coll/libnbc), on this project's 2-core machine with 2
// ranks, a 16.8 MB float32 all-reduce (mlp-medium's gradients) took 14.2 ms, as long as its
// binomial tree (14.8 ms); the ring took 5.5 ms (rabenseifner 6.5 ms, recursive doubling 9.9 ms;
// medians of 12 calls each; with 3 ranks 16 ms against 21 ms): a ring moves and sums each
// element once per rank, a tree the whole buffer per level. Before initialising MPI itself,
// chorus therefore asks Open MPI for the ring through its environment
// (OMPI_MCA_coll_libnbc_iallreduce_algorithm: 1 ring, 2 binomial, 3 rabenseifner, 4 recursive
// doubling), except:
// - when the variable is already set: the user's choice stands (a choice made only in a site's
//   mca-params.conf does not: the environment outranks that file);
// - before Open MPI 4.0.7 and 4.1.2, whose ring gave wrong sums in place from 4 ranks on
//   (open-mpi/ompi#9385, fixed in October 2021);
// - under another MPI (the variable would mean nothing), or when the program initialised MPI
//   before chorus (it can set the variable itself, or pass mpirun --mca).
// The ring's cost is latency: 2(p - 1) steps against a tree's ~2 log p, which shows only for
// small all-reduces on many ranks, not for gradient buckets.

/// The Open MPI release running (major, minor, release), or nothing under another MPI.
/// MPI_Get_library_version may be called before MPI_Init.
CHORUS_INLINE std::optional<std::array<int, 3>> open_mpi_version();
/// Whether that release's ring all-reduce is right in place (Note [ring all-reduce]).
CHORUS_INLINE bool ring_allreduce_in_place_fixed(const std::array<int, 3>& v);
/// What chorus chose for Open MPI's non-blocking all-reduce, and why (Note [ring all-reduce]):
/// "ring", or the reason it left the choice alone; empty until chorus initialises MPI.
CHORUS_INLINE std::string& iallreduce_choice();
CHORUS_INLINE std::string choose_iallreduce_algorithm();

/// The tag of the leaving notices on the exit communicator (Note [leaving notice]).
inline constexpr int kLeaveTag = 7301;

/// The communication thread (Note [communication thread], [leaving notice]).
class CommThread {
 public:
  /// Starts the MPI call for one collective (on the communication thread) and returns its request.
  using Start = std::function<int(MPI_Request*)>;

  /// `exit_comm`: where the leaving notices of the `world` ranks arrive.
  CommThread(MPI_Comm exit_comm, int world);
  ~CommThread();
  CommThread(const CommThread&) = delete;
  CommThread& operator=(const CommThread&) = delete;

  /// Queues a collective of the group (`counted`: numbered, as the other ranks number theirs;
  /// the exit barrier is not).
  void submit(Start start, std::shared_ptr<Work> work, bool counted = true);
  /// Collectives queued or in flight.
  std::size_t pending() const {
    std::lock_guard<std::mutex> lk(m_);
    return outstanding_;
  }
  /// Numbered collectives that finished (completed or failed): what a leaving notice carries.
  std::int64_t finished() const {
    std::lock_guard<std::mutex> lk(m_);
    return finished_;
  }
  /// Waits until every other rank's leaving notice arrived; false at `deadline`.
  bool wait_for_notices(std::chrono::steady_clock::time_point deadline);
  void stop();

 private:
  struct Op {
    Start start;
    std::shared_ptr<Work> work;
    MPI_Request request;
    std::int64_t seq;  // its number among the group's collectives; -1: the exit barrier
    std::int64_t started_ns = -1;  // when it started, while a profiler recorded (-1: not recorded)
    std::int64_t step = 0;         // the profiler's step then
    int lane = -1;                 // the profiler track it is drawn on (one per collective in flight)
  };

  /// A rank that said it is leaving (Note [leaving notice]).
  struct Left {
    int rank = -1;
    std::int64_t finished = 0;
    bool clean = true;
  };

  void post_notice_receive();
  void poll_notices();
  /// Why `op` can never complete because a rank left (empty: it still can).
  std::string orphaned(const Op& op) const;

  void run();

  // Note [polling collectives]
  // An MPI collective in flight moves only inside MPI calls: each MPI_Test runs the next steps
  // of its schedule (libnbc's rounds, the shared-memory transport's fragments and single-copy
  // reads), so a gap between two polls is a gap in the transfer. The first version backed off
  // to sleeps of up to 200 us after 16 idle polls; in mlp-medium's DDP step on 2 ranks (2 cores)
  // the two buckets' all-reduces (16.8 MB, 7.4 ms alone) then added 20 ms to the step (96 ms,
  // 76 ms under no_sync). Polling with sched_yield between tests made it 83-89 ms: a yield still
  // lets the computation threads of the same core run. The sleeps stay for a collective that has
  // not completed for kSpin while this process still computes (a peer still computing its step,
  // or one that hangs), so that the computation keeps the cores. While a thread of this process
  // waits for a collective (Work::wait), the polls only yield: a 64 MB reduce (MPI_Ireduce, mlp-
  // large's layer, ZeRO-2) moves one fragment per poll, and with 200 us sleeps between polls it
  // took seconds instead of the 50 ms a tight wait takes.
  static constexpr std::chrono::milliseconds kSpin{20};

  void complete(Op& op, std::string error);
  void record_span(const Op& op) const;  // Note [profiled collectives]

  MPI_Comm exit_comm_;
  int world_;
  mutable std::mutex m_;
  std::condition_variable cv_;
  std::deque<Op> queue_;
  std::size_t outstanding_ = 0;  // submitted, not yet finished
  std::int64_t issued_ = 0, finished_ = 0;  // numbered collectives
  int notices_ = 0;                          // leaving notices received
  bool awaiting_notices_ = false;            // a leave waits for them: poll while idle
  bool stopped_ = false;
  // The communication thread's own (Note [leaving notice]).
  std::array<std::int64_t, 2> notice_in_{};
  MPI_Request notice_req_ = MPI_REQUEST_NULL;
  int notices_posted_ = 0;
  std::optional<Left> first_left_, unclean_left_;
  std::thread thread_;  // last: it starts with everything above in place
};

/// CPU tensors over MPI (Note [process group bootstrap]: MPI initialised here unless the program
/// did so; a private MPI_Comm_dup with MPI_ERRORS_RETURN).
class MpiBackend final : public Backend {
 public:
  /// Initialises MPI (or joins the program's), and fills in the group's rank and world.
  explicit MpiBackend(GroupState& state);
  MpiBackend(const MpiBackend&) = delete;
  MpiBackend& operator=(const MpiBackend&) = delete;

  /// The private communicator (a duplicate of MPI_COMM_WORLD).
  MPI_Comm comm() const { return comm_; }

  CHORUS_INLINE void all_reduce(const std::shared_ptr<Work>& work, const AnyTensor& t, ReduceOp op) override;
  CHORUS_INLINE void reduce(const std::shared_ptr<Work>& work, const AnyTensor& t, ReduceOp op, int root) override;
  CHORUS_INLINE void broadcast(const std::shared_ptr<Work>& work, const AnyTensor& t, int root) override;
  CHORUS_INLINE void all_gather(const std::shared_ptr<Work>& work, const AnyTensor& in, const AnyTensor& out) override;
  CHORUS_INLINE void reduce_scatter(const std::shared_ptr<Work>& work, const AnyTensor& in, const AnyTensor& out,
                                    ReduceOp op) override;
  CHORUS_INLINE void barrier(const std::shared_ptr<Work>& work) override;

  /// The first half of leaving (Note [watchdog]): meets the other ranks within the timeout and
  /// stops the communication thread. Returns why MPI must not be finalised (empty: a clean leave).
  std::string leave();
  /// The second half: frees the communicators and finalises MPI if chorus initialised it.
  void finalize(bool clean);

 private:
  /// Tells every other rank that this one leaves (Note [leaving notice]).
  void send_leaving_notices(bool clean);
  bool sends_complete(std::chrono::steady_clock::time_point deadline);

  void submit(const std::shared_ptr<Work>& work, CommThread::Start start);

  GroupState& state_;
  MPI_Comm comm_ = MPI_COMM_NULL;
  MPI_Comm exit_comm_ = MPI_COMM_NULL;
  MPI_Op bf16_sum_ = MPI_OP_NULL, half_sum_ = MPI_OP_NULL;
  /// MPI's sum for T: its own for the 16-bit types (Note [16-bit sums over MPI]).
  template <class T>
  MPI_Op sum_op() const {
    if constexpr (std::is_same_v<T, bfloat16>) return bf16_sum_;
    else if constexpr (std::is_same_v<T, half>) return half_sum_;
    else return MPI_SUM;
  }
  bool owns_mpi_ = false;
  bool finalized_by_program_ = false;
  std::array<std::int64_t, 2> notice_out_{};   // Note [leaving notice]
  std::vector<MPI_Request> notice_sends_;
  std::unique_ptr<CommThread> comm_thread_;
};

}  // namespace detail
}  // namespace CHORUS_DIST_NS
}  // namespace dist
CHORUS_NAMESPACE_END

// The definitions: compiled into the MPI library (src/distributed/mpi.cpp), or here in the
// header-only form (Note [compiled chorus] in compiled.hpp).
#if !CHORUS_COMPILED
#include "mpi_backend_impl.hpp"
#endif
#endif  // CHORUS_DIST_MPI
