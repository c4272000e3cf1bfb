#pragma once
// chorus's distributed layer: the process group (MPI, NCCL), DistributedDataParallel and
// data::DistributedSampler. Not part of <chorus/chorus.hpp>: MPI is optional (link
// chorus::distributed for it; without it this header gives a world of one process).
#include "chorus.hpp"
#include "distributed/checkpointer.hpp"
#include "distributed/ddp.hpp"
#include "distributed/fsdp.hpp"
#include "distributed/process_group.hpp"
#include "distributed/sampler.hpp"
#include "distributed/zero_redundancy_optimizer.hpp"
