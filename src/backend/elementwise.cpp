// chorus::compiled: the elementwise kernels of backend/backend.hpp with their functors (Note
// [compiled chorus] in include/chorus/compiled.hpp).
#include <chorus/chorus.hpp>

CHORUS_DEFINE_INSTANCES(CHORUS_BACKEND_ELEMENTWISE_FLOAT_INSTANCES, CHORUS_FLOATING_DTYPES)
CHORUS_DEFINE_INSTANCES(CHORUS_BACKEND_ELEMENTWISE_INT_INSTANCES, CHORUS_INT_DTYPES)
