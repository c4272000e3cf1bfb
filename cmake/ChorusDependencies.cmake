# Finds what chorus needs; shared by the build and by chorusConfig.cmake (consumers).
include(CMakeFindDependencyMacro)
find_package(Threads REQUIRED)

# OpenBLAS for CPU matrix products (Debian: libopenblas-dev).
if(NOT TARGET BLAS::BLAS)
  set(BLA_VENDOR OpenBLAS)
  find_package(BLAS REQUIRED)
endif()

# nlohmann/json for checkpoint headers (Debian: nlohmann-json3-dev).
find_package(nlohmann_json 3.9 REQUIRED)

# CUDA: used when nvcc is found (and not switched off); sets CHORUS_HAS_CUDA.
set(CHORUS_HAS_CUDA OFF)
if(NOT DEFINED CHORUS_ENABLE_CUDA OR CHORUS_ENABLE_CUDA)
  if(NOT CMAKE_CUDA_COMPILER AND EXISTS /usr/local/cuda/bin/nvcc)
    set(CMAKE_CUDA_COMPILER /usr/local/cuda/bin/nvcc)
  endif()
  include(CheckLanguage)
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
      set(CMAKE_CUDA_ARCHITECTURES 90)  # NVIDIA H100/H200
    endif()
    # One CUDA runtime per program: chorus::cuda links the shared cudart (CUDA::cudart), so
    # nvcc-linked targets must not add the static one too (CMake's default), which would give
    # a program two runtimes with separate state. A consumer that set its own value keeps it.
    if(NOT DEFINED CMAKE_CUDA_RUNTIME_LIBRARY)
      set(CMAKE_CUDA_RUNTIME_LIBRARY Shared)
    endif()
    enable_language(CUDA)
    find_package(CUDAToolkit REQUIRED)
    find_library(CHORUS_NCCL_LIBRARY nccl HINTS ${CUDAToolkit_LIBRARY_DIR} /usr/local/cuda/lib64)
    find_path(CHORUS_NCCL_INCLUDE_DIR nccl.h HINTS ${CUDAToolkit_INCLUDE_DIRS} /usr/local/cuda/include)
    # cuDNN 9 (shipped with the toolkit here): optional, for convolutions.
    find_library(CHORUS_CUDNN_LIBRARY cudnn HINTS ${CUDAToolkit_LIBRARY_DIR} /usr/local/cuda/lib64)
    message(STATUS "chorus: cuDNN ${CHORUS_CUDNN_LIBRARY}")
    if(CHORUS_NCCL_LIBRARY AND CHORUS_NCCL_INCLUDE_DIR)
      set(CHORUS_HAS_CUDA ON)
    else()
      message(STATUS "chorus: nvcc found but NCCL not found; CUDA parts disabled")
    endif()
  endif()
endif()
message(STATUS "chorus: CUDA ${CHORUS_HAS_CUDA}")

# MPI for chorus::distributed (optional: without it everything else builds; Debian:
# openmpi-bin libopenmpi-dev, or mpich libmpich-dev). Sets CHORUS_HAS_MPI.
set(CHORUS_HAS_MPI OFF)
if(NOT DEFINED CHORUS_ENABLE_MPI OR CHORUS_ENABLE_MPI)
  # The C API through the C++ compiler (a project may not enable C), without the deprecated
  # C++ bindings (OMPI_SKIP_MPICXX).
  set(MPI_CXX_SKIP_MPICXX TRUE)
  find_package(MPI COMPONENTS CXX QUIET)
  if(MPI_CXX_FOUND)
    set(CHORUS_HAS_MPI ON)
  endif()
endif()
message(STATUS "chorus: MPI ${CHORUS_HAS_MPI}")

# libgomp (intra-op threads) and oneDNN for CPU convolutions (optional): found in
# ChorusOneDNN.cmake, which the installed package runs again in the consumer's configure.
include(${CMAKE_CURRENT_LIST_DIR}/ChorusOneDNN.cmake)
