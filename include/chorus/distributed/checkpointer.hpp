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
// so a resumed loop skips to it (README, "Crash and resume"); all of it gives parameters bitwise
// equal to an uninterrupted run's.
#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "../core/generator.hpp"
#include "../io/optimizer.hpp"
#include "../io/safetensors.hpp"
#include "process_group.hpp"

CHORUS_NAMESPACE_BEGIN
namespace dist {
inline namespace CHORUS_DIST_NS {

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
  std::int64_t resume() {
    const auto name = read_latest();
    if (name.empty()) return 0;
    const std::filesystem::path at = std::filesystem::path(dir_) / name;
    chorus::load(module_, (at / "model.safetensors").string());
    io::TrainingState with;
    with.scheduler = options_.scheduler;
    chorus::load(optimizer_, (at / "optimizer.safetensors").string(), with);
    auto f = io::read((at / "rng.safetensors").string());
    const std::int64_t step = std::stoll(name.substr(5));
    if (options_.generator) {
      const auto it = f.tensors.find("rng");
      CHORUS_CHECK(it != f.tensors.end(), "Checkpointer: '", at.string(), "' holds no generator state");
      auto rows = io::detail::host_tensor<std::int64_t>(f, it->second);
      CHORUS_CHECK(rows.dim() == 2 && rows.shape()[0] == group_.world_size(), "Checkpointer: '", at.string(),
                   "' holds the generators of ", rows.dim() == 2 ? rows.shape()[0] : 0,
                   " ranks, this job has ", group_.world_size());
      const auto* row = rows.data() + group_.rank() * rows.shape()[1];
      options_.generator->set_state(std::vector<std::uint64_t>(row, row + rows.shape()[1]));
    }
    return step;
  }

  /// After step `step` (the count of steps done): saves when it is a multiple of `every`.
  void step(std::int64_t step) {
    if (options_.every > 0 && step % options_.every == 0) save(step);
  }

  /// Saves the state after `step` steps (Note [checkpointer]).
  void save(std::int64_t step) {
    CHORUS_CHECK(step >= 0, "Checkpointer::save: step must be >= 0, got ", step);
    optimizer_.consolidate_state_dict(0);
    Tensor<std::int64_t> rng;
    if (options_.generator) {
      const auto state = options_.generator->get_state();
      auto mine = Tensor<std::int64_t>::empty(Shape{static_cast<std::int64_t>(state.size())});
      for (std::size_t i = 0; i < state.size(); ++i) mine.data()[i] = static_cast<std::int64_t>(state[i]);
      rng = group_.all_gather(mine);
    }
    if (group_.rank() == 0) write(step, rng);
    group_.barrier();  // nobody goes on before the checkpoint is complete
  }

  /// The step of the newest complete checkpoint (-1: none).
  std::int64_t latest_step() const {
    const auto name = read_latest();
    return name.empty() ? -1 : std::stoll(name.substr(5));
  }

 private:
  static std::string name_of(std::int64_t step) {
    std::ostringstream os;
    os << "step-" << step;
    return os.str();
  }
  std::string read_latest() const {
    std::ifstream f(std::filesystem::path(dir_) / "latest");
    std::string name;
    if (!(f >> name)) return {};
    CHORUS_CHECK(name.rfind("step-", 0) == 0 && name.size() > 5 &&
                     name.find_first_not_of("0123456789", 5) == std::string::npos,
                 "Checkpointer: '", dir_, "/latest' names '", name, "', not a checkpoint");
    return name;
  }

  void write(std::int64_t step, const Tensor<std::int64_t>& rng) {
    namespace fs = std::filesystem;
    const fs::path dir(dir_);
    fs::create_directories(dir);
    const fs::path final_dir = dir / name_of(step), tmp = dir / ("." + name_of(step) + ".tmp");
    fs::remove_all(tmp);
    fs::create_directories(tmp);
    chorus::save(module_, (tmp / "model.safetensors").string());
    io::TrainingState with;
    with.scheduler = options_.scheduler;
    chorus::save(optimizer_, (tmp / "optimizer.safetensors").string(), with);
    std::vector<nn::Module::NamedTensor> tensors;
    if (rng.defined()) tensors.push_back({"rng", AnyTensor(rng)});
    io::detail::write_atomically((tmp / "rng.safetensors").string(),
                                 io::detail::serialise(tensors, {{"step", std::to_string(step)}}));
    fs::remove_all(final_dir);  // a checkpoint of this step from before a crash
    fs::rename(tmp, final_dir);
    const std::string name = name_of(step) + "\n";
    io::detail::write_atomically((dir / "latest").string(), std::vector<std::uint8_t>(name.begin(), name.end()));
    // The newest `keep` stay.
    std::vector<std::int64_t> steps;
    for (const auto& e : fs::directory_iterator(dir)) {
      const auto n = e.path().filename().string();
      if (e.is_directory() && n.rfind("step-", 0) == 0 && n.size() > 5 &&
          n.find_first_not_of("0123456789", 5) == std::string::npos)
        steps.push_back(std::stoll(n.substr(5)));
    }
    std::sort(steps.begin(), steps.end());
    for (std::size_t i = 0; i + static_cast<std::size_t>(options_.keep) < steps.size(); ++i)
      if (steps[i] != step) fs::remove_all(dir / name_of(steps[i]));
  }

  std::string dir_;
  nn::Module& module_;
  optim::Optimizer& optimizer_;
  CheckpointerOptions options_;
  ProcessGroup& group_;
};

}  // namespace CHORUS_DIST_NS
}  // namespace dist
CHORUS_NAMESPACE_END
