#pragma once
// Build configuration of chorus: CUDA on/off, host/device macros and the inline ABI namespace.
//
// Note [ABI namespace]
// Following CCCL, everything lives in `chorus::<abi>` where <abi> is an inline namespace that
// encodes the version and whether the CUDA backend is compiled in (v0_1_cpu / v0_1_cuda). The
// same header compiled by g++ and by nvcc therefore produces differently mangled symbols:
// a program that mixes a CUDA and a CPU-only translation unit gets two distinct libraries
// (or a link error where a symbol is expected from the other) instead of an ODR violation.
// Host translation units built with oneDNN (CHORUS_HAS_ONEDNN, set by CMake where libdnnl is
// found) take CPU convolutions another way, so they get their own tag too (v0_1_cpu_dnnl);
// CUDA translation units never use oneDNN (backend/cpu/onednn.hpp). The compiled form carries
// its own tag (v0_1_cpu_dnnl_compiled, Note [compiled chorus] in compiled.hpp).
#include "version.hpp"

// The CUDA backend is compiled into a translation unit built by nvcc, or into any C++ one
// built with CHORUS_CUDA_PRECOMPILED=1 (what linking chorus::cuda_kernels defines): there the
// kernels come from that library, and the headers show g++ only their host side (Note
// [precompiled CUDA kernels] in backend/cuda/instances.hpp).
#if (defined(__CUDACC__) || (defined(CHORUS_CUDA_PRECOMPILED) && CHORUS_CUDA_PRECOMPILED)) && \
    !defined(CHORUS_DISABLE_CUDA)
#define CHORUS_CUDA 1
#else
#define CHORUS_CUDA 0
#endif

// The compiled form (chorus::compiled, Note [compiled chorus] in compiled.hpp) is CPU-only
// for now: a CUDA program uses the header-only form with chorus::cuda_kernels.
#if defined(CHORUS_COMPILED) && CHORUS_COMPILED && CHORUS_CUDA
#error "chorus::compiled is the CPU library: a CUDA translation unit links chorus::cuda_kernels (header-only form) instead"
#endif

#if CHORUS_CUDA
#if defined(__CUDACC__)
#define CHORUS_HOST_DEVICE __host__ __device__
#else
#define CHORUS_HOST_DEVICE
#endif
#define CHORUS_ABI_NS v0_1_cuda
#elif defined(CHORUS_HAS_ONEDNN) && CHORUS_HAS_ONEDNN
#define CHORUS_HOST_DEVICE
#if defined(CHORUS_COMPILED) && CHORUS_COMPILED
#define CHORUS_ABI_NS v0_1_cpu_dnnl_compiled
#else
#define CHORUS_ABI_NS v0_1_cpu_dnnl
#endif
#else
#define CHORUS_HOST_DEVICE
#if defined(CHORUS_COMPILED) && CHORUS_COMPILED
#define CHORUS_ABI_NS v0_1_cpu_compiled
#else
#define CHORUS_ABI_NS v0_1_cpu
#endif
#endif

// oneDNN (CPU convolutions, float and bfloat16 products), where CMake found it. nvcc's front
// end stops with an internal error on oneDNN's C++ API (CUDA 13.0, g++ 12 headers): translation
// units with the CUDA backend (nvcc's, and the C++ ones linking chorus::cuda_kernels, which
// must agree with the library's ABI v0_1_cuda) use OpenBLAS for products and im2col for CPU
// convolutions.
#if defined(CHORUS_HAS_ONEDNN) && CHORUS_HAS_ONEDNN && !CHORUS_CUDA
#define CHORUS_ONEDNN_API 1
#else
#define CHORUS_ONEDNN_API 0
#endif

#define CHORUS_NAMESPACE_BEGIN \
  namespace chorus {           \
  inline namespace CHORUS_ABI_NS {
#define CHORUS_NAMESPACE_END \
  }                          \
  }

namespace chorus {
inline namespace CHORUS_ABI_NS {
/// True when this translation unit was compiled with the CUDA backend.
inline constexpr bool kCudaEnabled = CHORUS_CUDA != 0;
}  // namespace CHORUS_ABI_NS
}  // namespace chorus
