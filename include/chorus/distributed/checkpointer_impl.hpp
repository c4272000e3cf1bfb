#pragma once
// The definitions of distributed/checkpointer.hpp (Checkpointer's saving and resuming):
// compiled into chorus::compiled and the MPI library (src/distributed/local.cpp, mpi.cpp),
// included by checkpointer.hpp itself in the header-only form (Note [compiled chorus]).
#include "checkpointer.hpp"

CHORUS_NAMESPACE_BEGIN
namespace dist {
inline namespace CHORUS_DIST_NS {

CHORUS_INLINE std::int64_t Checkpointer::resume() {
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
  return name.empty() ? -1 : std::stoll(name.substr(5));
}

CHORUS_INLINE std::string Checkpointer::name_of(std::int64_t step) {
  std::ostringstream os;
  os << "step-" << step;
  return os.str();
}

CHORUS_INLINE std::string Checkpointer::read_latest() const {
  std::ifstream f(std::filesystem::path(dir_) / "latest");
  std::string name;
  if (!(f >> name)) return {};
  CHORUS_CHECK(name.rfind("step-", 0) == 0 && name.size() > 5 &&
                   name.find_first_not_of("0123456789", 5) == std::string::npos,
               "Checkpointer: '", dir_, "/latest' names '", name, "', not a checkpoint");
  return name;
}

CHORUS_INLINE void Checkpointer::write(std::int64_t step, const Tensor<std::int64_t>& rng) {
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

}  // namespace CHORUS_DIST_NS
}  // namespace dist
CHORUS_NAMESPACE_END
