#pragma once
// The definitions of core/clone_scope.hpp: compiled into chorus::compiled (src/core/core.cpp),
// included by clone_scope.hpp itself in the header-only form (Note [compiled chorus] in
// compiled.hpp).
#include "clone_scope.hpp"

CHORUS_NAMESPACE_BEGIN

CHORUS_INLINE CloneScope::~CloneScope() { slot() = prev_; }

CHORUS_INLINE std::shared_ptr<void> CloneScope::map_object(const void* key,
                                                           const std::function<std::shared_ptr<void>()>& make) {
  if (auto it = memo_.find(key); it != memo_.end()) return it->second;
  auto copy = make();
  memo_.emplace(key, copy);
  return copy;
}

CHORUS_NAMESPACE_END
