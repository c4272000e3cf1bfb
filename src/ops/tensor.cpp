// chorus::compiled: Tensor<T>'s members (defined in ops/) (Note [compiled chorus] in
// include/chorus/compiled.hpp).
#include <chorus/chorus.hpp>
#include <chorus/autograd/engine_impl.hpp>

CHORUS_DEFINE_INSTANCES(CHORUS_OPS_TENSOR_INSTANCES, CHORUS_FLOATING_DTYPES)
CHORUS_DEFINE_INSTANCES(CHORUS_OPS_INT_TENSOR_INSTANCES, CHORUS_INT_DTYPES)
CHORUS_DEFINE_INSTANCES(CHORUS_OPS_CONVERT_INSTANCES, CHORUS_ALL_DTYPES)
