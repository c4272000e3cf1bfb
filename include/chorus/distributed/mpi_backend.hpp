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

/// The MPI type of `d`'s elements: 16-bit floating elements move as uint16 (exact), and are
/// summed by the backend's own operations (Note [16-bit sums over MPI]).
inline MPI_Datatype mpi_type(DType d) {
  switch (d) {
    case DType::Float32: return MPI_FLOAT;
    case DType::Float64: return MPI_DOUBLE;
    case DType::Int64: return MPI_INT64_T;
    case DType::BFloat16:
    case DType::Float16: return MPI_UINT16_T;
  }
  CHORUS_FAIL("MPI process group: unknown dtype");
}

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
inline std::optional<std::array<int, 3>> open_mpi_version() {
  char text[MPI_MAX_LIBRARY_VERSION_STRING] = {};
  int len = 0;
  if (MPI_Get_library_version(text, &len) != MPI_SUCCESS) return std::nullopt;
  std::array<int, 3> v{};
  if (std::sscanf(text, "Open MPI v%d.%d.%d", &v[0], &v[1], &v[2]) != 3) return std::nullopt;
  return v;
}
/// Whether that release's ring all-reduce is right in place (Note [ring all-reduce]).
inline bool ring_allreduce_in_place_fixed(const std::array<int, 3>& v) {
  if (v[0] != 4) return v[0] > 4;
  if (v[1] == 0) return v[2] >= 7;
  if (v[1] == 1) return v[2] >= 2;
  return true;
}
/// What chorus chose for Open MPI's non-blocking all-reduce, and why (Note [ring all-reduce]):
/// "ring", or the reason it left the choice alone; empty until chorus initialises MPI.
inline std::string& iallreduce_choice() {
  static std::string choice;
  return choice;
}
inline std::string choose_iallreduce_algorithm() {
  static constexpr const char* kVar = "OMPI_MCA_coll_libnbc_iallreduce_algorithm";
  if (std::getenv(kVar)) return std::string("left to the environment (") + kVar + " is set)";
  const auto v = open_mpi_version();
  if (!v) return "left alone: not Open MPI";
  if (!ring_allreduce_in_place_fixed(*v))
    return "left alone: Open MPI " + std::to_string((*v)[0]) + "." + std::to_string((*v)[1]) + "." +
           std::to_string((*v)[2]) + "'s ring all-reduce is wrong in place (open-mpi/ompi#9385)";
  ::setenv(kVar, "1", 0);
  return "ring";
}

/// The tag of the leaving notices on the exit communicator (Note [leaving notice]).
inline constexpr int kLeaveTag = 7301;

/// The communication thread (Note [communication thread], [leaving notice]).
class CommThread {
 public:
  /// Starts the MPI call for one collective (on the communication thread) and returns its request.
  using Start = std::function<int(MPI_Request*)>;

  /// `exit_comm`: where the leaving notices of the `world` ranks arrive.
  CommThread(MPI_Comm exit_comm, int world) : exit_comm_(exit_comm), world_(world), thread_([this] { run(); }) {}
  ~CommThread() { stop(); }
  CommThread(const CommThread&) = delete;
  CommThread& operator=(const CommThread&) = delete;

  /// Queues a collective of the group (`counted`: numbered, as the other ranks number theirs;
  /// the exit barrier is not).
  void submit(Start start, std::shared_ptr<Work> work, bool counted = true) {
    {
      std::lock_guard<std::mutex> lk(m_);
      queue_.push_back({std::move(start), std::move(work), MPI_REQUEST_NULL, counted ? issued_++ : -1});
      ++outstanding_;
    }
    cv_.notify_one();
  }
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
  bool wait_for_notices(std::chrono::steady_clock::time_point deadline) {
    std::unique_lock<std::mutex> lk(m_);
    awaiting_notices_ = true;  // the thread polls for them while it has nothing else to do
    cv_.notify_all();
    const bool all = cv_.wait_until(lk, deadline, [&] { return notices_ == world_ - 1; });
    awaiting_notices_ = false;
    return all;
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
    std::int64_t seq;  // its number among the group's collectives; -1: the exit barrier
  };

  /// A rank that said it is leaving (Note [leaving notice]).
  struct Left {
    int rank = -1;
    std::int64_t finished = 0;
    bool clean = true;
  };

