// chorus::distributed's compiled part: the distributed layer's non-template code over MPI (built with
// CHORUS_WITH_MPI=1: dist::with_mpi) (Note [compiled chorus] in include/chorus/compiled.hpp).
#include <chorus/distributed/backend_impl.hpp>
#include <chorus/distributed/checkpointer_impl.hpp>
#include <chorus/distributed/ddp_impl.hpp>
#include <chorus/distributed/fsdp_checkpoint_impl.hpp>
#include <chorus/distributed/fsdp_impl.hpp>
#include <chorus/distributed/mpi_backend_impl.hpp>
#include <chorus/distributed/process_group_impl.hpp>
#include <chorus/distributed/reducer_impl.hpp>
#include <chorus/distributed/sampler_impl.hpp>
#include <chorus/distributed/stats_reducer_impl.hpp>
#include <chorus/distributed/watchdog_impl.hpp>
#include <chorus/distributed/zero_redundancy_optimizer_impl.hpp>
