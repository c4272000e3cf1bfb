#pragma once
// chorus::Error and the check macros. Library code reports every failure by throwing
// chorus::Error; it never prints or exits.
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

#include "config.hpp"

CHORUS_NAMESPACE_BEGIN

/// The one exception type chorus throws. The message says what failed, with the values
/// involved and, where it matters, where (a replica, a device, a file).
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

namespace detail {
template <class... Args>
std::string str_cat(Args&&... args) {
  std::ostringstream os;
  (os << ... << std::forward<Args>(args));
  return os.str();
}

template <class... Args>
[[noreturn]] void throw_error(Args&&... args) {
  throw Error(str_cat(std::forward<Args>(args)...));
}
}  // namespace detail

CHORUS_NAMESPACE_END

/// CHORUS_CHECK(cond, parts...): throws chorus::Error made of `parts` when `cond` is false.
#define CHORUS_CHECK(cond, ...)                              \
  do {                                                       \
    if (!(cond)) [[unlikely]] {                              \
      ::chorus::detail::throw_error(__VA_ARGS__);            \
    }                                                        \
  } while (0)

/// CHORUS_FAIL(parts...): throws chorus::Error made of `parts`.
#define CHORUS_FAIL(...) ::chorus::detail::throw_error(__VA_ARGS__)
