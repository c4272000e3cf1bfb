#pragma once
// All differentiable operations.
#include "common.hpp"
#include "elementwise.hpp"
#include "factory.hpp"
#include "inplace.hpp"
#include "linalg.hpp"
#include "loss.hpp"
#include "nn.hpp"
#include "print.hpp"
#include "reduce.hpp"
#include "view.hpp"

// The sequence-model operators, last: chorus::max, min, abs, ... would hide the math library's
// overloads from an unqualified call in a kernel header parsed after them.
#include "index.hpp"
#include "minmax.hpp"
#include "shape.hpp"
#include "statistics.hpp"
// Attention, built from the operators above.
#include "attention.hpp"
