# Note [compiled chorus]: chorus's non-template code (nn::Module's registry, the optimizers, the
# communicators, the replicator, DataParallelCore, the backward engine, oneDNN's convolutions,
# the MPI backend) is compiled into the libraries, not into a compiled-form user's objects:
#  - COMPILED: objects of compiled-form programs; none may define a symbol matching PATTERNS;
#  - LIBRARY: the libraries' objects; together they define every pattern (so that a renamed
#    symbol cannot make this check pass without looking);
#  - HEADER_ONLY: objects of header-only programs that never build a DataParallel; none may
#    define the communicators (a virtual function declared out of line and defined `inline`
#    later becomes the class's key function, and every unit that includes the header then emits
#    the vtable and every virtual function: CHORUS_INLINE on the declaration prevents that).
set(ns "chorus::v0_1_[a-z_]+::")
set(patterns
    "vtable for ${ns}nn::Module$"
    "${ns}nn::Module::named_parameters\\(bool, bool\\) const"
    "${ns}optim::SGD::step\\(\\)"
    "${ns}optim::Optimizer::load_state\\("
    "${ns}parallel::CopyCommunicator::reduce_add\\("
    "${ns}parallel::ReplicatorCore::flatten_primary\\(\\)"
    "${ns}parallel::DataParallelCore::keep_workers_hot\\("
    "${ns}autograd::detail::GraphTask::"
    "${ns}backend::cpu::onednn::conv_forward\\("
    "${ns}dist::with_mpi::detail::MpiBackend::")
function(defined_symbols objects out)
  set(all "")
  foreach(object IN LISTS objects)
    if(object STREQUAL "")
      continue()
    endif()
    execute_process(COMMAND ${NM} -C --defined-only ${object} OUTPUT_VARIABLE syms RESULT_VARIABLE rc)
    if(NOT rc EQUAL 0)
      message(FATAL_ERROR "${NM} ${object} failed (${rc})")
    endif()
    string(APPEND all "${syms}")
  endforeach()
  string(REPLACE "\n" ";" lines "${all}")
  set(${out} "${lines}" PARENT_SCOPE)
endfunction()

# The first of `symbols` matching `regex`, or "".
function(first_match symbols regex out)
  set(hits ${symbols})
  list(FILTER hits INCLUDE REGEX "${regex}")
  set(first "")
  if(hits)
    list(GET hits 0 first)
  endif()
  set(${out} "${first}" PARENT_SCOPE)
endfunction()

defined_symbols("${LIBRARY}" library)
foreach(p IN LISTS patterns)
  if(p MATCHES "with_mpi" AND NOT HAVE_MPI)
    continue()
  endif()
  first_match("${library}" "${p}" first)
  if(NOT first)
    message(FATAL_ERROR "no library object defines a symbol matching '${p}': is the pattern stale?")
  endif()
endforeach()

set(failed FALSE)
foreach(object IN LISTS COMPILED)
  defined_symbols(${object} syms)
  foreach(p IN LISTS patterns)
    first_match("${syms}" "${p}" first)
    if(first)
      message(SEND_ERROR "${object} (compiled form) defines library code itself: ${first}")
      set(failed TRUE)
    endif()
  endforeach()
endforeach()
foreach(object IN LISTS HEADER_ONLY)
  defined_symbols(${object} syms)
  first_match("${syms}" "${ns}parallel::[A-Za-z]*Communicator::" first)
  if(first)
    message(SEND_ERROR "${object} (header-only, no DataParallel) emits a communicator: ${first}")
    set(failed TRUE)
  endif()
endforeach()
if(failed)
  message(FATAL_ERROR "library code compiled into users' objects")
endif()
list(LENGTH COMPILED n)
message(STATUS "${n} compiled-form objects define none of the library's code")
