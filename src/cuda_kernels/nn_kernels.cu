// chorus::cuda_kernels: the CNN launchers (backend/cuda/nn_kernels.cuh) and the cuDNN
// convolutions (backend/cuda/cudnn.cuh), compiled once (Note [precompiled CUDA kernels]).
#include <chorus/backend/cuda/nn_kernels.cuh>
#if CHORUS_HAS_CUDNN
#include <chorus/backend/cuda/cudnn.cuh>
#endif

CHORUS_NAMESPACE_BEGIN
namespace backend::cuda {
CHORUS_CUDA_NN_INSTANCES(CHORUS_CUDA_DEFINE_INSTANCE)
}  // namespace backend::cuda
#if CHORUS_HAS_CUDNN
namespace backend::cuda::cudnn {
CHORUS_CUDA_CUDNN_INSTANCES(CHORUS_CUDA_DEFINE_INSTANCE)
}  // namespace backend::cuda::cudnn
#endif
CHORUS_NAMESPACE_END
