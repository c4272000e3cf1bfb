# The README's first command (Quick start) in a fresh build folder WORK_DIR, without
# scripts/install-deps.sh (the packages are there wherever this runs): it must build only what
# scripts/run-examples.sh runs (the `examples` target: no test binary, no nvcc program), and the
# examples must run.
file(READ ${SOURCE_DIR}/README.md readme)
string(FIND "${readme}" "## Quick start" at)
if(at EQUAL -1)
  message(FATAL_ERROR "README.md has no '## Quick start' section")
endif()
string(SUBSTRING "${readme}" ${at} -1 rest)
string(REGEX MATCH "```sh\n([^\n]*)\n```" _ "${rest}")
set(cmd "${CMAKE_MATCH_1}")
if(NOT cmd MATCHES "--target examples" OR NOT cmd MATCHES "scripts/run-examples.sh build$")
  message(FATAL_ERROR "the README's first command should build only the examples and run them "
                      "(--target examples ... scripts/run-examples.sh build), not: ${cmd}")
endif()
string(REPLACE "scripts/install-deps.sh && " "" cmd "${cmd}")
string(REGEX REPLACE " build( |$)" " ${WORK_DIR}\\1" cmd "${cmd}")
file(REMOVE_RECURSE ${WORK_DIR})
string(TIMESTAMP t0 "%s")
execute_process(COMMAND bash -c "${cmd}" WORKING_DIRECTORY ${SOURCE_DIR} RESULT_VARIABLE rc OUTPUT_VARIABLE out
                ERROR_VARIABLE out)
string(TIMESTAMP t1 "%s")
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "the README's first command failed (${rc}): ${cmd}\n${out}")
endif()
foreach(extra tests/test_tensor tests/test_cuda examples/train_resnet examples/data_parallel_tutorial_cuda
              benchmarks/chorus_bench)
  if(EXISTS ${WORK_DIR}/${extra})
    message(FATAL_ERROR "the README's first command built ${extra}, which it does not run")
  endif()
endforeach()
math(EXPR secs "${t1} - ${t0}")
message(STATUS "the README's first command (without install-deps.sh) took ${secs} s: ${cmd}")
file(REMOVE_RECURSE ${WORK_DIR})
