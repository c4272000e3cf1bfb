#pragma once
// The CUDA runtime API as chorus uses it: the status check macro. Empty in CPU-only builds.
#include "../error.hpp"

#if CHORUS_CUDA
#include <cuda_runtime.h>

#include <cstdlib>
#include <string_view>

/// Checks a cudaError_t; throws chorus::Error naming the call, the error and where.
#define CHORUS_CUDA_CHECK(expr)                                                               \
  do {                                                                                        \
    cudaError_t chorus_err_ = (expr);                                                         \
    if (chorus_err_ != cudaSuccess) [[unlikely]] {                                            \
      (void)cudaGetLastError();                                                               \
      ::chorus::detail::throw_error("CUDA error: ", cudaGetErrorName(chorus_err_), " (",       \
                                    cudaGetErrorString(chorus_err_), ") in ", #expr, " at ", \
                                    __FILE__, ":", __LINE__);                                 \
    }                                                                                         \
  } while (0)

CHORUS_NAMESPACE_BEGIN
namespace cuda {
/// Note [CHORUS_DEBUG_SYNC]: with CHORUS_DEBUG_SYNC=1 every launch is followed by a device
/// synchronisation and an error check, so a fault is reported at the launch that caused it.
inline bool debug_sync_enabled() {
  static const bool on = [] {
    const char* v = std::getenv("CHORUS_DEBUG_SYNC");
    return v && std::string_view(v) != "0" && std::string_view(v) != "";
  }();
  return on;
}

/// Checks the launch that was just made (and, in debug-sync mode, its execution).
inline void check_launch(const char* what) {
  cudaError_t e = cudaGetLastError();
  CHORUS_CHECK(e == cudaSuccess, "CUDA kernel launch failed (", what, "): ", cudaGetErrorString(e));
  if (debug_sync_enabled()) {
    e = cudaDeviceSynchronize();
    CHORUS_CHECK(e == cudaSuccess, "CUDA kernel failed (", what, ", CHORUS_DEBUG_SYNC): ",
                 cudaGetErrorString(e));
  }
}

/// Sets the current CUDA device for the calling thread for the guard's lifetime.
class DeviceGuard {
 public:
  explicit DeviceGuard(int index) {
    CHORUS_CUDA_CHECK(cudaGetDevice(&prev_));
    if (prev_ != index) CHORUS_CUDA_CHECK(cudaSetDevice(index));
  }
  ~DeviceGuard() {
    int cur = -1;
    if (cudaGetDevice(&cur) == cudaSuccess && cur != prev_) (void)cudaSetDevice(prev_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int prev_ = 0;
};
}  // namespace cuda
CHORUS_NAMESPACE_END
#endif
