#pragma once
// Data parallelism: chunk plans, communicators, scatter, replicate, parallel_apply, gather, DataParallel,
// data_parallel.
#include "arguments.hpp"
#include "chunk_plan.hpp"
#include "comm.hpp"
#include "data_parallel.hpp"
#include "data_parallel_options.hpp"
#include "fully_shard.hpp"
#include "fully_sharded_data_parallel.hpp"
#include "functional.hpp"
#include "gather.hpp"
#include "parallel_apply.hpp"
#include "replicate.hpp"
#include "scatter.hpp"
#include "sharded_optimizer.hpp"
#include "stats_reducer.hpp"
