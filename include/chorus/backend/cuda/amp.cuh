#pragma once
// The CUDA kernel of amp::GradScaler::unscale_ (compiled only by nvcc; Note [loss scaling] in
// amp/grad_scaler.hpp): every gradient of a device multiplied by 1/scale in one multi-tensor
// pass, and one flag in device memory set when any element was inf or NaN. Nothing is read on
// the host. It mirrors amp::detail::unscale_check, the CPU loop.
#include <cstdint>
#include <vector>

#include "foreach.cuh"

CHORUS_NAMESPACE_BEGIN
namespace backend::cuda {
namespace k {

#if defined(__CUDACC__)  // device code (Note [precompiled CUDA kernels])

template <class T>
__global__ void multi_unscale_check(TensorChunk<T> c, T inv, float* found_inf) {
  std::int64_t i0, i1;
  T* x = c.ptr[chunk_tensor(c, blockIdx.x, i0, i1)];
  bool bad = false;
  for (std::int64_t i = i0 + threadIdx.x; i < i1; i += blockDim.x) {
    const T v = x[i];
    bad |= !isfinite(v);
    x[i] = v * inv;
  }
  if (bad) *found_inf = 1.0f;  // a benign race: every writer writes 1
}

#endif  // __CUDACC__
}  // namespace k

/// Every element of the tensors *= inv; found_inf[0] (device memory on d) = 1 when any was inf
/// or NaN; left as it is otherwise.
template <class T>
void foreach_unscale_check(const std::vector<T*>& ptrs, const std::vector<std::int64_t>& numels, T inv,
                           float* found_inf, Device d) {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, double>, "unscale: float or double gradients");
  Launch launch(d);
  for (const auto& c : make_chunks(ptrs, numels)) {
    CHORUS_LAUNCH_GRID((k::multi_unscale_check<T>), static_cast<unsigned>(c.first_block[c.count]), kThreads,
                       launch.stream, c, inv, found_inf);
  }
}

#if CHORUS_CUDA_PRECOMPILED  // Note [precompiled CUDA kernels]
CHORUS_CUDA_AMP_INSTANCES(CHORUS_CUDA_EXTERN_INSTANCE)
#endif

}  // namespace backend::cuda
CHORUS_NAMESPACE_END
