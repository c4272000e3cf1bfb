// chorus::compiled: the initialisers and layer helpers of nn/ (Note [compiled chorus] in
// include/chorus/compiled.hpp).
#include <chorus/chorus.hpp>

CHORUS_DEFINE_INSTANCES(CHORUS_NN_INIT_INSTANCES, CHORUS_ALL_DTYPES)
CHORUS_DEFINE_INSTANCES(CHORUS_NN_INIT_FLOAT_INSTANCES, CHORUS_FLOATING_DTYPES)
CHORUS_DEFINE_INSTANCES(CHORUS_NN_TRANSFORMER_INSTANCES, CHORUS_ALL_DTYPES)
