// chorus::compiled: chorus::Error's messages, CloneScope and AnyTensor (Note [compiled chorus]
// in include/chorus/compiled.hpp).
#include <chorus/core/any_tensor_impl.hpp>
#include <chorus/core/clone_scope_impl.hpp>
#include <chorus/error_impl.hpp>
