#pragma once
// Data parallelism: chunk plans, communicators, replication, parallel_apply, gather, DataParallel.
#include "arguments.hpp"
#include "chunk_plan.hpp"
#include "comm.hpp"
#include "data_parallel.hpp"
#include "gather.hpp"
#include "parallel_apply.hpp"
#include "replicate.hpp"
#include "stats_reducer.hpp"
