// chorus::compiled: reading and writing safetensors checkpoints (Note [compiled chorus] in
// include/chorus/compiled.hpp).
#include <chorus/io/safetensors_impl.hpp>
