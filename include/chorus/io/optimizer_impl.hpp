#pragma once
// The definitions of io/optimizer.hpp: compiled into chorus::compiled (src/io/state.cpp),
// included by optimizer.hpp itself in the header-only form (Note [compiled chorus]).
#include <charconv>

#include "optimizer.hpp"

CHORUS_NAMESPACE_BEGIN
namespace io::detail {
CHORUS_INLINE std::string number(double v) {
  char buf[64];
  auto r = std::to_chars(buf, buf + sizeof buf, v);
  return std::string(buf, r.ptr);
}
CHORUS_INLINE double parse_number(const std::string& s, const std::string& what) {
  double v = 0;
  auto r = std::from_chars(s.data(), s.data() + s.size(), v);
  CHORUS_CHECK(r.ec == std::errc() && r.ptr == s.data() + s.size() && !s.empty(), "load: ", what, " is '", s,
               "', not a number");
  return v;
}
}  // namespace io::detail

CHORUS_INLINE void save(const optim::Optimizer& opt, const std::string& path, const io::TrainingState& with) {
  std::vector<std::pair<std::size_t, const optim::Optimizer::State*>> states;
  for (std::size_t i = 0; i < opt.state().size(); ++i) states.emplace_back(i, &opt.state()[i]);
  io::detail::write_atomically(path, io::detail::optimizer_image(opt, states, with));
}

CHORUS_INLINE std::vector<std::uint8_t> io::detail::optimizer_image(
    const optim::Optimizer& opt, const std::vector<std::pair<std::size_t, const optim::Optimizer::State*>>& states,
    const io::TrainingState& with, std::optional<std::size_t> parameters) {
  const optim::LRScheduler* scheduler = with.scheduler;
  std::vector<nn::Module::NamedTensor> tensors;
  for (const auto& [i, state] : states)
    for (const auto& [k, v] : *state) tensors.push_back({std::to_string(i) + "." + k, v});
  if (with.master) {
    CHORUS_CHECK(with.master->size() == opt.parameters().size(), "save: the master weights hold ",
                 with.master->size(), " parameters, the optimizer steps ", opt.parameters().size());
    for (std::size_t i = 0; i < with.master->size(); ++i)
      if (with.master->is_copy(i)) tensors.push_back({"master." + std::to_string(i), with.master->parameters()[i]});
  }
  io::Metadata meta{{"format", "chorus.optimizer"},
                    {"optimizer", opt.name()},
                    {"parameters", std::to_string(parameters.value_or(opt.parameters().size()))},
                    {"groups", std::to_string(opt.num_groups())}};
  for (std::size_t g = 0; g < opt.num_groups(); ++g) {
    meta["group." + std::to_string(g) + ".lr"] = io::detail::number(opt.lr(g));
    if (opt.has_momentum()) meta["group." + std::to_string(g) + ".momentum"] = io::detail::number(opt.momentum(g));
  }
  if (scheduler) {
    CHORUS_CHECK(&scheduler->optimizer() == &opt, "save: the scheduler drives another optimizer");
    meta["scheduler"] = scheduler->name();
    meta["scheduler.last_epoch"] = std::to_string(scheduler->last_epoch());
    std::string bases;
    for (double b : scheduler->base_lrs()) {
      if (!bases.empty()) bases += ',';
      bases += io::detail::number(b);
    }
    meta["scheduler.base_lrs"] = bases;
  }
  if (with.scaler) {
    CHORUS_CHECK(with.scaler->is_enabled(), "save: the GradScaler is disabled (it has no state to save)");
    for (const auto& [k, v] : with.scaler->state_dict()) meta["scaler." + k] = io::detail::number(v);
  }
  return io::detail::serialise(tensors, meta);
}

CHORUS_INLINE void load(optim::Optimizer& opt, const std::string& path, const io::TrainingState& with) {
  load(opt, io::read(path), with);
}

