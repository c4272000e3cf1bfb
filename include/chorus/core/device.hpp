#pragma once
// Device: where a tensor's storage lives and where its work runs.
#include <cstdint>
#include <functional>
#include <ostream>
#include <string>
#include <string_view>

#include "../error.hpp"

CHORUS_NAMESPACE_BEGIN

/// The kind of a Device: the host CPU or a CUDA GPU.
enum class DeviceKind : std::uint8_t { CPU = 0, CUDA = 1 };

/// `cpu:i` (a virtual CPU device, see Note [virtual CPU devices]) or `cuda:i` (a visible GPU).
struct Device {
  DeviceKind kind = DeviceKind::CPU;  ///< CPU or CUDA
  int index = 0;                      ///< the device's number within its kind

  constexpr Device() = default;
  /// The device `i` of kind `k`.
  constexpr Device(DeviceKind k, int i) : kind(k), index(i) {}

  /// `cpu:i`.
  static constexpr Device cpu(int i = 0) { return {DeviceKind::CPU, i}; }
  /// `cuda:i`.
  static constexpr Device cuda(int i = 0) { return {DeviceKind::CUDA, i}; }

  /// Parses "cpu", "cpu:3", "cuda", "cuda:1".
  static Device parse(std::string_view s) {
    auto colon = s.find(':');
    std::string_view kind = s.substr(0, colon);
    int index = 0;
    if (colon != std::string_view::npos) {
      std::string_view num = s.substr(colon + 1);
      CHORUS_CHECK(!num.empty() && num.size() <= 6 &&
                       num.find_first_not_of("0123456789") == std::string_view::npos,
                   "invalid device string '", s, "': expected cpu[:N] or cuda[:N]");
      index = std::stoi(std::string(num));
    }
    if (kind == "cpu") return cpu(index);
    if (kind == "cuda") return cuda(index);
    CHORUS_FAIL("invalid device string '", s, "': expected cpu[:N] or cuda[:N]");
  }

  /// True for a CPU device.
  constexpr bool is_cpu() const { return kind == DeviceKind::CPU; }
  /// True for a CUDA device.
  constexpr bool is_cuda() const { return kind == DeviceKind::CUDA; }

  /// "cpu:i" or "cuda:i".
  std::string str() const { return std::string(is_cpu() ? "cpu:" : "cuda:") + std::to_string(index); }

  friend constexpr bool operator==(const Device&, const Device&) = default;
  friend constexpr auto operator<=>(const Device&, const Device&) = default;
  friend std::ostream& operator<<(std::ostream& os, const Device& d) { return os << d.str(); }
};

CHORUS_NAMESPACE_END

// Specialises the standard's std::hash for chorus::Device.
/// \cond
template <>
struct std::hash<chorus::Device> {
  std::size_t operator()(const chorus::Device& d) const noexcept {
    return (static_cast<std::size_t>(d.kind) << 16) ^ static_cast<std::size_t>(d.index);
  }
};
/// \endcond
