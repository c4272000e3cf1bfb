# The OpenMP runtime (libgomp, which comes with g++) and oneDNN (Debian: libdnnl-dev).
#
# chorus_gomp: libgomp, on which chorus runs the calling thread's intra-op team for its own
# loops (Note [intra-op threads]: CHORUS_HAS_GOMP) and which Debian's libdnnl runs on.
if(NOT TARGET chorus_gomp)
  find_library(CHORUS_GOMP_LIBRARY NAMES gomp libgomp.so.1
               HINTS /usr/lib/gcc/x86_64-linux-gnu/${CMAKE_CXX_COMPILER_VERSION_MAJOR} /usr/lib/x86_64-linux-gnu)
  if(CHORUS_GOMP_LIBRARY)
    add_library(chorus_gomp INTERFACE IMPORTED)
    set_target_properties(chorus_gomp PROPERTIES
      INTERFACE_LINK_LIBRARIES "${CHORUS_GOMP_LIBRARY}"
      INTERFACE_COMPILE_DEFINITIONS "CHORUS_HAS_GOMP=1")
  endif()
endif()
if(TARGET chorus_gomp)
  message(STATUS "chorus: OpenMP runtime ${CHORUS_GOMP_LIBRARY} (intra-op threads)")
else()
  message(STATUS "chorus: libgomp not found; chorus's own CPU loops run on the calling thread")
endif()

# chorus_onednn: oneDNN for CPU float32 convolutions; optional: without it chorus uses im2col +
# OpenBLAS. Found by hand: Debian's dnnl-config.cmake insists on OpenCL headers that a CPU
# build does not need. CHORUS_USE_ONEDNN=OFF switches it off.
if(NOT DEFINED CHORUS_USE_ONEDNN OR CHORUS_USE_ONEDNN)
  if(NOT TARGET chorus_onednn)
    find_path(CHORUS_ONEDNN_INCLUDE_DIR oneapi/dnnl/dnnl.hpp)
    find_library(CHORUS_ONEDNN_LIBRARY dnnl)
    if(CHORUS_ONEDNN_INCLUDE_DIR AND CHORUS_ONEDNN_LIBRARY)
      set(_chorus_onednn_libs "${CHORUS_ONEDNN_LIBRARY}")
      if(TARGET chorus_gomp)  # Debian's libdnnl runs on OpenMP; chorus sizes its teams (Note [oneDNN threads])
        list(APPEND _chorus_onednn_libs chorus_gomp)
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
