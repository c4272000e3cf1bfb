#pragma once
// nn::functional: the stateless forms of the layers and the losses.
#include "../ops/ops.hpp"

CHORUS_NAMESPACE_BEGIN
namespace nn::functional {
using chorus::adaptive_avg_pool2d;
using chorus::avg_pool2d;
using chorus::batch_norm;
using chorus::conv2d;
using chorus::dropout;
using chorus::dropout2d;
using chorus::embedding;
using chorus::layer_norm;
using chorus::max_pool2d;
using chorus::silu;
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