  void post_notice_receive() {
    if (notices_posted_ + 1 >= world_) return;  // one per other rank
    ++notices_posted_;
    if (MPI_Irecv(notice_in_.data(), 2, MPI_INT64_T, MPI_ANY_SOURCE, kLeaveTag, exit_comm_, &notice_req_) != MPI_SUCCESS)
      notice_req_ = MPI_REQUEST_NULL;
  }
  void poll_notices() {
    while (notice_req_ != MPI_REQUEST_NULL) {
      int flag = 0;
      MPI_Status st;
      if (MPI_Test(&notice_req_, &flag, &st) != MPI_SUCCESS || !flag) return;
      notice_req_ = MPI_REQUEST_NULL;
      const Left l{st.MPI_SOURCE, notice_in_[0], notice_in_[1] != 0};
      if (!first_left_ || l.finished < first_left_->finished) first_left_ = l;
      if (!l.clean && !unclean_left_) unclean_left_ = l;
      {
        std::lock_guard<std::mutex> lk(m_);
        ++notices_;
      }
      cv_.notify_all();
      post_notice_receive();
    }
  }
  /// Why `op` can never complete because a rank left (empty: it still can).
  std::string orphaned(const Op& op) const {
    if (op.seq >= 0 && first_left_ && op.seq >= first_left_->finished)
      return "rank " + std::to_string(first_left_->rank) + " left the process group after " +
             std::to_string(first_left_->finished) + " collectives, so it will never join this one (collective " +
             std::to_string(op.seq) + " of this rank)";
    if (op.seq < 0 && unclean_left_)
      return "rank " + std::to_string(unclean_left_->rank) + " left the process group without meeting the others (" +
             "its group was broken or had collectives in flight)";
    return {};
  }

  void run() {
    std::vector<Op> active;
    int idle_polls = 0;
    auto last_progress = std::chrono::steady_clock::now();
    if (world_ > 1) post_notice_receive();
    for (;;) {
      std::deque<Op> fresh;
      {
        std::unique_lock<std::mutex> lk(m_);
        const auto ready = [&] { return stopped_ || !queue_.empty(); };
        if (active.empty() && awaiting_notices_) {
          cv_.wait_for(lk, std::chrono::microseconds(200), ready);  // then polls the notices
        } else if (active.empty()) {
          // A leave that starts waiting for the notices wakes the thread too (it must poll them).
          cv_.wait(lk, [&] { return ready() || awaiting_notices_; });
        }
        if (stopped_) return;  // requests still in flight are abandoned (Note [watchdog])
        fresh.swap(queue_);
      }
      poll_notices();
      for (auto& op : fresh) {
        if (auto why = orphaned(op); !why.empty()) {  // never started: nobody would meet it
          complete(op, std::move(why));
          continue;
        }
        const int rc = op.start(&op.request);
        if (rc != MPI_SUCCESS) {
          complete(op, "MPI error: " + mpi_error_string(rc));
          continue;
        }
        active.push_back(std::move(op));
      }
      bool progressed = false;
      poll_notices();
      for (std::size_t i = 0; i < active.size();) {
        int flag = 0;
        const int rc = MPI_Test(&active[i].request, &flag, MPI_STATUS_IGNORE);
        std::string orphan = rc == MPI_SUCCESS && !flag ? orphaned(active[i]) : std::string();
        if (rc != MPI_SUCCESS || flag || !orphan.empty()) {  // an orphan's request is abandoned
          std::string err = std::move(orphan);
          if (rc != MPI_SUCCESS) err = "MPI error: " + mpi_error_string(rc);
          else if (flag && active[i].work->on_done) active[i].work->on_done();
          complete(active[i], std::move(err));
          active.erase(active.begin() + static_cast<std::ptrdiff_t>(i));
          progressed = true;
        } else {
          ++i;
        }
      }
      // Note [polling collectives]: poll without sleeping for kSpin after the last start or
      // completion, then back off (up to 200 us per poll) so that a rank waiting for a slow
      // peer leaves the cores to the computation.
      const auto now = std::chrono::steady_clock::now();
      if (progressed || !fresh.empty()) {
        last_progress = now;
        idle_polls = 0;
      }
      if (!active.empty()) {
        if (now - last_progress < kSpin) std::this_thread::yield();
        else std::this_thread::sleep_for(std::chrono::microseconds(std::min(200, 5 * ++idle_polls)));
      }
    }
  }

