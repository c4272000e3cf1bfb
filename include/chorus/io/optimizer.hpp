#pragma once
// Optimizer checkpoints: an optimizer's state in a safetensors file, with what else a step
// depends on (io::TrainingState): the learning-rate scheduler, the GradScaler and the float32
// master weights of a 16-bit model. Tensor "<i>.<key>" is entry `key` of parameter i's state,
// "master.<i>" the master copy of parameter i; the metadata holds the groups' hyperparameters,
// the scheduler's and the scaler's state.
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "../amp/grad_scaler.hpp"
#include "../amp/master_weights.hpp"
#include "../compiled.hpp"
#include "../optim/lr_scheduler.hpp"
#include "../optim/optimizer.hpp"
#include "safetensors.hpp"

CHORUS_NAMESPACE_BEGIN
namespace io::detail {
/// Shortest round-trip text of a double (checkpoint metadata holds strings only).
CHORUS_INLINE std::string number(double v);
CHORUS_INLINE double parse_number(const std::string& s, const std::string& what);
}  // namespace io::detail

namespace io {
/// What else an optimizer checkpoint holds (each optional):
/// `save(opt, path, {.scheduler = &sched, .scaler = &scaler, .master = &master})`.
struct TrainingState {
  optim::LRScheduler* scheduler = nullptr;  ///< the lr scheduler: its epoch and base lrs (Note [closed-form schedules])
  amp::GradScaler* scaler = nullptr;        ///< the GradScaler: its state_dict() (scale, factors, growth tracker)
  amp::MasterWeights* master = nullptr;     ///< the float32 masters the optimizer steps (bitwise resume)
};
}  // namespace io

namespace io::detail {
/// What save(opt, path, with) writes, for the states of the given parameters only (the index the
/// file gives it, that parameter's state): a ZeroRedundancyOptimizer's rank writes its own, a
/// one-process FullyShardedDataParallel each device's. `parameters`: how many parameters the file
/// says the optimizer steps (default: opt's).
CHORUS_INLINE std::vector<std::uint8_t> optimizer_image(
    const optim::Optimizer& opt, const std::vector<std::pair<std::size_t, const optim::Optimizer::State*>>& states,
    const io::TrainingState& with, std::optional<std::size_t> parameters = std::nullopt);
}  // namespace io::detail

/// Saves an optimizer's state: tensor "<i>.<key>" is entry `key` of parameter i's state; the
/// metadata holds each parameter group's lr (and momentum), and the file what `with` names.
CHORUS_INLINE void save(const optim::Optimizer& opt, const std::string& path, const io::TrainingState& with = {});

/// Loads optimizer state saved by save(optimizer): same optimizer type, same parameters and
/// groups; restores each group's lr (and momentum) and what `with` names (the file must hold
/// it: a scheduler of the same kind, a scaler's state, the masters, which are then written into
/// the model too). Nothing changes when anything mismatches.
CHORUS_INLINE void load(optim::Optimizer& opt, const std::string& path, const io::TrainingState& with = {});
/// The same from a file already read (io::read) or an image (io::parse).
CHORUS_INLINE void load(optim::Optimizer& opt, const io::File& f, const io::TrainingState& with = {});

CHORUS_NAMESPACE_END

// The definitions: compiled into chorus::compiled, or here in the header-only form (Note
// [compiled chorus] in compiled.hpp).
#if !CHORUS_COMPILED
#include "optimizer_impl.hpp"
#endif
