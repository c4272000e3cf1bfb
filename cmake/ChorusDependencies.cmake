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

# oneDNN (Debian: libdnnl-dev) for CPU float32 convolutions; optional: without it chorus
# uses im2col + OpenBLAS. Found by hand: Debian's dnnl-config.cmake insists on OpenCL
# headers that a CPU build does not need. CHORUS_USE_ONEDNN=OFF switches it off.
if(NOT DEFINED CHORUS_USE_ONEDNN OR CHORUS_USE_ONEDNN)
  if(NOT TARGET chorus_onednn)
    find_path(CHORUS_ONEDNN_INCLUDE_DIR oneapi/dnnl/dnnl.hpp)
    find_library(CHORUS_ONEDNN_LIBRARY dnnl)
    # Debian's libdnnl runs on OpenMP; chorus sizes its teams (Note [oneDNN threads]).
    find_library(CHORUS_GOMP_LIBRARY NAMES gomp libgomp.so.1
                 HINTS /usr/lib/gcc/x86_64-linux-gnu/${CMAKE_CXX_COMPILER_VERSION_MAJOR} /usr/lib/x86_64-linux-gnu)
    if(CHORUS_ONEDNN_INCLUDE_DIR AND CHORUS_ONEDNN_LIBRARY)
      set(_chorus_onednn_libs "${CHORUS_ONEDNN_LIBRARY}")
      if(CHORUS_GOMP_LIBRARY)
        list(APPEND _chorus_onednn_libs "${CHORUS_GOMP_LIBRARY}")
      endif()
      add_library(chorus_onednn INTERFACE IMPORTED)
      set_target_properties(chorus_onednn PROPERTIES
        INTERFACE_INCLUDE_DIRECTORIES "${CHORUS_ONEDNN_INCLUDE_DIR}"
        INTERFACE_LINK_LIBRARIES "${_chorus_onednn_libs}"
        INTERFACE_COMPILE_DEFINITIONS "CHORUS_HAS_ONEDNN=1")
    endif()
  endif()
endif()
if(TARGET chorus_onednn)
  message(STATUS "chorus: oneDNN ${CHORUS_ONEDNN_LIBRARY}")
else()
  message(STATUS "chorus: oneDNN not found (apt-get install libdnnl-dev); CPU convolutions use im2col + OpenBLAS")
endif()
