#pragma once
// All differentiable operations.
#include "common.hpp"
#include "elementwise.hpp"
#include "factory.hpp"
#include "linalg.hpp"
#include "loss.hpp"
#include "nn.hpp"
#include "print.hpp"
#include "reduce.hpp"
#include "view.hpp"
