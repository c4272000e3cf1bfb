# Configures, builds and runs the consumer project.
# MODE: find_package | find_package_cuda | find_package_distributed | add_subdirectory.
#   find_package       a C++-only consumer of the installed package, in both forms (chorus::chorus
#                      and chorus::compiled): the package was installed by a build that found nvcc
#                      (when the machine has one: MAIN_BUILD_DIR, the build running the test), yet
#                      the consumer's configure must not enable CUDA nor see that toolkit's paths.
#   find_package_cuda  (machines with nvcc) the cuda component comes from the consumer's own
#                      configure, and -DCHORUS_ENABLE_CUDA=OFF switches it off; the cuda_kernels
#                      component builds the kernels library there and a C++ program against it.
#   find_package_distributed  (machines with MPI) the distributed component comes from the
#                      consumer's own MPI, its compiled-form part built there; the consumer runs
#                      as a world of 1, in both forms.
#   add_subdirectory   chorus as a subproject, with -DCHORUS_ENABLE_CUDA=OFF honoured.
file(REMOVE_RECURSE ${WORK_DIR})
set(consumer ${SOURCE_DIR}/tests/consumer)
function(run)
  execute_process(COMMAND ${ARGV} RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "failed (${rc}): ${ARGV}")
  endif()
endfunction()
# The consumer build at `dir` has not enabled the CUDA language.
function(expect_no_cuda_language dir)
  file(STRINGS ${dir}/CMakeCache.txt cuda_lines REGEX "^CMAKE_CUDA_COMPILER[:=]")
  if(cuda_lines OR EXISTS ${dir}/CMakeFiles/${CMAKE_VERSION}/CMakeCUDACompiler.cmake)
    message(FATAL_ERROR "the C++-only consumer in ${dir} enabled the CUDA language: ${cuda_lines}")
  endif()
endfunction()
set(nvcc_here FALSE)
if(EXISTS /usr/local/cuda/bin/nvcc)
  set(nvcc_here TRUE)
endif()

