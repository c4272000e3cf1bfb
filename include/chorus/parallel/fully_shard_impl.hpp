#pragma once
// The definitions of parallel/fully_shard.hpp: compiled into chorus::compiled, or included by
// fully_shard.hpp in the header-only form (Note [compiled chorus]).
#include <algorithm>
#include <unordered_map>

#include "fully_shard.hpp"

CHORUS_NAMESPACE_BEGIN
namespace parallel::detail {

CHORUS_INLINE std::vector<std::pair<std::string, std::vector<nn::Module::NamedTensor>>> fsdp_units(
    nn::Module& root, std::vector<FsdpUnitSlot*>& slots) {
  std::vector<std::pair<std::string, std::vector<nn::Module::NamedTensor>>> units{{"", {}}};
  slots.assign(1, nullptr);
  std::unordered_map<const void*, std::size_t> unit_of;  // a parameter's unit, by impl key
  std::unordered_map<const void*, std::string> name_of;
  // Each module's own parameters go to the innermost unit around it.
  auto walk = [&](auto& self, nn::Module& m, const std::string& prefix, std::size_t unit) -> void {
    if (auto* slot = dynamic_cast<FsdpUnitSlot*>(&m); slot && &m != &root) {
      CHORUS_CHECK(!slot->fsdp_unit, "FullyShardedDataParallel: the FullyShard module '", prefix,
                   "' is a unit of another FullyShardedDataParallel already");
      units.push_back({prefix, {}});
      slots.push_back(slot);
      unit = units.size() - 1;
    }
    for (auto& [name, t] : m.named_parameters(/*recurse=*/false)) {
      const std::string full = prefix.empty() ? name : prefix + "." + name;
      const void* key = t.impl_key();
      const auto it = unit_of.find(key);
      if (it != unit_of.end()) {
        CHORUS_CHECK(it->second == unit, "FullyShardedDataParallel: the parameter '", name_of[key], "' is also '",
                     full, "', in ", units[unit].first.empty() ? std::string("the root") : "unit '" +
                     units[unit].first + "'", " and ", units[it->second].first.empty() ? std::string("the root") :
                     "unit '" + units[it->second].first + "'", "; a tied weight must live in one unit (wrap the "
                     "modules that share it together, or leave them to the root)");
        continue;
      }
      unit_of.emplace(key, unit);
      name_of.emplace(key, full);
      units[unit].second.push_back({full, t});
    }
    for (const auto& child : m.named_children())
      self(self, *child.module, prefix.empty() ? child.name : prefix + "." + child.name, unit);
  };
  walk(walk, root, "", 0);
  return units;
}

CHORUS_INLINE std::vector<std::shared_ptr<FsdpUnit>> make_units(nn::Module& root, FsdpShared& shared) {
  std::vector<FsdpUnitSlot*> slots;
  auto layout = fsdp_units(root, slots);
  std::vector<std::shared_ptr<FsdpUnit>> units;
  for (std::size_t u = 0; u < layout.size(); ++u) {
    units.push_back(std::make_shared<FsdpUnit>(layout[u].first, layout[u].second, shared, u == 0));
    shared.units.push_back(units.back().get());
    for (const auto& p : units.back()->params()) shared.holder.emplace(p.impl_key(), units.back().get());
    if (slots[u]) slots[u]->fsdp_unit = units.back();
  }
  return units;
}

CHORUS_INLINE void unlink_units(nn::Module& root, const std::vector<std::shared_ptr<FsdpUnit>>& units) {
  for (const auto& u : units) u->release();  // a graph that outlives the wrapper refuses backward
  auto walk = [&](auto& self, nn::Module& m) -> void {
    auto* slot = dynamic_cast<FsdpUnitSlot*>(&m);
    if (slot && std::find(units.begin(), units.end(), slot->fsdp_unit) != units.end()) slot->fsdp_unit.reset();
    for (const auto& child : m.named_children()) self(self, *child.module);
  };
  walk(walk, root);
}

}  // namespace parallel::detail
CHORUS_NAMESPACE_END
