#pragma once
// println: one whole line per call, also from several threads at once.
//
// DataParallel runs the replicas' forward passes concurrently (Note [DataParallel threads]),
// so `std::cout << "in replica " << x.shape() << "\n"` in a forward can interleave with other
// replicas' output mid-line. println formats its arguments into one string first and writes
// it, newline included, under a process-wide lock, then flushes: lines never mix (with other
// println calls; raw `std::cout <<` elsewhere is not locked). std::osyncstream (<syncstream>)
// does the same where the standard library provides it.
#include <mutex>
#include <iostream>
#include <ostream>
#include <sstream>
#include <string>
#include <type_traits>

#include "../config.hpp"

CHORUS_NAMESPACE_BEGIN
namespace detail {
inline std::mutex& println_mutex() {
  static std::mutex m;
  return m;
}
}  // namespace detail

/// Writes the arguments (anything with an `operator<<`) and a newline to `os` as one line.
template <class... Args>
void println(std::ostream& os, const Args&... args) {
  std::ostringstream line;
  ((line << args), ...);
  line << '\n';
  const std::string s = std::move(line).str();
  std::lock_guard<std::mutex> lk(detail::println_mutex());
  os.write(s.data(), static_cast<std::streamsize>(s.size()));
  os.flush();
}

/// Writes the arguments and a newline to std::cout as one line (see println(os, ...)).
template <class First, class... Rest>
  requires(!std::is_base_of_v<std::ios_base, std::remove_cvref_t<First>>)  // a stream goes to the overload above
void println(const First& first, const Rest&... rest) {
  println(std::cout, first, rest...);
}
/// Writes an empty line to std::cout.
inline void println() { println(std::cout); }

CHORUS_NAMESPACE_END
