#pragma once
// Checkpointer: crash and resume for a training job (one process or many).
//
// Note [checkpointer]
// A checkpoint is a directory `<dir>/step-<N>` holding what step N+1 depends on: the model's
// parameters and buffers (model.safetensors), the optimizer's state with the learning-rate
// scheduler's (optimizer.safetensors, io::save's format; a ZeroRedundancyOptimizer is
// consolidated on rank 0 first), and every rank's random-number generator (rng.safetensors,
// one row per rank). `<dir>/latest` names the newest complete one. Rank 0 writes everything,
// into a temporary directory renamed into place, then `latest` (written to a temporary file and
// renamed): a crash at any moment leaves the previous checkpoint whole. Every rank reads. The
// sampler's position is the step itself: with data::DistributedSampler (or any order that
// depends only on the epoch) step N is batch N % batches_per_epoch of epoch N / batches_per_epoch,
// so a resumed loop skips to it (docs/distributed.md, "Crash and resume"); all of it gives parameters bitwise
// equal to an uninterrupted run's.
#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "../compiled.hpp"
#include "../core/generator.hpp"
#include "../io/optimizer.hpp"
#include "../io/safetensors.hpp"
#include "process_group.hpp"

CHORUS_NAMESPACE_BEGIN
namespace dist {
inline namespace CHORUS_DIST_NS {

/// When a Checkpointer saves, how many checkpoints it keeps, and what it saves besides the model
/// and optimizer: `{.every = 100, .scheduler = &sched}`.
struct CheckpointerOptions {
  std::int64_t every = 0;                        ///< save after every `every`-th step (0: only save())
  int keep = 2;                                  ///< the newest checkpoints kept; older ones are removed
  optim::LRScheduler* scheduler = nullptr;       ///< saved and restored with the optimizer
  Generator* generator = &default_generator();   ///< each rank's, saved and restored (null: none)
};

/// Saves a job's state every N steps and resumes it (Note [checkpointer]):
///   dist::Checkpointer ckpt("ckpt", ddp.module(), opt, {.every = 100, .scheduler = &sched});
///   for (std::int64_t step = ckpt.resume(); step < total; ) { ...one step...; ckpt.step(++step); }
///   ckpt.save(total);
/// Every rank constructs it and calls resume(), step() and save() (they are collectives);
/// `dir` must be a directory every rank sees.
class Checkpointer {
 public:
  /// Checkpoints `module` (a module or its holder) and `optimizer` in directory `dir`, over
  /// `group` (default: dist::init()'s).
  template <class M>
  Checkpointer(std::string dir, M& module, optim::Optimizer& optimizer, CheckpointerOptions options = {},
               ProcessGroup* group = nullptr)
      : dir_(std::move(dir)), module_(nn::module_of(module)), optimizer_(optimizer), options_(options),
        group_(group ? *group : dist::init()) {
    CHORUS_CHECK(options_.every >= 0, "Checkpointer: every must be >= 0, got ", options_.every);
    CHORUS_CHECK(options_.keep >= 1, "Checkpointer: keep must be >= 1, got ", options_.keep);
  }

  /// Loads the newest complete checkpoint, if there is one, into the model, the optimizer, the
  /// scheduler and the generator; returns its step (0, and nothing changed, when there is none).
  std::int64_t resume();

  /// After step `step` (the count of steps done): saves when it is a multiple of `every`.
  void step(std::int64_t step) {
    if (options_.every > 0 && step % options_.every == 0) save(step);
  }

  /// Saves the state after `step` steps (Note [checkpointer]).
  void save(std::int64_t step);

  /// The step of the newest complete checkpoint (-1: none).
  std::int64_t latest_step() const;

 private:
  static std::string name_of(std::int64_t step);
  std::string read_latest() const;
  void write_files(std::int64_t step, const Tensor<std::int64_t>& rng);

  void write(std::int64_t step, const Tensor<std::int64_t>& rng);

  std::string dir_;
  nn::Module& module_;
  optim::Optimizer& optimizer_;
  CheckpointerOptions options_;
  ProcessGroup& group_;
};

}  // namespace CHORUS_DIST_NS
}  // namespace dist
CHORUS_NAMESPACE_END

// The definitions: compiled into chorus::compiled and the MPI library, or here in the
// header-only form (Note [compiled chorus] in compiled.hpp).
#if !CHORUS_COMPILED
#include "checkpointer_impl.hpp"
#endif