if(MODE MATCHES "^find_package")
  # Install chorus alone (no tests/examples) into a temporary prefix, CUDA detection left at
  # its default: on a machine with nvcc the installing build enables CUDA.
  if(MODE STREQUAL "find_package" OR MODE STREQUAL "find_package_distributed")
    # The plain and distributed modes install the build that runs this test (its chorus::compiled
    # is built already; it found nvcc where the machine has it).
    run(${CMAKE_COMMAND} --install ${MAIN_BUILD_DIR} --prefix ${WORK_DIR}/prefix)
  else()
    # The cuda mode installs a fresh configure without the compiled form (nothing to build).
    run(${CMAKE_COMMAND} -S ${SOURCE_DIR} -B ${WORK_DIR}/chorus-build -G ${GENERATOR} -DCHORUS_BUILD_TESTS=OFF
        -DCHORUS_BUILD_EXAMPLES=OFF -DCHORUS_BUILD_BENCHMARKS=OFF -DCHORUS_INSTALL=ON -DCHORUS_BUILD_COMPILED=OFF
        -DCMAKE_INSTALL_PREFIX=${WORK_DIR}/prefix)
    run(${CMAKE_COMMAND} --install ${WORK_DIR}/chorus-build)
  endif()
  # The generated package files carry nothing of the installing build's CUDA (ChorusCuda.cmake,
  # which looks for the consumer's toolkit, is the one place that names CUDA).
  file(GLOB pkg_files ${WORK_DIR}/prefix/share/chorus/cmake/chorusConfig.cmake
       ${WORK_DIR}/prefix/share/chorus/cmake/chorusTargets*.cmake)
  foreach(f IN LISTS pkg_files)
    file(READ ${f} text)
    if(text MATCHES "/cuda|CUDA::|set\\(CHORUS_ENABLE_CUDA|enable_language|add_library\\(chorus::cuda")
      message(FATAL_ERROR "${f} hard-wires the installing build's CUDA (${CMAKE_MATCH_0})")
    endif()
  endforeach()
  if(MODE STREQUAL "find_package_distributed")
    # chorus::distributed from this configure's MPI (nothing of the installing build's MPI baked in).
    foreach(f IN LISTS pkg_files)
      file(READ ${f} text)
      if(text MATCHES "MPI::|CHORUS_WITH_MPI")
        message(FATAL_ERROR "${f} hard-wires the installing build's MPI (${CMAKE_MATCH_0})")
      endif()
    endforeach()
    run(${CMAKE_COMMAND} -S ${consumer} -B ${WORK_DIR}/build -G ${GENERATOR} -DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix
        -DCONSUMER_WANTS_DISTRIBUTED=ON)
    expect_no_cuda_language(${WORK_DIR}/build)
    run(${CMAKE_COMMAND} --build ${WORK_DIR}/build)
    run(${WORK_DIR}/build/consumer_distributed)
    run(${WORK_DIR}/build/consumer_distributed_compiled)
  elseif(MODE STREQUAL "find_package")
    run(${CMAKE_COMMAND} -S ${consumer} -B ${WORK_DIR}/build -G ${GENERATOR} -DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix
        -DCONSUMER_EXPECT_CUDA_TARGET=OFF -DCONSUMER_EXPECT_COMPILED=ON)
    expect_no_cuda_language(${WORK_DIR}/build)
  else()
    # Asked for: chorus::cuda from this configure's toolkit (still no CUDA language needed).
    run(${CMAKE_COMMAND} -S ${consumer} -B ${WORK_DIR}/build-cuda -G ${GENERATOR}
        -DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix -DCONSUMER_WANTS_CUDA=ON -DCONSUMER_EXPECT_CUDA_TARGET=${nvcc_here})
    expect_no_cuda_language(${WORK_DIR}/build-cuda)
    if(nvcc_here)
      # The cuda_kernels component: the kernels library built in the consumer's project from the
      # installed sources, and a C++ program with the CUDA backend linked against it (it runs on
      # the CPU where there is no GPU).
      run(${CMAKE_COMMAND} -S ${consumer} -B ${WORK_DIR}/build-kernels -G ${GENERATOR}
          -DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix -DCONSUMER_WANTS_CUDA_KERNELS=ON -DCMAKE_CUDA_ARCHITECTURES=90
          -DCMAKE_BUILD_TYPE=Release)
      run(${CMAKE_COMMAND} --build ${WORK_DIR}/build-kernels --target consumer_cuda)
      run(${WORK_DIR}/build-kernels/consumer_cuda)
    endif()
    # Asked for but switched off by the consumer: not made.
    run(${CMAKE_COMMAND} -S ${consumer} -B ${WORK_DIR}/build -G ${GENERATOR} -DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix
        -DCONSUMER_WANTS_CUDA=ON -DCHORUS_ENABLE_CUDA=OFF -DCONSUMER_EXPECT_CUDA_TARGET=OFF)
    expect_no_cuda_language(${WORK_DIR}/build)
  endif()
else()
  run(${CMAKE_COMMAND} -S ${consumer} -B ${WORK_DIR}/build -G ${GENERATOR} -DCHORUS_SOURCE_DIR=${SOURCE_DIR}
      -DCHORUS_ENABLE_CUDA=OFF -DCONSUMER_EXPECT_CUDA_TARGET=OFF -DCHORUS_BUILD_COMPILED=OFF)
  expect_no_cuda_language(${WORK_DIR}/build)
endif()
run(${CMAKE_COMMAND} --build ${WORK_DIR}/build --parallel 2)
run(${WORK_DIR}/build/consumer)
if(EXISTS ${WORK_DIR}/build/consumer_compiled)
  run(${WORK_DIR}/build/consumer_compiled)
elseif(MODE STREQUAL "find_package")
  message(FATAL_ERROR "the find_package consumer built no consumer_compiled")
endif()
