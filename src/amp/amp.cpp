// chorus::compiled: mixed precision, amp::GradScaler and amp::MasterWeights (Note [compiled
// chorus] in include/chorus/compiled.hpp).
#include <chorus/amp/grad_scaler_impl.hpp>
#include <chorus/amp/master_weights_impl.hpp>
