#pragma once
// chorus::Error and the check macros. Library code reports every failure by throwing
// chorus::Error; it never prints or exits.
#include <initializer_list>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>

#include "compiled.hpp"

CHORUS_NAMESPACE_BEGIN

/// The one exception type chorus throws. The message says what failed, with the values
/// involved and, where it matters, where (a replica, a device, a file).
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

namespace detail {
// Note [message parts]
// A failed check's message is made of parts of any printable type. Folding them into one
// ostringstream inside a variadic template instantiated that stream code once per combination
// of argument types (in the compiled form those copies were a tenth of train_lm's object code).
// Each part is instead a pointer to its value and a printer made once per type (none for
// strings), and one non-template function prints them into one stream, in order, so stream
// manipulators (std::hex) apply to the parts after them as before.
class MessagePart {
 public:
  using Manipulator = std::ios_base& (*)(std::ios_base&);
  MessagePart(const char* s) : text_(s ? s : "(null)") {}
  MessagePart(std::string_view s) : text_(s) {}
  MessagePart(const std::string& s) : text_(s) {}
  MessagePart(Manipulator m) : manipulator_(m) {}
  template <class X>
  MessagePart(const X& x)
      : value_(&x), print_([](std::ostream& os, const void* v) { os << *static_cast<const X*>(v); }) {}

  void print(std::ostream& os) const;

 private:
  std::string_view text_;
  Manipulator manipulator_ = nullptr;
  const void* value_ = nullptr;
  void (*print_)(std::ostream&, const void*) = nullptr;
};

CHORUS_INLINE std::string join_message(std::initializer_list<MessagePart> parts);

[[noreturn]] CHORUS_INLINE void throw_message(std::initializer_list<MessagePart> parts);

/// The parts printed one after another, as `(os << ... << args)` prints them.
template <class... Args>
std::string str_cat(const Args&... args) {
  return join_message({MessagePart(args)...});
}

template <class... Args>
[[noreturn]] void throw_error(const Args&... args) {
  throw_message({MessagePart(args)...});
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

// The definitions: compiled into chorus::compiled, or here in the header-only form (Note
// [compiled chorus] in compiled.hpp).
#if !CHORUS_COMPILED
#include "error_impl.hpp"
#endif