  // Note [polling collectives]
  // An MPI collective in flight moves only inside MPI calls: each MPI_Test runs the next steps
  // of its schedule (libnbc's rounds, the shared-memory transport's fragments and single-copy
  // reads), so a gap between two polls is a gap in the transfer. The first version backed off
  // to sleeps of up to 200 us after 16 idle polls; in mlp-medium's DDP step on 2 ranks (2 cores)
  // the two buckets' all-reduces (16.8 MB, 7.4 ms alone) then added 20 ms to the step (96 ms,
  // 76 ms under no_sync). Polling with sched_yield between tests made it 83-89 ms: a yield still
  // lets the computation threads of the same core run. The sleeps stay for a collective that has
  // not moved for kSpin (a peer still computing its step, or one that hangs), so that a waiting
  // rank does not hold a core for long.
  static constexpr std::chrono::milliseconds kSpin{20};

  void complete(Op& op, std::string error) {
    {
      std::lock_guard<std::mutex> lk(m_);
      --outstanding_;
      if (op.seq >= 0) ++finished_;
    }
    op.work->finish(std::move(error));
  }

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
  explicit MpiBackend(GroupState& state) : state_(state) {
    int initialized = 0;
    CHORUS_MPI_CHECK(MPI_Initialized(&initialized));
    int provided = 0;
    if (!initialized) {
      iallreduce_choice() = choose_iallreduce_algorithm();  // Note [ring all-reduce]
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
    CHORUS_MPI_CHECK(MPI_Comm_rank(comm_, &state_.rank));
    CHORUS_MPI_CHECK(MPI_Comm_size(comm_, &state_.world));
    MPI_Comm local;
    CHORUS_MPI_CHECK(MPI_Comm_split_type(comm_, MPI_COMM_TYPE_SHARED, state_.rank, MPI_INFO_NULL, &local));
    CHORUS_MPI_CHECK(MPI_Comm_rank(local, &state_.local_rank));
    CHORUS_MPI_CHECK(MPI_Comm_size(local, &state_.local_world));
    CHORUS_MPI_CHECK(MPI_Comm_free(&local));
    CHORUS_MPI_CHECK(MPI_Op_create(&sum_16bit<bfloat16>, 1, &bf16_sum_));  // Note [16-bit sums over MPI]
    CHORUS_MPI_CHECK(MPI_Op_create(&sum_16bit<half>, 1, &half_sum_));
    state_.launcher = state_.world > 1 || mpi_launcher_present() ? Launcher::Mpi : Launcher::None;
    comm_thread_ = std::make_unique<CommThread>(exit_comm_, state_.world);
  }
  MpiBackend(const MpiBackend&) = delete;
  MpiBackend& operator=(const MpiBackend&) = delete;

  /// The private communicator (a duplicate of MPI_COMM_WORLD).
  MPI_Comm comm() const { return comm_; }

  void all_reduce(const std::shared_ptr<Work>& work, const AnyTensor& t, ReduceOp op) override {
    t.visit([&](const auto& x) {
      using T = typename std::decay_t<decltype(x)>::value_type;
      const int world = state_.world, n = checked_int_count(x.numel(), work->what());
      const MPI_Datatype type = mpi_type(dtype_of<T>());
      MPI_Op sum = MPI_SUM;
      if constexpr (std::is_same_v<T, bfloat16>) sum = bf16_sum_;
      if constexpr (std::is_same_v<T, half>) sum = half_sum_;
      if (op == ReduceOp::Avg) work->on_done = [x, world] { divide_in_place(x, world); };
      submit(work, [x, n, type, sum, comm = comm_](MPI_Request* r) {
        return MPI_Iallreduce(MPI_IN_PLACE, x.data(), n, type, sum, comm, r);
      });
    });
  }
  void broadcast(const std::shared_ptr<Work>& work, const AnyTensor& t, int root) override {
    t.visit([&](const auto& x) {
      using T = typename std::decay_t<decltype(x)>::value_type;
      const int n = checked_int_count(x.numel(), work->what());
      submit(work, [x, n, root, comm = comm_](MPI_Request* r) {
        return MPI_Ibcast(x.data(), n, mpi_type(dtype_of<T>()), root, comm, r);
      });
    });
  }
  void all_gather(const std::shared_ptr<Work>& work, const AnyTensor& in, const AnyTensor& out) override {
    in.visit([&](const auto& x) {
      using T = typename std::decay_t<decltype(x)>::value_type;
      const auto o = out.template as<T>();
      const int n = checked_int_count(x.numel(), work->what());
      submit(work, [x, o, n, comm = comm_](MPI_Request* r) {
        return MPI_Iallgather(x.data(), n, mpi_type(dtype_of<T>()), o.data(), n, mpi_type(dtype_of<T>()), comm, r);
      });
    });
  }
  void barrier(const std::shared_ptr<Work>& work) override {
    submit(work, [comm = comm_](MPI_Request* r) { return MPI_Ibarrier(comm, r); });
  }

  /// The first half of leaving (Note [watchdog]): meets the other ranks within the timeout and
  /// stops the communication thread. Returns why MPI must not be finalised (empty: a clean leave).
  std::string leave() {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (finalized) {  // the program finalised MPI itself (it should have called dist::shutdown() first)
      comm_thread_->stop();
      finalized_by_program_ = true;
      return "MPI was finalised before dist::shutdown()";
    }
    std::string why;
    if (state_.broken()) {
      why = "the process group is broken (" + state_.broken_reason() + ")";
    } else if (const auto pending = comm_thread_->pending(); pending != 0) {
      why = std::to_string(pending) + " collective(s) still in flight";
    }
    if (state_.world > 1) {
      send_leaving_notices(why.empty());  // Note [leaving notice]
      if (why.empty()) {
        // Note [watchdog]: a barrier on a communicator nothing else uses, so that it cannot be
        // confused with a collective some other rank is still stuck in.
        auto work = std::make_shared<Work>("shutdown barrier");
        work->group = &state_;
        comm_thread_->submit([comm = exit_comm_](MPI_Request* r) { return MPI_Ibarrier(comm, r); }, work,
                             /*counted=*/false);
        try {
          work->wait(state_.timeout);
        } catch (const Error& e) {
          why = e.what();
        }
      }
      // A clean leave frees the communicators: every notice in and out first (all were sent
      // before the barrier, so they come at once).
      if (why.empty() && !(comm_thread_->wait_for_notices(std::chrono::steady_clock::now() + state_.timeout) &&
                           sends_complete(std::chrono::steady_clock::now() + state_.timeout)))
        why = "the other ranks' leaving notices did not arrive within the timeout";
    }
    comm_thread_->stop();
    return why;
  }
  /// The second half: frees the communicators and finalises MPI if chorus initialised it.
  void finalize(bool clean) {
    if (finalized_by_program_ || !clean) return;  // no MPI_Finalize: the launcher ends the job (Note [watchdog])
    (void)MPI_Op_free(&bf16_sum_);
    (void)MPI_Op_free(&half_sum_);
    (void)MPI_Comm_free(&comm_);
    (void)MPI_Comm_free(&exit_comm_);
    if (owns_mpi_) MPI_Finalize();
  }

 private:
  /// Tells every other rank that this one leaves (Note [leaving notice]).
  void send_leaving_notices(bool clean) {
    notice_out_ = {comm_thread_->finished(), clean ? 1 : 0};
    for (int r = 0; r < state_.world; ++r) {
      if (r == state_.rank) continue;
      MPI_Request req = MPI_REQUEST_NULL;
      if (MPI_Isend(notice_out_.data(), 2, MPI_INT64_T, r, kLeaveTag, exit_comm_, &req) == MPI_SUCCESS)
        notice_sends_.push_back(req);
    }
  }
  bool sends_complete(std::chrono::steady_clock::time_point deadline) {
    for (;;) {
      int done = 0;
      if (MPI_Testall(static_cast<int>(notice_sends_.size()), notice_sends_.data(), &done, MPI_STATUSES_IGNORE) !=
          MPI_SUCCESS)
        return false;
      if (done) return true;
      if (std::chrono::steady_clock::now() >= deadline) return false;
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
  }

  void submit(const std::shared_ptr<Work>& work, CommThread::Start start) {
    // The tensor's pending work (a CPU device's worker) finishes before MPI reads it.
    for (auto& k : work->keep) {
      Event e;
      e.record(current_stream(k.device()));
      e.synchronize();
    }
    comm_thread_->submit(std::move(start), work);
  }

  GroupState& state_;
  MPI_Comm comm_ = MPI_COMM_NULL;
  MPI_Comm exit_comm_ = MPI_COMM_NULL;
  MPI_Op bf16_sum_ = MPI_OP_NULL, half_sum_ = MPI_OP_NULL;
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
#endif  // CHORUS_DIST_MPI
