// chorus::cuda_kernels: the elementwise, reduction, loss and optimizer launchers of
// backend/cuda/kernels.cuh, compiled once (Note [precompiled CUDA kernels]).
#include <chorus/backend/cuda/kernels.cuh>

CHORUS_NAMESPACE_BEGIN
namespace backend::cuda {
CHORUS_CUDA_KERNELS_INSTANCES(CHORUS_CUDA_DEFINE_INSTANCE)
}  // namespace backend::cuda
CHORUS_NAMESPACE_END
