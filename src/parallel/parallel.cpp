// chorus::compiled: the non-template code of parallel/ (communicators, replication, statistics
// reducer, sharded optimizer, scatter) (Note [compiled chorus] in include/chorus/compiled.hpp).
#include <chorus/parallel/arguments_impl.hpp>
#include <chorus/parallel/comm_impl.hpp>
#include <chorus/parallel/fully_shard_impl.hpp>
#include <chorus/parallel/fully_sharded_data_parallel_impl.hpp>
#include <chorus/parallel/replicate_impl.hpp>
#include <chorus/parallel/scatter_impl.hpp>
#include <chorus/parallel/shard_checkpoint_impl.hpp>
#include <chorus/parallel/shard_unit_impl.hpp>
#include <chorus/parallel/sharded_optimizer_impl.hpp>
#include <chorus/parallel/stats_reducer_impl.hpp>
