# chorus_add_cuda_kernels(<sources dir> <chorus::cuda target>): the static library
# chorus::cuda_kernels, the CUDA launchers compiled once (Note [precompiled CUDA kernels] in
# include/chorus/backend/cuda/instances.hpp), from the sources in <sources dir> (src/cuda_kernels
# in the source tree, share/chorus/cuda_kernels when installed). The one definition of the
# target, for chorus's own build (CMakeLists.txt) and for a consumer of the installed package
# (ChorusCuda.cmake). The CUDA language must be enabled.
function(chorus_add_cuda_kernels dir cuda_target)
  # EXCLUDE_FROM_ALL: built when a target links it (~70 s of nvcc), not by an install alone.
  add_library(chorus_cuda_kernels STATIC EXCLUDE_FROM_ALL ${dir}/kernels.cu ${dir}/nn_kernels.cu
                                         ${dir}/index_kernels.cu)
  add_library(chorus::cuda_kernels ALIAS chorus_cuda_kernels)
  set_target_properties(chorus_cuda_kernels PROPERTIES EXPORT_NAME cuda_kernels)
  target_link_libraries(chorus_cuda_kernels PUBLIC ${cuda_target})
  target_compile_definitions(chorus_cuda_kernels PUBLIC CHORUS_CUDA_PRECOMPILED=1)
  target_compile_options(chorus_cuda_kernels PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:-std=c++20>)
endfunction()
