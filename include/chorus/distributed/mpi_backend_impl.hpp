#pragma once
// The definitions of distributed/mpi_backend.hpp (the communication thread, the MPI backend):
// compiled into the MPI library (src/distributed/mpi.cpp), included by mpi_backend.hpp itself in
// the header-only form (Note [compiled chorus]). Empty without MPI, as the header.
#include "mpi_backend.hpp"

#if CHORUS_DIST_MPI
CHORUS_NAMESPACE_BEGIN
namespace dist {
inline namespace CHORUS_DIST_NS {
namespace detail {

CHORUS_INLINE std::string mpi_error_string(int code) {
  char buf[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(code, buf, &len) != MPI_SUCCESS) return "MPI error " + std::to_string(code);
  return std::string(buf, static_cast<std::size_t>(len));
}

CHORUS_INLINE MPI_Datatype mpi_type(DType d) {
  switch (d) {
    case DType::Float32: return MPI_FLOAT;
    case DType::Float64: return MPI_DOUBLE;
    case DType::Int64: return MPI_INT64_T;
    case DType::BFloat16:
    case DType::Float16: return MPI_UINT16_T;
  }
  CHORUS_FAIL("MPI process group: unknown dtype");
}

CHORUS_INLINE std::optional<std::array<int, 3>> open_mpi_version() {
  char text[MPI_MAX_LIBRARY_VERSION_STRING] = {};
  int len = 0;
  if (MPI_Get_library_version(text, &len) != MPI_SUCCESS) return std::nullopt;
  std::array<int, 3> v{};
  if (std::sscanf(text, "Open MPI v%d.%d.%d", &v[0], &v[1], &v[2]) != 3) return std::nullopt;
  return v;
}

CHORUS_INLINE bool ring_allreduce_in_place_fixed(const std::array<int, 3>& v) {
  if (v[0] != 4) return v[0] > 4;
  if (v[1] == 0) return v[2] >= 7;
  if (v[1] == 1) return v[2] >= 2;
  return true;
}

CHORUS_INLINE std::string& iallreduce_choice() {
  static std::string choice;
  return choice;
}

CHORUS_INLINE std::string choose_iallreduce_algorithm() {
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

CHORUS_INLINE CommThread::CommThread(MPI_Comm exit_comm, int world)
    : exit_comm_(exit_comm), world_(world), thread_([this] { run(); }) {}

CHORUS_INLINE CommThread::~CommThread() { stop(); }

CHORUS_INLINE void CommThread::submit(Start start, std::shared_ptr<Work> work, bool counted) {
  {
    std::lock_guard<std::mutex> lk(m_);
    queue_.push_back({std::move(start), std::move(work), MPI_REQUEST_NULL, counted ? issued_++ : -1});
    ++outstanding_;
  }
  cv_.notify_one();
}

CHORUS_INLINE bool CommThread::wait_for_notices(std::chrono::steady_clock::time_point deadline) {
  std::unique_lock<std::mutex> lk(m_);
  awaiting_notices_ = true;  // the thread polls for them while it has nothing else to do
  cv_.notify_all();
  const bool all = cv_.wait_until(lk, deadline, [&] { return notices_ == world_ - 1; });
  awaiting_notices_ = false;
  return all;
}

CHORUS_INLINE void CommThread::stop() {
  {
    std::lock_guard<std::mutex> lk(m_);
    if (stopped_) return;
    stopped_ = true;
  }
  cv_.notify_one();
  thread_.join();
}

CHORUS_INLINE void CommThread::post_notice_receive() {
  if (notices_posted_ + 1 >= world_) return;  // one per other rank
  ++notices_posted_;
  if (MPI_Irecv(notice_in_.data(), 2, MPI_INT64_T, MPI_ANY_SOURCE, kLeaveTag, exit_comm_, &notice_req_) != MPI_SUCCESS)
    notice_req_ = MPI_REQUEST_NULL;
}

CHORUS_INLINE void CommThread::poll_notices() {
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

CHORUS_INLINE std::string CommThread::orphaned(const Op& op) const {
  if (op.seq >= 0 && first_left_ && op.seq >= first_left_->finished)
    return "rank " + std::to_string(first_left_->rank) + " left the process group after " +
           std::to_string(first_left_->finished) + " collectives, so it will never join this one (collective " +
           std::to_string(op.seq) + " of this rank)";
  if (op.seq < 0 && unclean_left_)
    return "rank " + std::to_string(unclean_left_->rank) + " left the process group without meeting the others (" +
           "its group was broken or had collectives in flight)";
  return {};
}

CHORUS_INLINE void CommThread::run() {
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
      if (profiler::enabled()) {  // Note [profiled collectives]
        op.started_ns = profiler::detail::now_ns();
        op.step = profiler::current_step();
        op.lane = 0;
        while (std::any_of(active.begin(), active.end(), [&](const Op& o) { return o.lane == op.lane; })) ++op.lane;
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
        record_span(active[i]);
        complete(active[i], std::move(err));
        active.erase(active.begin() + static_cast<std::ptrdiff_t>(i));
        progressed = true;
      } else {
        ++i;
      }
    }
    // Note [polling collectives]: poll without sleeping for kSpin after the last start or
    // completion, or while a thread of this process waits for a collective, then back off (up to
    // 200 us per poll) so that a rank waiting for a slow peer leaves the cores to the computation.
    const auto now = std::chrono::steady_clock::now();
    if (progressed || !fresh.empty()) {
      last_progress = now;
      idle_polls = 0;
    }
    if (!active.empty()) {
      if (now - last_progress < kSpin || detail::collective_waiters().load(std::memory_order_relaxed) > 0)
        std::this_thread::yield();
      else std::this_thread::sleep_for(std::chrono::microseconds(std::min(200, 5 * ++idle_polls)));
    }
  }
}

// Note [profiled collectives]
// While a profiler records, each collective the communication thread starts is a span from its
// start to the MPI_Test that finds it complete, named by its kind ("all_reduce") with its bytes
// (those of the tensors it reads and writes) and description. Several are in flight at once, so
// each is drawn on the lowest "comm lane k" track free when it started (profiler::record_on_track).
// A collective is in flight from its start, also while it waits for a rank that still computes;
// a thread that waits for one (Work::wait: DDP's last buckets at the end of backward) records a
// communication span "wait for all_reduce" on its own track. The summary counts neither as
// computation, so the share hidden is that of the time in flight during which some thread
// computed, and the waits at the end of backward are what the overlap did not hide.
CHORUS_INLINE void CommThread::record_span(const Op& op) const {
  if (op.started_ns < 0 || !profiler::enabled()) return;
  profiler::Span s;
  const std::string& what = op.work->what();
  s.name = what.substr(0, what.find_first_of("( "));
  s.category = profiler::Category::communication;
  s.start_ns = op.started_ns;
  s.end_ns = profiler::detail::now_ns();
  s.step = op.step;
  s.bytes = 0;
  for (const auto& t : op.work->keep) s.bytes += t.numel() * static_cast<std::int64_t>(dtype_size(t.dtype()));
  s.detail = what;
  profiler::record_on_track("comm lane " + std::to_string(op.lane), std::move(s));
}

CHORUS_INLINE void CommThread::complete(Op& op, std::string error) {
  {
    std::lock_guard<std::mutex> lk(m_);
    --outstanding_;
    if (op.seq >= 0) ++finished_;
  }
  op.work->finish(std::move(error));
}

CHORUS_INLINE MpiBackend::MpiBackend(GroupState& state) : state_(state) {
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

CHORUS_INLINE void MpiBackend::all_reduce(const std::shared_ptr<Work>& work, const AnyTensor& t, ReduceOp op) {
  t.visit([&](const auto& x) {
    using T = typename std::decay_t<decltype(x)>::value_type;
    const int world = state_.world, n = checked_int_count(x.numel(), work->what());
    const MPI_Datatype type = mpi_type(dtype_of<T>());
    const MPI_Op sum = sum_op<T>();
    if (op == ReduceOp::Avg) work->on_done = [x, world] { divide_in_place(x, world); };
    submit(work, [x, n, type, sum, comm = comm_](MPI_Request* r) {
      return MPI_Iallreduce(MPI_IN_PLACE, x.data(), n, type, sum, comm, r);
    });
  });
}

CHORUS_INLINE void MpiBackend::reduce(const std::shared_ptr<Work>& work, const AnyTensor& t, ReduceOp op, int root) {
  t.visit([&](const auto& x) {
    using T = typename std::decay_t<decltype(x)>::value_type;
    const int world = state_.world, n = checked_int_count(x.numel(), work->what());
    const bool mine = state_.rank == root;
    const MPI_Datatype type = mpi_type(dtype_of<T>());
    const MPI_Op sum = sum_op<T>();
    if (op == ReduceOp::Avg && mine) work->on_done = [x, world] { divide_in_place(x, world); };
    submit(work, [x, n, type, sum, root, mine, comm = comm_](MPI_Request* r) {
      return MPI_Ireduce(mine ? MPI_IN_PLACE : x.data(), x.data(), n, type, sum, root, comm, r);
    });
  });
}

CHORUS_INLINE void MpiBackend::broadcast(const std::shared_ptr<Work>& work, const AnyTensor& t, int root) {
  t.visit([&](const auto& x) {
    using T = typename std::decay_t<decltype(x)>::value_type;
    const int n = checked_int_count(x.numel(), work->what());
    submit(work, [x, n, root, comm = comm_](MPI_Request* r) {
      return MPI_Ibcast(x.data(), n, mpi_type(dtype_of<T>()), root, comm, r);
    });
  });
}

CHORUS_INLINE void MpiBackend::all_gather(const std::shared_ptr<Work>& work, const AnyTensor& in,
                                            const AnyTensor& out) {
  in.visit([&](const auto& x) {
    using T = typename std::decay_t<decltype(x)>::value_type;
    const auto o = out.template as<T>();
    const int n = checked_int_count(x.numel(), work->what());
    submit(work, [x, o, n, comm = comm_](MPI_Request* r) {
      return MPI_Iallgather(x.data(), n, mpi_type(dtype_of<T>()), o.data(), n, mpi_type(dtype_of<T>()), comm, r);
    });
  });
}

CHORUS_INLINE void MpiBackend::reduce_scatter(const std::shared_ptr<Work>& work, const AnyTensor& in,
                                                const AnyTensor& out, ReduceOp op) {
  in.visit([&](const auto& x) {
    using T = typename std::decay_t<decltype(x)>::value_type;
    const auto o = out.template as<T>();
    const int world = state_.world, n = checked_int_count(o.numel(), work->what());
    const MPI_Datatype type = mpi_type(dtype_of<T>());
    const MPI_Op sum = sum_op<T>();
    if (op == ReduceOp::Avg) work->on_done = [o, world] { divide_in_place(o, world); };
    submit(work, [x, o, n, type, sum, comm = comm_](MPI_Request* r) {
      return MPI_Ireduce_scatter_block(x.data(), o.data(), n, type, sum, comm, r);
    });
  });
}

CHORUS_INLINE void MpiBackend::barrier(const std::shared_ptr<Work>& work) {
  submit(work, [comm = comm_](MPI_Request* r) { return MPI_Ibarrier(comm, r); });
}

CHORUS_INLINE std::string MpiBackend::leave() {
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

CHORUS_INLINE void MpiBackend::finalize(bool clean) {
  if (finalized_by_program_ || !clean) return;  // no MPI_Finalize: the launcher ends the job (Note [watchdog])
  (void)MPI_Op_free(&bf16_sum_);
  (void)MPI_Op_free(&half_sum_);
  (void)MPI_Comm_free(&comm_);
  (void)MPI_Comm_free(&exit_comm_);
  if (owns_mpi_) MPI_Finalize();
}

CHORUS_INLINE void MpiBackend::send_leaving_notices(bool clean) {
  notice_out_ = {comm_thread_->finished(), clean ? 1 : 0};
  for (int r = 0; r < state_.world; ++r) {
    if (r == state_.rank) continue;
    MPI_Request req = MPI_REQUEST_NULL;
    if (MPI_Isend(notice_out_.data(), 2, MPI_INT64_T, r, kLeaveTag, exit_comm_, &req) == MPI_SUCCESS)
      notice_sends_.push_back(req);
  }
}

CHORUS_INLINE bool MpiBackend::sends_complete(std::chrono::steady_clock::time_point deadline) {
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

CHORUS_INLINE void MpiBackend::submit(const std::shared_ptr<Work>& work, CommThread::Start start) {
  // The tensor's pending work (a CPU device's worker) finishes before MPI reads it.
  for (auto& k : work->keep) {
    Event e;
    e.record(current_stream(k.device()));
    e.synchronize();
  }
  comm_thread_->submit(std::move(start), work);
}

}  // namespace detail
}  // namespace CHORUS_DIST_NS
}  // namespace dist
CHORUS_NAMESPACE_END
#endif  // CHORUS_DIST_MPI