CHORUS_INLINE void load(optim::Optimizer& opt, const io::File& f, const io::TrainingState& with) {
  optim::LRScheduler* scheduler = with.scheduler;
  // For messages: the file's name (its source without read()'s quotes).
  const std::string path = f.source.size() >= 2 && f.source.front() == '\'' && f.source.back() == '\''
                               ? f.source.substr(1, f.source.size() - 2)
                               : f.source;
  auto get = [&](const char* k) {
    auto it = f.metadata.find(k);
    return it == f.metadata.end() ? std::string() : it->second;
  };
  CHORUS_CHECK(get("format") == "chorus.optimizer", "load: '", path, "' is not an optimizer checkpoint");
  CHORUS_CHECK(get("optimizer") == opt.name(), "load: '", path, "' holds ", get("optimizer"), " state, not ",
               opt.name());
  CHORUS_CHECK(get("parameters") == std::to_string(opt.parameters().size()), "load: '", path, "' holds state for ",
               get("parameters"), " parameters, the optimizer has ", opt.parameters().size());
  // Group hyperparameters (files from before parameter groups have none: lrs stay as they are).
  std::vector<double> lrs, momenta;
  if (f.metadata.count("groups")) {
    CHORUS_CHECK(get("groups") == std::to_string(opt.num_groups()), "load: '", path, "' holds ", get("groups"),
                 " parameter groups, the optimizer has ", opt.num_groups());
    for (std::size_t g = 0; g < opt.num_groups(); ++g) {
      const std::string key = "group." + std::to_string(g) + ".";
      lrs.push_back(io::detail::parse_number(get((key + "lr").c_str()), "'" + path + "': " + key + "lr"));
      CHORUS_CHECK(lrs.back() >= 0, "load: '", path, "': ", key, "lr is negative (", lrs.back(), ")");
      if (opt.has_momentum())
        momenta.push_back(io::detail::parse_number(get((key + "momentum").c_str()), "'" + path + "': " + key + "momentum"));
    }
  }
  std::int64_t sched_epoch = 0;
  std::vector<double> sched_bases;
  if (scheduler) {
    CHORUS_CHECK(f.metadata.count("scheduler"), "load: '", path, "' holds no learning-rate scheduler state (wanted ",
                 scheduler->name(), ")");
    CHORUS_CHECK(get("scheduler") == scheduler->name(), "load: '", path, "' holds ", get("scheduler"),
                 " scheduler state, not ", scheduler->name());
    sched_epoch = static_cast<std::int64_t>(
        io::detail::parse_number(get("scheduler.last_epoch"), "'" + path + "': scheduler.last_epoch"));
    const std::string bases = get("scheduler.base_lrs");
    for (std::size_t pos = 0; pos <= bases.size();) {
      auto comma = bases.find(',', pos);
      if (comma == std::string::npos) comma = bases.size();
      sched_bases.push_back(
          io::detail::parse_number(bases.substr(pos, comma - pos), "'" + path + "': scheduler.base_lrs"));
      pos = comma + 1;
    }
    CHORUS_CHECK(sched_bases.size() == opt.num_groups(), "load: '", path, "' holds ", sched_bases.size(),
                 " scheduler base lrs for ", opt.num_groups(), " parameter groups");
  }
  std::map<std::string, double> scaler_state;
  if (with.scaler) {
    for (const auto& [k, v] : f.metadata)
      if (k.rfind("scaler.", 0) == 0) scaler_state[k.substr(7)] = io::detail::parse_number(v, "'" + path + "': " + k);
    CHORUS_CHECK(!scaler_state.empty(), "load: '", path, "' holds no GradScaler state");
    amp::GradScaler probe(with.scaler->options());  // validates before anything changes
    probe.load_state_dict(scaler_state);
  }
  std::vector<std::pair<std::size_t, Tensor<float>>> masters;
  if (with.master) {
    CHORUS_CHECK(with.master->size() == opt.parameters().size(), "load: the master weights hold ",
                 with.master->size(), " parameters, the optimizer steps ", opt.parameters().size());
    for (std::size_t i = 0; i < with.master->size(); ++i) {
      if (!with.master->is_copy(i)) continue;
      const auto it = f.tensors.find("master." + std::to_string(i));
      CHORUS_CHECK(it != f.tensors.end(), "load: '", path, "' holds no master copy of parameter ", i);
      const auto& want = with.master->parameters()[i];
      CHORUS_CHECK(it->second.dtype == DType::Float32 && it->second.shape == want.shape(), "load: '", path,
                   "': master.", i, " is ", dtype_name(it->second.dtype), " ", it->second.shape, ", expected float32 ",
                   want.shape());
      masters.emplace_back(i, io::detail::host_tensor<float>(f, it->second).to(want.device()));
    }
  }
  std::vector<optim::Optimizer::State> state(opt.parameters().size());
  for (const auto& [name, r] : f.tensors) {
    // Master weights saved and none to load them into: the stale masters would overwrite the
    // model at the next step (training would jump back), so the load is refused.
    CHORUS_CHECK(with.master || name.rfind("master.", 0) != 0, "load: '", path,
                 "' holds master weights (", name, "): pass the program's amp::MasterWeights, load(opt, path, "
                 "{.master = &master})");
    if (name.rfind("master.", 0) == 0) continue;
    const auto dot = name.find('.');
    CHORUS_CHECK(dot != std::string::npos && dot > 0 && name.find_first_not_of("0123456789") == dot, "load: '", path,
                 "': '", name, "' is not of the form <parameter index>.<state>");
    // from_chars, not stoul: a 23-digit index must be a chorus::Error, not std::out_of_range.
    std::size_t i = 0;
    const auto [end, ec] = std::from_chars(name.data(), name.data() + dot, i);
    CHORUS_CHECK(ec == std::errc() && end == name.data() + dot && i < state.size(), "load: '", path, "': '", name,
                 "' names parameter ", name.substr(0, dot), ", but the optimizer has ", state.size());
    const Device dev = opt.parameters()[i].device();
    AnyTensor t;
    switch (r.dtype) {
      case DType::Float32: t = io::detail::host_tensor<float>(f, r).to(dev); break;
      case DType::Float64: t = io::detail::host_tensor<double>(f, r); break;  // scalars stay on the host
      case DType::Int64: t = io::detail::host_tensor<std::int64_t>(f, r).to(dev); break;
      case DType::BFloat16: t = io::detail::host_tensor<bfloat16>(f, r).to(dev); break;
      case DType::Float16: t = io::detail::host_tensor<half>(f, r).to(dev); break;
    }
    if (r.dtype == DType::Float64 && name.substr(dot + 1) != "step") t = t.as<double>().to(dev);
    state[i][name.substr(dot + 1)] = t;
  }
  // Nothing changes unless everything loads (README): the checks above read only the file, the
  // scheduler's state is checked before anything is written, and of the writes only a momentum
  // or the state itself can still be refused: those go first and are undone if one is.
  if (scheduler) scheduler->check_state(sched_epoch, sched_bases);
  std::vector<double> old_momenta;
  for (std::size_t g = 0; g < momenta.size(); ++g) old_momenta.push_back(opt.momentum(g));
  try {
    for (std::size_t g = 0; g < momenta.size(); ++g) opt.set_momentum(g, momenta[g]);
    opt.load_state(std::move(state));
  } catch (...) {
    for (std::size_t g = 0; g < old_momenta.size(); ++g) opt.set_momentum(g, old_momenta[g]);
    throw;
  }
  for (std::size_t g = 0; g < lrs.size(); ++g) opt.set_lr(g, lrs[g]);
  if (scheduler) scheduler->load_state(sched_epoch, std::move(sched_bases));
  if (with.scaler) with.scaler->load_state_dict(scaler_state);
  if (with.master) {
    NoGradGuard g;
    for (auto& [i, t] : masters) {
      const auto& m = with.master->parameters()[i].as<float>();
      backend::copy(m, t);
      m.bump_version();
    }
    with.master->master_to_model();
  }
}

CHORUS_NAMESPACE_END
