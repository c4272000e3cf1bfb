// chorus::compiled: the learning-rate schedulers of optim/ (Note [compiled chorus] in
// include/chorus/compiled.hpp).
#include <chorus/optim/lr_scheduler_impl.hpp>
