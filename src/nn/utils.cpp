// chorus::compiled: gradient clipping, clip_grad_norm_ / clip_grad_value_ (Note [compiled
// chorus] in include/chorus/compiled.hpp).
#include <chorus/nn/utils_impl.hpp>
