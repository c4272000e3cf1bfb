// chorus::compiled: the layers of nn/ (Note [compiled chorus] in include/chorus/compiled.hpp).
#include <chorus/chorus.hpp>

CHORUS_DEFINE_INSTANCES(CHORUS_NN_LAYER_INSTANCES, CHORUS_FLOATING_DTYPES)
