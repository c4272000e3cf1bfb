#pragma once
// nn::functional: the stateless forms of the layers and the losses.
#include "../ops/ops.hpp"

CHORUS_NAMESPACE_BEGIN
namespace nn::functional {
using chorus::dropout;
using chorus::gelu;
using chorus::linear;
using chorus::log_softmax;
using chorus::relu;
using chorus::sigmoid;
using chorus::softmax;
using chorus::tanh;
// mse_loss, cross_entropy and nll_loss are defined in ops/loss.hpp, in this namespace.
}  // namespace nn::functional
CHORUS_NAMESPACE_END
