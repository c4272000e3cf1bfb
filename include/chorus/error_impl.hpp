#pragma once
// The definitions of error.hpp (building a failed check's message and throwing it): compiled
// into chorus::compiled (src/core/core.cpp), included by error.hpp itself in the header-only
// form (Note [compiled chorus] in compiled.hpp).
#include <sstream>

#include "error.hpp"

CHORUS_NAMESPACE_BEGIN
namespace detail {

CHORUS_INLINE void MessagePart::print(std::ostream& os) const {
  if (print_) {
    print_(os, value_);
  } else if (manipulator_) {
    os << manipulator_;
  } else {
    os << text_;
  }
}

CHORUS_INLINE std::string join_message(std::initializer_list<MessagePart> parts) {
  std::ostringstream os;
  for (const auto& p : parts) p.print(os);
  return os.str();
}

[[noreturn]] CHORUS_INLINE void throw_message(std::initializer_list<MessagePart> parts) { throw Error(join_message(parts)); }

}  // namespace detail
CHORUS_NAMESPACE_END
