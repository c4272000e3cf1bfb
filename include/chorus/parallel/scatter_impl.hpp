#pragma once
// The definitions of parallel/scatter.hpp (SplitMeasure's names, check_dims_fit): compiled into
// chorus::compiled (src/parallel/parallel.cpp), included by scatter.hpp itself in the
// header-only form (Note [compiled chorus]).
#include "scatter.hpp"

CHORUS_NAMESPACE_BEGIN
namespace parallel {
namespace detail {

CHORUS_INLINE std::string SplitMeasure::name(std::size_t index, const LeafPath& path) const {
  const std::string i = std::to_string(index);
  return what_ + (naming_ == Numbered ? " " + i : naming_ == Indexed ? "[" + i + "]" : std::string()) + path.str();
}

CHORUS_INLINE void check_dims_fit(const char* who, const char* dims_name, std::size_t dims, std::size_t elements,
                                  const char* elements_name) {
  CHORUS_CHECK(dims <= elements, who, ": ", dims_name, " has ", dims, " entries but there ",
               elements == 1 ? "is " : "are ", elements, " ", elements_name);
}

}  // namespace detail
}  // namespace parallel
CHORUS_NAMESPACE_END
