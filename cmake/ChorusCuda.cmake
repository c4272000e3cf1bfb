# chorus::cuda for a consumer of the installed package (included by chorusConfig.cmake).
#
# Note [consumer decides CUDA]
# Nothing about the installing machine's CUDA is baked into the package: chorus::chorus is
# header-only C++ and never needs CUDA, and chorus::cuda is made here, in the consumer's own
# configure, from the toolkit found there. It is made when the consumer asks for it
# (find_package(chorus COMPONENTS cuda)) or has enabled the CUDA language itself, unless the
# consumer sets CHORUS_ENABLE_CUDA=OFF. The CUDA language is never enabled here: a C++-only
# consumer pays nothing for a toolkit it does not use.
set(chorus_cuda_FOUND FALSE)
get_property(_chorus_languages GLOBAL PROPERTY ENABLED_LANGUAGES)
set(_chorus_want_cuda FALSE)
if("cuda" IN_LIST chorus_FIND_COMPONENTS OR "cuda_kernels" IN_LIST chorus_FIND_COMPONENTS
   OR "CUDA" IN_LIST _chorus_languages)
  set(_chorus_want_cuda TRUE)
endif()
if(DEFINED CHORUS_ENABLE_CUDA AND NOT CHORUS_ENABLE_CUDA)
  set(_chorus_want_cuda FALSE)
  set(chorus_cuda_NOT_FOUND_MESSAGE "chorus::cuda is off: CHORUS_ENABLE_CUDA=${CHORUS_ENABLE_CUDA}")
endif()
if(TARGET chorus::cuda)
  set(chorus_cuda_FOUND TRUE)
elseif(_chorus_want_cuda)
  if(NOT CUDAToolkit_ROOT AND NOT DEFINED ENV{CUDAToolkit_ROOT} AND EXISTS /usr/local/cuda/bin/nvcc)
    set(CUDAToolkit_ROOT /usr/local/cuda)
  endif()
  find_package(CUDAToolkit QUIET)
  if(CUDAToolkit_FOUND)
    find_library(CHORUS_NCCL_LIBRARY nccl HINTS ${CUDAToolkit_LIBRARY_DIR})
    find_path(CHORUS_NCCL_INCLUDE_DIR nccl.h HINTS ${CUDAToolkit_INCLUDE_DIRS})
  endif()
  if(CUDAToolkit_FOUND AND CHORUS_NCCL_LIBRARY AND CHORUS_NCCL_INCLUDE_DIR)
    add_library(chorus::cuda INTERFACE IMPORTED)
    target_link_libraries(chorus::cuda INTERFACE chorus::chorus CUDA::cudart CUDA::cublas CUDA::cublasLt
                                                 ${CHORUS_NCCL_LIBRARY})
    target_include_directories(chorus::cuda INTERFACE ${CHORUS_NCCL_INCLUDE_DIR})
    target_link_options(chorus::cuda INTERFACE "LINKER:--as-needed")  # Note [CUDA programs link as needed]
    set(chorus_cuda_FOUND TRUE)
  elseif(NOT CUDAToolkit_FOUND)
    set(chorus_cuda_NOT_FOUND_MESSAGE "chorus::cuda needs the CUDA toolkit, which was not found (set CUDAToolkit_ROOT)")
  else()
    set(chorus_cuda_NOT_FOUND_MESSAGE "chorus::cuda needs NCCL (nccl.h, libnccl), which was not found")
  endif()
endif()
if(chorus_cuda_NOT_FOUND_MESSAGE AND NOT chorus_cuda_FOUND AND "cuda" IN_LIST chorus_FIND_COMPONENTS)
  set(chorus_NOT_FOUND_MESSAGE "${chorus_cuda_NOT_FOUND_MESSAGE}")
endif()

# chorus::cuda_kernels (component "cuda_kernels", implies "cuda"): the CUDA kernels compiled once
# (Note [precompiled CUDA kernels] in include/chorus/backend/cuda/instances.hpp), built in the
# consumer's project from the installed sources, with the consumer's CUDA language and
# architectures (CMAKE_CUDA_ARCHITECTURES; enabling CUDA here is what asking for it means). Its
# users compile their training code as C++.
set(chorus_cuda_kernels_FOUND FALSE)
if(TARGET chorus::cuda_kernels)
  set(chorus_cuda_kernels_FOUND TRUE)
elseif("cuda_kernels" IN_LIST chorus_FIND_COMPONENTS)
  if(NOT chorus_cuda_FOUND)
    set(chorus_cuda_kernels_NOT_FOUND_MESSAGE "chorus::cuda_kernels needs chorus::cuda: ${chorus_cuda_NOT_FOUND_MESSAGE}")
  else()
    if(NOT CMAKE_CUDA_COMPILER AND NOT DEFINED ENV{CUDACXX} AND EXISTS "${CUDAToolkit_NVCC_EXECUTABLE}")
      set(CMAKE_CUDA_COMPILER "${CUDAToolkit_NVCC_EXECUTABLE}")
    endif()
    enable_language(CUDA)
    include(${CMAKE_CURRENT_LIST_DIR}/ChorusCudaKernels.cmake)
    get_filename_component(_chorus_kernels_dir "${CMAKE_CURRENT_LIST_DIR}/../cuda_kernels" ABSOLUTE)
    chorus_add_cuda_kernels(${_chorus_kernels_dir} chorus::cuda)
    set(chorus_cuda_kernels_FOUND TRUE)
    unset(_chorus_kernels_dir)
  endif()
  if(NOT chorus_cuda_kernels_FOUND)
    set(chorus_NOT_FOUND_MESSAGE "${chorus_cuda_kernels_NOT_FOUND_MESSAGE}")
  endif()
endif()
unset(_chorus_languages)
unset(_chorus_want_cuda)
