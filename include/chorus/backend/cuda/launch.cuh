#pragma once
// Launch plumbing for the CUDA kernels: the stream of the calling thread, grid sizes, and
// shape/stride descriptors passed to kernels by value.
#include <algorithm>
#include <cstdint>

#include "../../core/runtime.hpp"
#include "../../core/shape.hpp"
#include "instances.hpp"

CHORUS_NAMESPACE_BEGIN
namespace backend::cuda {

inline constexpr int kThreads = 256;

/// Grid size for a grid-stride loop over n elements.
inline unsigned blocks_for(std::int64_t n) {
  const std::int64_t b = (n + kThreads - 1) / kThreads;
  return static_cast<unsigned>(std::clamp<std::int64_t>(b, 1, 65535LL * 16));
}

/// The calling thread's current stream on `d`, with `d` made the current device.
struct Launch {
  explicit Launch(Device d) : guard(d.index), stream(current_stream(d).handle()) {}
  ::chorus::cuda::DeviceGuard guard;
  cudaStream_t stream;
};

/// Sizes and up to three operands' strides, by value in kernel parameters.
struct NdDesc {
  int nd = 0;
  std::int64_t size[Dims::kMaxDims] = {};
  std::int64_t stride[3][Dims::kMaxDims] = {};
};

inline NdDesc make_desc(const Shape& shape, const Strides& s0, const Strides& s1 = {}, const Strides& s2 = {}) {
  NdDesc d;
  d.nd = shape.size();
  for (int i = 0; i < d.nd; ++i) {
    d.size[i] = shape[i];
    d.stride[0][i] = s0[i];
    d.stride[1][i] = s1.size() > i ? s1[i] : 0;
    d.stride[2][i] = s2.size() > i ? s2[i] : 0;
  }
  return d;
}

#if defined(__CUDACC__)  // device code: Note [precompiled CUDA kernels]
/// Offsets of linear element index `i` (row-major over desc.size) in each operand.
__device__ inline void nd_offsets(const NdDesc& d, std::int64_t i, std::int64_t off[3]) {
  off[0] = off[1] = off[2] = 0;
  for (int k = d.nd - 1; k >= 0; --k) {
    const std::int64_t idx = i % d.size[k];
    i /= d.size[k];
    off[0] += idx * d.stride[0][k];
    off[1] += idx * d.stride[1][k];
    off[2] += idx * d.stride[2][k];
  }
}

// Launches `kernel` (parenthesised when it has template arguments) over n elements, on the stream of
// a `launch` in scope (used by every CUDA kernel file of the backend); CHORUS_LAUNCH_GRID with
// an explicit grid, block and stream.
#define CHORUS_LAUNCH(kernel, n, ...)                                          \
  do {                                                                         \
    if ((n) > 0) CHORUS_LAUNCH_GRID(kernel, blocks_for(n), kThreads, launch.stream, __VA_ARGS__); \
  } while (0)
#define CHORUS_LAUNCH_GRID(kernel, grid, block, stream, ...)   \
  do {                                                         \
    auto* chorus_kernel_ = kernel;                             \
    chorus_kernel_<<<grid, block, 0, stream>>>(__VA_ARGS__);   \
    ::chorus::cuda::check_launch(#kernel);                     \
  } while (0)

#define CHORUS_GRID_STRIDE(i, n) \
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < (n); \
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x)

/// Sum of `v` over the block (all threads get the result).
template <class A>
__device__ inline A block_sum(A v) {
  __shared__ A buf[32];
  for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();
  if (lane == 0) buf[warp] = v;
  __syncthreads();
  const int warps = (blockDim.x + 31) >> 5;
  v = threadIdx.x < warps ? buf[threadIdx.x] : A(0);
  if (warp == 0)
    for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
  if (threadIdx.x == 0) buf[0] = v;
  __syncthreads();
  v = buf[0];
  __syncthreads();
  return v;
}

/// Maximum of `v` over the block (all threads get the result).
template <class A>
__device__ inline A block_max(A v) {
  __shared__ A buf[32];
  for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_down_sync(0xffffffffu, v, o));
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();
  if (lane == 0) buf[warp] = v;
  __syncthreads();
  const int warps = (blockDim.x + 31) >> 5;
  v = threadIdx.x < warps ? buf[threadIdx.x] : buf[0];
  if (warp == 0)
    for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_down_sync(0xffffffffu, v, o));
  if (threadIdx.x == 0) buf[0] = v;
  __syncthreads();
  v = buf[0];
  __syncthreads();
  return v;
}

#else  // a C++ translation unit with the precompiled kernels: the launchers' bodies parse, and are
       // never instantiated (their instances are extern templates)
/// Never defined: a launcher instantiation missing from instances.hpp, in a translation unit
/// not compiled by nvcc, fails to link naming the launcher (Note [precompiled CUDA kernels]).
[[noreturn]] void launcher_missing_from_cuda_kernels_instances_hpp();
#define CHORUS_LAUNCH(kernel, n, ...) ::chorus::backend::cuda::launcher_missing_from_cuda_kernels_instances_hpp()
#define CHORUS_LAUNCH_GRID(kernel, grid, block, stream, ...) \
  ::chorus::backend::cuda::launcher_missing_from_cuda_kernels_instances_hpp()
#endif  // __CUDACC__

}  // namespace backend::cuda
CHORUS_NAMESPACE_END
