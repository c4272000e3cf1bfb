# chorus::distributed for a consumer of the installed package (included by chorusConfig.cmake).
# As with chorus::cuda (Note [consumer decides CUDA] in ChorusCuda.cmake), nothing about the
# installing machine's MPI is baked into the package: the target is made here, from the MPI
# found in the consumer's configure, when the consumer asks for it
# (find_package(chorus COMPONENTS distributed)).
set(chorus_distributed_FOUND FALSE)
if(TARGET chorus::distributed)
  set(chorus_distributed_FOUND TRUE)
elseif("distributed" IN_LIST chorus_FIND_COMPONENTS)
  set(MPI_CXX_SKIP_MPICXX TRUE)  # the C API through the C++ compiler, no deprecated C++ bindings
  find_package(MPI COMPONENTS CXX QUIET)
  if(MPI_CXX_FOUND)
    add_library(chorus::distributed INTERFACE IMPORTED)
    target_link_libraries(chorus::distributed INTERFACE chorus::chorus MPI::MPI_CXX)
    target_compile_definitions(chorus::distributed INTERFACE CHORUS_WITH_MPI=1)
    # For units of the compiled form: the distributed layer's MPI part, built here from the
    # installed source against this MPI (its objects carry the compiled ABI namespace, so a
    # header-only unit never pulls them in).
    if(TARGET chorus::compiled AND NOT TARGET chorus_distributed_compiled)
      get_filename_component(_chorus_dist_src "${CMAKE_CURRENT_LIST_DIR}/../distributed/mpi.cpp" ABSOLUTE)
      add_library(chorus_distributed_compiled STATIC ${_chorus_dist_src})
      target_link_libraries(chorus_distributed_compiled PRIVATE chorus::compiled MPI::MPI_CXX)
      target_compile_definitions(chorus_distributed_compiled PRIVATE CHORUS_WITH_MPI=1)
      target_link_libraries(chorus::distributed INTERFACE chorus_distributed_compiled)
    endif()
    set(chorus_distributed_FOUND TRUE)
  else()
    set(chorus_NOT_FOUND_MESSAGE "chorus::distributed needs MPI (Debian: openmpi-bin libopenmpi-dev), which was not found")
  endif()
endif()
