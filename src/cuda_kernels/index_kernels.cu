// chorus::cuda_kernels: the indexing launchers (backend/cuda/index_kernels.cuh), the
// multi-tensor ones (foreach.cuh, amp.cuh) and the cuBLAS products (blas.cuh,
// blas_batched.cuh), compiled once (Note [precompiled CUDA kernels]).
#include <chorus/backend/cuda/amp.cuh>
#include <chorus/backend/cuda/blas_batched.cuh>
#include <chorus/backend/cuda/foreach.cuh>
#include <chorus/backend/cuda/index_kernels.cuh>

CHORUS_NAMESPACE_BEGIN
namespace backend::cuda {
CHORUS_CUDA_INDEX_INSTANCES(CHORUS_CUDA_DEFINE_INSTANCE)
CHORUS_CUDA_FOREACH_INSTANCES(CHORUS_CUDA_DEFINE_INSTANCE)
CHORUS_CUDA_AMP_INSTANCES(CHORUS_CUDA_DEFINE_INSTANCE)
CHORUS_CUDA_BLAS_INSTANCES(CHORUS_CUDA_DEFINE_INSTANCE)
CHORUS_CUDA_BLAS_BATCHED_INSTANCES(CHORUS_CUDA_DEFINE_INSTANCE)
}  // namespace backend::cuda
CHORUS_NAMESPACE_END
