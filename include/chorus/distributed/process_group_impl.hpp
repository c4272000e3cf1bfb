#pragma once
// The definitions of distributed/process_group.hpp (ProcessGroup's non-template members,
// dist::init and the job's group): compiled into chorus::compiled and the MPI library
// (src/distributed/local.cpp, mpi.cpp), included by process_group.hpp itself in the header-only
// form (Note [compiled chorus]).
#include "../backend/cpu/blas.hpp"
#include "process_group.hpp"

CHORUS_NAMESPACE_BEGIN
namespace dist {
inline namespace CHORUS_DIST_NS {

CHORUS_INLINE ProcessGroup::ProcessGroup(Options options) {
  state_.timeout = resolve_timeout(options);
#if CHORUS_DIST_MPI
  if (!(detail::torchrun_present() && !detail::mpi_launcher_present())) {
    mpi_ = std::make_unique<detail::MpiBackend>(state_);
    state_.add_backend(mpi_.get());
    // Note [BLAS threads shared by devices]: the node's ranks share its cores.
    if (state_.default_device().is_cpu()) backend::cpu::share_blas_threads(state_.local_world);
    return;
  }
#endif
  if (detail::torchrun_present()) {
    init_torchrun();
    return;
  }
  // World of 1, nothing to talk to; unless an MPI launcher started several processes, which
  // would each train alone and write the same checkpoints.
  for (const char* v : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK"}) {
    const int n = detail::env_int(v, 0);
    const bool size = std::string_view(v).ends_with("SIZE");
    CHORUS_CHECK(size ? n <= 1 : n == 0, "dist::init: started by an MPI launcher (", v, "=", n,
                 "), but this program was built without MPI, so each process would train alone as a world of 1; "
                 "link chorus::distributed (find_package(chorus COMPONENTS distributed)) where MPI is found");
  }
}

CHORUS_INLINE ProcessGroup::~ProcessGroup() { (void)leave(); }

CHORUS_INLINE void ProcessGroup::add_collective_step(const std::vector<AnyTensor>& params) {
  std::lock_guard<std::mutex> lk(collective_m_);
  for (const auto& p : params) collective_.insert(p.impl_key());
}
CHORUS_INLINE void ProcessGroup::remove_collective_step(const std::vector<AnyTensor>& params) noexcept {
  std::lock_guard<std::mutex> lk(collective_m_);
  for (const auto& p : params)
    if (auto it = collective_.find(p.impl_key()); it != collective_.end()) collective_.erase(it);
}
CHORUS_INLINE bool ProcessGroup::has_collective_step(const std::vector<AnyTensor>& params) const {
  std::lock_guard<std::mutex> lk(collective_m_);
  for (const auto& p : params)
    if (collective_.count(p.impl_key())) return true;
  return false;
}

CHORUS_INLINE std::string ProcessGroup::backend() const {
  return state_.launcher == Launcher::Torchrun ? "nccl" : (has_mpi() ? "mpi" : "local");
}

CHORUS_INLINE void ProcessGroup::set_timeout(std::chrono::milliseconds t) {
  CHORUS_CHECK(t.count() > 0, "dist: timeout must be positive");
  state_.timeout = t;
}

CHORUS_INLINE void ProcessGroup::broadcast(const AnyTensor& t, int root) {
  t.visit([&](const auto& x) { broadcast(x, root); });
}

CHORUS_INLINE void ProcessGroup::barrier() {
  if (state_.world == 1) return;
  auto work = std::make_shared<Work>("barrier");
  work->group = &state_;
  check_usable(work->what());
  // MPI where the group has it; under torchrun a one-element all-reduce over NCCL.
  backend_for(has_mpi() ? Device::cpu(0) : default_device(), "barrier").barrier(work);
  work->wait(state_.timeout);
}

CHORUS_INLINE void ProcessGroup::shutdown() {
  const auto why = leave();
  CHORUS_CHECK(why.empty(), "dist: shutdown on rank ", state_.rank, " failed: ", why,
               "; MPI was not finalised, so that the launcher ends the job");
}

CHORUS_INLINE void ProcessGroup::check_usable(const std::string& what) const {
  const auto broken = state_.broken_reason();
  CHORUS_CHECK(broken.empty(), "dist: ", what, " on rank ", state_.rank, ": the process group is broken (", broken,
               ")");
  CHORUS_CHECK(!shut_down_, "dist: ", what, " after the process group was shut down");
}

CHORUS_INLINE std::string ProcessGroup::leave() noexcept {
  if (shut_down_) return {};
  shut_down_ = true;
  std::string why;
#if CHORUS_DIST_MPI
  if (mpi_) {
    try {
      why = mpi_->leave();
    } catch (const std::exception& e) {
      why = e.what();
    }
  }
#endif
#if CHORUS_CUDA
  // Whatever the launcher (under torchrun the group is NCCL alone): the communicator goes here,
  // before main returns, not in the group's static destructor after the CUDA runtime's teardown.
  nccl_.reset();
#endif
#if CHORUS_DIST_MPI
  if (mpi_) mpi_->finalize(why.empty());
#endif
  return why;
}

CHORUS_INLINE std::chrono::milliseconds ProcessGroup::resolve_timeout(const Options& o) {
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

CHORUS_INLINE detail::Backend& ProcessGroup::backend_for([[maybe_unused]] Device device,
                                                         [[maybe_unused]] const std::string& what) {
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

CHORUS_INLINE void ProcessGroup::init_torchrun() {
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

namespace detail {
CHORUS_INLINE std::unique_ptr<ProcessGroup>& global_group() {
  static std::unique_ptr<ProcessGroup> g;  // destroyed at exit: shutdown() (Note [watchdog])
  return g;
}
}  // namespace detail

CHORUS_INLINE ProcessGroup& init(Options options) {
  auto& g = detail::global_group();
  if (!g) {
    g = std::make_unique<ProcessGroup>(options);
    profiler::set_process_rank(g->rank());  // traces name the process by its rank
    return *g;
  }
  if (options.timeout && *options.timeout != g->timeout())
    CHORUS_FAIL("dist::init: the process group already exists, with a timeout of ", g->timeout().count(),
                " ms; a second init() asks for ", options.timeout->count(),
                " ms. Call init() once with the options you want (or change it with group().set_timeout())");
  return *g;
}

CHORUS_INLINE ProcessGroup& group() {
  CHORUS_CHECK(is_initialized(), "dist: the process group is not initialised (call chorus::dist::init() first)");
  return *detail::global_group();
}

CHORUS_INLINE void shutdown() {
  if (auto& g = detail::global_group()) g->shutdown();
}

}  // namespace CHORUS_DIST_NS
}  // namespace dist
CHORUS_NAMESPACE_END
