# CTest version_agrees: the version of project() (-DVERSION=...), include/chorus/version.hpp's
# macros and the newest release heading of CHANGELOG.md ("## [X.Y.Z]") must be one.
#   cmake -DROOT=<source dir> -DVERSION=<project version> -P cmake/check_version.cmake
file(READ "${ROOT}/include/chorus/version.hpp" header)
foreach(part MAJOR MINOR PATCH)
  string(REGEX MATCH "#define CHORUS_VERSION_${part} ([0-9]+)" _ "${header}")
  set(${part} "${CMAKE_MATCH_1}")
  if(${part} STREQUAL "")
    message(FATAL_ERROR "version.hpp: no CHORUS_VERSION_${part}")
  endif()
endforeach()
string(REGEX MATCH "#define CHORUS_VERSION_STRING \"([^\"]*)\"" _ "${header}")
set(string_macro "${CMAKE_MATCH_1}")
file(READ "${ROOT}/CHANGELOG.md" changelog)
string(REGEX MATCH "\n## \\[([0-9]+\\.[0-9]+\\.[0-9]+)\\]" _ "${changelog}")
set(changelog_version "${CMAKE_MATCH_1}")
set(numbers "${MAJOR}.${MINOR}.${PATCH}")
if(NOT numbers STREQUAL VERSION OR NOT string_macro STREQUAL VERSION OR NOT changelog_version STREQUAL VERSION)
  message(FATAL_ERROR "the versions disagree: CMakeLists.txt project() ${VERSION}, version.hpp numbers ${numbers} "
                      "and string \"${string_macro}\", CHANGELOG.md's newest release '${changelog_version}'")
endif()
message(STATUS "version ${VERSION}: CMakeLists.txt, version.hpp and CHANGELOG.md agree")
