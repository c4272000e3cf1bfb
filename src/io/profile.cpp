// chorus::compiled: the profiler's Profile, its Chrome trace and summary (Note [compiled chorus]
// in include/chorus/compiled.hpp).
#include <chorus/io/profile_impl.hpp>
