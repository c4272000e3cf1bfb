#pragma once
// chorus: data-parallel training of neural networks across devices. The one header to include.
#include "config.hpp"
#include "error.hpp"
#include "version.hpp"

#include "core/any_tensor.hpp"
#include "core/println.hpp"
#include "core/runtime.hpp"
#include "core/tensor.hpp"

#include "autograd/engine.hpp"
#include "autograd/grad_mode.hpp"

#include "ops/ops.hpp"

#include "nn/nn.hpp"

#include "optim/optim.hpp"

#include "data/data.hpp"

#include "parallel/parallel.hpp"

#include "amp.hpp"

#include "io/optimizer.hpp"
#include "io/profile.hpp"
#include "io/safetensors.hpp"
