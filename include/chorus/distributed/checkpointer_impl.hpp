#pragma once
// The definitions of distributed/checkpointer.hpp (Checkpointer's saving and resuming):
// compiled into chorus::compiled and the MPI library (src/distributed/local.cpp, mpi.cpp),
// included by checkpointer.hpp itself in the header-only form (Note [compiled chorus]).
#include <charconv>
#include <optional>
#include <system_error>

#include "checkpointer.hpp"

CHORUS_NAMESPACE_BEGIN
namespace dist {
inline namespace CHORUS_DIST_NS {

namespace detail {
/// N of a directory name `step-N` (digits only), or nullopt for any other name or a number
/// beyond int64.
CHORUS_INLINE std::optional<std::int64_t> checkpoint_step(const std::string& name) {
  if (name.rfind("step-", 0) != 0 || name.size() <= 5 || name.find_first_not_of("0123456789", 5) != std::string::npos)
    return std::nullopt;
  std::int64_t step = 0;
  const auto [end, ec] = std::from_chars(name.data() + 5, name.data() + name.size(), step);
  if (ec != std::errc() || end != name.data() + name.size()) return std::nullopt;
  return step;
}
}  // namespace detail

CHORUS_INLINE std::int64_t Checkpointer::resume() {
  const auto name = read_latest();
  if (name.empty()) return 0;
  const std::filesystem::path at = std::filesystem::path(dir_) / name;
  // Every file's header is read and checked against its size before the first is applied: a
  // truncated one changes nothing. The model loads from the file read here.
  const auto model_path = (at / "model.safetensors").string();
  const auto model = io::read(model_path);
  (void)io::read((at / "optimizer.safetensors").string());
  auto f = io::read((at / "rng.safetensors").string());
  io::load_into(module_, model, "'" + model_path + "'");
  io::TrainingState with;
  with.scheduler = options_.scheduler;
  chorus::load(optimizer_, (at / "optimizer.safetensors").string(), with);
  const std::int64_t step = *detail::checkpoint_step(name);
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

CHORUS_INLINE void Checkpointer::save(std::int64_t step) {
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

CHORUS_INLINE std::int64_t Checkpointer::latest_step() const {
  const auto name = read_latest();
  return name.empty() ? -1 : *detail::checkpoint_step(name);
}

CHORUS_INLINE std::string Checkpointer::name_of(std::int64_t step) {
  std::ostringstream os;
  os << "step-" << step;
  return os.str();
}

CHORUS_INLINE std::string Checkpointer::read_latest() const {
  namespace fs = std::filesystem;
  std::ifstream f(fs::path(dir_) / "latest");
  std::string name;
  if (!(f >> name)) {
    // No `latest`: a fresh start, unless checkpoints are there (a lost or deleted `latest` must
    // not silently restart the job from step 0 over them).
    std::error_code ec;
    for (fs::directory_iterator it(dir_, ec), end; !ec && it != end; it.increment(ec)) {
      const auto n = it->path().filename().string();
      CHORUS_CHECK(!(detail::checkpoint_step(n) && it->is_directory()), "Checkpointer: '", dir_, "' holds ", n,
                   " but no readable 'latest' naming the newest complete checkpoint; write its name into '", dir_,
                   "/latest' to resume from it, or use another directory to start afresh");
    }
    return {};
  }
  CHORUS_CHECK(detail::checkpoint_step(name), "Checkpointer: '", dir_, "/latest' names '", name,
               "', not a checkpoint (step-N, N an int64)");
  return name;
}

CHORUS_INLINE void Checkpointer::write(std::int64_t step, const Tensor<std::int64_t>& rng) {
  try {
    write_files(step, rng);
  } catch (const std::filesystem::filesystem_error& e) {
    CHORUS_FAIL("Checkpointer: cannot write step ", step, " into '", dir_, "': ", e.what());
  }
}

CHORUS_INLINE void Checkpointer::write_files(std::int64_t step, const Tensor<std::int64_t>& rng) {
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
  // The newest `keep` stay (a directory named like a checkpoint but not one is left alone).
  std::vector<std::int64_t> steps;
  for (const auto& e : fs::directory_iterator(dir)) {
    const auto n = detail::checkpoint_step(e.path().filename().string());
    if (n && e.is_directory() && e.path().filename() == name_of(*n)) steps.push_back(*n);
  }
  std::sort(steps.begin(), steps.end());
  for (std::size_t i = 0; i + static_cast<std::size_t>(options_.keep) < steps.size(); ++i)
    if (steps[i] != step) fs::remove_all(dir / name_of(steps[i]));
}

}  // namespace CHORUS_DIST_NS
}  // namespace dist
CHORUS_NAMESPACE_END
