// chorus::compiled: the gather of parallel/ (Note [compiled chorus] in
// include/chorus/compiled.hpp).
#include <chorus/chorus.hpp>

CHORUS_DEFINE_INSTANCES(CHORUS_PARALLEL_GATHER_INSTANCES, CHORUS_ALL_DTYPES)
