// chorus::compiled: loading a module's state by name and optimizer checkpoints (Note [compiled
// chorus] in include/chorus/compiled.hpp).
#include <chorus/io/optimizer_impl.hpp>
#include <chorus/io/state_impl.hpp>
