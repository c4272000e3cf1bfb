// chorus::compiled: nn::Module's registry, device moves and deep-copy scope (Note [compiled
// chorus] in include/chorus/compiled.hpp).
#include <chorus/nn/module_impl.hpp>
CHORUS_DEFINE_INSTANCES(CHORUS_NN_MODULE_INSTANCES, CHORUS_ALL_DTYPES)
