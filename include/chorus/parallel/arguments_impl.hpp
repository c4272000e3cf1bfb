#pragma once
// The definitions of parallel/arguments.hpp (LeafPath): compiled into chorus::compiled
// (src/parallel/parallel.cpp), included by arguments.hpp itself in the header-only form (Note
// [compiled chorus]).
#include "arguments.hpp"

CHORUS_NAMESPACE_BEGIN
namespace parallel::detail {

CHORUS_INLINE std::string LeafPath::str() const {
  if (!parent) return {};
  return parent->str() + (key ? "[\"" + *key + "\"]" : "[" + std::to_string(index) + "]");
}

}  // namespace parallel::detail
CHORUS_NAMESPACE_END
