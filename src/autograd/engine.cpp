// chorus::compiled: the graph helpers and the backward engine of autograd/ (Note [compiled chorus]
// in include/chorus/compiled.hpp).
#include <chorus/chorus.hpp>
#include <chorus/autograd/engine_impl.hpp>

CHORUS_DEFINE_INSTANCES(CHORUS_AUTOGRAD_NODE_INSTANCES, CHORUS_ALL_DTYPES)
CHORUS_DEFINE_INSTANCES(CHORUS_AUTOGRAD_ENGINE_FLOAT_INSTANCES, CHORUS_FLOATING_DTYPES)
CHORUS_DEFINE_INSTANCES(CHORUS_AUTOGRAD_ACCUMULATE_INSTANCES, CHORUS_ALL_DTYPES)
