# Builds TARGET in BUILD_DIR; passes when the build fails with output matching EXPECT
# (or, without EXPECT, when it succeeds: the control).
execute_process(COMMAND ${CMAKE_COMMAND} --build ${BUILD_DIR} --target ${TARGET} RESULT_VARIABLE rc
                OUTPUT_VARIABLE out ERROR_VARIABLE out)
if(NOT DEFINED EXPECT)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "the control ${TARGET} must compile:\n${out}")
  endif()
  return()
endif()
if(rc EQUAL 0)
  message(FATAL_ERROR "${TARGET} compiled, but must not")
endif()
if(NOT out MATCHES "${EXPECT}")
  message(FATAL_ERROR "${TARGET} failed without the expected message '${EXPECT}':\n${out}")
endif()
